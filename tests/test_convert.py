"""pyggml.convert: HF checkpoints to GGUF, checked against the HF model itself and against llama.cpp.

Llama/Mistral here (BERT's converter is tested in test_bert.py, with llama.cpp too); the registry
and the shared pieces (lazy sources, tensor types, the plan checks) at the end."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyggml.convert import convert_hf, from_interleaved_rope, to_interleaved_rope

torch = pytest.importorskip("torch", reason="the converter tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the converter tests build HF models")

from .hf_fixtures import make_tiny_gemma, make_tiny_llama  # noqa: E402  (needs torch/transformers)

HF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


def read_gguf(path: Path) -> tuple[dict, dict[str, tuple[str, np.ndarray]]]:
    """(metadata without GGUF.* header fields, name -> (type name, float32 data in numpy order))."""
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
               for t in reader.tensors}
    return meta, tensors


def hf_weights(model) -> dict[str, np.ndarray]:
    """HF state dict keyed by GGUF names, q/k still in HF row order."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    for i in range(model.config.num_hidden_layers):
        for ours, theirs in HF_NAMES.items():
            out[f"blk.{i}.{ours}.weight"] = sd[f"model.layers.{i}.{theirs}.weight"]
    out["output_norm.weight"] = sd["model.norm.weight"]
    if not model.config.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    return out


def unpermuted(name: str, data: np.ndarray, cfg) -> np.ndarray:
    if ".attn_q." in name:
        return from_interleaved_rope(data, cfg.num_attention_heads)
    if ".attn_k." in name:
        return from_interleaved_rope(data, cfg.num_key_value_heads)
    return data


def test_permutation_moves_half_split_pairs_next_to_each_other():
    rows = np.arange(2 * 8)[:, None]  # 2 heads of dim 8
    moved = to_interleaved_rope(rows, 2)[:, 0]
    # head 0: rows (0, 4), (1, 5), ... become adjacent; head 1 likewise
    assert moved.tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert np.array_equal(from_interleaved_rope(to_interleaved_rope(rows, 2), 2), rows)


def test_bpe_untied_gqa_f32_roundtrips_every_weight(tmp_path):
    hf_dir, model = make_tiny_llama(tmp_path, n_kv_heads=2, tie=False, vocab="bpe")
    calls = []
    out = convert_hf(hf_dir, tmp_path / "m.gguf", "f32", progress=lambda d, t: calls.append((d, t)))
    meta, tensors = read_gguf(out)
    cfg = model.config

    assert meta["general.architecture"] == "llama"
    assert meta["general.name"] == hf_dir.name
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    expected = {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
                "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16,
                "vocab_size": cfg.vocab_size, "rope.freq_base": 10000.0}
    for key, value in expected.items():
        assert meta[f"llama.{key}"] == value, key
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert not any(k.startswith("llama.rope.scaling") or k == "llama.attention.key_length" for k in meta)

    ref = hf_weights(model)
    assert list(tensors) == list(ref)  # token_embd, blk.*, output_norm, output
    for name, (kind, data) in tensors.items():
        assert kind == "F32", name
        assert data.shape == ref[name].shape, name
        np.testing.assert_array_equal(unpermuted(name, data, cfg), ref[name], err_msg=name)
    # q/k really are reordered (not just passed through)
    assert not np.array_equal(tensors["blk.0.attn_q.weight"][1], ref["blk.0.attn_q.weight"][1])
    # progress: bytes written after each tensor, out of all tensor bytes
    sizes = np.cumsum([data.nbytes for _, data in tensors.values()]).tolist()
    assert calls == [(done, sizes[-1]) for done in sizes]


def test_bpe_vocabulary(tmp_path):
    hf_dir, model = make_tiny_llama(tmp_path, n_kv_heads=4, tie=True, vocab="bpe")
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf"))
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    n = model.config.vocab_size

    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "llama-bpe"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == n
    for text, i in tok["model"]["vocab"].items():
        assert tokens[i] == text
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert types[added["<|begin_of_text|>"]] == gguf.TokenType.CONTROL
    assert types[added["<tool>"]] == gguf.TokenType.USER_DEFINED
    assert types[300] == gguf.TokenType.NORMAL
    n_real = max(added.values()) + 1
    assert tokens[n_real:] == [f"[PAD{i}]" for i in range(n_real, n)]
    assert set(types[n_real:]) == {gguf.TokenType.UNUSED}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert meta["tokenizer.ggml.merges"] == merges
    assert meta["tokenizer.ggml.bos_token_id"] == added["<|begin_of_text|>"]
    assert meta["tokenizer.ggml.eos_token_id"] == added["<|end_of_text|>"]
    assert meta["tokenizer.ggml.padding_token_id"] == added["<|pad|>"]
    assert meta["tokenizer.ggml.add_bos_token"] is True  # from the TemplateProcessing post-processor
    assert meta["tokenizer.chat_template"].startswith("{% for m in messages %}")
    # tied embeddings: no output.weight; MHA (kv heads == heads)
    assert "output.weight" not in tensors
    assert meta["llama.attention.head_count_kv"] == 4
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    assert tensors["token_embd.weight"][0] == "F16" and tensors["output_norm.weight"][0] == "F32"


