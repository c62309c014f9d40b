"""Qwen 2 and 2.5 decoders (GGUF architecture "qwen2").

Llama's network (``pyggml.models.llama``) with two differences, and so a subclass of it: the
query, key and value projections have biases, and rope is NeoX's (each head's two halves rotate
together, the Hugging Face layout, so the converter leaves q/k rows as they are). The output
projection is tied to the token embeddings when the file has no ``output.weight`` (the small models).
"""

from __future__ import annotations

from pyggml import nn
from pyggml.models import llama, register
from pyggml.tensor import RopeType


class Options(llama.Options):
    rope_mode = RopeType.NEOX


class SelfAttention(llama.SelfAttention):
    attn_q: nn.Linear = nn.shape("hidden_size", "n_heads * head_dim", bias=True)
    attn_k: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim", bias=True)
    attn_v: nn.Linear = nn.shape("hidden_size", "n_kv_heads * head_dim_v", bias=True)


class Layer(llama.Layer):
    attention: SelfAttention


class Weights(llama.Weights):
    blk: list[Layer]


@register("qwen2")
class Qwen2(llama.Llama):
    Options, Weights = Options, Weights
