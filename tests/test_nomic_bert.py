"""Nomic BERT embeddings (GGUF ``nomic-bert``) end to end on a tiny random model: our converter's file
run by pyggml against transformers' ``NomicBertModel`` (torch CPU) and llama.cpp, from both config.json
styles (transformers' and the hub's original ``n_embd``/``n_head`` one), pooling, packing several
texts per pass, the server's embedding routes and the converter's refusals.

The checkpoint is written by transformers' ``save_pretrained``, which stores nomic's original tensor
layout (``encoder.layers.N.attn.Wqkv``, ``mlp.fc11``/``fc12``/``fc2``, ``emb_ln``), as the hub files have it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch==2.13.0 (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="needs transformers (the `reference` extra)")
if not hasattr(transformers, "NomicBertModel"):
    pytest.skip("needs a transformers with NomicBertModel (>= 5)", allow_module_level=True)

import pyggml  # noqa: E402
from pyggml import models  # noqa: E402
from pyggml.convert import convert_hf  # noqa: E402
from pyggml.models import Batch, Pooling  # noqa: E402

from ._gguf_meta import read_metadata  # noqa: E402
from .hf_fixtures import make_wordpiece_vocab  # noqa: E402
from .test_bert import converted_lazily, hf_pooled, hf_states, run_embed  # noqa: E402  (the same helpers serve both encoders)

TEXTS = [
    "Hello world, the café is naïve!",
    "the of and",
    "Which way about many people water? " * 4,  # ~60 tokens: rotary positions up to ~60
    "x",
]
# max |ours - x| over mean-pooled vectors / hidden states (values up to ~3), measured (2 threads, x86-64):
# transformers F32 4.8e-7, F16 weights 1.1e-3, Q8_0 weights 2.6e-2; llama.cpp on the same F32 and Q8_0
# files 0 (bit-identical: the same ggml kernels in the same order); the bounds leave room for other CPUs
F32_TOL, F16_TOL, Q8_TOL, LLAMA_CPP_TOL = 4e-6, 5e-3, 9e-2, 2e-3
HIDDEN = 64
# nomic-embed-text-v1.5's config.json, shrunk: the original keys the hub checkpoints ship
ORIGINAL_CONFIG = {
    "activation_function": "swiglu", "architectures": ["NomicBertModel"], "bos_token_id": None, "causal": False,
    "dense_seq_output": True, "embd_pdrop": 0.0, "eos_token_id": None, "fused_bias_fc": True,
    "fused_dropout_add_ln": True, "initializer_range": 0.02, "layer_norm_epsilon": 1e-12,
    "max_trained_positions": 128, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "model_type": "nomic_bert",
    "n_embd": HIDDEN, "n_head": 4, "n_inner": 96, "n_layer": 2, "n_positions": 512, "pad_vocab_size_multiple": 64,
    "parallel_block": False, "parallel_block_tied_norm": False, "prenorm": False, "qkv_proj_bias": False,
    "reorder_and_upcast_attn": False, "resid_pdrop": 0.0, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
    "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True, "type_vocab_size": 2, "use_cache": True,
    "use_flash_attn": True, "use_rms_norm": False, "use_xentropy": True,
}


def make_tiny_nomic(root, seed: int = 0):
    """(hf_dir, hf_model): a 2-layer, 4-head, 64-wide random NomicBertModel (transformers' config)
    with a WordPiece vocabulary; LayerNorm weights and biases randomised so a swapped one shows."""
    hf_dir = root / "tiny-nomic"
    hf_dir.mkdir(parents=True, exist_ok=True)
    n_tokens = make_wordpiece_vocab(hf_dir, seed)
    config = transformers.NomicBertConfig(
        vocab_size=-(-n_tokens // 32) * 32, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=128, type_vocab_size=2, layer_norm_eps=1e-12)
    torch.manual_seed(seed)
    model = transformers.NomicBertModel(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    return hf_dir, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf_dir, hf_model, gguf(out_type) -> path) of one tiny random Nomic BERT, converted lazily."""
    root = tmp_path_factory.mktemp("nomic")
    hf_dir, hf_model = make_tiny_nomic(root)
    return hf_dir, hf_model, converted_lazily(hf_dir, root, "tiny-nomic")


@pytest.fixture(scope="module")
def model(tiny):
    m = models.load(tiny[2]("f32"), pyggml.BackendParams(n_threads=2))
    yield m
    m.close()


# ---- parity with transformers ---------------------------------------------------------------------

def test_hidden_states_of_texts_batched_together_match_transformers(model, tiny):
    """Four texts of 3..60 tokens in one graph: the mask keeps them apart, each rotates from position 0."""
    ids_list = [model.tokenizer.encode(t) for t in TEXTS]
    ours = run_embed(model, ids_list, Pooling.NONE)
    ref = np.concatenate([hf_states(tiny[1], ids) for ids in ids_list])
    assert ours.shape == ref.shape == (sum(map(len, ids_list)), HIDDEN)
    assert np.abs(ours - ref).max() <= F32_TOL


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_embeddings_match_transformers(model, tiny, pooling):
    ids_list = [model.tokenizer.encode(t) for t in TEXTS]
    ours = run_embed(model, ids_list, Pooling.parse(pooling))
    assert np.abs(ours - hf_pooled(tiny[1], ids_list, pooling)).max() <= F32_TOL


@pytest.mark.parametrize("out_type, tol", [("f16", F16_TOL), ("q8_0", Q8_TOL)])
def test_f16_and_q8_embeddings_close_to_transformers(tiny, out_type, tol):
    with pyggml.load(tiny[2](out_type), n_threads=2) as llm:
        ours = llm.embed(TEXTS, normalize=False)
        ref = hf_pooled(tiny[1], [llm.tokenize(t) for t in TEXTS], "mean")
    err = np.abs(ours - ref).max()
    assert err <= tol, f"{out_type}: {err:.2e}"


def test_llm_embed_normalises_and_packs_texts(tiny):
    many = [TEXTS[i % 4] + f" {i}" for i in range(24)]
    with pyggml.load(tiny[2]("f32"), n_threads=2, batch_size=64) as llm:
        unit = llm.embed(TEXTS)
        ref = hf_pooled(tiny[1], [llm.tokenize(t) for t in TEXTS], "mean")
        np.testing.assert_allclose(unit, ref / np.linalg.norm(ref, axis=1, keepdims=True), atol=F32_TOL)
        packed = llm.embed(many)
        alone = np.concatenate([llm.embed(t) for t in many[:6]])
    np.testing.assert_allclose(packed[:6], alone, atol=1e-5)


# ---- the converter ------------------------------------------------------------------------------

def test_gguf_metadata_and_tensor_names_follow_llama_cpp(tiny, model):
    import gguf

    meta = read_metadata(tiny[2]("f32"))
    assert meta["general.architecture"] == "nomic-bert" and meta["nomic-bert.pooling_type"] == Pooling.MEAN
    assert meta["nomic-bert.attention.causal"] is False and meta["nomic-bert.context_length"] == 128
    assert meta["nomic-bert.embedding_length"] == HIDDEN and meta["nomic-bert.block_count"] == 2
    assert meta["nomic-bert.attention.head_count"] == 4 and meta["nomic-bert.feed_forward_length"] == 96
    assert meta["nomic-bert.rope.freq_base"] == pytest.approx(1000.0)
    assert meta["tokenizer.ggml.model"] == "bert" and meta["tokenizer.ggml.token_type_count"] == 2
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.NOMIC_BERT]}
    names = set(model.backend.tensors())
    assert {n.rsplit(".", 1)[0].replace("blk.0.", "blk.{bid}.").replace("blk.1.", "blk.{bid}.")
            for n in names} <= known
    assert "blk.0.attn_qkv.weight" in names and len(names) == 4 + 2 * 9  # no position_embd, no biases


