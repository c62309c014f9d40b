"""Model interface and the registry of architectures by GGUF ``general.architecture``."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from pyggml.input import Batch, Input, Multimodal, MultimodalIndex
from pyggml.nn import ModelError

if TYPE_CHECKING:
    import numpy as np

    from pyggml.backend import Backend, BackendParams, Context, ProgressFn
    from pyggml.kvcache import Cache
    from pyggml.tensor import Tensor

__all__ = ["Batch", "Input", "Model", "ModelError", "Multimodal", "MultimodalIndex", "Pooling", "VisionPart", "load",
           "register", "registry"]


class Pooling(enum.IntEnum):
    """How an embedding model turns its token states into one vector per sequence (the values of
    GGUF ``<arch>.pooling_type``, as llama.cpp numbers them)."""

    NONE = 0  # no pooling: one vector per token
    MEAN = 1
    CLS = 2  # the first token's state
    LAST = 3  # the last token's state
    RANK = 4  # a reranker's classification head (not supported)

    @classmethod
    def parse(cls, value: Pooling | str | int) -> Pooling:
        """A Pooling from itself, its name in any case ("mean") or its number."""
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown pooling {value!r}; choose one of "
                                 f"{', '.join(p.name.lower() for p in cls)}") from None
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown pooling type {value!r}") from None


class Model:
    """A network built from a Backend's weights. Subclasses declare weights as annotated fields
    (see ``pyggml.nn``) and implement ``forward`` (text generation), ``embed`` (embedding models),
    or both."""

    architecture: ClassVar[str] = ""
    backend: Backend
    config: Any
    cache: Cache | None
    tokenizer: Any
    generates: ClassVar[bool] = True  # implements forward(): logits for the next token
    # the architecture's hyper-parameters (a frozen dataclass with ``from_config(config)``) and its
    # nn.Module tree of weights: ``pyggml.synthetic`` writes random files for any registered model from them
    Options: ClassVar[Any] = None
    Weights: ClassVar[Any] = None
    pooling: Pooling | None = None  # embedding models: the file's pooling; None: no embed()
    # the most sequences the model can serve at once (its cache's limit: mllama's encoder cache holds one
    # image); None: no limit. The runner serves at most this many.
    max_parallel: ClassVar[int | None] = None
    vision: VisionPart | None = None  # the image encoder of a vision model (or of its mmproj file)
    _projector: Backend | None = None  # an attached mmproj file's weights (attach_vision), closed with the model

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        """Logits (vocab, len(batch.outputs)) for the batch."""
        raise NotImplementedError

    def embed(self, ctx: Context, batch: Batch, pooling: Pooling | None = None) -> Tensor:
        """Embeddings (hidden, n_sequences) of a batch of whole sequences numbered 0..n-1 (each
        sequence's inputs together and in position order), pooled by ``pooling`` (default: the
        model's); ``Pooling.NONE`` gives every token's state, (hidden, n_tokens)."""
        raise NotImplementedError

    def attach_mmproj(self, projector: Backend) -> None:
        """Take the vision part from a llama.cpp mmproj file's weights (loaded as ``projector``, which
        the model then owns and closes); the base refuses."""
        raise ModelError(f"the {self.architecture or 'loaded'} model takes no mmproj file (no vision part is "
                         "implemented for it)")

    def attach_vision(self, projector: Backend, vision: VisionPart | None) -> None:
        """For ``attach_mmproj``: hold ``vision``, read from the mmproj weights ``projector`` (closed with
        the model); ModelError when the model has a vision part already or the file has none."""
        if self.vision is not None:
            raise ModelError(f"{self.backend.path} has a vision part already; it takes no mmproj file")
        if vision is None:
            raise ModelError(f"{projector.path}: no vision tensors (v.patch_embd.weight)")
        self.vision, self._projector = vision, projector

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    @property
    def context_length(self) -> int:
        """The context the model was trained for (GGUF ``<arch>.context_length``); 0 when unknown."""
        return self.config.uint("context_length", 0) or 0

    @property
    def can_shift(self) -> bool:
        """Whether ``shift`` is implemented, so a full context can drop old tokens and go on."""
        return type(self).shift is not Model.shift

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        """Re-rotate cached keys of ``layer`` by ``shift`` positions (context shift). Models with
        rotary positions implement it and give it to their cache; the base raises
        NotImplementedError (``can_shift`` is then False)."""
        raise NotImplementedError(f"{self.architecture}: context shift is not implemented")

    def close(self) -> None:
        """Free the cache and the weights. Dropping the cache also breaks the cycle model -> cache ->
        ``model.shift`` (the cache's shift function), so the model and everything it holds go as soon as
        the caller lets go of it, not at the next garbage collection (~2.5 MB per model otherwise)."""
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        self.backend.close()
        if self._projector is not None:
            self._projector.close()
            self._projector = None


class VisionPart:
    """A model's image encoder, held as ``model.vision`` (None: the model takes no images). The runner
    and the engine reach images only through it:

    - ``preprocess(data)``: the image file's bytes, decoded (once: on the requesting thread, so a bad
      image fails its request before any work) into the named arrays its graph reads;
    - ``placeholders(image, tokenizer)``: the inputs that stand for one image in the prompt (marker
      tokens, and the image's ``Input`` with ``same_batch`` keeping its rows in one batch; for a text
      model with multi-axis rope, each input's ``rope_offset``/``rope_step``: Qwen-VL's mRoPE positions);
    - ``build(ctx, inputs)``: the encoder graph of those arrays, read through
      ``ctx.from_numpy(array, name=name)`` so the engine keeps one graph per input shape and refills
      it for the next image of that shape (shapes may differ per image: dynamic resolution);
    - ``worst_case()``: arrays of its largest graph, reserved at start-up (and sizing the batches).
    """

    max_images: ClassVar[int | None] = None  # images one prompt may hold (None: any number)
    # False: the graph reads per-image values the refill cannot reach; the engine builds one per image
    reusable: ClassVar[bool] = True

    def preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        """The arrays ``build`` reads, by input name; ValueError for bytes that are not an image it takes."""
        raise NotImplementedError

    def build(self, ctx: Context, inputs: Mapping[str, np.ndarray]) -> list[Tensor]:
        """The image's embeddings: one or more tensors (the text model reads them from ``Multimodal``
        items, as numpy arrays (rows, hidden) once computed)."""
        raise NotImplementedError

    def worst_case(self) -> dict[str, np.ndarray] | None:
        """Inputs of the largest graph (any values); None when unknown (nothing is reserved)."""
        return None

    def placeholders(self, image: Input, tokenizer: Any) -> list[Input]:
        """The inputs standing for ``image`` in the prompt; ``image.multimodal[0].data`` holds what
        ``preprocess`` gave (or ``worst_case()``, for sizing the batches)."""
        raise NotImplementedError

    def encode(self, ctx: Context, data: bytes) -> list[Multimodal]:
        """Preprocess ``data`` and build its graph in ``ctx`` (a one-off; the runner keeps graphs)."""
        return [Multimodal(tensor=t) for t in self.build(ctx, self.preprocess(data))]


_REGISTRY: dict[str, type[Model]] = {}


def register(architecture: str) -> Callable[[type[Model]], type[Model]]:
    """Class decorator: run GGUF files whose ``general.architecture`` is ``architecture`` with it."""

    def wrap(cls: type[Model]) -> type[Model]:
        cls.architecture = architecture
        _REGISTRY[architecture] = cls
        return cls

    return wrap


def registry() -> dict[str, type[Model]]:
    _import_builtin()
    return dict(_REGISTRY)


def _import_builtin() -> None:
    import pyggml.models.mllama  # noqa: F401  (registers itself)
    from pyggml.models import (  # noqa: F401  (register themselves)
        bert,
        deepseek2,
        gemma2,
        gemma3,
        gemma4,
        gemma_embedding,
        glm4moe,
        gptoss,
        granitehybrid,
        lfm2,
        lfm2moe,
        llama,
        llama4,
        mistral3,
        nemotron_h,
        nomic_bert,
        olmo2,
        phi3,
        qwen2,
        qwen2vl,
        qwen3,
        qwen3moe,
        qwen3next,
        qwen3vl,  # and qwen3vlmoe
        qwen25vl,
        qwen35,
        qwen35moe,
        smollm3,
    )


def load(path: str | os.PathLike, params: BackendParams | None = None, progress: ProgressFn | None = None,
         mmproj: str | os.PathLike | None = None) -> Model:
    """Load a GGUF file and build the model its architecture names, with its tokenizer; ``mmproj``: a
    llama.cpp multimodal projector file (``general.architecture = clip``) giving it its vision part."""
    from pyggml.backend import Backend
    from pyggml.backend.metadata import GGUFError
    from pyggml.tokenizer import from_metadata

    _import_builtin()
    backend = Backend.load(path, params, progress)
    try:
        arch = backend.config.architecture
        cls = _REGISTRY.get(arch)
        if cls is None:
            raise ModelError(f"{path}: unsupported architecture {arch or '(none)'!r}; "
                             f"supported: {', '.join(sorted(_REGISTRY))}")
        try:
            model = cls(backend)
        except GGUFError as exc:  # a hyper-parameter of the wrong type or out of range (Config's getters)
            raise ModelError(f"{path}: {exc}") from None
        model.config = backend.config
        model.tokenizer = from_metadata(backend.config) if "tokenizer.ggml.model" in backend.config else None
        if mmproj is not None:
            projector = Backend.load(mmproj, params)
            try:
                if projector.config.architecture != "clip":
                    raise ModelError(f"{mmproj}: not an mmproj file (general.architecture is "
                                     f"{projector.config.architecture!r}, not 'clip')")
                model.attach_mmproj(projector)
            except BaseException:
                projector.close()
                model.close()
                raise
        return model
    except BaseException:
        backend.close()
        raise