def test_spm_vocabulary_matches_sentencepiece(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    hf_dir, model = make_tiny_llama(tmp_path, n_kv_heads=1, tie=True, vocab="spm")
    meta, _ = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf"))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    n = sp.get_piece_size()

    assert meta["tokenizer.ggml.model"] == "llama"
    assert "tokenizer.ggml.pre" not in meta and "tokenizer.ggml.merges" not in meta
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    scores = meta["tokenizer.ggml.scores"]
    assert len(tokens) == len(types) == len(scores) == model.config.vocab_size
    assert tokens[:n] == [sp.id_to_piece(i) for i in range(n)]
    np.testing.assert_array_equal(np.float32(scores[:n]), np.float32([sp.get_score(i) for i in range(n)]))
    for i in range(n):
        want = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                else gguf.TokenType.BYTE if sp.is_byte(i)
                else gguf.TokenType.USER_DEFINED if sp.id_to_piece(i) == "<tool>" else gguf.TokenType.NORMAL)
        assert types[i] == want, (i, sp.id_to_piece(i))
    assert tokens[sp.piece_to_id("<0x41>")] == "<0x41>"
    assert set(types[n:]) <= {gguf.TokenType.UNUSED}
    assert (meta["tokenizer.ggml.unknown_token_id"], meta["tokenizer.ggml.bos_token_id"],
            meta["tokenizer.ggml.eos_token_id"]) == (sp.unk_id(), sp.bos_id(), sp.eos_id())
    assert "tokenizer.ggml.padding_token_id" not in meta
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_eos_token"] is False
    assert meta["tokenizer.ggml.add_space_prefix"] is True
    assert meta["llama.attention.head_count_kv"] == 1


