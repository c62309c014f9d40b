"""Gemma 4 text: tiny random Hugging Face models converted by our converter give transformers' logits
(one batch, token by token through both caches past the window, several sequences at once), and
llama.cpp computes the same from our files. Two configurations cover the layer machinery: an E2B-like
one (per-layer embeddings, the last two layers reading earlier layers' caches, double-wide MLPs there)
and a 26B-A4B-like one (experts beside the MLP, global layers with one KV head whose values are their
keys' projection)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ._models import scaled_error
from .hf_fixtures import make_spaced_bpe_tokenizer, make_spm_tokenizer
from .test_convert import llama_cpp_logits, needs_llama_cpp

torch = pytest.importorskip("torch", reason="the parity tests need torch (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (`reference` extra)")

WINDOW = 4
TEXT = "The cafe is naive, 42 people said! Then they left"
SLIDING, FULL = "sliding_attention", "full_attention"
CASES = {
    # layers 4 and 5 share the caches of layers 2 (sliding) and 3 (global)
    "e2b-like-ple-shared-kv": dict(
        layer_types=[SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, use_double_wide_mlp=True),
    "26b-like-experts-k-eq-v": dict(
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL], hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24, attention_k_eq_v=True,
        num_global_key_value_heads=1),
}


def make_tiny_gemma4(tmp_path: Path, seed: int = 0, tokenizer=make_spm_tokenizer, **overrides) -> tuple[Path, object]:
    hf_dir = tmp_path / "tiny-gemma4"
    hf_dir.mkdir(parents=True, exist_ok=True)
    n_tokens = tokenizer(hf_dir, seed)
    vocab = -(-n_tokens // 32) * 32
    config = transformers.Gemma4TextConfig(
        vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64, intermediate_size=96,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        max_position_embeddings=256, sliding_window=WINDOW, rms_norm_eps=1e-6, final_logit_softcapping=10.0,
        initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager",
        **overrides)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            # norms, scales and the layer scalar start at 1: move them so that each matters
            if name.endswith(("norm.weight", "layernorm.weight", "norm_1.weight", "norm_2.weight", "router.scale",
                              "per_expert_scale", "layer_scalar")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    return hf_dir, model


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    import pyggml
    from pyggml.convert import convert_hf

    tmp = tmp_path_factory.mktemp(request.param)
    hf_dir, model = make_tiny_gemma4(tmp, **CASES[request.param])
    path = convert_hf(hf_dir, tmp / "model.gguf", "f32")
    with pyggml.load(path, n_threads=1, num_ctx=64) as llm:
        tokens = llm.tokenize(TEXT)
        n_vocab = llm.tokenizer.vocab_size  # the files drop the embedding rows past the tokenizer's tokens
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()[:, :n_vocab]
        for module in model.modules():  # GELU as ggml computes it: looked up in an F16 table of F16 inputs
            if hasattr(module, "act_fn"):
                module.act_fn = F16TableGelu()
        ref_f16_gelu = model(torch.tensor([tokens])).logits[0].numpy()[:, :n_vocab]
    return request.param, path, tokens, ref, ref_f16_gelu


class F16TableGelu(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()


def test_logits_match_transformers_in_one_batch_and_token_by_token_past_the_window(converted):
    import pyggml

    case, path, tokens, ref, ref_f16_gelu = converted
    assert len(tokens) > 3 * WINDOW  # positions well past the window
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        assert llm.model.architecture == "gemma4"
        batch = llm.logits(tokens)
    with pyggml.load(path, n_threads=2, num_ctx=64, batch_size=1, cache_type="f32") as llm:
        steps = llm.logits(tokens)  # one token per forward pass: the window slides through the cache
    # ggml's GELU looks its values up in an F16 table of F16 inputs, and the per-layer embeddings' RMS norm
    # of a small bottleneck amplifies that rounding. Measured, e2b-like / 26b-like: from transformers 2.9e-3 /
    # 6.9e-4; from transformers with that GELU 2.0e-4 / 1.1e-4 in one batch and 1.5e-3 / 1.1e-4 token by token
    # (one row: an F16 input rounded the other way; llama.cpp's one batch is ours to the bit, and token by
    # token it is 1.4e-3 from its own batch)
    assert scaled_error(batch, ref_f16_gelu) <= 1e-3
    assert scaled_error(steps, ref_f16_gelu) <= 3e-3
    for ours in (batch, steps):
        assert scaled_error(ours, ref) <= 5e-3


def test_logits_match_with_several_sequence_slots(converted):
    """Three sequences scored at once, past the window: each gives what it gives alone."""
    import pyggml

    from ._models import logits_in_slots

    case, path, tokens, _, ref = converted
    prompts = [tokens, tokens[3:], tokens[:-4]]
    together = logits_in_slots(path, prompts)
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        for prompt, logits in zip(prompts, together, strict=True):
            assert scaled_error(logits, llm.logits(prompt)) <= 1e-3
    assert scaled_error(together[0], ref) <= 1e-3


def test_the_shared_layers_store_nothing_and_read_their_source(converted):
    import pyggml

    case, path, tokens, _, _ = converted
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        opts, (local, full) = llm.model.options, llm.model.cache.caches
        llm.logits(tokens)
        stored = sorted([*local.keys, *full.keys])
    if case.startswith("e2b"):
        assert opts.kv_layers == (0, 1, 2, 3, 2, 3)
        assert stored == [0, 1, 2, 3]  # layers 4 and 5 have no cache of their own
        assert opts.head_dims == (16, 16, 16, 32, 16, 32) and opts.ffn_size == (96,) * 4 + (192,) * 2
    else:
        assert opts.kv_layers == tuple(range(6)) and stored == list(range(6))
        assert opts.n_kv_heads == (2, 2, 1, 2, 2, 1)


TOKENIZER_TEXTS = ["Hello  world", "Then they left.\n\nThe cafe is naive, 42 people said!", "naïve 日本 🙂 über",
                   " leading and trailing spaces  ", "\n\n\n", "a\tb"]


def test_a_spaced_bpe_tokenizer_json_becomes_llama_cpps_gemma4_vocabulary(tmp_path):
    """Gemma 4's tokenizer.json (BPE over U+2581 text, <0xXX> bytes) converts to the ``gemma4`` vocabulary,
    which tokenizes as the Hugging Face tokenizer and llama.cpp do and decodes back to the text."""
    import gguf
    from tokenizers import Tokenizer

    import pyggml
    from pyggml.convert import convert_hf

    hf_dir, _ = make_tiny_gemma4(tmp_path, tokenizer=make_spaced_bpe_tokenizer, **CASES["e2b-like-ple-shared-kv"])
    path = convert_hf(hf_dir, tmp_path / "model.gguf", "f32")
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.model"].contents() == "gemma4"
    reference = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    with pyggml.load(path, n_threads=1, num_ctx=64) as llm:
        for text in TOKENIZER_TEXTS:
            ids = llm.tokenize(text)
            assert ids == reference.encode(text).ids, text
            assert llm.detokenize(ids[1:]) == text
    if importlib.util.find_spec("llama_cpp") is not None:
        for text in TOKENIZER_TEXTS:
            assert llama_cpp_logits(path, text)[0] == reference.encode(text).ids, text


def test_channel_and_tool_tokens_are_written_to_be_rendered(tmp_path):
    """Gemma 4 writes its reasoning channel and tool calls with special tokens (``<|channel>``, ``<tool_call|>``,
    ...): the file marks them USER_DEFINED, as llama.cpp's converter does, so detokenizing shows them to the chat
    parser, while the other special tokens stay CONTROL (not rendered)."""
    import json

    import gguf

    import pyggml
    from pyggml.convert import convert_hf

    hf_dir, _ = make_tiny_gemma4(tmp_path, tokenizer=make_spaced_bpe_tokenizer, **CASES["e2b-like-ple-shared-kv"])
    spec = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    renamed = {"<|channel>": max(by_id) - 1, "<tool_call|>": max(by_id)}  # two byte tokens take the names
    for name, i in renamed.items():
        del vocab[by_id[i]]
        vocab[name] = i
        spec["added_tokens"].append({"id": i, "content": name, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (hf_dir / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    path = convert_hf(hf_dir, tmp_path / "model.gguf", "f32")
    types = gguf.GGUFReader(path).fields["tokenizer.ggml.token_type"].contents()
    bos = vocab["<bos>"]
    assert [types[i] for i in renamed.values()] == [gguf.TokenType.USER_DEFINED] * 2
    assert types[bos] == gguf.TokenType.CONTROL
    with pyggml.load(path, n_threads=1, num_ctx=64) as llm:
        assert llm.detokenize([renamed["<|channel>"], renamed["<tool_call|>"]]) == "<|channel><tool_call|>"
        assert llm.detokenize([bos]) == ""


@needs_llama_cpp
def test_llama_cpp_computes_the_same_logits_from_our_file(converted):
    import pyggml

    case, path, tokens, _, ref = converted
    theirs_tokens, theirs = llama_cpp_logits(path, TEXT)
    assert theirs_tokens == tokens
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        ours = llm.logits(tokens)
    # measured: 0 (e2b-like: the same kernels in the same order), 1.0e-4 (26b-like: experts summed apart)
    assert scaled_error(ours, theirs) <= 1e-3
    assert scaled_error(theirs, ref) <= 1e-3


def test_pyggml_compare_matches_every_block(converted, tmp_path):
    """`pyggml compare` finds every block, the final norm and the logits, all within the GELU-table floor
    above (measured: at most 3.5e-3 max error, e2b-like's last block)."""
    from pyggml import porting

    case, path, tokens, _, _ = converted
    result = porting.compare(path.parent / "tiny-gemma4", path, TEXT, n_threads=2, tolerance=5e-3)
    names = [x.name for x in result.layers]
    assert names == ["token_embd", *(f"blk.{i}" for i in range(6)), "output_norm", "logits"], result.table()
    assert not result.unmatched and result.ok, result.table()


def test_the_text_decoder_of_a_multimodal_checkpoint_converts(tmp_path):
    """Gemma 4 is published as Gemma4ForConditionalGeneration: its text decoder converts (the vision tower is
    left out) and gives the multimodal model's logits for text."""
    import pyggml
    from pyggml.convert import convert_hf

    hf_dir = tmp_path / "tiny-gemma4-mm"
    hf_dir.mkdir()
    n_tokens = make_spm_tokenizer(hf_dir, 0)
    vocab = -(-n_tokens // 32) * 32
    text = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64, intermediate_size=96,
                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                max_position_embeddings=256, sliding_window=WINDOW, final_logit_softcapping=10.0,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, **CASES["e2b-like-ple-shared-kv"])
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision.to_dict(), audio_config=None)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    model.save_pretrained(hf_dir)
    path = convert_hf(hf_dir, tmp_path / "model.gguf", "f32")
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        assert llm.model.options.kv_layers == (0, 1, 2, 3, 2, 3)
        tokens = llm.tokenize(TEXT)
        ours = llm.logits(tokens)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0].numpy()[:, :ours.shape[1]]
    assert scaled_error(ours, ref) <= 5e-3  # the GELU-table floor (see above)


