"""Llama 4 (GGUF ``llama4``): tiny random Hugging Face models (chunked rope layers with q/k norms, a NoPE layer with
attention temperature, dense layers between expert layers with a shared expert) converted with ``pyggml.convert``,
run by pyggml against transformers (F32 logits in one batch, in batches that cut the chunks, token by token,
several sequences at once; prompts run past several chunk and temperature boundaries) and against llama.cpp on
the same files (llama.cpp's fixed chunk of 8192 positions: a prompt past it); names, keys and refused configs."""

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

from ._models import (
    converted_cases,
    error,
    logits_match_in_batches,
    refuses_config,
    sequences_match_transformers,
    shifted_keys,
)
from .test_convert import needs_llama_cpp, read_gguf

torch = pytest.importorskip("torch", reason="the Llama 4 parity tests build HF models with torch")
transformers = pytest.importorskip("transformers", reason="the Llama 4 parity tests build HF models")

from .hf_fixtures import make_bpe_tokenizer  # noqa: E402  (needs torch/transformers)
from .test_qwen import TEXTS, llama_cpp_agrees  # noqa: E402

CHUNK = 4
# chunk: attention_chunk_size; floor: the temperature's step (floor_scale); llama.cpp's fixed values: 8192 both
CASES = {"gqa-chunk4": dict(chunk=CHUNK, floor=3),
         "mha-all-experts-llama3-rope": dict(chunk=CHUNK, floor=5, n_kv_heads=4, moe_step=1, seed=1,
                                             rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 1.0,  # as Scout's
                                                   "original_max_position_embeddings": 16}),
         "maverick-no-qk-norm": dict(chunk=CHUNK, floor=4, n_experts=128, seed=2),  # 128 experts: no q/k norm
         "no-temperature": dict(chunk=CHUNK, floor=4, tuning=False, seed=3),
         "llama-cpp-defaults": dict(chunk=8192, floor=8192, seed=4)}
# max |ours - theirs| / max |theirs| over the logits; measured 4.6e-7 .. 5.7e-7 against transformers (F32 cache);
# the temperature's step one position late gives 1.7e-3, expert weights on the outputs 3e-2, no chunks 1.2
TOLERANCE = 1e-4