def rope_normal(x: np.ndarray, pos: np.ndarray, base: float, freq_factors=None) -> np.ndarray:
    """ggml's normal (GGML_ROPE_TYPE_NORMAL) rope on (n_tokens, n_heads, head_dim): pairs (2i, 2i+1)."""
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-np.arange(0, d, 2) / d)
    if freq_factors is not None:
        theta = theta / freq_factors
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_gguf_qk_with_ggml_rope_give_hf_attention_scores(tmp_path, rope_scaling):
    """The permutation is right only if ggml's interleaved rope on GGUF q/k reproduces HF's rope."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf_dir, model = make_tiny_llama(tmp_path, n_kv_heads=2, tie=False, rope_scaling=rope_scaling)
    _, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf", "f32"))
    n_tok, d = 200, 16
    x = np.random.default_rng(0).standard_normal((n_tok, 64)).astype(np.float32)
    pos = np.arange(n_tok)
    factors = tensors["rope_freqs.weight"][1] if rope_scaling else None

    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        xt = torch.from_numpy(x)[None]
        q = attn.q_proj(xt).view(1, n_tok, 4, d).transpose(1, 2)
        k = attn.k_proj(xt).view(1, n_tok, 2, d).transpose(1, 2)
        cos, sin = model.model.rotary_emb(xt, torch.from_numpy(pos)[None])
        q_hf, k_hf = (t[0].transpose(0, 1).numpy() for t in apply_rotary_pos_emb(q, k, cos, sin))

    q_gg = rope_normal((x @ tensors["blk.0.attn_q.weight"][1].T).reshape(n_tok, 4, d), pos, 10000.0, factors)
    k_gg = rope_normal((x @ tensors["blk.0.attn_k.weight"][1].T).reshape(n_tok, 2, d), pos, 10000.0, factors)
    # same vectors, up to the per-head reordering of dimensions
    # float32 rounding of cos/sin at positions up to 200 differs between torch and numpy (and with
    # torch's thread count): a wrong permutation would be off by O(1), so 1e-4 still catches it
    np.testing.assert_allclose(from_interleaved_rope(q_gg.reshape(n_tok, 64).T, 4).T,
                               q_hf.reshape(n_tok, 64), atol=1e-4, rtol=1e-4)
    for h in range(4):  # attention scores, query head h against its kv head h // 2
        s_hf = q_hf[:, h] @ k_hf[:, h // 2].T
        s_gg = q_gg[:, h] @ k_gg[:, h // 2].T
        np.testing.assert_allclose(s_gg, s_hf, atol=5e-4, rtol=1e-4)


def test_llama3_rope_freqs_match_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf_dir, model = make_tiny_llama(tmp_path, n_kv_heads=2, tie=False, rope_scaling=scaling)
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf"))
    kind, factors = tensors["rope_freqs.weight"]
    assert kind == "F32" and factors.shape == (8,)
    assert list(tensors)[0] == "rope_freqs.weight"
    assert "llama.rope.scaling.type" not in meta  # llama3 scaling lives in the tensor alone
    base_inv_freq = 10000.0 ** -(np.arange(0, 16, 2) / 16)
    hf_inv_freq = model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(base_inv_freq / factors, hf_inv_freq, rtol=1e-5)
    assert factors[0] == 1.0 and 1.0 < factors[1] < 8.0 and factors[-1] == 8.0  # all three bands


def test_linear_and_yarn_rope_scaling_metadata(tmp_path):
    hf_dir, _ = make_tiny_llama(tmp_path / "lin", rope_scaling={"rope_type": "linear", "factor": 4.0})
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "lin.gguf"))
    assert meta["llama.rope.scaling.type"] == "linear"
    assert meta["llama.rope.scaling.factor"] == 4.0
    assert "rope_freqs.weight" not in tensors

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 16.0, "beta_slow": 2.0}
    hf_dir, _ = make_tiny_llama(tmp_path / "yarn", rope_scaling=yarn)
    meta, _ = read_gguf(convert_hf(hf_dir, tmp_path / "yarn.gguf"))
    assert meta["llama.rope.scaling.type"] == "yarn"
    assert meta["llama.rope.scaling.factor"] == 4.0
    assert meta["llama.rope.scaling.original_context_length"] == 64
    assert meta["llama.rope.scaling.yarn_beta_fast"] == 16.0
    assert meta["llama.rope.scaling.yarn_beta_slow"] == 2.0


def test_q8_0_dequantises_close_and_short_rows_fall_back_to_f16(tmp_path):
    # intermediate 80: ffn_down rows have 80 columns, not a multiple of the q8_0 block of 32
    hf_dir, model = make_tiny_llama(tmp_path, n_kv_heads=2, tie=False, intermediate_size=80)
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf", "q8_0"))
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    ref = hf_weights(model)
    for name, (kind, data) in tensors.items():
        want = unpermuted(name, data, model.config)
        if name.endswith("norm.weight"):
            assert kind == "F32", name
            np.testing.assert_array_equal(want, ref[name])
        elif ".ffn_down." in name:
            assert kind == "F16", name
            np.testing.assert_allclose(want, ref[name], rtol=1e-3, atol=1e-6)
        else:
            assert kind == "Q8_0", name
            # error at most half a quantisation step of the 32-wide block, plus the f16 scale's
            # rounding (2**-11 relative, times up to 127 steps)
            step = np.abs(ref[name]).reshape(-1, 32).max(axis=1) / 127
            err = np.abs(want - ref[name]).reshape(-1, 32).max(axis=1)
            assert np.all(err <= step * (0.5 + 127 * 2.0**-11)), name


def test_key_length_written_when_head_dim_is_not_hidden_over_heads(tmp_path):
    hf_dir, model = make_tiny_llama(tmp_path, n_kv_heads=2, head_dim=32, arch="mistral")
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf", "f32"))
    assert meta["llama.attention.key_length"] == meta["llama.attention.value_length"] == 32
    assert meta["llama.rope.dimension_count"] == 32
    assert tensors["blk.0.attn_q.weight"][1].shape == (4 * 32, 64)
    ref = hf_weights(model)
    np.testing.assert_array_equal(unpermuted("blk.1.attn_k.weight", tensors["blk.1.attn_k.weight"][1],
                                             model.config), ref["blk.1.attn_k.weight"])


def test_sharded_and_bf16_checkpoints(tmp_path):
    hf_dir, model = make_tiny_llama(tmp_path / "one", n_kv_heads=2)
    sharded_dir, _ = make_tiny_llama(tmp_path / "many", n_kv_heads=2, max_shard_size="40KB")
    assert (sharded_dir / "model.safetensors.index.json").exists()
    one, many = (convert_hf(d, tmp_path / f"{i}.gguf", "f32") for i, d in enumerate((hf_dir, sharded_dir)))
    assert one.read_bytes() == many.read_bytes()

    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bf16" / f).write_bytes((hf_dir / f).read_bytes())
    _, tensors = read_gguf(convert_hf(tmp_path / "bf16", tmp_path / "bf16.gguf", "f32"))
    ref = hf_weights(model)  # the model itself is now bfloat16
    np.testing.assert_array_equal(tensors["blk.0.ffn_up.weight"][1], ref["blk.0.ffn_up.weight"])


def test_errors_are_clear_and_leave_no_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert_hf(tmp_path, tmp_path / "x.gguf")

    hf_dir, _ = make_tiny_llama(tmp_path, n_kv_heads=2)
    with pytest.raises(ValueError, match="out_type.*f32, f16, bf16, q8_0"):
        convert_hf(hf_dir, tmp_path / "x.gguf", "q4_k")

    from safetensors.numpy import load_file, save_file

    weights = load_file(hf_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): blk.1.ffn_up.weight "
                                         r"\(model.layers.1.mlp.up_proj.weight\)"):
        convert_hf(hf_dir, tmp_path / "x.gguf")

    config = json.loads((hf_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, (.*, )?MistralForCausalLM"):
        convert_hf(hf_dir, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("x.gguf*"))


def test_bpe_pre_tokenizer_name_rule(tmp_path):
    hf_dir, _ = make_tiny_llama(tmp_path, n_kv_heads=2)
    path = hf_dir / "tokenizer.json"
    tok = json.loads(path.read_text())

    def pre_after(pre_tokenizer) -> str:
        path.write_text(json.dumps({**tok, "pre_tokenizer": pre_tokenizer}))
        meta, _ = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf"))
        return meta["tokenizer.ggml.pre"]

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert pre_after(byte_level) == "gpt-2"  # GPT-2's own regex
    other_split = {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "Isolated", "invert": False}
    assert pre_after({"type": "Sequence", "pretokenizers": [other_split, byte_level]}) == "default"

    path.write_text(json.dumps({**tok, "pre_tokenizer": None, "decoder": {"type": "Metaspace"}}))
    with pytest.raises(ValueError, match="tokenizer.model"):
        convert_hf(hf_dir, tmp_path / "m.gguf")


def test_bf16_keeps_the_top_half_of_each_float32(tmp_path):
    hf_dir, model = make_tiny_llama(tmp_path, n_kv_heads=2, tie=False)
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf", "bf16"))
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16
    ref = hf_weights(model)
    for name, (kind, data) in tensors.items():
        assert kind == ("F32" if name.endswith("norm.weight") else "BF16"), name
        want = unpermuted(name, data, model.config)
        np.testing.assert_allclose(want, ref[name], rtol=2.0**-8, atol=0, err_msg=name)  # 8-bit mantissa


# ---- llama.cpp loads our files and computes the same logits -----------------------------------------

_LLAMA_CPP = textwrap.dedent("""
    import json, sys
    import llama_cpp
    path, text = sys.argv[1], sys.argv[2]
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, logits_all=True, verbose=False,
                          type_k=0, type_v=0)  # an F32 KV cache: the comparison is then to float32 rounding
    tokens = llm.tokenize(text.encode(), add_bos=True)
    llm.eval(tokens)
    print(json.dumps({"tokens": tokens, "logits": llm.scores[:len(tokens)].tolist()}))
