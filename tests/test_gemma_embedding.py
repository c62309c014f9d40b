"""EmbeddingGemma (GGUF ``gemma-embedding``): tiny random sentence-transformers folders around a bidirectional Gemma 3
text model (mean pooling, two Dense projections) converted with ``pyggml.convert``, embedded by pyggml against
transformers (F32: texts past the sliding window, one at a time and several at once) and against llama.cpp on the
same files; the Ollama and OpenAI embedding routes; names, keys and refused configs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pyggml
from pyggml.convert import convert_hf

from .test_convert import needs_llama_cpp, read_gguf

torch = pytest.importorskip("torch", reason="the EmbeddingGemma parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the EmbeddingGemma parity tests build HF models")

from ._models import error  # noqa: E402
from .hf_fixtures import make_spm_tokenizer  # noqa: E402  (needs torch/transformers)
from .test_qwen import TEXTS  # noqa: E402

WINDOW = 4  # sliding-window layers see 2 positions either way
CASES = {"gqa-dense": dict(), "mha-no-dense": dict(n_kv_heads=4, dense=False, seed=1)}
# max |ours - theirs| / max |theirs| over the embeddings; measured 2.0e-4 .. 2.7e-4 against transformers (F32), from
# ggml's GELU (an F16 table, as in llama.cpp); a window one position wider gives 0.4, a causal global layer 0.14
TOLERANCE = 1e-3


def make_tiny_embedding_gemma(root, *, n_kv_heads: int = 2, dense: bool = True, seed: int = 0):
    """A sentence-transformers folder: a random 6-layer bidirectional Gemma 3 text model (64 wide, 4 heads of 16,
    layer 5 global), mean pooling, Dense 64 -> 96 -> 64 (``dense``), Normalize; SentencePiece tokenizer adding
    <s> and </s> as EmbeddingGemma's adds <bos> and <eos>. Returns ``(hf_dir, model, dense weights)``."""
    from safetensors.numpy import save_file

    hf_dir = root / f"tiny-embeddinggemma-kv{n_kv_heads}-{'dense' if dense else 'plain'}-s{seed}"
    hf_dir.mkdir(parents=True, exist_ok=True)
    n_tokens = make_spm_tokenizer(hf_dir, seed)
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text()) | {"add_eos_token": True}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config = transformers.Gemma3TextConfig(
        vocab_size=-(-n_tokens // 32) * 32, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=n_kv_heads, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=WINDOW, use_bidirectional_attention=True,
        initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.Gemma3TextModel(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    rng = np.random.default_rng(seed)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (hf_dir / "1_Pooling").mkdir(exist_ok=True)
    (hf_dir / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  "pooling_mode_mean_tokens": True}))
    weights = []
    for folder, n_in, n_out in (("2_Dense", 64, 96), ("3_Dense", 96, 64)) if dense else ():
        (hf_dir / folder).mkdir(exist_ok=True)
        weights.append((rng.standard_normal((n_out, n_in)) * n_in ** -0.5).astype(np.float32))
        save_file({"linear.weight": weights[-1]}, str(hf_dir / folder / "model.safetensors"))
        (hf_dir / folder / "config.json").write_text(json.dumps({
            "in_features": n_in, "out_features": n_out, "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity"}))
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": folder,
                        "type": "sentence_transformers.models.Dense"})
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": "4_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (hf_dir / "modules.json").write_text(json.dumps(modules))
    return hf_dir, model, weights


def reference(model, dense: list[np.ndarray], tokens: list[int]) -> np.ndarray:
    """What sentence-transformers computes before its Normalize: mean of the last hidden states, then the Dense
    projections."""
    with torch.no_grad():
        out = model(torch.tensor([tokens])).last_hidden_state[0].numpy().astype(np.float64).mean(axis=0)
    for w in dense:
        out = w @ out
    return out.astype(np.float32)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case)``: (path of the converted F32 file, HF model, dense weights), made once;
    ``converted.hf_dirs[case]``: the folder."""
    root, done = tmp_path_factory.mktemp("embeddinggemma"), {}

    def get(case: str):
        if case not in done:
            hf_dir, model, dense = make_tiny_embedding_gemma(root, **CASES[case])
            path = convert_hf(hf_dir, root / f"{case}.gguf", "f32")
            done[case] = path, model, dense
            get.hf_dirs[case] = hf_dir
        return done[case]

    get.hf_dirs = {}
    return get


LONG = [TEXTS[0] + " " + TEXTS[1], TEXTS[2], TEXTS[1]]


@pytest.mark.parametrize("case", list(CASES))
def test_embeddings_match_transformers_alone_and_together(case, converted):
    path, model, dense = converted(case)
    with pyggml.load(path, n_threads=2, num_ctx=64) as llm:
        ids = [llm.tokenize(t) for t in LONG]  # the same ids as llama.cpp's (test below)
        together = llm.embed(LONG, normalize=False)  # one batch of three texts
        alone = [llm.embed(t, normalize=False)[0] for t in LONG]
        unit = llm.embed(LONG)
    assert ids[0][0] == 1 and ids[0][-1] == 2 and len(ids[0]) > 4 * WINDOW  # <s> ... </s>, well past the window
    expected = [reference(model, dense, t) for t in ids]
    assert together.shape == (3, 64)
    for i in range(3):
        assert error(together[i], expected[i]) < TOLERANCE, i
        assert error(alone[i], expected[i]) < TOLERANCE, i
        np.testing.assert_allclose(unit[i], together[i] / np.linalg.norm(together[i]), atol=1e-6)  # L2-normalised


_LLAMA_CPP = textwrap.dedent("""
    import json, sys
    import llama_cpp
    llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=2, verbose=False, embedding=True,
                          pooling_type=1)
    texts = json.loads(sys.argv[2])
    print(json.dumps({"tokens": [llm.tokenize(t.encode()) for t in texts],
                      "out": [llm.embed(t, normalize=False) for t in texts]}))