def make_tiny_llama4(root, *, chunk: int, floor: int, n_kv_heads: int = 2, n_experts: int = 4, moe_step: int = 2,
                     tuning: bool = True, rope: dict | None = None, seed: int = 0):
    """A random 4-layer Llama 4 text model (64 wide, 4 heads of 16; layer 3 without rope; experts of 32, one chosen
    per token, in every ``moe_step``-th layer) with a BPE tokenizer: ``(hf_dir, model)`` (float32, eval, eager)."""
    hf_dir = root / f"tiny-llama4-c{chunk}-f{floor}-kv{n_kv_heads}-e{n_experts}-m{moe_step}-s{seed}"
    hf_dir.mkdir(parents=True, exist_ok=True)
    n_tokens = make_bpe_tokenizer(hf_dir, seed)
    config = transformers.Llama4TextConfig(
        vocab_size=-(-n_tokens // 32) * 32, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=n_kv_heads, head_dim=16,
        num_local_experts=n_experts, num_experts_per_tok=1, interleave_moe_layer_step=moe_step,
        use_qk_norm=n_experts != 128, attention_chunk_size=chunk, floor_scale=floor, attn_scale=0.1,
        attn_temperature_tuning=tuning, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.05,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 500000.0}, bos_token_id=0, eos_token_id=1,
        pad_token_id=2, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("router.weight"):  # decisive routing: a misrouted token shows
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    return hf_dir, model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case)``: (path of the converted F32 file, HF model, HF tokenizer), made once;
    ``converted.hf_dirs[case]``: the checkpoint's folder."""
    return converted_cases(tmp_path_factory.mktemp("llama4"), make_tiny_llama4, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_one_batch_and_token_by_token(case, converted):
    path, model, tokenizer = converted(case)
    text = TEXTS[0] + " " + TEXTS[1]
    tokens = tokenizer.encode(text)
    assert len(tokens) > 5 * CHUNK  # past several chunks and temperature steps
    # the whole prompt; batches that cut the chunks; token by token
    logits_match_in_batches(path, model, tokens, TOLERANCE, batch_sizes=(512, 3, 1), text=text)


@pytest.mark.parametrize("case", ["gqa-chunk4", "mha-all-experts-llama3-rope"])
def test_several_sequences_at_once_match_transformers(case, converted):
    path, model, tokenizer = converted(case)
    prompts = [tokenizer.encode(t) for t in (TEXTS[0] + " " + TEXTS[2], TEXTS[1], TEXTS[2])]
    sequences_match_transformers(path, model, prompts, TOLERANCE)


@needs_llama_cpp
def test_llama_cpp_gives_the_same_logits_and_greedy_tokens(converted):
    llama_cpp_agrees(converted("llama-cpp-defaults")[0])


_LLAMA_CPP_LONG = textwrap.dedent("""
    import json, sys
    import llama_cpp
    path, tokens, last = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(tokens) + 64, n_batch=512, n_threads=2, logits_all=True,
                          verbose=False)
    llm.eval(tokens)
    print(json.dumps([list(map(float, row)) for row in llm.scores[len(tokens) - last:len(tokens)]]))
""")


@needs_llama_cpp
def test_llama_cpp_agrees_past_its_8192_position_chunk(tmp_path):
    """llama.cpp's fixed chunk (8192) and temperature step (8192 positions, from position 8191 on): the
    logits of a prompt that crosses both, on a synthetic file."""
    from pyggml.synthetic import write_model

    from .test_architectures import TINY

    path = write_model(tmp_path / "m.gguf", "llama4", TINY["llama4"], "f32", seed=5)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 320, 8192 + 48)]
    last = 96  # rows 8160 .. 8239: both sides of the boundary
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP_LONG, str(path), json.dumps(tokens), str(last)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = np.array(json.loads(done.stdout.strip().splitlines()[-1]), np.float32)
    with pyggml.load(path, n_threads=2, num_ctx=len(tokens) + 64, batch_size=512) as llm:
        ours = llm.logits(tokens)[-last:]
    # both F16 caches; llama.cpp's fixed temperature left out gives 1.3e-2, its chunks left out 0.87
    assert error(ours, theirs) < 1e-3


@pytest.mark.parametrize("case", ["gqa-chunk4", "mha-all-experts-llama3-rope"])
def test_files_have_llama_cpps_names_and_keys(case, converted):
    path, model, _ = converted(case)
    meta, tensors = read_gguf(path)
    cfg = model.config
    assert meta["general.architecture"] == "llama4"
    attention = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
    dense, moe = ["ffn_gate", "ffn_up", "ffn_down"], ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                                      "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    names = {f"blk.{i}.{n}.weight" for i in range(4) for n in attention + (moe if i in cfg.moe_layers else dense)}
    rope = {"rope_freqs.weight"} if cfg.rope_parameters["rope_type"] == "llama3" else set()
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | names | rope
    assert meta["llama4.expert_count"] == 4 and meta["llama4.expert_used_count"] == 1
    assert meta["llama4.expert_feed_forward_length"] == 32 and meta["llama4.feed_forward_length"] == 96
    assert meta["llama4.interleave_moe_layer_step"] == cfg.interleave_moe_layer_step
    assert meta["llama4.attention.chunk_size"] == CHUNK
    assert meta["llama4.attention.temperature_length"] == cfg.floor_scale
    assert meta["llama4.attention.temperature_scale"] == pytest.approx(0.1)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    # adjacent rope pairs already: q rows in Hugging Face's order
    assert (tensors["blk.0.attn_q.weight"][1] == sd["model.layers.0.self_attn.q_proj.weight"]).all()
    gate_up = sd[f"model.layers.{cfg.moe_layers[0]}.feed_forward.experts.gate_up_proj"]  # (experts, hidden, 2 ff)
    up = tensors[f"blk.{cfg.moe_layers[0]}.ffn_up_exps.weight"][1]  # (experts, ff, hidden)
    assert (up == gate_up[:, :, 32:].transpose(0, 2, 1)).all()


