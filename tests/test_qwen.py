"""Qwen 2, Qwen 3, Qwen 3 MoE and Qwen3-Embedding: tiny random Hugging Face models (GQA and MHA,
tied and untied, more experts than used), converted with ``pyggml.convert``, run by pyggml and
checked against transformers (F32 logits in one batch, token by token, several sequences at once)
and against llama.cpp on the same files (F32 and Q8_0: logits and greedy tokens); malformed MoE
files fail at load naming the tensor or key. (The registry-wide checks on synthetic files are in
test_architectures.py; the converter's names and keys in test_convert.py.)"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pyggml
from pyggml import models
from pyggml.convert import convert_hf
from pyggml.models import ModelError
from pyggml.runner import CompletionRequest
from pyggml.synthetic import write_model

from ._models import converted_cases, error, logits_match_in_batches, sequences_match_transformers
from .test_architectures import TINY
from .test_convert import needs_llama_cpp

torch = pytest.importorskip("torch", reason="the Qwen parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the Qwen parity tests build HF models")

from .hf_fixtures import make_tiny_llama  # noqa: E402  (needs torch/transformers)

CASES = {"qwen2-gqa-untied": dict(arch="qwen2", n_kv_heads=2, tie=False),
         "qwen2-mha-tied": dict(arch="qwen2", n_kv_heads=4, tie=True),
         "qwen3-gqa-tied": dict(arch="qwen3", n_kv_heads=2, tie=True),
         "qwen3-mha-untied-wide-heads": dict(arch="qwen3", n_kv_heads=4, tie=False, head_dim=32),
         "qwen3moe-gqa-untied": dict(arch="qwen3moe", n_kv_heads=2, tie=False),  # 4 experts, 2 used
         "qwen3moe-mha-tied": dict(arch="qwen3moe", n_kv_heads=4, tie=True, seed=1)}
TEXTS = ["The cafe is naive, 42 people said!", "Which way about many people water?", "Hello world"]
# max |ours - theirs| / max |theirs| over the logits; measured 3.5e-7 .. 8.4e-7 against transformers (F32 cache,
# summation order only) and 0 against llama.cpp on the converted F32 and Q8_0 files (same kernels, both F16 caches)
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case, out_type)``: (path of the converted file, HF model, HF tokenizer), made once."""
    return converted_cases(tmp_path_factory.mktemp("qwen"), functools.partial(make_tiny_llama, vocab="qwen"), CASES)


# ---- against transformers ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    tokens = tokenizer.encode(TEXTS[0])
    assert len(tokens) > 8
    # the whole prompt in one batch; one token per batch through the cache
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 1), text=TEXTS[0])


@pytest.mark.parametrize("case", ["qwen2-gqa-untied", "qwen3-mha-untied-wide-heads", "qwen3moe-gqa-untied"])
def test_several_sequences_at_once_match_transformers(case, converted):
    path, model, tokenizer = converted(case)
    sequences_match_transformers(path, model, [tokenizer.encode(t) for t in TEXTS], TOLERANCE)


# ---- against llama.cpp, on the same files ----------------------------------------------------------------
_LLAMA_CPP = textwrap.dedent("""
    import json, sys
    import numpy as np
    import llama_cpp
    path, text, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    banned = json.loads(sys.argv[4])
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    tokens = llm.tokenize(text.encode(), add_bos=True)
    llm.eval(tokens)
    logits = llm.scores[:len(tokens)].tolist()
    greedy = []
    for _ in range(steps):  # greedy decoding, end-of-generation tokens banned
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        row[banned] = -np.inf
        greedy.append(int(row.argmax()))
        llm.eval([greedy[-1]])
    print(json.dumps({"tokens": tokens, "logits": logits, "greedy": greedy}))
""")