def test_original_hub_config_converts_to_the_same_model(tiny, tmp_path):
    """The hub's config.json (n_embd, n_head, rotary_emb_base, ...) with the same weights: the same file
    tensors and embeddings; the context is max_trained_positions (as llama.cpp's converter decides)."""
    hub = tmp_path / "hub"
    shutil.copytree(tiny[0], hub)
    vocab = json.loads((hub / "config.json").read_text())["vocab_size"]
    (hub / "config.json").write_text(json.dumps({**ORIGINAL_CONFIG, "vocab_size": vocab}))
    path = convert_hf(hub, tmp_path / "hub.gguf", out_type="f32")
    meta = read_metadata(path)
    assert meta["nomic-bert.context_length"] == 128 and meta["nomic-bert.rope.freq_base"] == pytest.approx(1000.0)
    assert meta["nomic-bert.attention.layer_norm_epsilon"] == pytest.approx(1e-12)
    with pyggml.load(path, n_threads=2) as a, pyggml.load(tiny[2]("f32"), n_threads=2) as b:
        np.testing.assert_array_equal(a.embed(TEXTS), b.embed(TEXTS))


@pytest.mark.parametrize("key, value", [("rotary_emb_fraction", 0.5), ("activation_function", "gelu"),
                                        ("qkv_proj_bias", True), ("prenorm", True), ("moe_every_n_layers", 2),
                                        ("rotary_emb_interleaved", True)])