""")


def llama_cpp_logits(path: Path, text: str) -> tuple[list[int], np.ndarray]:
    """llama.cpp's tokens and logits for ``text`` (one batch, F32 KV cache); in a subprocess, so that a
    crash there fails one test."""
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path), text], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    return theirs["tokens"], np.array(theirs["logits"], dtype=np.float32)


needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="needs llama-cpp-python==0.3.36 (the `bench` extra)")


@needs_llama_cpp
@pytest.mark.parametrize("case", [dict(n_kv_heads=2, tie=False, vocab="bpe"),
                                  dict(n_kv_heads=4, tie=True, vocab="spm", arch="mistral")],
                         ids=["llama-bpe-gqa-untied", "mistral-spm-mha-tied"])
def test_llama_cpp_computes_the_same_logits_from_our_file(tmp_path, case):
    import pyggml

    hf_dir, _ = make_tiny_llama(tmp_path, **case)
    path = convert_hf(hf_dir, tmp_path / "m.gguf", "f32")
    text = "The cafe is naive, 42 people said!"
    tokens, expected = llama_cpp_logits(path, text)
    with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
        assert llm.tokenize(text) == tokens
        ours = llm.logits(tokens)
    assert len(tokens) > 5
    scale = np.abs(expected).max()  # both with F32 KV caches
    assert np.abs(ours - expected).max() <= 1e-3 * scale


# ---- the registry and the shared pieces -------------------------------------------------------------


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    from pyggml.convert import supported

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'NoSuchForCausalLM'; supported: (.*, )?"
                                         "BertModel, .*LlamaForCausalLM, (.*, )?MistralForCausalLM"):
        convert_hf(tmp_path, tmp_path / "x.gguf")
    assert {"LlamaForCausalLM", "MistralForCausalLM", "BertModel", "BertForMaskedLM"} <= set(supported())


def test_an_architecture_is_one_registered_class(tmp_path):
    """A new architecture needs only a class: here llama with its MLP stored fused (gate and up in one
    matrix), as some checkpoints do; the hook splits it and the file equals the plain conversion."""
    from safetensors.numpy import load_file, save_file

    from pyggml.convert import Source, register
    from pyggml.convert.base import _REGISTRY
    from pyggml.convert.llama import Llama

    @register("FusedLlamaForCausalLM")
    class FusedLlama(Llama):
        def tensors(self, name: str, source: Source):
            if name.endswith("mlp.gate_up_proj.weight"):
                gate, up = source.split([self.n_ff, self.n_ff])
                yield from super().tensors(name.replace("gate_up_proj", "gate_proj"), gate)
                yield from super().tensors(name.replace("gate_up_proj", "up_proj"), up)
            else:
                yield from super().tensors(name, source)

    try:
        hf_dir, _ = make_tiny_llama(tmp_path, n_kv_heads=2)
        plain = convert_hf(hf_dir, tmp_path / "plain.gguf", "f32")
        weights = load_file(hf_dir / "model.safetensors")
        for i in range(2):
            prefix = f"model.layers.{i}.mlp."
            weights[prefix + "gate_up_proj.weight"] = np.concatenate(
                [weights.pop(prefix + "gate_proj.weight"), weights.pop(prefix + "up_proj.weight")])
        save_file(weights, hf_dir / "model.safetensors")
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "architectures": ["FusedLlamaForCausalLM"]}))
        fused = convert_hf(hf_dir, tmp_path / "fused.gguf", "f32")
        assert fused.read_bytes() == plain.read_bytes()
    finally:
        del _REGISTRY["FusedLlamaForCausalLM"]


def test_sources_are_lazy_and_split_and_stack(tmp_path):
    from pyggml.convert import Source

    reads = []
    a = Source((4, 3), lambda: reads.append("a") or np.arange(12.0).reshape(4, 3))
    top, bottom = a.split([1, 3])
    doubled = bottom.map(lambda w: 2 * w)
    stacked = Source.stack([top.map(lambda w: w.repeat(3, 0), (3, 3)), doubled])
    assert (top.shape, bottom.shape, stacked.shape) == ((1, 3), (3, 3), (2, 3, 3))
    assert reads == []  # nothing is read until the data is needed
    np.testing.assert_array_equal(stacked.load()[1], 2 * np.arange(3.0, 12.0).reshape(3, 3))
    with pytest.raises(ValueError, match="cannot split 4 rows"):
        a.split([2, 3])
    with pytest.raises(ValueError, match="different shapes"):
        Source.stack([top, bottom])


def test_extra_and_misshapen_tensors_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_dir, _ = make_tiny_llama(tmp_path, n_kv_heads=2)
    original = load_file(hf_dir / "model.safetensors")
    weights = dict(original)
    weights["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(ValueError, match="does not have: model.layers.0.self_attn.q_proj.bias -> blk.0.attn_q.bias"):
        convert_hf(hf_dir, tmp_path / "x.gguf")

    weights = dict(original)
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"][:, :64]
    save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"down_proj.weight has shape \(64, 64\) but config.json implies \(64, 128\)"):
        convert_hf(hf_dir, tmp_path / "x.gguf")

    weights = dict(original)
    weights["model.layers.0.mlp.experts.0.up_proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(ValueError, match="does not know: model.layers.0.mlp.experts.0.up_proj.weight"):
        convert_hf(hf_dir, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("x.gguf*"))


def test_cli_convert_writes_the_file_and_reports_errors(tmp_path, capsys):
    from pyggml.cli import main

    hf_dir, _ = make_tiny_llama(tmp_path, n_kv_heads=2)
    assert main(["convert", str(hf_dir), str(tmp_path / "m.gguf"), "--type", "q8_0"]) == 0
    meta, _ = read_gguf(tmp_path / "m.gguf")
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert main(["convert", str(hf_dir), str(tmp_path / "n.gguf"), "--pooling", "cls"]) == 1
    assert "pooling applies to embedding models" in capsys.readouterr().err


# ---- Qwen 2 / 3: llama.cpp's names and keys, and llama.cpp runs the files like transformers ------------

QWEN_CASES = {"qwen2-gqa-untied": dict(arch="qwen2", n_kv_heads=2, tie=False),
              "qwen3-mha-tied-wide-heads": dict(arch="qwen3", n_kv_heads=4, tie=True, head_dim=32),
              "qwen3moe-gqa-untied": dict(arch="qwen3moe", n_kv_heads=2, tie=False)}


def expected_names(arch: str, tied: bool) -> set[str]:
    per_block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down"]
    per_block += {"qwen2": ["attn_q.bias", "attn_k.bias", "attn_v.bias"],
                  "qwen3": ["attn_q_norm", "attn_k_norm"], "qwen3moe": ["attn_q_norm", "attn_k_norm"]}[arch]
    if arch == "qwen3moe":
        per_block = [n for n in per_block if n not in ("ffn_gate", "ffn_up", "ffn_down")]
        per_block += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
    names = {"token_embd.weight", "output_norm.weight"} | (set() if tied else {"output.weight"})
    return names | {f"blk.{i}.{n}" + ("" if n.endswith(".bias") else ".weight") for i in range(2) for n in per_block}


@pytest.mark.parametrize("case", list(QWEN_CASES))
def test_qwen_files_have_llama_cpps_names_and_keys(tmp_path, case):
    hf_dir, model = make_tiny_llama(tmp_path, vocab="qwen", **QWEN_CASES[case])
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf", "f32"))
    cfg, arch = model.config, QWEN_CASES[case]["arch"]

    assert meta["general.architecture"] == arch
    assert set(tensors) == expected_names(arch, cfg.tie_word_embeddings)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]}
    assert {n.rsplit(".", 1)[0].replace("blk.0.", "blk.{bid}.").replace("blk.1.", "blk.{bid}.")
            for n in tensors} <= known
    keys = {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": cfg.num_key_value_heads, "rope.freq_base": 10000.0}
    if arch == "qwen3":
        keys |= {"attention.key_length": 32, "attention.value_length": 32}
    if arch == "qwen3moe":
        keys |= {"attention.key_length": 16, "attention.value_length": 16, "expert_count": 4,
                 "expert_used_count": 2, "expert_feed_forward_length": 32}
    assert {k.removeprefix(f"{arch}."): v for k, v in meta.items() if k.startswith(f"{arch}.")} == pytest.approx(
        keys | {"attention.layer_norm_rms_epsilon": 1e-5})
    # NeoX rope: q/k rows are HF's, unpermuted; every tensor is the HF weight itself
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(tensors["blk.1.attn_q.weight"][1], sd["model.layers.1.self_attn.q_proj.weight"])
    if arch == "qwen2":
        np.testing.assert_array_equal(tensors["blk.0.attn_k.bias"][1], sd["model.layers.0.self_attn.k_proj.bias"])
    elif arch == "qwen3moe":  # transformers holds the experts fused: (expert, gate rows then up rows, hidden)
        gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(tensors["blk.1.ffn_gate_exps.weight"][1], gate_up[:, :32])
        np.testing.assert_array_equal(tensors["blk.1.ffn_up_exps.weight"][1], gate_up[:, 32:])
        down = sd["model.layers.0.mlp.experts.down_proj"]
        np.testing.assert_array_equal(tensors["blk.0.ffn_down_exps.weight"][1], down)
        assert tensors["blk.0.ffn_gate_inp.weight"][0] == "F32"
    else:
        np.testing.assert_array_equal(tensors["blk.0.attn_k_norm.weight"][1],
                                      sd["model.layers.0.self_attn.k_norm.weight"])

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    assert meta["tokenizer.ggml.eos_token_id"] == added["<|im_end|>"]
    assert meta["tokenizer.ggml.bos_token_id"] == added["<|endoftext|>"]  # from config.json, as llama.cpp does
    assert meta["tokenizer.ggml.padding_token_id"] == added["<|endoftext|>"]
    assert "tokenizer.ggml.add_bos_token" not in meta  # llama.cpp's qwen2 default: no BOS


@needs_llama_cpp
@pytest.mark.parametrize("case", list(QWEN_CASES))
def test_llama_cpp_runs_our_qwen_files_like_transformers(tmp_path, case):
    from pyggml import models

    hf_dir, model = make_tiny_llama(tmp_path, vocab="qwen", **QWEN_CASES[case])
    path = convert_hf(hf_dir, tmp_path / "m.gguf", "f32")
    text = "The cafe is naive, 42 people said!"
    tokens, theirs = llama_cpp_logits(path, text)
    assert tokens == transformers.AutoTokenizer.from_pretrained(hf_dir).encode(text)  # no BOS
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()
    scale = np.abs(ref).max()
    assert np.abs(theirs - ref).max() <= 1e-4 * scale
    if QWEN_CASES[case]["arch"] in models.registry():  # once pyggml runs the architecture, it must agree too
        import pyggml

        with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
            assert np.abs(llm.logits(tokens) - theirs).max() <= 1e-3 * scale


def test_moe_checkpoint_missing_an_expert_or_renormalisation_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_dir, _ = make_tiny_llama(tmp_path, vocab="qwen", arch="qwen3moe")
    weights = load_file(hf_dir / "model.safetensors")
    del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing parts of model.layers.1.mlp.experts.up_proj \(3 found\)"):
        convert_hf(hf_dir, tmp_path / "x.gguf")
    weights["model.layers.1.mlp.experts.4.up_proj.weight"] = weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(ValueError, match="index 4 is outside 0..3"):
        convert_hf(hf_dir, tmp_path / "x.gguf")

    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    with pytest.raises(ValueError, match="norm_topk_prob=false"):
        convert_hf(hf_dir, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("x.gguf*"))


def test_moe_experts_fused_as_transformers_5_holds_them_convert_the_same(tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_dir, _ = make_tiny_llama(tmp_path, vocab="qwen", arch="qwen3moe")
    per_expert = convert_hf(hf_dir, tmp_path / "a.gguf", "f32")
    weights = load_file(hf_dir / "model.safetensors")
    for i in range(2):
        experts = f"model.layers.{i}.mlp.experts"
        take = {k: np.stack([weights.pop(f"{experts}.{e}.{k}_proj.weight") for e in range(4)])
                for k in ("gate", "up", "down")}
        weights[f"{experts}.gate_up_proj"] = np.concatenate([take["gate"], take["up"]], axis=1)
        weights[f"{experts}.down_proj"] = take["down"]
    save_file(weights, hf_dir / "model.safetensors")
    assert convert_hf(hf_dir, tmp_path / "b.gguf", "f32").read_bytes() == per_expert.read_bytes()



# ---- Gemma 2 / 3: 1 + weight norms, sliding window; llama.cpp runs the files like transformers --------------

GEMMA_CASES = {"gemma2-gqa": dict(arch="gemma2", n_layers=2, n_kv_heads=2),
               "gemma3-mha": dict(arch="gemma3", n_layers=6, n_kv_heads=4)}


@pytest.mark.parametrize("case", list(GEMMA_CASES))
def test_gemma_files_have_llama_cpps_names_and_keys(tmp_path, case):
    hf_dir, model = make_tiny_gemma(tmp_path, **GEMMA_CASES[case])
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf", "q8_0"))
    arch, n_layers = GEMMA_CASES[case]["arch"], GEMMA_CASES[case]["n_layers"]
    n_real = len(meta["tokenizer.ggml.tokens"])

    assert meta["general.architecture"] == arch
    per_block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]
    per_block += ["attn_q_norm", "attn_k_norm"] if arch == "gemma3" else []
    assert set(tensors) == {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(n_layers) for n in per_block}  # tied: no output.weight
    keys = {"context_length": 256, "embedding_length": 64, "block_count": n_layers, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": GEMMA_CASES[case]["n_kv_heads"],
            "attention.key_length": 16, "attention.value_length": 16, "attention.layer_norm_rms_epsilon": 1e-6,
            "attention.sliding_window": 4}
    if arch == "gemma2":
        keys |= {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rope.freq_base": 10000.0}
    else:
        keys |= {"rope.freq_base": 1e6}
    assert {k.removeprefix(f"{arch}."): v for k, v in meta.items() if k.startswith(f"{arch}.")} == pytest.approx(keys)
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is False

    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for name, hf in (("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
                     ("output_norm.weight", "model.norm.weight")):
        assert tensors[name][0] == "F32"
        np.testing.assert_array_equal(tensors[name][1], sd[hf] + 1)  # Gemma's RMSNorm scales by 1 + w
    embd = tensors["token_embd.weight"]
    assert embd[0] == "Q8_0"
    # gemma3 keeps only the tokenizer's rows (as llama.cpp's converter does), gemma2 all of them
    assert n_real == (400 if arch == "gemma3" else model.config.vocab_size) and embd[1].shape == (n_real, 64)


@needs_llama_cpp
@pytest.mark.parametrize("case", list(GEMMA_CASES))
def test_llama_cpp_runs_our_gemma_files_like_transformers_past_the_window(tmp_path, case):
    from pyggml import models

    hf_dir, model = make_tiny_gemma(tmp_path, **GEMMA_CASES[case])
    path = convert_hf(hf_dir, tmp_path / "m.gguf", "f32")
    tokens, theirs = llama_cpp_logits(path, "Which way about many people water? The cafe is naive, 42 said!")
    assert len(tokens) > 3 * 4  # well past the 4-token window
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()[:, :theirs.shape[1]]
    # ggml's CPU GELU reads a table of F16 values: measured 2e-4..5e-4 of the scale at every position;
    # a window one token off gives ~0.6
    scale = np.abs(ref).max()
    assert np.abs(theirs - ref).max() <= 1e-3 * scale
    if GEMMA_CASES[case]["arch"] in models.registry():  # once pyggml runs the architecture, it must agree too
        import pyggml

        with pyggml.load(path, n_threads=2, num_ctx=64, cache_type="f32") as llm:
            assert np.abs(llm.logits(tokens) - theirs).max() <= 1e-3 * scale


# ---- Phi-3: fused qkv and gate/up kept fused, LongRoPE factors --------------------------------------------

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0]}
PHI3_CASES = {"phi3-gqa": dict(n_kv_heads=2),
              "phi3-longrope": dict(n_kv_heads=4, rope_scaling=LONGROPE,
                                    config_extra={"original_max_position_embeddings": 64})}


@pytest.mark.parametrize("case", list(PHI3_CASES))
def test_phi3_files_have_llama_cpps_names_and_keys(tmp_path, case):
    hf_dir, model = make_tiny_llama(tmp_path, arch="phi3", vocab="spm", **PHI3_CASES[case])
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf", "f32"))
    longrope = "rope_scaling" in PHI3_CASES[case]

    per_block = ["attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"]
    extra = {"rope_factors_long.weight", "rope_factors_short.weight"} if longrope else set()
    assert set(tensors) == extra | {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2) for n in per_block}
    keys = {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": PHI3_CASES[case]["n_kv_heads"],
            "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0, "rope.dimension_count": 16,
            "rope.scaling.original_context_length": 64 if longrope else 4096,  # Phi3Config default
            "attention.sliding_window": 0}
    if longrope:  # transformers' LongRoPE attention scale for 256 / 64
        keys["rope.scaling.attn_factor"] = np.sqrt(1 + np.log(4) / np.log(64))
        np.testing.assert_array_equal(tensors["rope_factors_long.weight"][1], LONGROPE["long_factor"])
        np.testing.assert_array_equal(tensors["rope_factors_short.weight"][1], np.float32(LONGROPE["short_factor"]))
    assert {k.removeprefix("phi3."): v for k, v in meta.items() if k.startswith("phi3.")} == pytest.approx(keys)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(tensors["blk.1.attn_qkv.weight"][1], sd["model.layers.1.self_attn.qkv_proj.weight"])
    np.testing.assert_array_equal(tensors["blk.0.ffn_up.weight"][1], sd["model.layers.0.mlp.gate_up_proj.weight"])


@needs_llama_cpp
@pytest.mark.parametrize("case", list(PHI3_CASES))
def test_llama_cpp_runs_our_phi3_files_like_transformers(tmp_path, case):
    from pyggml import models

    hf_dir, model = make_tiny_llama(tmp_path, arch="phi3", vocab="spm", **PHI3_CASES[case])
    path = convert_hf(hf_dir, tmp_path / "m.gguf", "f32")
    tokens, theirs = llama_cpp_logits(path, "Which way about many people water? The cafe is naive, 42 said!")
    if "rope_scaling" in PHI3_CASES[case]:
        # llama.cpp pads its context to 256, past the original 64, so it rotates with the long factors;
        # transformers picks them by prompt length: give the reference long factors in both places
        config = copy.deepcopy(model.config)
        config.rope_parameters["short_factor"] = LONGROPE["long_factor"]
        model_long = type(model)(config).eval()
        model_long.load_state_dict(model.state_dict())
        model = model_long
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()
    scale = np.abs(ref).max()
    assert np.abs(theirs - ref).max() <= 1e-4 * scale
    if "phi3" in models.registry():  # once pyggml runs the architecture, it must agree too
        import pyggml

        # a context past the original 64: pyggml then takes the long factors too
        with pyggml.load(path, n_threads=2, num_ctx=256, cache_type="f32") as llm:
            assert np.abs(llm.logits(tokens) - theirs).max() <= 1e-3 * scale


# ---- gpt-oss: sinks, biased experts, MXFP4 experts repacked as they are ------------------------------------

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_openai_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(expert, out, in) floats as OpenAI's MXFP4 checkpoint tensors: blocks (expert, out, in / 32, 16)
    with value 2i in the low nibble of byte i, and one E8M0 exponent per 32 values."""
    x = w.reshape(*w.shape[:-1], -1, 32)
    exponent = np.clip(np.floor(np.log2(np.maximum(np.abs(x).max(-1, keepdims=True), 1e-30))) - 2, -127, 127)
    codes = np.abs(np.abs(x / 2.0**exponent)[..., None] - FP4_VALUES).argmin(-1) | ((x < 0) << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    # contiguous: safetensors' numpy writer stores the buffer as it lies in memory, whatever the strides
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exponent[..., 0] + 127).astype(np.uint8))


