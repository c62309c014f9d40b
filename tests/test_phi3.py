"""Phi-3: tiny random Hugging Face models converted by our converter give transformers' logits (one
batch, and token by token through the cache), with GQA/MHA, partial rotary, LongRoPE (short and
long factors, chosen by the context) and a sliding window shorter than the prompt; llama.cpp
computes the same from our files."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from ._models import scaled_error
from .hf_fixtures import make_tiny_llama
from .test_convert import llama_cpp_logits, needs_llama_cpp
from .test_gemma import _llama_cpp_greedy

torch = pytest.importorskip("torch", reason="the parity tests need torch (the `reference` extra)")
pytest.importorskip("transformers", reason="the parity tests need transformers (the `reference` extra)")

TEXT = "Which way about many people water? The cafe is naive, 42 said!"
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0]}
LONG_ORIGINAL = {"original_max_position_embeddings": 64}
# (make_tiny_llama arguments, pyggml's num_ctx): a context of 64 keeps LongRoPE's short factors (the
# original context is 64), 128 takes the long ones
CASES = {
    "gqa": (dict(n_kv_heads=2), 64),
    "mha-partial-rotary": (dict(n_kv_heads=4, config_extra={"partial_rotary_factor": 0.5}), 64),
    "longrope-short": (dict(n_kv_heads=4, rope_scaling=LONGROPE, config_extra=LONG_ORIGINAL), 64),
    "longrope-long": (dict(n_kv_heads=2, rope_scaling=LONGROPE, config_extra=LONG_ORIGINAL), 128),
    "sliding-window": (dict(n_kv_heads=2, config_extra={"sliding_window": 4}), 64),
}


def long_factors_everywhere(model):
    """The transformers model with its short factors replaced by the long ones: transformers picks
    by the prompt's length, pyggml (as llama.cpp) by the context, so a short prompt in a long
    context rotates with the long factors."""
    config = copy.deepcopy(model.config)
    config.rope_parameters["short_factor"] = LONGROPE["long_factor"]
    long = type(model)(config).eval()
    long.load_state_dict(model.state_dict())
    return long


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    import pyggml
    from pyggml.convert import convert_hf

    args, num_ctx = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    hf_dir, model = make_tiny_llama(tmp, arch="phi3", vocab="spm", **args)
    path = convert_hf(hf_dir, tmp / "model.gguf", "f32")
    with pyggml.load(path, n_threads=1, num_ctx=num_ctx) as llm:
        tokens = llm.tokenize(TEXT)
    if num_ctx > 64 and "rope_scaling" in args:
        model = long_factors_everywhere(model)
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()
    return request.param, path, num_ctx, tokens, ref


def test_logits_match_transformers_in_one_batch_and_token_by_token(converted):
    import pyggml

    case, path, num_ctx, tokens, ref = converted
    assert len(tokens) > 3 * 4  # well past the sliding window of 4
    with pyggml.load(path, n_threads=2, num_ctx=num_ctx, cache_type="f32") as llm:
        assert llm.model.architecture == "phi3"
        assert llm.model.cache.swa_window == (4 if case == "sliding-window" else None)
        batch = llm.logits(tokens)
    with pyggml.load(path, n_threads=2, num_ctx=num_ctx, batch_size=1, cache_type="f32") as llm:
        steps = llm.logits(tokens)
    # measured: 3.8e-7 .. 5.6e-7 in all cases, one batch and token by token (float32 rounding)
    assert scaled_error(batch, ref) <= 1e-3
    assert scaled_error(steps, ref) <= 1e-3


@pytest.mark.ci_may_skip  # cases where the check does not apply skip
def test_longrope_factors_and_the_window_matter(converted):
    """The other factor set, or no window, gives other logits: the parity above checks them."""
    import pyggml

    case, path, num_ctx, tokens, ref = converted
    if case not in ("longrope-short", "longrope-long", "sliding-window"):
        pytest.skip("no LongRoPE factors or window in this case")
    if case == "sliding-window":  # the same weights without a window
        path = copy_gguf(path, path.with_name("no-window.gguf"), keys={"phi3.attention.sliding_window": 0})
    else:  # the other factor set
        num_ctx = 128 if num_ctx == 64 else 64
    with pyggml.load(path, n_threads=2, num_ctx=num_ctx, cache_type="f32") as llm:
        other = llm.logits(tokens)
    assert scaled_error(other, ref) > 1e-2


@needs_llama_cpp
@pytest.mark.ci_may_skip  # cases where the check does not apply skip
def test_llama_cpp_computes_the_same_logits_from_our_file(converted):
    import pyggml

    case, path, num_ctx, tokens, ref = converted
    if case == "sliding-window":
        pytest.skip("llama.cpp ignores Phi-3's sliding window (llama.cpp PR 13676)")
    if case == "longrope-short":
        pytest.skip("llama.cpp pads its context to 256 and so always takes the long factors here")
    theirs_tokens, theirs = llama_cpp_logits(path, TEXT)
    assert theirs_tokens == tokens
    with pyggml.load(path, n_threads=2, num_ctx=num_ctx, cache_type="f32") as llm:
        ours = llm.logits(tokens)
        llm.generate(tokens, max_tokens=8, temperature=0)
        greedy = llm.stats.tokens
    assert greedy == _llama_cpp_greedy(path, tokens, 8)
    # measured: 0 (both F32 caches: the same kernels); llama.cpp vs transformers up to 5.4e-7
    assert scaled_error(ours, theirs) <= 1e-4
    assert scaled_error(theirs, ref) <= 1e-4


@pytest.mark.ci_may_skip  # cases where the check does not apply skip
def test_llama_cpps_longrope_scaling_type_is_read(converted, tmp_path):
    """llama.cpp's converter writes ``rope.scaling.type = longrope`` (ours leaves it out): the same."""
    import pyggml

    case, path, num_ctx, tokens, ref = converted
    if not case.startswith("longrope"):
        pytest.skip("no LongRoPE in this case")
    named = copy_gguf(path, tmp_path / "named.gguf", keys={"phi3.rope.scaling.type": "longrope"})
    with pyggml.load(named, n_threads=2, num_ctx=num_ctx, cache_type="f32") as llm:
        assert scaled_error(llm.logits(tokens), ref) <= 1e-3


