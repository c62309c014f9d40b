"""Gemma 4 text models (GGUF ``gemma4``): norms stored as they apply (no ``1 + weight``), per-layer head
sizes and KV heads (global layers wider), the last layers sharing earlier layers' KV (no k/v weights),
per-layer embeddings, experts beside the MLP, and "proportional" rope on the global layers written as
llama.cpp does: all of the head rotates, with ``rope_freqs`` factors of 1e30 freezing the pairs past
the rotated part."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .base import Architecture, register
from .tensors import Source
from .vocab import USER_DEFINED, Vocab, read_vocab

# scales stored beside a weight in GGUF: the checkpoint name's ending -> the weight it belongs to
_SCALES = {".router.scale": ".router.proj", ".router.per_expert_scale": ".experts.down_proj"}

# special tokens Gemma 4 writes into its answers' text (channels, tool calls, quoted strings)
VISIBLE_TOKENS = frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                            "<tool_response|>", '<|"|>'})


@register("Gemma4ForCausalLM", model_types=("gemma4_text",))
class Gemma4(Architecture):
    gguf_arch = "gemma4"
    skip = (*Architecture.skip, r"^lm_head\.weight$")  # the output is the embedding
    rope_types = ("default", "proportional")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"config.json has hidden_activation={cfg['hidden_activation']!r}; GGUF gemma4 runs "
                             "gelu_pytorch_tanh")
        if cfg.get("use_bidirectional_attention") or cfg.get("attention_bias"):
            raise ValueError("config.json sets use_bidirectional_attention or attention_bias; GGUF gemma4 text "
                             "has neither")
        if not self.tied:
            raise ValueError("config.json unties the output from the embeddings; GGUF gemma4 ties them")
        self.kinds = [t == "sliding_attention" for t in self.hparam("layer_types")]  # True: sliding
        self.head_dims, self.kv_heads = self._per_layer_attention()
        self.n_shared = int(cfg.get("num_kv_shared_layers") or 0)
        first = self.n_layers - self.n_shared
        if any(self.kinds[first - (2 if sliding else 1)] != sliding for sliding in self.kinds[first:]):
            raise ValueError(f"config.json's last {self.n_shared} layers share KV of the last earlier layer of "
                             "their kind; GGUF gemma4 needs layer num_hidden_layers - num_kv_shared_layers - 1 "
                             "global and the one before it sliding")
        wide = 2 if cfg.get("use_double_wide_mlp") else 1
        self.ffn = [self.n_ff * (wide if i >= first else 1) for i in range(self.n_layers)]
        self.ple = int(cfg.get("hidden_size_per_layer_input") or 0)
        if self.ple and cfg.get("vocab_size_per_layer_input", self.n_vocab) != self.n_vocab:
            raise ValueError("config.json's vocab_size_per_layer_input differs from vocab_size; GGUF gemma4 has "
                             "one vocabulary for both embeddings")
        self.n_experts = int(cfg.get("num_experts") or 0) if cfg.get("enable_moe_block") else 0
        # llama.cpp drops embedding rows past the tokenizer's last token (and so does the vocabulary here)
        self._vocab = read_vocab(self.hf_dir, self.n_vocab, pad=False)
        self.n_tokens = len(self._vocab.tokens)

    def _per_layer_attention(self) -> tuple[list[int], list[int]]:
        """Each layer's head size and KV heads: transformers writes the global layers' in
        ``per_layer_config``; checkpoints also as ``global_head_dim`` and ``num_global_key_value_heads``
        (the latter only with ``attention_k_eq_v``, as transformers reads it)."""
        cfg, overrides = self.config, self.config.get("per_layer_config")
        if overrides is None:
            full: dict[str, Any] = {"head_dim": cfg.get("global_head_dim", 512)}
            if cfg.get("attention_k_eq_v", True) and cfg.get("num_global_key_value_heads") is not None:
                full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
            overrides = {i: full for i, sliding in enumerate(self.kinds) if not sliding}
        per_layer = [overrides.get(str(i), overrides.get(i, {})) for i in range(self.n_layers)]
        if any(per_layer[i] and self.kinds[i] for i in range(self.n_layers)) or \
                len({(p.get("head_dim"), p.get("num_key_value_heads")) for p in per_layer if p}) > 1:
            raise ValueError("config.json's per_layer_config must give every global layer the same head_dim and "
                             "num_key_value_heads, and sliding layers nothing")
        heads = [p.get("head_dim", self.head_dim) for p in per_layer]
        return heads, [p.get("num_key_value_heads", self.n_kv_heads) for p in per_layer]

    @property
    def global_head_dim(self) -> int:
        return next((d for d, sliding in zip(self.head_dims, self.kinds, strict=True) if not sliding), self.head_dim)

    def _rope_parameters(self) -> dict[str, Any]:
        params = self.config.get("rope_parameters") or {}
        self.rope_local = params.get("sliding_attention") or {"rope_theta": 10000.0}
        full = dict(params.get("full_attention") or {"rope_type": "default", "rope_theta": 1_000_000.0})
        if full.get("factor", 1.0) != 1.0 or self.rope_local.get("rope_type", "default") != "default" or \
                self.rope_local.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config.json's rope_parameters scale the global rope or rotate part of the sliding "
                             "layers' heads; GGUF gemma4 does neither")
        self.config = {**self.config, "rope_parameters": full}
        return super()._rope_parameters()

    def metadata(self, w: gguf.GGUFWriter) -> None:
        w.add_context_length(self.context_length)
        w.add_embedding_length(self.n_embd)
        w.add_block_count(self.n_layers)
        w.add_feed_forward_length(self.ffn if len(set(self.ffn)) > 1 else self.ffn[0])
        w.add_head_count(self.n_heads)
        w.add_head_count_kv(self.kv_heads if len(set(self.kv_heads)) > 1 else self.kv_heads[0])
        w.add_layer_norm_rms_eps(float(self.config.get("rms_norm_eps", 1e-6)))
        w.add_rope_freq_base(float(self.rope.get("rope_theta", 1_000_000.0)))
        w.add_key_length(self.global_head_dim)
        w.add_value_length(self.global_head_dim)
        w.add_key_length_swa(self.head_dim)
        w.add_value_length_swa(self.head_dim)
        w.add_rope_dimension_count(self.global_head_dim)  # the unrotated part by rope_freqs
        w.add_rope_dimension_count_swa(self.head_dim)
        w.add_rope_freq_base_swa(float(self.rope_local.get("rope_theta", 10000.0)))
        w.add_sliding_window(int(self.hparam("sliding_window")))
        w.add_sliding_window_pattern(self.kinds)
        w.add_shared_kv_layers(self.n_shared)
        w.add_embedding_length_per_layer_input(self.ple)
        if self.config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(self.config["final_logit_softcapping"]))
        if self.n_experts:
            w.add_expert_count(self.n_experts)
            w.add_expert_used_count(int(self.hparam("top_k_experts")))
            w.add_expert_feed_forward_length(int(self.hparam("moe_intermediate_size")))

    def vocab(self) -> Vocab:
        self._vocab.add_space_prefix = False
        for i, token in enumerate(self._vocab.tokens):  # rendered in the text (as llama.cpp writes them): the
            if token in VISIBLE_TOKENS:  # reasoning channel and tool calls must reach the chat parser
                self._vocab.types[i] = USER_DEFINED
        return self._vocab

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        shared = re.search(r"\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\.", name)
        if shared and int(shared[1]) >= self.n_layers - self.n_shared:
            return  # transformers ignores these in the layers reading an earlier layer's cache (so does llama.cpp)
        if name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight")):
            source = source.map(lambda w: w[:self.n_tokens], (self.n_tokens, *source.shape[1:]))
        for suffix, owner in _SCALES.items():
            if name.endswith(suffix):
                yield self.map_name(name[:-len(suffix)] + owner) + ".scale", source
                return
        if name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
            name += ".weight"
        yield from super().tensors(name, source)

    def extra_tensors(self) -> Iterable[tuple[str, Source]]:
        rotated = int(self.global_head_dim * self.rope.get("partial_rotary_factor", 1.0)) // 2
        factors = np.ones(self.global_head_dim // 2, np.float32)
        factors[rotated:] = 1e30  # frequencies / 1e30: these pairs do not turn
        yield "rope_freqs.weight", Source.of(factors)

    def expected(self) -> dict[str, tuple[int, ...]]:
        embd, vocab, first = self.n_embd, self.n_tokens, self.n_layers - self.n_shared
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, embd)}
        if self.ple:
            shapes |= {"per_layer_token_embd.weight": (vocab, self.ple * self.n_layers),
                       "per_layer_model_proj.weight": (self.ple * self.n_layers, embd),
                       "per_layer_proj_norm.weight": (self.ple,)}
        shapes["rope_freqs.weight"] = (self.global_head_dim // 2,)
        for i in range(self.n_layers):
            head, ff, b = self.head_dims[i], self.ffn[i], f"blk.{i}."
            q, kv = self.n_heads * head, self.kv_heads[i] * head
            shapes |= {b + "attn_norm.weight": (embd,), b + "attn_q.weight": (q, embd),
                       b + "attn_q_norm.weight": (head,)}
            if i < first:
                shapes |= {b + "attn_k.weight": (kv, embd), b + "attn_k_norm.weight": (head,)}
                if self.kinds[i] or not self.config.get("attention_k_eq_v"):
                    shapes[b + "attn_v.weight"] = (kv, embd)
            shapes |= {b + "attn_output.weight": (embd, q), b + "post_attention_norm.weight": (embd,),
                       b + "ffn_norm.weight": (embd,), b + "ffn_gate.weight": (ff, embd),
                       b + "ffn_up.weight": (ff, embd), b + "ffn_down.weight": (embd, ff),
                       b + "post_ffw_norm.weight": (embd,)}
            if self.n_experts:
                n, ffe = self.n_experts, int(self.hparam("moe_intermediate_size"))
                shapes |= {b + "ffn_gate_inp.weight": (n, embd), b + "ffn_gate_inp.scale": (embd,),
                           b + "ffn_gate_up_exps.weight": (n, 2 * ffe, embd),
                           b + "ffn_down_exps.weight": (n, embd, ffe), b + "ffn_down_exps.scale": (n,),
                           b + "pre_ffw_norm_2.weight": (embd,), b + "post_ffw_norm_1.weight": (embd,),
                           b + "post_ffw_norm_2.weight": (embd,)}
            if self.ple:
                shapes |= {b + "inp_gate.weight": (self.ple, embd), b + "proj.weight": (embd, self.ple),
                           b + "post_norm.weight": (embd,)}
            shapes[b + "layer_output_scale.weight"] = (1,)
        shapes["output_norm.weight"] = (embd,)
        return shapes


class Gemma4Text(Gemma4):
    """The text decoder of a multimodal Gemma 4 checkpoint (how Google publishes them); its vision and audio
    towers are left out here (gemma4_vision.py, registered for these checkpoints, adds the vision part)."""

    skip = (*Gemma4.skip, r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.")

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        text = {"tie_word_embeddings": config.get("tie_word_embeddings", True), **(config.get("text_config") or {})}
        super().__init__(hf_dir, text, pooling)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        yield from super().tensors(name.replace("model.language_model.", "model.", 1), source)
