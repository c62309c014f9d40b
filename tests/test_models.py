"""Model registry and loader: architectures, missing tensors, wrong shapes, the nn weight loader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import pyggml
from pyggml import models, nn
from pyggml.models import Batch, Input, ModelError
from pyggml.synthetic import write_synthetic

from .conftest import SHARED_MODELS


def write_llama(path, *, arch="llama", drop=(), reshape=None, tie=False):
    """A 1-layer llama GGUF with small random F32 weights (and a tiny SPM vocab)."""
    hidden, ffn, heads, kv, vocab = 32, 64, 4, 2, 300
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_context_length(128)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [f"▁w{i}" for i in range(41)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * 41)
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    shapes = {
        "token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (kv * head_dim, hidden),
        "blk.0.attn_v.weight": (kv * head_dim, hidden), "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    if not tie:
        shapes["output.weight"] = (vocab, hidden)
    if reshape:
        shapes.update(reshape)
    for name, shape in shapes.items():
        if name not in drop:
            writer.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_registry_knows_llama():
    assert "llama" in models.registry()


def test_unknown_architecture_lists_supported(tmp_path):
    path = write_llama(tmp_path / "m.gguf", arch="mamba9")
    with pytest.raises(ModelError, match="unsupported architecture 'mamba9'.*llama"):
        models.load(path)


def test_missing_tensors_are_all_named(tmp_path):
    path = write_llama(tmp_path / "m.gguf", drop=("blk.0.attn_k.weight", "output_norm.weight"))
    with pytest.raises(nn.MissingWeightsError) as err:
        models.load(path)
    assert "blk.0.attn_k.weight" in str(err.value) and "output_norm.weight" in str(err.value)


def test_wrong_tensor_shape_is_reported(tmp_path):
    path = write_llama(tmp_path / "m.gguf", reshape={"blk.0.ffn_up.weight": (48, 32)})
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_up\.weight has shape \(32, 48\), expected \(32, 64\)"):
        models.load(path)


def test_tied_output_uses_token_embeddings(tmp_path):
    model = models.load(write_llama(tmp_path / "m.gguf", tie=True))
    try:
        assert model.weights.output.weight is model.weights.token_embd.weight
    finally:
        model.close()


class Block(nn.Module):
    attn_q: nn.Linear
    attn_q_norm: nn.RMSNorm | None


class Weights(nn.Module):
    blk: list[Block]
    output: nn.Linear = nn.alt("token_embd")
    rope_freqs: nn.Weight | None


def test_nn_loader_optional_and_alt_fields(tmp_path):
    backend = pyggml.Backend.load(write_llama(tmp_path / "m.gguf", tie=True))
    try:
        w = nn.load(Weights, backend)
        assert w.blk[0].attn_q.weight.shape == (32, 32)
        assert w.blk[0].attn_q_norm is None and w.rope_freqs is None
        assert w.output.weight.name == "token_embd.weight"
    finally:
        backend.close()


def test_input_equality_uses_token_and_hash():
    assert Input(token=5) == Input(token=5, same_batch=3)
    assert Input(token=5, multimodal_hash=1) != Input(token=5)
    assert Batch(inputs=[Input(token=7), 8]).tokens == [7, 8]


def test_batch_with_no_outputs_still_updates_the_cache(tmp_path):
    model = models.load(write_synthetic(tmp_path / "s.gguf", "tiny", "f32"))
    try:
        model.cache.init(model.backend, max_sequences=1, capacity=64, max_batch=16)
        with model.backend.new_context() as ctx:
            batch = Batch(inputs=[1, 2, 3], outputs=[], positions=[0, 1, 2], sequences=[0, 0, 0])
            model.cache.start_forward(ctx, batch)
            ctx.compute(model.forward(ctx, batch))
        assert list(model.cache.cells.seq_positions(0)) == [0, 1, 2]
    finally:
        model.close()


def test_position_beyond_context_is_refused_before_touching_the_cache(tmp_path):
    model = models.load(write_synthetic(tmp_path / "s.gguf", "tiny", "f32"))
    try:
        model.cache.init(model.backend, max_sequences=1, capacity=16, max_batch=64)
        with model.backend.new_context() as ctx:
            batch = Batch(inputs=[1] * 20, outputs=[0], positions=list(range(20)), sequences=[0] * 20)
            with pytest.raises(ValueError, match="beyond the cache's context"):
                model.cache.start_forward(ctx, batch)
        assert model.cache.cells.free_count == model.cache.cells.capacity
    finally:
        model.close()


@pytest.mark.skipif(not SHARED_MODELS.is_dir(), reason="../shared/models is absent")
def test_gguf_v1_file_is_refused():
    with pytest.raises(pyggml.GGUFError, match="version 1"):
        models.load(SHARED_MODELS / "legacy" / "tinyllamas-stories-260k-f32.gguf")