def test_gpt_oss_files_have_llama_cpps_names_and_keys(tmp_path):
    hf_dir, model = make_tiny_llama(tmp_path, arch="gpt_oss", vocab="bpe")
    meta, tensors = read_gguf(convert_hf(hf_dir, tmp_path / "m.gguf", "q8_0"))

    assert meta["general.architecture"] == "gpt-oss"
    per_block = {"attn_norm.weight", "attn_sinks.weight", "post_attention_norm.weight"}
    per_block |= {f"{k}.{s}" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps",
                                       "ffn_up_exps", "ffn_down_exps") for s in ("weight", "bias")}
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}" for i in range(2) for n in per_block}
    keys = {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
            "attention.value_length": 16, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0,
            "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 128,
            "attention.sliding_window": 4}
    assert {k.removeprefix("gpt-oss."): v for k, v in meta.items() if k.startswith("gpt-oss.")} == pytest.approx(keys)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]  # (expert, hidden, gate/up interleaved)
    assert tensors["blk.1.ffn_up_exps.weight"][0] == "Q8_0"
    np.testing.assert_allclose(tensors["blk.1.ffn_up_exps.weight"][1], gate_up[:, :, 1::2].transpose(0, 2, 1),
                               atol=0.01)
    bias = tensors["blk.1.ffn_gate_exps.bias"]
    assert bias[0] == "F32"  # biases stay F32, as in llama.cpp's files
    np.testing.assert_array_equal(bias[1], sd["model.layers.1.mlp.experts.gate_up_proj_bias"][:, 0::2])
    np.testing.assert_array_equal(tensors["blk.0.attn_sinks.weight"][1], sd["model.layers.0.self_attn.sinks"])


