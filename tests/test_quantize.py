"""``pyggml quantize`` and ``convert --type q4_k_m``: ggml's quantizers with llama-quantize's type mixes.

The strongest check: for every type, the file equals the one llama.cpp's own ``llama_model_quantize``
(llama-cpp-python, the same ggml) writes from the same input, tensor by tensor and byte for byte,
with the same metadata. Then pyggml runs the quantized files with logits close to the source's."""

from __future__ import annotations

import ctypes
from collections import Counter

import gguf
import numpy as np
import pytest

from pyggml.quantize import FILE_TYPES, Mix, quantize_gguf
from pyggml.synthetic import defaults, write_model
from pyggml.tensor import DType

from .conftest import SHARED_MODELS

STORIES = SHARED_MODELS / "stories260K.gguf"
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL"]


def tensors(path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(path).tensors}


def metadata(path) -> dict[str, object]:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


@pytest.fixture(scope="module")
def model_8_layers(tmp_path_factory):
    """A llama of 8 layers (the _M mixes pick layers by eighths), rows of 256 (K-quant blocks), GQA 4."""
    path = tmp_path_factory.mktemp("q") / "m.gguf"
    return write_model(path, "llama", {**defaults("llama"), "block_count": 8, "embedding_length": 256,
                                       "feed_forward_length": 512, "attention.head_count": 4,
                                       "attention.head_count_kv": 1, "vocab_size": 512})


def assert_same_as_llama_quantize(source, tmp_path, file_type):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference quantizer")
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantize_gguf(source, ours, file_type)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = int(FILE_TYPES[file_type][1]), 1
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    a, b = tensors(ours), tensors(theirs)
    assert sorted(a) == sorted(b)  # llama.cpp writes them in its own order
    assert {n: t for n, (t, _) in a.items()} == {n: t for n, (t, _) in b.items()}
    assert [n for n in a if a[n][1] != b[n][1]] == []
    assert metadata(ours) == metadata(theirs)


@pytest.mark.parametrize("file_type", TYPES)
def test_files_equal_llama_quantize_byte_for_byte(model_8_layers, tmp_path, file_type):
    assert_same_as_llama_quantize(model_8_layers, tmp_path, file_type)


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q4_0", "Q6_K"])
def test_tied_output_and_bert_files_equal_llama_quantize(tmp_path, file_type):
    # tied: token_embd is the output matrix (Q6_K); BERT: position and token-type embeddings stay
    tied = write_model(tmp_path / "tied.gguf", "llama", {**defaults("llama"), "block_count": 3,
                                                         "embedding_length": 256, "vocab_size": 512},
                       omit=("output.weight",))
    assert_same_as_llama_quantize(tied, tmp_path, file_type)
    bert = write_model(tmp_path / "bert.gguf", "bert", {**defaults("bert"), "embedding_length": 256,
                                                        "feed_forward_length": 256}, "f16")
    assert_same_as_llama_quantize(bert, tmp_path, file_type)


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q5_K_M", "IQ4_NL", "Q4_K_S"])
def test_moe_and_hybrid_files_equal_llama_quantize(tmp_path, file_type):
    # 8 experts: llama.cpp gives attention v/k Q8_0 and the output projection Q5_K; a hybrid (LFM2: attention in
    # some layers only) counts its attention layers, not its layers, to choose the ones with more bits
    moe = write_model(tmp_path / "moe.gguf", "qwen3moe", {
        **defaults("qwen3moe"), "block_count": 8, "embedding_length": 256, "attention.head_count": 4,
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 256, "vocab_size": 512})
    assert_same_as_llama_quantize(moe, tmp_path, file_type)
    kv = [0, 2, 0, 0, 2, 0, 0, 2, 2, 0, 2, 0, 0, 2, 0, 0]
    hybrid = write_model(tmp_path / "lfm2.gguf", "lfm2", {
        **defaults("lfm2"), "block_count": 16, "embedding_length": 256, "feed_forward_length": 256,
        "attention.head_count": 4, "attention.head_count_kv": kv, "vocab_size": 512})
    assert_same_as_llama_quantize(hybrid, tmp_path, file_type)


def test_mixes_choose_llama_cpps_types():
    mix = Mix("Q4_K_M", n_layers=8)
    # more bits for attn_v/ffn_down of the first and last eighth and every third layer between
    assert [mix.tensor_type(f"blk.{i}.ffn_down.weight", (256, 256), DType.F16).name for i in range(8)] == \
        ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert mix.tensor_type("blk.1.attn_q.weight", (256, 256), DType.F16) == DType.Q4_K
    assert mix.tensor_type("output.weight", (256, 512), DType.F16) == DType.Q6_K
    assert mix.tensor_type("token_embd.weight", (256, 512), DType.F16) == DType.Q4_K
    assert Mix("Q4_K_M", 8, tied_output=True).tensor_type("token_embd.weight", (256, 512), DType.F16) == DType.Q6_K
    assert Mix("Q8_0", 8).tensor_type("output.weight", (256, 512), DType.F16) == DType.Q8_0
    # rows that are not whole blocks fall back (Q4_K -> Q5_0, then F16); norms and 1-d stay as they are
    assert mix.tensor_type("blk.1.attn_q.weight", (64, 64), DType.F32) == DType.Q5_0
    assert mix.tensor_type("blk.1.attn_q.weight", (48, 64), DType.F32) == DType.F16
    assert mix.tensor_type("blk.1.attn_norm.weight", (256,), DType.F32) == DType.F32
    assert mix.tensor_type("token_types.weight", (256, 2), DType.F32) == DType.F32
    assert Mix("F16", 8).tensor_type("blk.0.attn_q.weight", (256, 256), DType.F32) == DType.F16