@pytest.mark.parametrize("change, message", [
    ({"attention.shared_kv_layers": 1}, "follow a sliding layer and a global one"),  # llama.cpp: 5 reads 4
    ({"attention.shared_kv_layers": 3}, "have none of kind"),  # no global layer before layer 3
    ({"attention.shared_kv_layers": 6}, "leave no layer"),
    ({"attention.head_count_kv": [2, 2, 3, 1, 2, 1]}, "must divide"),
    ({"expert_feed_forward_length": 0}, "expert_feed_forward_length set"),
])
def test_files_gemma4_cannot_run_are_refused_at_load(change, message, tmp_path):
    from pyggml.synthetic import write_model

    from .test_architectures import TINY

    with pytest.raises(ValueError, match=message):
        write_model(tmp_path / "bad.gguf", "gemma4", {**TINY["gemma4"], **change}, "f32")


def test_k_and_v_weights_of_the_sharing_layers_are_left_out(tmp_path):
    """Published checkpoints keep k/v projections in the layers that read another layer's cache; transformers
    ignores them, and so does the converter (the file equals one converted without them)."""
    from safetensors.numpy import load_file, save_file

    import pyggml
    from pyggml.convert import convert_hf

    hf_dir, _ = make_tiny_gemma4(tmp_path, **CASES["e2b-like-ple-shared-kv"])
    plain = convert_hf(hf_dir, tmp_path / "plain.gguf", "f32")
    weights = load_file(hf_dir / "model.safetensors")
    rng = np.random.default_rng(0)
    for layer, head in ((4, 16), (5, 32)):
        for name, shape in (("k_proj.weight", (2 * head, 64)), ("v_proj.weight", (2 * head, 64)),
                            ("k_norm.weight", (head,))):
            weights[f"model.layers.{layer}.self_attn.{name}"] = rng.standard_normal(shape).astype(np.float32)
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    extra = convert_hf(hf_dir, tmp_path / "extra.gguf", "f32")
    with pyggml.load(plain, n_threads=2, num_ctx=64) as a, pyggml.load(extra, n_threads=2, num_ctx=64) as b:
        tokens = a.tokenize(TEXT)
        np.testing.assert_array_equal(a.logits(tokens), b.logits(tokens))