@pytest.mark.parametrize("change, message", [
    (dict(no_rope_layers=[1, 0, 1, 1]), "no_rope_layers"),
    (dict(layer_types=["full_attention"] * 4), "layer_types"),
    (dict(attention_chunk_size=None), "attention_chunk_size"),
    (dict(moe_layers=[0, 1]), "moe_layers"),
    (dict(use_qk_norm=False), "use_qk_norm"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0}), "rope scaling type"),
])
def test_configs_gguf_llama4_cannot_express_are_refused(change, message, converted, tmp_path):
    converted("gqa-chunk4")
    refuses_config(converted.hf_dirs["gqa-chunk4"], tmp_path, change, message)


def test_a_context_shift_rotates_the_rope_layers_keys_only(tmp_path):
    """Cached keys of the NoPE layer carry no position: a shift must leave them as they are."""
    keys, out = shifted_keys(tmp_path, "llama4")
    assert np.array_equal(out[3], keys)  # layer 3: no rope
    for layer in range(3):
        assert np.abs(out[layer] - keys).max() > 0.1, layer


def test_pyggml_compare_agrees_layer_by_layer(converted):
    """``pyggml compare`` taps every block of the Llama 4 graph against the transformers modules."""
    from pyggml import porting

    path, _, _ = converted("gqa-chunk4")
    result = porting.compare(converted.hf_dirs["gqa-chunk4"], path, TEXTS[0] + " " + TEXTS[1], n_threads=2)
    names = [x.name for x in result.layers]
    assert [n for n in names if n.startswith("blk.")] == [f"blk.{i}" for i in range(4)], result.table()
    assert names[0] == "token_embd" and names[-2:] == ["output_norm", "output"], result.table()
    assert not result.unmatched and result.ok and max(x.error for x in result.layers) < TOLERANCE, result.table()


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])  # transformers 4 / 5
def test_the_text_decoder_of_a_checkpoint_with_its_vision_part(prefix, converted, tmp_path):
    """A ``Llama4ForConditionalGeneration`` checkpoint (as Meta publishes Llama 4) gives the file its text model
    alone gives; the vision tower and projector are left out."""
    from safetensors.numpy import load_file, save_file

    path, _, _ = converted("gqa-chunk4")
    text_dir, full = converted.hf_dirs["gqa-chunk4"], tmp_path / "full"
    shutil.copytree(text_dir, full)
    weights = load_file(str(full / "model.safetensors"))
    renamed = {("language_model." if prefix.startswith("language") else "") + "lm_head.weight" if k == "lm_head.weight"
               else prefix + k.removeprefix("model."): v for k, v in weights.items()}
    renamed |= {"vision_model.patch_embedding.linear.weight": np.zeros((8, 12), np.float32),
                "multi_modal_projector.linear_1.weight": np.zeros((64, 8), np.float32)}
    (full / "model.safetensors").unlink()
    save_file(renamed, str(full / "model.safetensors"))
    text = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({"architectures": ["Llama4ForConditionalGeneration"],
                                                  "model_type": "llama4", "text_config": text,
                                                  "vision_config": {"hidden_size": 8}, "tie_word_embeddings": False}))
    _, ours = read_gguf(convert_hf(full, tmp_path / "full.gguf", "f32"))
    _, reference_file = read_gguf(path)
    assert set(ours) == set(reference_file)
    assert all((ours[n][1] == reference_file[n][1]).all() for n in ours)
