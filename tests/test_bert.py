"""BERT embeddings end to end on a tiny random model: our converter's GGUF run by pyggml against
Hugging Face transformers (torch CPU) and llama.cpp, pooling, packing several texts per pass,
the Runner, the CLI and bad inputs.

Tolerances (absolute, outputs of magnitude ~2-4): F32 1e-4 (measured ~1e-6); F16 weights 5e-3
(measured ~9e-4); q8_0 0.1 (measured ~0.03); llama.cpp 2e-3 (measured ~4e-4: it uses the tanh
approximation of GELU where BERT, and pyggml, use the exact one).
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

import pyggml  # noqa: E402
from pyggml import models  # noqa: E402
from pyggml.convert import convert_hf  # noqa: E402
from pyggml.models import Batch, Pooling  # noqa: E402
from pyggml.runner import CompletionRequest, GenerationNotSupportedError, Runner  # noqa: E402

from ._gguf_meta import read_metadata  # noqa: E402
from .hf_fixtures import corpus, make_tiny_bert  # noqa: E402

TEXTS = [
    "Hello world, the café is naïve!",
    "the of and",
    "Which way about many people water? " * 4,  # ~60 tokens
    "x",
]
# max |ours - transformers| over the hidden states / pooled vectors (values up to ~3.7), ~3x the measured:
# F32 1.4e-6 (hidden states), F16 weights 8.7e-4 (mean pooled), Q8_0 weights 2.9e-2 (mean pooled)
F32_TOL, F16_TOL, Q8_TOL, LLAMA_CPP_TOL = 4e-6, 2.5e-3, 9e-2, 2e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf_dir, hf_model, {out_type: gguf path}) of one tiny random BERT, converted lazily."""
    root = tmp_path_factory.mktemp("bert")
    hf_dir, hf_model = make_tiny_bert(root)
    return hf_dir, hf_model, converted_lazily(hf_dir, root, "tiny-bert")


def converted_lazily(hf_dir, root, stem: str):
    """gguf(out_type="f32") -> the path of ``hf_dir`` converted to that type (root/stem-type.gguf),
    converted on first use."""
    files = {}

    def gguf(out_type: str = "f32"):
        if out_type not in files:
            files[out_type] = convert_hf(hf_dir, root / f"{stem}-{out_type}.gguf", out_type=out_type)
        return files[out_type]

    return gguf


@pytest.fixture(scope="module")
def model(tiny):
    m = models.load(tiny[2]("f32"), pyggml.BackendParams(n_threads=2))
    yield m
    m.close()