""")


@needs_llama_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_gives_the_same_embeddings(case, converted):
    path = converted(case)[0]
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path), json.dumps(LONG)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    with pyggml.load(path, n_threads=2, num_ctx=64) as llm:
        assert [llm.tokenize(t) for t in LONG] == theirs["tokens"]
        ours = llm.embed(LONG, normalize=False)
    for i in range(3):
        assert error(ours[i], np.array(theirs["out"][i], np.float32)) < 1e-3, i  # llama.cpp: F16 masks


def test_ollama_and_openai_routes_embed_with_it(converted):
    import httpx

    from ._server import running_server

    path = converted("gqa-dense")[0]
    with pyggml.load(path, n_threads=1, num_ctx=64) as llm:
        expected = llm.embed(LONG)
    with running_server(path, parallel=2, queue=4, num_ctx=64) as (base, served):
        ollama = httpx.post(f"{base}/api/embed", json={"model": served.name, "input": LONG}, timeout=60).json()
        openai = httpx.post(f"{base}/v1/embeddings", json={"model": served.name, "input": LONG[1],
                                                           "encoding_format": "float"}, timeout=60).json()
    # other batches (the server's batch size, two slots): other summation orders, ~1e-5
    np.testing.assert_allclose(ollama["embeddings"], expected, atol=1e-4)
    np.testing.assert_allclose(openai["data"][0]["embedding"], expected[1], atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_files_have_llama_cpps_names_and_keys(case, converted):
    path, model, dense = converted(case)
    meta, tensors = read_gguf(path)
    assert meta["general.architecture"] == "gemma-embedding"
    assert meta["gemma-embedding.pooling_type"] == 1 and meta["gemma-embedding.attention.sliding_window"] == WINDOW
    assert meta["tokenizer.ggml.add_eos_token"] is True
    per_block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]
    projections = {"dense_2.weight", "dense_3.weight"} if dense else set()
    assert set(tensors) == {"token_embd.weight", "output_norm.weight"} | projections | {
        f"blk.{i}.{n}.weight" for i in range(6) for n in per_block}
    if dense:
        assert (meta["gemma-embedding.dense_2_feat_in"], meta["gemma-embedding.dense_2_feat_out"]) == (64, 96)
        assert (meta["gemma-embedding.dense_3_feat_in"], meta["gemma-embedding.dense_3_feat_out"]) == (96, 64)
        assert (tensors["dense_2.weight"][1] == dense[0]).all() and (tensors["dense_3.weight"][1] == dense[1]).all()


@pytest.mark.parametrize("change, message", [
    ({"config.json": {"use_bidirectional_attention": False}}, "use_bidirectional_attention"),
    ({"2_Dense/config.json": {"bias": True}}, "bias"),
    ({"3_Dense/config.json": {"activation_function": "torch.nn.modules.activation.Tanh"}}, "activation"),
])
def test_configs_gguf_gemma_embedding_cannot_express_are_refused(change, message, converted, tmp_path):
    converted("gqa-dense")
    bad = tmp_path / "bad"
    shutil.copytree(converted.hf_dirs["gqa-dense"], bad)
    for file, edit in change.items():
        (bad / file).write_text(json.dumps(json.loads((bad / file).read_text()) | edit))
    with pytest.raises(ValueError, match=message):
        convert_hf(bad, tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


def test_pyggml_compare_agrees_layer_by_layer(converted):
    """``pyggml compare`` taps every block of the encoder against the transformers modules."""
    from pyggml import porting

    path = converted("gqa-dense")[0]
    result = porting.compare(converted.hf_dirs["gqa-dense"], path, LONG[0], n_threads=2)
    names = [x.name for x in result.layers]
    assert names == ["token_embd", *(f"blk.{i}" for i in range(6)), "output_norm"], result.table()
    assert not result.unmatched and result.ok and max(x.error for x in result.layers) < TOLERANCE, result.table()