# logits of stories260K (a trained model) after quantization: relative error and top-1 agreement
# with the F32 original over a 36-token text (measured: F16 0.0004, Q8_0 0.009, Q6_K 0.009,
# Q5_K_M 0.047, Q4_K_M 0.049, IQ4_NL 0.084, Q4_0 0.14; top-1 0.94..1.0). Width 64: the K types fall back
BOUNDS = {"F16": (0.002, 1.0), "Q8_0": (0.02, 0.97), "Q6_K": (0.02, 0.97), "Q5_K_M": (0.08, 0.9),
          "Q4_K_M": (0.08, 0.9), "IQ4_NL": (0.13, 0.9), "Q4_0": (0.2, 0.85)}


@pytest.mark.parametrize("file_type", list(BOUNDS))
def test_quantized_logits_stay_close_to_the_source(tmp_path, file_type):
    if not STORIES.exists():
        pytest.skip(f"needs {STORIES}")
    import pyggml

    text = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    with pyggml.load(STORIES, num_ctx=128) as llm:
        tokens = llm.tokenize(text)
        ref = llm.logits(tokens)
    quantize_gguf(STORIES, tmp_path / "q.gguf", file_type)
    with pyggml.load(tmp_path / "q.gguf", num_ctx=128) as llm:
        got = llm.logits(tokens)
    max_rel, min_top1 = BOUNDS[file_type]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < max_rel
    assert (got.argmax(1) == ref.argmax(1)).mean() >= min_top1


def test_llama_cpp_runs_a_quantized_file_like_pyggml(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python runs the file")
    if not STORIES.exists():
        pytest.skip(f"needs {STORIES}")
    import pyggml

    quantize_gguf(STORIES, tmp_path / "q.gguf", "Q4_K_M")
    with pyggml.load(tmp_path / "q.gguf", num_ctx=64) as llm:
        tokens = llm.tokenize("Once upon a time")
        ours = llm.logits(tokens)
    ref = llama_cpp.Llama(str(tmp_path / "q.gguf"), n_ctx=64, logits_all=True, verbose=False)
    ref.eval(tokens)
    theirs = np.array(ref.scores[:len(tokens)])
    ref.close()
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-3


def test_requantizing_keeps_tensors_already_of_the_type_and_refuses_nonsense(tmp_path):
    if not STORIES.exists():
        pytest.skip(f"needs {STORIES}")
    first = quantize_gguf(STORIES, tmp_path / "a.gguf", "Q8_0")
    again = quantize_gguf(tmp_path / "a.gguf", tmp_path / "b.gguf", "Q8_0")
    assert first == again and tensors(tmp_path / "a.gguf") == tensors(tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="unknown quantization type 'q3_k'; choose one of .*Q4_K_M"):
        quantize_gguf(STORIES, tmp_path / "c.gguf", "q3_k")
    with pytest.raises(ValueError, match="another file"):
        quantize_gguf(tmp_path / "a.gguf", tmp_path / "a.gguf", "Q4_0")
    assert not (tmp_path / "c.gguf").exists()


def test_cli_quantize_reports_the_types(tmp_path, capsys):
    if not STORIES.exists():
        pytest.skip(f"needs {STORIES}")
    from pyggml.cli import CONVERT_TYPES, main
    from pyggml.convert.tensors import OUT_TYPES, QUANTIZED_TYPES

    assert main(["quantize", str(STORIES), str(tmp_path / "q.gguf"), "q4_k_m"]) == 0
    out = capsys.readouterr().out
    counts = Counter(t for t, _ in tensors(tmp_path / "q.gguf").values())
    assert "(Q4_K_M," in out and f"{counts['Q5_0']} Q5_0" in out
    assert metadata(tmp_path / "q.gguf")["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert main(["quantize", str(STORIES), str(tmp_path / "r.gguf"), "Q9"]) == 1
    assert "unknown quantization type 'Q9'" in capsys.readouterr().err
    # convert --type offers the converter's own types and these
    assert CONVERT_TYPES == [*OUT_TYPES, *(t.lower() for t in QUANTIZED_TYPES)]
    assert set(QUANTIZED_TYPES) == set(FILE_TYPES) - {"F32", "F16", "BF16", "Q8_0"}


def test_convert_type_q4_k_m_equals_quantizing_the_f32_file(tmp_path):
    pytest.importorskip("torch", reason="builds an HF model")
    pytest.importorskip("transformers", reason="builds an HF model")
    from pyggml.convert import convert_hf

    from .hf_fixtures import make_tiny_llama

    # ffn_down rows of 256: whole K-quant blocks; the other rows (64) fall back as llama-quantize does
    hf_dir, _ = make_tiny_llama(tmp_path, n_kv_heads=2, intermediate_size=256)
    convert_hf(hf_dir, tmp_path / "f32.gguf", "f32")
    quantize_gguf(tmp_path / "f32.gguf", tmp_path / "q.gguf", "Q4_K_M")
    convert_hf(hf_dir, tmp_path / "direct.gguf", "q4_k_m")
    assert tensors(tmp_path / "direct.gguf") == tensors(tmp_path / "q.gguf")
    assert metadata(tmp_path / "direct.gguf") == metadata(tmp_path / "q.gguf")
    assert {t for t, _ in tensors(tmp_path / "q.gguf").values()} >= {"Q4_K", "Q6_K", "Q5_0"}