def llama_cpp_agrees(path, steps: int = 12) -> None:
    """llama.cpp and pyggml compute the same logits for TEXTS[0] from the file at ``path``, and decode
    the same greedy tokens (end-of-generation tokens banned)."""
    with pyggml.load(path, n_threads=2, num_ctx=64) as llm:
        n_vocab = llm.model.weights.token_embd.weight.shape[1]
        banned = [i for i in range(n_vocab) if llm.tokenizer.is_eog(i)]
        done = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path), TEXTS[0], str(steps), json.dumps(banned)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        theirs = json.loads(done.stdout.strip().splitlines()[-1])
        tokens = theirs["tokens"]
        assert llm.tokenize(TEXTS[0]) == tokens
        assert error(llm.logits(tokens), np.array(theirs["logits"], np.float32)) < TOLERANCE
        request = CompletionRequest(tokens, max_tokens=steps, temperature=0.0,
                                    logit_bias={i: -np.inf for i in banned})
        greedy = [t for chunk in llm.runner.completion(request) for t in chunk.tokens]
    assert greedy == theirs["greedy"]


@needs_llama_cpp
@pytest.mark.parametrize("out_type", ["f32", "q8_0"])
@pytest.mark.parametrize("case", ["qwen2-gqa-untied", "qwen3-gqa-tied", "qwen3moe-gqa-untied", "qwen3moe-mha-tied"])
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(case, out_type, converted):
    llama_cpp_agrees(converted(case, out_type)[0])


@needs_llama_cpp
@pytest.mark.parametrize("dtype", ["q4_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3moe"])
def test_llama_cpp_agrees_on_k_quantized_files(arch, dtype, tmp_path):
    """Our converter writes up to Q8_0; K-quants come from pyggml.synthetic, 256 wide so that every matrix
    really is quantized (the experts included). The engines differ by ~1e-7 (relative) in places; with
    seed 5 the Q4_K MoE file has a router near-tie at one token of the last layer, which that flips
    (2.5e-3 on that row, every other row ~1e-7), so the seed is 6 (max difference 4.7e-7)."""
    wide = {"embedding_length": 256, "feed_forward_length": 256, "expert_feed_forward_length": 256,
            "attention.key_length": 64, "attention.value_length": 64}
    llama_cpp_agrees(write_model(tmp_path / "m.gguf", arch, {**TINY[arch], **wide}, dtype, seed=6))


# ---- Qwen3-Embedding ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory):
    """(path, HF model) of a tiny Qwen3-Embedding: saved as Qwen3Model (no ``model.`` prefix, no lm_head)
    with a sentence-transformers last-token Pooling module."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("qwen3-embedding")
    hf_dir, model = make_tiny_llama(root, vocab="qwen", arch="qwen3", n_kv_heads=2, tie=True, seed=3)
    weights = load_file(hf_dir / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head.")},
              hf_dir / "model.safetensors")
    (hf_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (hf_dir / "1_Pooling").mkdir()
    (hf_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    return convert_hf(hf_dir, root / "qwen3-embedding.gguf", "f32"), model


def test_qwen3_embedding_pools_the_last_token_like_transformers(embedding_model):
    path, model = embedding_model
    with pyggml.load(path, n_threads=2) as llm:
        assert llm.model.pooling == models.Pooling.LAST and not llm.runner.generates
        ids = [llm.tokenize(t) for t in TEXTS]
        raw = llm.embed(TEXTS, normalize=False)  # the three texts in one pass
        unit = llm.embed(TEXTS[1])
        with pytest.raises(ValueError, match="embedding model"):
            llm.generate("hello", max_tokens=2)
    with torch.no_grad():
        expected = np.stack([model.model(torch.tensor([t])).last_hidden_state[0, -1].numpy() for t in ids])
    assert error(raw, expected) < TOLERANCE
    np.testing.assert_allclose(unit[0], expected[1] / np.linalg.norm(expected[1]), atol=1e-5)


@needs_llama_cpp
def test_llama_cpp_embeds_the_qwen3_embedding_file_alike(embedding_model):
    path, _ = embedding_model
    script = textwrap.dedent("""
        import json, sys
        import llama_cpp
        llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=2, verbose=False, embedding=True,
                              pooling_type=3)
        print(json.dumps([llm.embed(t, normalize=False) for t in json.loads(sys.argv[2])]))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(path), json.dumps(TEXTS)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = np.array(json.loads(done.stdout.strip().splitlines()[-1]), np.float32)
    with pyggml.load(path, n_threads=2) as llm:
        assert error(llm.embed(TEXTS, normalize=False), theirs) < TOLERANCE


