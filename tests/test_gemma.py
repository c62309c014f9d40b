"""Gemma 2 and Gemma 3 text: tiny random Hugging Face models converted by our converter give
transformers' logits (one batch, and token by token through the sliding-window cache past the
window), and llama.cpp computes the same from our files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ._models import scaled_error
from .hf_fixtures import make_spm_tokenizer
from .test_convert import llama_cpp_logits, needs_llama_cpp

torch = pytest.importorskip("torch", reason="the parity tests need torch (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (`reference` extra)")

WINDOW = 4
TEXT = "The cafe is naive, 42 people said! Then they left"
# gemma2: 4 layers (sliding, global, sliding, global), soft caps small enough to bend the scores;
# gemma3: 6 layers (5 sliding, 1 global), the global rope scaled (linear, 2x) and the local base apart
CASES = {
    "gemma2-gqa-softcap": ("gemma2", dict(num_hidden_layers=4, num_key_value_heads=2, attn_logit_softcapping=2.0,
                                          final_logit_softcapping=3.0)),
    "gemma3-mha-scaled-rope": ("gemma3", dict(num_hidden_layers=6, num_key_value_heads=4, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def make_tiny_gemma(tmp_path: Path, arch: str, seed: int = 0, **overrides) -> tuple[Path, object]:
    hf_dir = tmp_path / f"tiny-{arch}"
    hf_dir.mkdir(parents=True, exist_ok=True)
    n_tokens = make_spm_tokenizer(hf_dir, seed)
    config_cls, model_cls = {"gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
                             "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[arch]
    config = config_cls(vocab_size=-(-n_tokens // 32) * 32, hidden_size=64, intermediate_size=96,
                        num_attention_heads=4, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=256,
                        sliding_window=WINDOW, rms_norm_eps=1e-6, initializer_range=0.05, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0, attn_implementation="eager", **overrides)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms scale by 1 + weight: randomise around 0
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    return hf_dir, model


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    from pyggml.convert import convert_hf

    arch, overrides = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    hf_dir, model = make_tiny_gemma(tmp, arch, **overrides)
    path = convert_hf(hf_dir, tmp / "model.gguf", "f32")
    import pyggml

    with pyggml.load(path, n_threads=1, num_ctx=64) as llm:  # Gemma's tokenizer: no space prefix
        tokens = llm.tokenize(TEXT)
        n_vocab = llm.tokenizer.vocab_size  # gemma3 files drop the embedding rows past the tokenizer's tokens
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()[:, :n_vocab]
    return arch, path, tokens, ref


def test_logits_match_transformers_in_one_batch_and_token_by_token_past_the_window(converted):
    import pyggml

    arch, path, tokens, ref = converted
    assert len(tokens) > 3 * WINDOW  # positions well past the window
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        assert llm.model.architecture == arch
        batch = llm.logits(tokens)
    with pyggml.load(path, n_threads=2, num_ctx=64, batch_size=1, cache_type="f32") as llm:
        steps = llm.logits(tokens)  # one token per forward pass: the window slides through the cache
    # measured (one batch / token by token): gemma2 4.7e-4 / 4.7e-4, gemma3 6.6e-4 / 7.1e-4, all from
    # ggml's GELU, which looks its values up in an F16 table (llama.cpp computes the same)
    assert scaled_error(batch, ref) <= 1e-3
    assert scaled_error(steps, ref) <= 1e-3


def test_logits_match_with_several_sequence_slots(converted):
    """Three sequences scored at once (the cache's per-sequence groups, as ``serve`` runs them), past the
    window: each gives what it gives alone, and the first transformers' logits (soft-capping included)."""
    import pyggml

    from ._models import logits_in_slots

    arch, path, tokens, ref = converted
    prompts = [tokens, tokens[3:], tokens[:-4]]
    together = logits_in_slots(path, prompts)
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        for prompt, logits in zip(prompts, together, strict=True):
            assert scaled_error(logits, llm.logits(prompt)) <= 1e-3
    assert scaled_error(together[0], ref) <= 1e-3


def test_the_window_masks(converted):
    """The same file with a window as wide as the prompt gives other logits past the window, so the
    parity above really checks the sliding window."""
    import pyggml

    arch, path, tokens, ref = converted
    with pyggml.load(path, n_threads=2, num_ctx=64) as llm:
        cache = llm.model.cache
        assert [c.swa_window for c in cache.caches] == [WINDOW, None]
    wide = path.with_name("wide.gguf")
    _rewrite_window(path, wide, 64)
    with pyggml.load(wide, n_threads=2, num_ctx=64) as llm:
        unwindowed = llm.logits(tokens)
    assert scaled_error(unwindowed[:WINDOW], ref[:WINDOW]) <= 1e-3  # nothing is out of the window yet
    assert scaled_error(unwindowed, ref) > 1e-2


@needs_llama_cpp
def test_llama_cpp_computes_the_same_logits_from_our_file(converted):
    import pyggml

    arch, path, tokens, ref = converted
    theirs_tokens, theirs = llama_cpp_logits(path, TEXT)
    assert theirs_tokens == tokens
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        ours = llm.logits(tokens)
        llm.generate(tokens, max_tokens=8, temperature=0)
        greedy = llm.stats.tokens
    # both with an F32 KV cache; llama.cpp vs transformers differs by the F16 GELU table (up to 7e-4)
    assert scaled_error(ours, theirs) <= 1e-3
    assert scaled_error(theirs, ref) <= 3e-3
    assert greedy == _llama_cpp_greedy(path, tokens, 8)


def _llama_cpp_greedy(path: Path, tokens: list[int], n: int) -> list[int]:
    """llama.cpp's greedy continuation of ``tokens``: up to ``n`` ids, ending before an end token."""
    import json
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import json, sys
        import llama_cpp
        llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=2, verbose=False)
        ids = []
        for token in llm.generate(json.loads(sys.argv[2]), top_k=1, temp=0.0):
            if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token) or \
                    len(ids) == int(sys.argv[3]):
                break
            ids.append(token)
        print(json.dumps(ids))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(path), json.dumps(tokens), str(n)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rewrite_window(src: Path, dst: Path, window: int) -> None:
    """Copy a GGUF with another ``attention.sliding_window``."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = window if name == f"{arch}.attention.sliding_window" else field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data))  # F32 files: the data has the numpy shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