def test_converter_refuses_what_nomic_bert_cannot_express(tiny, tmp_path, key, value):
    bad = tmp_path / "bad"
    shutil.copytree(tiny[0], bad)
    vocab = json.loads((bad / "config.json").read_text())["vocab_size"]
    (bad / "config.json").write_text(json.dumps({**ORIGINAL_CONFIG, "vocab_size": vocab, key: value}))
    with pytest.raises(ValueError, match=f"{key}="):
        convert_hf(bad, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("x.gguf*"))


def test_bad_files_and_batches_raise_clear_errors(tmp_path, model):
    from pyggml.backend.metadata import Config
    from pyggml.synthetic import metadata, write_model

    hparams = {"block_count": 1, "embedding_length": 32, "feed_forward_length": 48, "attention.head_count": 2,
               "context_length": 32, "pooling_type": 1, "vocab_size": 64, "tokenizer.ggml.model": "bert"}
    options = models.registry()["nomic-bert"].Options
    for key, value, words in [("moe_every_n_layers", 2, "moe_every_n_layers"), ("attention.causal", True, "causal"),
                              ("rope.dimension_count", 8, "partial rotary"), ("pooling_type", 4, "rank pooling")]:
        with pytest.raises(models.ModelError, match=words):
            options.from_config(Config(metadata("nomic-bert", {**hparams, key: value})))
    path = write_model(tmp_path / "missing.gguf", "nomic-bert", hparams, omit=("blk.0.attn_qkv.weight",))
    with pytest.raises(models.ModelError, match="blk.0.attn_qkv.weight"):
        models.load(path)
    good = [2, 50, 3]
    with model.backend.new_context() as ctx, pytest.raises(ValueError, match="positions must lie"):
        model.embed(ctx, Batch(inputs=good, positions=[0, 1, 200], sequences=[0, 0, 0]))
    with model.backend.new_context() as ctx, pytest.raises(NotImplementedError, match="embedding model"):
        model.forward(ctx, Batch(inputs=good, positions=[0, 1, 2], sequences=[0, 0, 0]))


# ---- llama.cpp ----------------------------------------------------------------------------------

_LLAMA_CPP = textwrap.dedent("""
    import json, sys
    import llama_cpp
    path, texts = sys.argv[1], json.loads(sys.argv[2])
    llm = llama_cpp.Llama(model_path=path, embedding=True, n_ctx=128, n_threads=2, verbose=False)
    print(json.dumps({"tokens": [llm.tokenize(t.encode()) for t in texts], "embeddings": llm.embed(texts)}))
""")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp (llama-cpp-python) is absent")
@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
def test_embeddings_match_llama_cpp(tiny, out_type):
    """The same file in llama.cpp (a subprocess: a crash there must not take the test run down)."""
    path = tiny[2](out_type)
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path), json.dumps(TEXTS)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    with pyggml.load(path, n_threads=2) as llm:
        assert [llm.tokenize(t) for t in TEXTS] == theirs["tokens"]
        ours = llm.embed(TEXTS, normalize=False)  # llama-cpp-python's embed() does not normalise
    err = np.abs(ours - np.array(theirs["embeddings"])).max()
    assert err <= LLAMA_CPP_TOL, f"{out_type}: {err:.2e}"


# ---- the server -----------------------------------------------------------------------------------

def test_server_embeddings_routes(tiny):
    httpx = pytest.importorskip("httpx", reason="the server tests need the `server` extra")
    pytest.importorskip("starlette", reason="the server tests need the `server` extra")
    pytest.importorskip("uvicorn", reason="the server tests need the `server` extra")
    from ._server import running_server

    path = tiny[2]("f32")
    with pyggml.load(path, n_threads=1) as llm:
        expected = llm.embed(TEXTS[:2])
    with running_server(path, parallel=2, num_ctx=128) as (base, served):
        ollama = httpx.post(base + "/api/embed", json={"model": served.name, "input": TEXTS[:2]}, timeout=120)
        openai = httpx.post(base + "/v1/embeddings", json={"model": served.name, "input": TEXTS[:2],
                                                           "encoding_format": "float"}, timeout=120)
    assert ollama.status_code == 200 and openai.status_code == 200, (ollama.text, openai.text)
    np.testing.assert_allclose(ollama.json()["embeddings"], expected, atol=1e-6)
    np.testing.assert_allclose([d["embedding"] for d in openai.json()["data"]], expected, atol=1e-6)