def test_qwen3_embedding_through_the_openai_and_ollama_apis(embedding_model):
    pytest.importorskip("starlette", reason="the server tests need starlette, uvicorn, openai, ollama")
    from .test_server import ollama, openai_client, running_server

    path, _ = embedding_model
    with pyggml.load(path, n_threads=1) as llm:
        expected = llm.embed(TEXTS)
    with running_server(path, parallel=1, queue=2, num_ctx=64) as (base, served):
        done = openai_client(base).embeddings.create(model=served.name, input=TEXTS, encoding_format="float")
        np.testing.assert_allclose([d.embedding for d in done.data], expected, atol=1e-5)
        reply = ollama.Client(host=base, timeout=60).embed(model=served.name, input=TEXTS)
        np.testing.assert_allclose(reply.embeddings, expected, atol=1e-5)


# ---- malformed files ----------------------------------------------------------------------------------
def test_a_missing_expert_tensor_is_named(tmp_path):
    path = write_model(tmp_path / "m.gguf", "qwen3moe", TINY["qwen3moe"], omit=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ModelError, match=r"missing tensors: blk\.1\.ffn_up_exps\.weight"):
        models.load(path)


def test_a_wrong_expert_count_is_named(tmp_path):
    hparams = TINY["qwen3moe"]  # 8 experts of 32 in the metadata; the tensors hold 6
    shapes = {f"blk.{i}.{name}.weight": shape for i in range(2) for name, shape in
              (("ffn_gate_inp", (64, 6)), ("ffn_gate_exps", (64, 32, 6)), ("ffn_up_exps", (64, 32, 6)),
               ("ffn_down_exps", (32, 64, 6)))}
    path = write_model(tmp_path / "m.gguf", "qwen3moe", hparams, shapes=shapes)
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_gate_exps\.weight has shape \(64, 32, 6\), expected "
                                         r"\(64, 32, 8\) = \(hidden_size, expert_ffn_size, n_experts\)"):
        models.load(path)


@pytest.mark.parametrize("key, value, words", [
    ("expert_used_count", 9, "qwen3moe.expert_used_count"),
    ("expert_count", 0, "qwen3moe.expert_count"),
    ("expert_gating_func", 2, "qwen3moe.expert_gating_func"),
    ("rope.scaling.type", "longrope", "qwen3moe.rope.scaling.type")])
def test_unsupported_or_inconsistent_keys_are_named(key, value, words):
    from pyggml.backend.metadata import Config
    from pyggml.models.qwen3moe import Options
    from pyggml.synthetic import metadata

    with pytest.raises(ModelError, match=words.replace(".", r"\.")):
        Options.from_config(Config(metadata("qwen3moe", {**TINY["qwen3moe"], key: value})))


def test_a_reranker_pooling_type_needs_the_yes_no_head(tmp_path):
    # issue 29: rank pooling (Qwen3-Reranker) is supported now (tests/test_rerank.py); the head must be there
    path = write_model(tmp_path / "m.gguf", "qwen3", {**TINY["qwen3"], "pooling_type": 4})
    model = models.load(path)
    assert model.pooling == models.Pooling.RANK and not model.generates
    model.close()
    path = write_model(tmp_path / "n.gguf", "qwen3", {**TINY["qwen3"], "pooling_type": 4}, omit=("cls.output.weight",))
    with pytest.raises(ModelError, match=r"cls\.output\.weight"):
        models.load(path)


# ---- the benchmark shapes -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b", "qwen3moe-small", "qwen3-small-dense"])
def test_named_bench_shapes_are_valid_models(name):
    from pyggml import nn
    from pyggml.backend.metadata import Config
    from pyggml.synthetic import SHAPES, metadata

    shape = SHAPES[name]
    cls = models.registry()[shape.arch]
    options = cls.Options.from_config(Config(metadata(shape.arch, {**shape.hparams(), "vocab_size": 300})))
    assert nn.declared(cls.Weights, options)  # every tensor's size is known
    if shape.arch == "qwen3moe":  # its dense twin has the same active parameters per token (the router aside)
        dense = SHAPES["qwen3-small-dense"]
        assert options.n_experts_used * options.expert_ffn_size == dense.ffn
        assert (shape.n_layers, shape.hidden, shape.n_heads, shape.n_kv_heads) == \
            (dense.n_layers, dense.hidden, dense.n_heads, dense.n_kv_heads)
