"""What an architecture file defines: the :class:`Architecture` hooks and the registry by HF name.

An architecture file subclasses :class:`Architecture` (or a related architecture's class) and
registers it under the Hugging Face ``architectures`` names it converts. The hooks, in the order
:func:`pyggml.convert.convert_hf` calls them (only ``gguf_arch`` and ``expected`` are required):

- ``gguf_arch``: the GGUF ``general.architecture`` (a ``gguf.MODEL_ARCH`` name), which also picks
  ``gguf``'s Hugging Face -> GGUF tensor-name map;
- ``__init__``: read and check hyper-parameters; refuse what the GGUF architecture cannot express
  (raise ValueError naming the config.json key);
- ``metadata(writer)``: hyper-parameters -> GGUF keys (the default writes the keys every transformer
  has, from the usual config.json names; call ``super()`` and add yours);
- ``vocab()``: the tokenizer (default: tokenizer.model as SentencePiece, else tokenizer.json as BPE);
- ``skip``: regexes of checkpoint tensors not written (rotary caches, heads another task uses);
- ``tensors(name, source)``: one checkpoint tensor -> zero or more ``(gguf_name, source)`` pairs; the
  place for renames the map lacks (``gpt_oss.py``), transforms with ``source.map`` (``llama.py``'s
  rope permutation, ``gemma2.py``'s ``1 + weight``), splits of fused tensors with ``source.split``
  and merges with ``self.gather`` then ``Source.stack`` (:class:`StackedExperts`, which Qwen 3 MoE, Qwen 3.5
  MoE and DeepSeek put before their base class; :class:`TextOfMultimodal`, the text decoder of a checkpoint
  saved with its vision part);
- ``extra_tensors()``: tensors computed from the config (``rope_freqs``, ``rope_factors_*``);
- ``expected()``: every tensor of the file, GGUF name (``{bid}`` per block) -> numpy shape; the file
  must have exactly these, so a missing, unknown or misshapen tensor fails before anything is written,
  and it is the order tensors are written in (``decoder_shapes()`` is Llama's layout, to extend);
- ``keep_f32``: GGUF tensor kinds never quantised (besides vectors, biases and norms).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

import gguf

from .checkpoint import read_json
from .tensors import Source
from .vocab import Vocab, read_vocab

# sentence-transformers Pooling config flag -> our name for it; our names -> gguf pooling types
_POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_POOLING = {"none": gguf.PoolingType.NONE, "mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS,
            "last": gguf.PoolingType.LAST}
_REGISTRY: dict[str, type[Architecture]] = {}
_BY_MODEL_TYPE: dict[str, type[Architecture]] = {}
_ARCHS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
# one expert's matrix, as checkpoints saved before transformers 5 store them
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def register(*hf_names: str, model_types: Iterable[str] = ()) -> Callable[[type[Architecture]], type[Architecture]]:
    """Class decorator: convert checkpoints whose config.json ``architectures[0]`` is one of ``hf_names``
    (or, when a config has no ``architectures``, whose ``model_type`` is one of ``model_types``)."""
    def add(cls: type[Architecture]) -> type[Architecture]:
        if (cls.tensor_names or cls.gguf_arch) not in _ARCHS:
            raise ValueError(f"{cls.__name__}.gguf_arch {cls.gguf_arch!r} is not a gguf.MODEL_ARCH name (set "
                             "tensor_names to the one whose tensor-name map applies)")
        for name in hf_names:
            _REGISTRY[name] = cls
        for name in model_types:
            _BY_MODEL_TYPE[name] = cls
        return cls
    return add


def supported() -> list[str]:
    """The Hugging Face architecture names that convert, sorted."""
    return sorted(_REGISTRY)


def architecture_for(config: dict[str, Any]) -> type[Architecture]:
    """The registered class for a config.json, or ValueError naming what is supported."""
    name = (config.get("architectures") or [None])[0]
    cls = _REGISTRY.get(name) if name else _BY_MODEL_TYPE.get(config.get("model_type"))
    if cls is None:
        raise ValueError(f"unsupported architecture {name or config.get('model_type')!r}; "
                         f"supported: {', '.join(supported())}")
    return cls


class UnknownTensorError(ValueError):
    """A checkpoint tensor that neither the name map nor the architecture's hook knows."""