def copy_gguf(src, dst, *, keys=None, drop=(), tensors=None):
    """Copy an F32 GGUF with some metadata values replaced or added (``keys``), some tensors left out
    (``drop``) and some re-encoded: ``tensors(name, data)`` returns the data to write, or
    (bytes, gguf type) for a quantized tensor, or None to keep it."""
    import gguf

    keys = keys or {}
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = keys.get(name, field.contents())
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, field.types[0])
    for name, value in keys.items():  # keys the file lacks
        if name not in reader.fields:
            add = {str: writer.add_string, int: writer.add_uint32, float: writer.add_float32}[type(value)]
            add(name, value)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data)  # F32: the data has the numpy shape
        new = tensors(t.name, data) if tensors is not None else None
        if isinstance(new, tuple):
            writer.add_tensor(t.name, new[0], raw_dtype=new[1])
        else:
            writer.add_tensor(t.name, data if new is None else new)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_only_one_longrope_factor_set_is_a_clear_error(tmp_path):
    import pyggml
    from pyggml.convert import convert_hf
    from pyggml.models import ModelError

    hf_dir, _ = make_tiny_llama(tmp_path, arch="phi3", vocab="spm", rope_scaling=LONGROPE, config_extra=LONG_ORIGINAL)
    path = convert_hf(hf_dir, tmp_path / "m.gguf", "f32")
    short_only = copy_gguf(path, tmp_path / "short-only.gguf", drop={"rope_factors_long.weight"})
    with pytest.raises(ModelError, match="rope_factors_long"):
        pyggml.load(short_only, n_threads=1, num_ctx=64)