def hf_states(hf_model, ids: list[int]) -> np.ndarray:
    """Last hidden states (n_tokens, hidden) of one text run alone."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).last_hidden_state[0].numpy()


def hf_pooled(hf_model, ids_list: list[list[int]], pooling: str) -> np.ndarray:
    states = [hf_states(hf_model, ids) for ids in ids_list]
    pick = {"mean": lambda s: s.mean(0), "cls": lambda s: s[0], "last": lambda s: s[-1]}[pooling]
    return np.stack([pick(s) for s in states])


def run_embed(model, ids_list: list[list[int]], pooling: Pooling) -> np.ndarray:
    batch = Batch(inputs=[t for ids in ids_list for t in ids],
                  positions=[p for ids in ids_list for p in range(len(ids))],
                  sequences=[s for s, ids in enumerate(ids_list) for _ in ids])
    with model.backend.new_context() as ctx:
        out = model.embed(ctx, batch, pooling)
        ctx.compute(out)
        return out.numpy()


# ---- parity with transformers ---------------------------------------------------------------------

def test_tokenizer_matches_transformers(tiny, model):
    tok = transformers.BertTokenizer.from_pretrained(tiny[0])
    for line in TEXTS + corpus(seed=1, n_lines=40):
        assert model.tokenizer.encode(line) == tok(line)["input_ids"], line


def test_hidden_states_of_texts_batched_together_match_transformers(tiny, model):
    """Four texts of 3..60 tokens in one graph: the block-diagonal mask keeps them apart."""
    ids_list = [model.tokenizer.encode(t) for t in TEXTS]
    ours = run_embed(model, ids_list, Pooling.NONE)
    ref = np.concatenate([hf_states(tiny[1], ids) for ids in ids_list])
    assert ours.shape == ref.shape == (sum(map(len, ids_list)), 64)
    assert np.abs(ours - ref).max() <= F32_TOL


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_embeddings_match_transformers(tiny, model, pooling):
    ids_list = [model.tokenizer.encode(t) for t in TEXTS]
    ours = run_embed(model, ids_list, Pooling.parse(pooling))
    ref = hf_pooled(tiny[1], ids_list, pooling)
    assert ours.shape == (len(TEXTS), 64)
    assert np.abs(ours - ref).max() <= F32_TOL


@pytest.mark.parametrize("out_type, tol", [("f16", F16_TOL), ("q8_0", Q8_TOL)])
def test_f16_and_q8_embeddings_close_to_transformers(tiny, out_type, tol):
    with pyggml.load(tiny[2](out_type), n_threads=2) as llm:
        ours = llm.embed(TEXTS, normalize=False)
        ref = hf_pooled(tiny[1], [llm.tokenize(t) for t in TEXTS], "mean")
    err = np.abs(ours - ref).max()
    assert err <= tol, f"{out_type}: {err:.2e}"


def test_llm_embed_normalises_and_packs_texts_into_passes(tiny):
    with pyggml.load(tiny[2]("f32"), n_threads=2) as llm:
        ref = hf_pooled(tiny[1], [llm.tokenize(t) for t in TEXTS], "mean")
        raw = llm.embed(TEXTS, normalize=False)
        assert np.abs(raw - ref).max() <= F32_TOL
        unit = llm.embed(TEXTS)
        np.testing.assert_allclose(unit, ref / np.linalg.norm(ref, axis=1, keepdims=True), atol=F32_TOL)
        assert unit.dtype == np.float32 and llm.embed("x").shape == (1, 64)
        cls = llm.embed(TEXTS, normalize=False, pooling="cls")
        assert np.abs(cls - hf_pooled(tiny[1], [llm.tokenize(t) for t in TEXTS], "cls")).max() <= F32_TOL
    # a pass holds at most batch_size tokens (but always one whole text): 100 texts, many passes
    many = [TEXTS[i % 4] + f" {i}" for i in range(100)]
    with pyggml.load(tiny[2]("f32"), n_threads=2, batch_size=64) as llm:
        assert llm.runner.embedder.batch_size == 128  # raised to the longest text
        packed = llm.embed(many)
        alone = np.concatenate([llm.embed(t) for t in many[:8]])
    np.testing.assert_allclose(packed[:8], alone, atol=1e-5)


# ---- the converter ------------------------------------------------------------------------------

def test_gguf_metadata_follows_llama_cpp(tiny):
    meta = read_metadata(tiny[2]("f32"))
    assert meta["general.architecture"] == "bert" and meta["bert.pooling_type"] == 1  # mean by default
    assert meta["bert.attention.causal"] is False and meta["bert.context_length"] == 128
    assert meta["bert.embedding_length"] == 64 and meta["bert.block_count"] == 2
    assert meta["bert.attention.head_count"] == 4 and meta["bert.feed_forward_length"] == 128
    assert meta["bert.attention.layer_norm_epsilon"] == pytest.approx(1e-12)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert meta["tokenizer.ggml.model"] == "bert" and tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert types[:6] == [3, 3, 3, 3, 3, 1] and "\u2581the" in tokens and "s" in tokens  # "the", "##s"
    assert len(tokens) % 32 == 0 and tokens[-1].startswith("[PAD") and types[-1] == 5
    ids = {k: meta[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "seperator_token_id", "unknown_token_id",
                                                    "padding_token_id", "mask_token_id")}
    assert ids == {"bos_token_id": 2, "seperator_token_id": 3, "unknown_token_id": 1, "padding_token_id": 0,
                   "mask_token_id": 4}
    assert meta["tokenizer.ggml.token_type_count"] == 2


def test_gguf_tensor_names_are_llama_cpps(tiny, model):
    import gguf

    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.BERT]}
    names = set(model.backend.tensors())
    assert {n.rsplit(".", 1)[0].replace("blk.0.", "blk.{bid}.").replace("blk.1.", "blk.{bid}.")
            for n in names} <= known
    assert len(names) == 5 + 2 * 16  # embeddings (3) + norm (2); per layer 8 weights + 8 biases


@pytest.mark.parametrize("mode, expected", [("cls", Pooling.CLS), ("lasttoken", Pooling.LAST)])
def test_pooling_comes_from_sentence_transformers_config_or_override(tmp_path, mode, expected):
    hf_dir, _ = make_tiny_bert(tmp_path, pooling=mode)
    path = convert_hf(hf_dir, tmp_path / "st.gguf", out_type="f32")
    assert read_metadata(path)["bert.pooling_type"] == expected
    path = convert_hf(hf_dir, tmp_path / "over.gguf", out_type="f32", pooling="mean")
    assert read_metadata(path)["bert.pooling_type"] == Pooling.MEAN


def test_pytorch_bin_checkpoint_converts_the_same(tiny, tmp_path):
    hf_dir = tiny[0]
    bin_dir = tmp_path / "bin"
    shutil.copytree(hf_dir, bin_dir)
    (bin_dir / "model.safetensors").unlink()
    torch.save(tiny[1].state_dict(), bin_dir / "pytorch_model.bin")
    path = convert_hf(bin_dir, tmp_path / "bin.gguf", out_type="f32")
    with pyggml.load(path, n_threads=2) as a, pyggml.load(tiny[2]("f32"), n_threads=2) as b:
        np.testing.assert_array_equal(a.embed(TEXTS), b.embed(TEXTS))


def test_converter_refuses_what_it_cannot_convert(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny[0], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        convert_hf(bad, tmp_path / "x.gguf")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        convert_hf(bad, tmp_path / "x.gguf", pooling="max")
    tok_config = json.loads((bad / "tokenizer_config.json").read_text())
    (bad / "tokenizer_config.json").write_text(json.dumps({**tok_config, "do_lower_case": False}))
    with pytest.raises(ValueError, match="cased"):
        convert_hf(bad, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("x.gguf*"))


# ---- llama.cpp ----------------------------------------------------------------------------------

_LLAMA_CPP = textwrap.dedent("""
    import json, sys
    import llama_cpp
    path, texts = sys.argv[1], json.loads(sys.argv[2])
    llm = llama_cpp.Llama(model_path=path, embedding=True, n_ctx=128, n_threads=2, verbose=False)
    print(json.dumps({"tokens": [llm.tokenize(t.encode()) for t in texts], "embeddings": llm.embed(texts)}))