class Architecture:
    """One Hugging Face architecture's conversion to GGUF (see the module docstring for the hooks)."""

    gguf_arch: ClassVar[str]
    # the gguf.MODEL_ARCH whose Hugging Face -> GGUF tensor-name map applies, for architectures the gguf
    # package does not know (Ollama's ``mllama``); None: gguf_arch's
    tensor_names: ClassVar[str | None] = None
    skip: ClassVar[tuple[str, ...]] = (r"rotary_emb\.inv_freq$",)
    keep_f32: ClassVar[tuple[str, ...]] = ("ffn_gate_inp", "position_embd", "token_types")
    rope_types: ClassVar[tuple[str, ...]] = ("default", "linear", "yarn")  # rope scaling this arch can take
    # True: an encoder whose file always carries a pooling type (default mean); None: a decoder that is
    # an embedding model when its sentence-transformers config (or ``pooling=``) names a pooling
    embedding: ClassVar[bool | None] = False
    default_context: ClassVar[int] = 2048  # when config.json names no max_position_embeddings
    always_head_dim: ClassVar[bool] = False  # write attention.key_length even when it is hidden / heads

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        self.hf_dir, self.config, self.pooling = hf_dir, config, pooling
        if pooling is not None and self.embedding is False:
            raise ValueError(f"pooling applies to embedding models; {self.gguf_arch} is a text generation model")
        self.n_layers: int = self.hparam("num_hidden_layers")
        self.n_embd: int = self.hparam("hidden_size")
        self.n_heads: int = self.hparam("num_attention_heads")
        self.n_kv_heads: int = config.get("num_key_value_heads") or self.n_heads
        self.head_dim: int = config.get("head_dim") or self.n_embd // self.n_heads
        self.n_ff: int | None = config.get("intermediate_size")
        self.n_vocab: int = self.hparam("vocab_size")
        self.context_length: int = config.get("max_position_embeddings") or self.default_context
        self.tied: bool = bool(config.get("tie_word_embeddings", False))
        self.rope = self._rope_parameters()
        self.name_map = gguf.get_tensor_name_map(_ARCHS[self.tensor_names or self.gguf_arch], self.n_layers)
        self._gathered: dict[str, dict[int, Source]] = {}

    def hparam(self, *keys: str) -> Any:
        """The first of ``keys`` present in config.json; ValueError naming them when none is."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.config[key]
        raise ValueError(f"config.json has no {' or '.join(keys)}")

    # --- hooks -----------------------------------------------------------------------------------

    def metadata(self, w: gguf.GGUFWriter) -> None:
        """The keys every transformer has, named as llama.cpp names them; subclasses add theirs."""
        w.add_context_length(self.context_length)
        w.add_embedding_length(self.n_embd)
        w.add_block_count(self.n_layers)
        if self.n_ff is not None:
            w.add_feed_forward_length(self.n_ff)
        w.add_head_count(self.n_heads)
        if "num_key_value_heads" in self.config:
            w.add_head_count_kv(self.n_kv_heads)
        if self.always_head_dim or self.head_dim != self.n_embd // self.n_heads:
            w.add_key_length(self.head_dim)
            w.add_value_length(self.head_dim)
        if "rms_norm_eps" in self.config:
            w.add_layer_norm_rms_eps(float(self.config["rms_norm_eps"]))
        if "layer_norm_eps" in self.config:
            w.add_layer_norm_eps(float(self.config["layer_norm_eps"]))
        if "rope_theta" in self.rope:
            w.add_rope_freq_base(float(self.rope["rope_theta"]))
        self._rope_scaling(w)

    def vocab(self) -> Vocab:
        return read_vocab(self.hf_dir, self.n_vocab)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if self.tied and name == "lm_head.weight":  # some checkpoints save the tied copy too
            return
        yield self.map_name(name), source

    def extra_tensors(self) -> Iterable[tuple[str, Source]]:
        return ()

    def expected(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    # --- helpers for the hooks ---------------------------------------------------------------------

    def decoder_shapes(self) -> dict[str, tuple[int, ...]]:
        """``expected()`` of the usual decoder (Llama's layout: RMS-normed attention and gated MLP,
        output tied or not), for architectures to extend."""
        embd, ff, vocab = self.n_embd, self.hparam("intermediate_size"), self.n_vocab
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {
            "token_embd.weight": (vocab, embd),
            "blk.{bid}.attn_norm.weight": (embd,),
            "blk.{bid}.attn_q.weight": (q, embd),
            "blk.{bid}.attn_k.weight": (kv, embd),
            "blk.{bid}.attn_v.weight": (kv, embd),
            "blk.{bid}.attn_output.weight": (embd, q),
            "blk.{bid}.ffn_norm.weight": (embd,),
            "blk.{bid}.ffn_gate.weight": (ff, embd),
            "blk.{bid}.ffn_up.weight": (ff, embd),
            "blk.{bid}.ffn_down.weight": (embd, ff),
            "output_norm.weight": (embd,),
        }
        if not self.tied:
            shapes["output.weight"] = (vocab, embd)
        return shapes

    def map_name(self, name: str) -> str:
        """The GGUF name of a checkpoint tensor by ``gguf``'s map for this architecture."""
        mapped = self.name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise UnknownTensorError(name)
        return mapped

    def gather(self, key: str, index: int, count: int, source: Source) -> list[Source] | None:
        """Collect ``count`` tensors under ``key`` (e.g. one layer's experts); all of them, in index
        order, once the last arrives, else None. The converter fails naming any key left incomplete."""
        parts = self._gathered.setdefault(key, {})
        if not 0 <= index < count:
            raise ValueError(f"{key}: index {index} is outside 0..{count - 1} (config.json says {count})")
        parts[index] = source
        if len(parts) < count:
            return None
        del self._gathered[key]
        return [parts[i] for i in range(count)]

    def incomplete(self) -> list[str]:
        """What :meth:`gather` is still waiting for, one line per key."""
        return [f"{key} ({len(parts)} found)" for key, parts in sorted(self._gathered.items())]

    def sentence_transformers_pooling(self) -> gguf.PoolingType | None:
        """The ``pooling=`` override, else the sentence-transformers Pooling module's mode, else None."""
        if self.pooling is not None:
            if self.pooling not in _POOLING:
                raise ValueError(f"unknown pooling {self.pooling!r}; choose one of {', '.join(_POOLING)}")
            return _POOLING[self.pooling]
        for module in read_json(self.hf_dir / "modules.json") or []:
            if module.get("type", "").endswith("Pooling"):
                pool_cfg = read_json(self.hf_dir / module.get("path", "") / "config.json") or {}
                modes = [mode for flag, mode in _POOLING_FLAGS.items() if pool_cfg.get(flag)]
                others = [k for k, v in pool_cfg.items()
                          if k.startswith("pooling_mode") and v and k not in _POOLING_FLAGS]
                if len(modes) != 1 or others:
                    raise ValueError(f"{module.get('path')}/config.json asks for pooling {modes + others}; supported: "
                                     "exactly one of mean, cls, lasttoken (pass pooling=... to override)")
                return _POOLING[modes[0]]
        return None

    def skipped(self, name: str) -> bool:
        return any(re.search(pattern, name) for pattern in self.skip)

    def _rope_parameters(self) -> dict[str, Any]:
        # transformers >= 5 writes "rope_parameters" (with rope_theta inside); older versions write
        # "rope_theta" and "rope_scaling" (its kind under "type" or "rope_type")
        rope = {**(self.config.get("rope_scaling") or {}), **(self.config.get("rope_parameters") or {})}
        rope["rope_type"] = rope.get("rope_type", rope.get("type")) or "default"
        if "rope_theta" not in rope and self.config.get("rope_theta") is not None:
            rope["rope_theta"] = self.config["rope_theta"]
        if rope["rope_type"] not in self.rope_types:
            raise ValueError(f"unsupported rope scaling type {rope['rope_type']!r} for {self.gguf_arch}; "
                             f"supported: {', '.join(t for t in self.rope_types if t != 'default')}")
        return rope

    def _rope_scaling(self, w: gguf.GGUFWriter) -> None:
        rope, kind = self.rope, self.rope["rope_type"]
        if kind == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(rope["factor"]))
        elif kind == "yarn":
            # HF's optional yarn parameters pass through; the runtime has defaults for absent ones
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(rope["factor"]))
            w.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings") or self.context_length))
            optional = {"extrapolation_factor": w.add_rope_scaling_yarn_ext_factor,
                        "attention_factor": w.add_rope_scaling_yarn_attn_factor,
                        "beta_fast": w.add_rope_scaling_yarn_beta_fast,
                        "beta_slow": w.add_rope_scaling_yarn_beta_slow}
            for key, add in optional.items():
                if rope.get(key) is not None:
                    add(float(rope[key]))


