"""Model registry and loader: architectures, missing tensors, wrong shapes, the nn weight loader."""

from __future__ import annotations

import types

import gguf
import pytest

import pyggml
from pyggml import DType, models, nn
from pyggml.models import Batch, Input, ModelError
from pyggml.synthetic import write_model, write_synthetic

from .conftest import SHARED_MODELS


def write_llama(path, *, drop=(), reshape=None, tie=False):
    """A 1-layer llama GGUF with small random F32 weights (and a tiny SPM vocab); ``drop``: tensors to
    leave out, ``reshape``: numpy shapes to write instead of the right ones."""
    hparams = {"block_count": 1, "embedding_length": 32, "feed_forward_length": 64, "attention.head_count": 4,
               "attention.head_count_kv": 2, "context_length": 128, "vocab_size": 300}
    return write_model(path, "llama", hparams, "f32", omit=(*drop, *(("output.weight",) if tie else ())),
                       shapes={name: tuple(reversed(shape)) for name, shape in (reshape or {}).items()})


def test_registry_knows_llama():
    assert "llama" in models.registry()


def test_unknown_architecture_lists_supported(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "mamba9")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
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


def test_every_missing_tensor_and_wrong_shape_is_listed_at_once(tmp_path):
    wrong = {"blk.0.ffn_up.weight": (48, 32), "output.weight": (300, 16), "output_norm.weight": (31,)}
    path = write_llama(tmp_path / "m.gguf", drop=("blk.0.attn_v.weight",), reshape=wrong)
    with pytest.raises(nn.MissingWeightsError) as err:
        models.load(path)
    message = str(err.value)
    assert "missing tensors: blk.0.attn_v.weight" in message
    assert "blk.0.ffn_up.weight has shape (32, 48), expected (32, 64) = (hidden_size, ffn_size)" in message
    assert "output.weight has shape (16, 300), expected (32, 300) = (hidden_size, vocab_size)" in message
    assert "output_norm.weight has shape (31,), expected (32,) = (hidden_size)" in message


def test_declared_shapes_follow_the_hyper_parameters():
    from pyggml.models.llama import Llama

    opts = {"n_layers": 2, "hidden_size": 8, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4, "head_dim_v": 4,
            "ffn_size": 16, "vocab_size": 10, "rope": nn.Rope(n_dims=4)}
    shapes = {t.name: (t.shape, t.required) for t in nn.declared(Llama.Weights, opts)}
    assert shapes["blk.1.attn_k.weight"] == ((8, 4), True)
    assert shapes["blk.0.attn_output.weight"] == ((8, 8), True)
    assert shapes["blk.0.ffn_down.weight"] == ((16, 8), True)
    assert shapes["output.weight"] == ((8, 10), True) and shapes["rope_freqs.weight"] == ((2,), False)
    assert len(shapes) == 3 + 1 + 2 * 9


class Mixed(nn.Module):
    ffn_up: nn.Linear = nn.shape("hidden", "ffn[layer]")
    ffn_gate_inp: nn.Linear | None = nn.shape("hidden", "n_experts", when="layer % 2 == 1")  # every other layer


class MixedWeights(nn.Module):
    token_embd: nn.Embedding = nn.shape("hidden", "vocab")
    blk: list[Mixed]
    output: nn.Linear = nn.shape("hidden", "vocab", alt="token_embd")


def test_declarations_per_layer_and_conditional_tensors():
    hp = {"n_layers": 3, "hidden": 8, "ffn": [16, 24, 32], "n_experts": 4, "vocab": 10}
    decl = {t.name: (t.shape, t.required) for t in nn.declared(MixedWeights, hp)}
    assert [decl[f"blk.{i}.ffn_up.weight"] for i in range(3)] == [((8, 16), True), ((8, 24), True), ((8, 32), True)]
    assert [decl[f"blk.{i}.ffn_gate_inp.weight"][1] for i in range(3)] == [False, True, False]
    with pytest.raises(ValueError, match="size of vocab is unknown"):
        nn.declared(MixedWeights, {**hp, "vocab": None})


class FakeBackend:
    """What nn.load reads of a Backend: tensors by name (only their shapes matter here)."""

    path = "fake.gguf"

    def __init__(self, shapes):
        self.tensors = {name: types.SimpleNamespace(shape=shape, name=name, dtype=DType.F32)
                        for name, shape in shapes.items()}

    def get(self, name):
        return self.tensors.get(name)

    def matmul_weight(self, weight):
        return weight


def test_loader_binds_unknown_sizes_from_the_file_and_requires_conditional_tensors():
    hp = {"n_layers": 2, "hidden": 8, "ffn": [16, 16], "n_experts": 4, "vocab": None}
    shapes = {"token_embd.weight": (8, 11), "blk.0.ffn_up.weight": (8, 16), "blk.1.ffn_up.weight": (8, 16),
              "blk.1.ffn_gate_inp.weight": (8, 4)}
    w = nn.load(MixedWeights, FakeBackend(shapes), hp)  # vocab: 11, from token_embd; output tied to it
    assert w.output.weight.shape == (8, 11) and w.blk[0].ffn_gate_inp is None
    shapes.pop("blk.1.ffn_gate_inp.weight")
    shapes["output.weight"] = (8, 12)  # must agree with the vocabulary size token_embd gave
    with pytest.raises(nn.MissingWeightsError) as err:
        nn.load(MixedWeights, FakeBackend(shapes), hp)
    assert "missing tensors: blk.1.ffn_gate_inp.weight" in str(err.value)
    assert "output.weight has shape (8, 12), expected (8, 11) = (hidden, vocab)" in str(err.value)


def test_bert_biases_and_stated_token_types_are_required(tmp_path):
    hparams = {"block_count": 1, "embedding_length": 32, "feed_forward_length": 64, "attention.head_count": 4,
               "context_length": 16, "vocab_size": 64, "tokenizer.ggml.model": "bert",
               "tokenizer.ggml.token_type_count": 2}
    path = write_model(tmp_path / "b.gguf", "bert", hparams, omit=("token_types.weight", "blk.0.attn_q.bias"))
    with pytest.raises(nn.MissingWeightsError, match=r"missing tensors: token_types\.weight, blk\.0\.attn_q\.bias"):
        models.load(path)


def test_shape_declarations_reject_non_arithmetic():
    with pytest.raises(ValueError, match="integer expression"):
        nn.shape("hidden_size", "__import__('os')")


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


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "gpt-oss"])
@pytest.mark.parametrize("key, value, named", [("attention.head_count_kv", 3, "head_count"),
                                               ("block_count", 10**9, "block_count"),
                                               ("attention.value_length", 8, "value_length")])
def test_attention_sizes_are_checked_alike_by_every_model(arch, key, value, named):
    """One helper (nn.attention_sizes) reads and bounds the head sizes of these models: a bad value is a
    ModelError (or, out of range, the config's GGUFError, which models.load turns into one) naming the key."""
    from pyggml.backend.metadata import Config

    meta = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
            f"{arch}.block_count": 2, f"{arch}.{key}": value}
    with pytest.raises(ValueError, match=named):
        nn.attention_sizes(Config(meta))