@needs_llama_cpp
@pytest.mark.parametrize("experts", ["float", "mxfp4"])
def test_llama_cpp_runs_our_gpt_oss_files_like_transformers_past_the_window(tmp_path, experts):
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_dir, model = make_tiny_llama(tmp_path, arch="gpt_oss", vocab="bpe")
    if experts == "mxfp4":  # requantise the experts as OpenAI ships them; transformers dequantises the reference
        weights = load_file(hf_dir / "model.safetensors")
        for i, layer in enumerate(model.model.layers):
            for kind in ("gate_up", "down"):
                name = f"model.layers.{i}.mlp.experts.{kind}_proj"
                blocks, scales = to_openai_mxfp4(weights.pop(name).transpose(0, 2, 1))
                weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
                dequantised = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                         dtype=torch.float32)
                with torch.no_grad():
                    getattr(layer.mlp.experts, f"{kind}_proj").copy_(dequantised)
        save_file(weights, hf_dir / "model.safetensors")
    path = convert_hf(hf_dir, tmp_path / "m.gguf", "f32")
    if experts == "mxfp4":  # repacked, not requantised: the file holds exactly transformers' values
        _, tensors = read_gguf(path)
        down = model.model.layers[1].mlp.experts.down_proj.detach().numpy().transpose(0, 2, 1)
        assert tensors["blk.1.ffn_down_exps.weight"][0] == "MXFP4"
        np.testing.assert_array_equal(tensors["blk.1.ffn_down_exps.weight"][1], down)
    tokens, theirs = llama_cpp_logits(path, "Which way about many people water? The cafe is naive, 42 said!")
    assert len(tokens) > 3 * 4  # past the 4-token window
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0].numpy()
    # float experts: measured 4e-7 of the scale; MXFP4 experts: ggml multiplies them with activations
    # quantised to 8 bits
    scale = np.abs(ref).max()
    assert np.abs(theirs - ref).max() <= (1e-4 if experts == "float" else 2e-2) * scale