class StackedExperts(Architecture):
    """An architecture whose ``mlp.experts`` (``n_experts`` of width ``n_ff_exp``, both set by its ``__init__``)
    GGUF stores stacked: one matrix per expert (stacked once the layer's last expert arrives), or transformers 5's
    ``gate_up_proj`` / ``down_proj`` of all experts, go on to the next class's ``tensors`` as the
    ``mlp.experts.{gate,up,down}_proj.weight`` stacks gguf's map names ``ffn_*_exps``. Listed before the
    architecture it extends: ``class Qwen3Moe(StackedExperts, Qwen3)``."""

    n_experts: int
    n_ff_exp: int

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if m := _EXPERT.match(name):
            experts = self.gather(f"{m[1]}.{m[3]}_proj", int(m[2]), self.n_experts, source)
            if experts:
                yield from super().tensors(f"{m[1]}.{m[3]}_proj.weight", Source.stack(experts))
        elif name.endswith(".mlp.experts.gate_up_proj"):  # all experts' gate and up in one
            gate, up = source.split([self.n_ff_exp, self.n_ff_exp], axis=1)
            yield from super().tensors(name.replace("gate_up_proj", "gate_proj.weight"), gate)
            yield from super().tensors(name.replace("gate_up_proj", "up_proj.weight"), up)
        elif name.endswith(".mlp.experts.down_proj"):
            yield from super().tensors(name + ".weight", source)
        else:
            yield from super().tensors(name, source)


class TextOfMultimodal(Architecture):
    """The text decoder of a checkpoint saved with its vision part (a ``...ForConditionalGeneration``): config.json's
    ``text_config`` (with the model's own ``tie_word_embeddings``: transformers writes a default into text_config
    too), and ``language_model.model.*`` (or ``model.language_model.*``) and ``(language_model.)lm_head.*`` named as
    the text model's tensors. Listed before the text architecture it extends (``class Llama4Text(TextOfMultimodal,
    Llama4)``), whose ``skip`` leaves the vision part out (or whose subclass converts it)."""

    def __init__(self, hf_dir: Path, config: dict[str, Any], pooling: str | None = None) -> None:
        text = dict(config.get("text_config") or {})
        if "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        super().__init__(hf_dir, text, pooling)

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        if name.endswith("lm_head.weight"):
            name = "lm_head.weight"
        else:
            name = re.sub(r"^(model\.)?language_model\.(model\.)?", "model.", name)
        return super().tensors(name, source)
