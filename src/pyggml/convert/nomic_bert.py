"""Nomic BERT encoders (GGUF ``nomic-bert``: nomic-embed-text v1 / v1.5), from either config.json
style: the original one (``n_embd``, ``n_head``, ``n_layer``, ``n_inner``, ``rotary_emb_base``, ...,
as the hub checkpoints ship it) or transformers' own ``NomicBertConfig`` (``hidden_size``, ...).
Both store the same tensors (``encoder.layers.N.attn.Wqkv``, ``mlp.fc11``/``fc12``/``fc2``,
``norm1``/``norm2``, ``emb_ln``); the fused q/k/v matrix stays fused, as llama.cpp keeps it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from .base import Architecture, register
from .bert import encoder_metadata
from .tensors import Source
from .vocab import Vocab, wordpiece_vocab

# the original config's names -> transformers' names (which the shared code reads)
_ALIASES = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
            "n_inner": "intermediate_size", "layer_norm_epsilon": "layer_norm_eps", "rotary_emb_base": "rope_theta"}
# original config keys whose value must be this one: what the GGUF architecture (and llama.cpp) can express
_REQUIRED = {"activation_function": "swiglu", "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
             "rotary_emb_scale_base": None, "rotary_scaling_factor": None, "qkv_proj_bias": False,
             "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False, "causal": False,
             "use_rms_norm": False, "parallel_block": False, "moe_every_n_layers": None}


@register("NomicBertModel", model_types=("nomic_bert",))
class NomicBert(Architecture):
    gguf_arch = "nomic-bert"
    skip = (r"^(bert\.)?(pooler\.|cls\.|lm_head\.|embeddings\.position_ids)", r"rotary_emb\.inv_freq$")
    embedding = True

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        original = "n_embd" in config
        if original:
            for key, value in _REQUIRED.items():
                if config.get(key, value) != value and not (value is None and not config.get(key)):
                    raise ValueError(f"config.json has {key}={config[key]!r}; only {value!r} converts to nomic-bert")
            config = {**config, **{new: config[old] for old, new in _ALIASES.items() if old in config}}
            # v1/v1.5 set n_positions 8192 but were trained on max_trained_positions (2048): llama.cpp's choice
            sizes = [n for n in (config.get("n_positions"), config.get("max_trained_positions")) if n]
            config["max_position_embeddings"] = min(sizes, default=2048)
        elif config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json has hidden_act={config['hidden_act']!r}; only 'silu' (SwiGLU) "
                             "converts to nomic-bert")
        super().__init__(hf_dir, config, pooling)
        if self.n_embd % self.n_heads or self.head_dim != self.n_embd // self.n_heads:
            raise ValueError("config.json: the head size must be hidden size / heads for nomic-bert")
        if self.n_kv_heads != self.n_heads:
            raise ValueError("config.json: nomic-bert has as many key/value heads as query heads")
        self.n_types = self.config.get("type_vocab_size") or 2
        self.pooling_type = self.sentence_transformers_pooling() or gguf.PoolingType.MEAN

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        encoder_metadata(self, w)
        if "rope_theta" not in self.rope:
            w.add_rope_freq_base(1000.0)  # nomic-bert's default base

    def vocab(self) -> Vocab:
        return wordpiece_vocab(self.hf_dir, self.n_vocab)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        yield self.map_name(name.removeprefix("bert.")), source  # NomicBertForPreTraining nests the encoder

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, ff = self.n_embd, self.hparam("intermediate_size")
        shapes = {"token_embd.weight": (self.n_vocab, embd), "token_types.weight": (self.n_types, embd),
                  "token_embd_norm.weight": (embd,), "token_embd_norm.bias": (embd,)}
        per_layer = {"attn_qkv.weight": (3 * embd, embd), "attn_output.weight": (embd, embd),
                     "attn_output_norm.weight": (embd,), "attn_output_norm.bias": (embd,),
                     "ffn_up.weight": (ff, embd), "ffn_gate.weight": (ff, embd), "ffn_down.weight": (embd, ff),
                     "layer_output_norm.weight": (embd,), "layer_output_norm.bias": (embd,)}
        return shapes | {f"blk.{{bid}}.{name}": shape for name, shape in per_layer.items()}