# ---- what GGUF cannot express is refused, naming the config.json key ----------------------------------------

REFUSALS = {
    "llama-dynamic-rope": (dict(arch="llama"), {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
                                                "rope_parameters": None},  # as transformers 4 writes it
                           "unsupported rope scaling type 'dynamic' for llama; supported: linear, yarn, llama3"),
    "qwen2-sliding-window": (dict(arch="qwen2", vocab="qwen"), {"use_sliding_window": True}, "use_sliding_window"),
    "gemma2-layer-pattern": (dict(gemma="gemma2", n_layers=2),
                             {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    "gemma3-query-scale": (dict(gemma="gemma3", n_layers=6), {"query_pre_attn_scalar": 20},
                           "query_pre_attn_scalar=20"),
    "gemma3-local-rope": (dict(gemma="gemma3", n_layers=6), {"rope_local_base_freq": 5000.0, "rope_parameters": None,
                                                             "rope_theta": 1e6}, "rope base is 5000"),
    "phi3-longrope-factors": (dict(arch="phi3", vocab="spm"),
                              {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
                               "rope_parameters": None}, "long_factor must have 8 values"),
    "gpt-oss-swiglu": (dict(arch="gpt_oss"), {"swiglu_limit": 10.0}, "swiglu_limit=10.0"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_configs_gguf_cannot_express_are_refused(tmp_path, case):
    make, change, message = REFUSALS[case]
    if "gemma" in make:
        hf_dir, _ = make_tiny_gemma(tmp_path, arch=make["gemma"], n_layers=make["n_layers"])
    else:
        hf_dir, _ = make_tiny_llama(tmp_path, **make)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_hf(hf_dir, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("x.gguf*"))


# ---- Qwen 3 as an embedding model (Qwen3-Embedding): last-token pooling ----------------------------------------

_LLAMA_CPP_EMBED = textwrap.dedent("""
    import json, sys
    import llama_cpp
    path, text = sys.argv[1], sys.argv[2]
    llm = llama_cpp.Llama(model_path=path, embedding=True, n_ctx=64, n_threads=2, verbose=False, type_k=0, type_v=0)
    print(json.dumps({"tokens": llm.tokenize(text.encode(), add_bos=True), "embedding": llm.embed(text)}))
""")


@pytest.mark.parametrize("headless", [False, True], ids=["Qwen3ForCausalLM", "Qwen3Model"])
def test_qwen3_embedding_model_pools_the_last_token_in_llama_cpp_like_transformers(tmp_path, headless):
    from safetensors.numpy import load_file, save_file

    hf_dir, model = make_tiny_llama(tmp_path, arch="qwen3", vocab="qwen", tie=True)
    (hf_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (hf_dir / "1_Pooling").mkdir()
    (hf_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    if headless:  # the bare transformer, as some embedding checkpoints ship: no "model." prefix, no head
        weights = {k.removeprefix("model."): v for k, v in load_file(hf_dir / "model.safetensors").items()}
        save_file(weights, hf_dir / "model.safetensors")
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3Model"]}))
    path = convert_hf(hf_dir, tmp_path / "m.gguf", "f32")
    meta, tensors = read_gguf(path)
    assert meta["qwen3.pooling_type"] == gguf.PoolingType.LAST
    assert set(tensors) == expected_names("qwen3", tied=True)
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("needs llama-cpp-python==0.3.36 (the `bench` extra) for the rest")
    text = "The cafe is naive, 42 people said!"
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP_EMBED, str(path), text], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        ref = model.model(torch.tensor([theirs["tokens"]])).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(np.array(theirs["embedding"]), ref, atol=1e-4 * np.abs(ref).max())