""")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp (llama-cpp-python) is absent")
def test_embeddings_match_llama_cpp(tiny):
    """llama.cpp runs in a subprocess: a crash there must not take the test run down."""
    path = tiny[2]("f32")
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path), json.dumps(TEXTS)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    with pyggml.load(path, n_threads=2) as llm:
        assert [llm.tokenize(t) for t in TEXTS] == theirs["tokens"]
        ours = llm.embed(TEXTS, normalize=False)  # llama-cpp-python's embed() does not normalise
    err = np.abs(ours - np.array(theirs["embeddings"])).max()
    assert err <= LLAMA_CPP_TOL, f"{err:.2e}"


# ---- the runner, the CLI, bad inputs --------------------------------------------------------------

def test_runner_serves_embeddings_and_refuses_completions(tiny, model):
    with pyggml.load(tiny[2]("f32"), n_threads=2) as llm:
        expected = llm.embed(TEXTS)
    with Runner(model, parallel=2, num_ctx=4096) as runner:
        assert runner.num_ctx == 128 and not runner.generates
        np.testing.assert_allclose(runner.embedding(TEXTS[0]), expected[0], atol=1e-6)
        np.testing.assert_allclose(runner.embeddings(TEXTS), expected, atol=1e-6)
        with pytest.raises(GenerationNotSupportedError, match="embedding model"):
            runner.completion(CompletionRequest("hello"))
        assert isinstance(GenerationNotSupportedError("x"), ValueError)  # the server answers 400


def test_cli_embed_prints_one_json_vector_per_text(tiny, capsys):
    from pyggml.cli import main

    assert main(["embed", str(tiny[2]("f32")), *TEXTS[:2], "--threads", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    with pyggml.load(tiny[2]("f32"), n_threads=2) as llm:
        np.testing.assert_allclose(np.array([json.loads(line) for line in lines]), llm.embed(TEXTS[:2]), atol=1e-6)
    assert main(["run", str(tiny[2]("f32")), "hello"]) == 1
    assert "embedding model" in capsys.readouterr().err


def test_bad_inputs_raise_clear_errors(tiny):
    with pyggml.load(tiny[2]("f32"), n_threads=2) as llm:
        cases = [("", ValueError, "empty string"), ([], ValueError, "no texts"), (3, TypeError, "got int"),
                 (["a", None], TypeError, "got NoneType"), ("word " * 200, ValueError, "does not fit the context"),
                 ("a", ValueError, "unknown pooling")]
        for texts, kind, words in cases:
            with pytest.raises(kind, match=words):
                llm.embed(texts, pooling="max" if words == "unknown pooling" else None)
        with pytest.raises(ValueError, match="no single vector"):
            llm.embed("a", pooling="none")
        long = llm.embed("word " * 200, truncate=True)  # the first 127 tokens and [SEP]
        ids = llm.tokenize("word " * 200)
        np.testing.assert_allclose(long, llm.embed(llm.detokenize(ids[1:127]).strip()), atol=1e-5)
        with pytest.raises(GenerationNotSupportedError, match="cannot generate"):
            llm.generate("hello")
        with pytest.raises(GenerationNotSupportedError):
            llm.logits([1, 2, 3])
        assert llm.embed(TEXTS).shape == (4, 64)  # still works after every refusal


def test_bad_batches_are_refused_before_ggml(model):
    good = [2, 50, 3]
    for batch, words in [
        (Batch(inputs=good, positions=[0, 1, 2], sequences=[1, 1, 1]), "numbered 0, 1"),
        (Batch(inputs=good + good, positions=[0, 1, 2] * 2, sequences=[0, 1, 0, 1, 0, 1]), "together"),
        (Batch(inputs=good, positions=[0, 1, 200], sequences=[0, 0, 0]), "positions must lie"),
        (Batch(inputs=[2, 99999, 3], positions=[0, 1, 2], sequences=[0, 0, 0]), "token ids"),
        (Batch(inputs=good, positions=[0, 1], sequences=[0, 0, 0]), "equally long"),
        (Batch(), "non-empty"),
    ]:
        with model.backend.new_context() as ctx, pytest.raises(ValueError, match=words):
            model.embed(ctx, batch)
    with model.backend.new_context() as ctx, pytest.raises(NotImplementedError, match="embedding model"):
        model.forward(ctx, Batch(inputs=good, positions=[0, 1, 2], sequences=[0, 0, 0]))
