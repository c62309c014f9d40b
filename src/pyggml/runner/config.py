"""One engine configuration, built once, and the one function that opens it.

``pyggml.load`` (``LLM``), ``pyggml run`` and ``pyggml serve`` describe the engine they want as an
``EngineConfig`` (the model file, how its weights are placed and computed, the optional vision
projector and draft model, the Runner's options) and get it from ``open_engine``: the model (with its
mmproj), the draft, and the ``Runner`` that serves them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pyggml import models
from pyggml.backend import BackendParams, ProgressFn
from pyggml.models import Model
from pyggml.runner.runner import Runner
from pyggml.tensor import DType

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 4096  # per sequence when neither the caller nor a shorter trained context says


@dataclass
class EngineConfig:
    """How to open an engine. ``model`` may be None only where a server picks models by request."""

    model: str | os.PathLike | None
    backend: BackendParams = field(default_factory=BackendParams)
    mmproj: str | os.PathLike | None = None  # a llama.cpp projector file: the model's vision part
    mmproj_optional: bool = False  # True: a projector that cannot be used is dropped with a warning
    draft: str | os.PathLike | None = None  # speculative decoding: a smaller model, the same vocabulary
    draft_max: int = 8  # most tokens drafted per step
    parallel: int = 4  # sequences served at once
    num_ctx: int | None = None  # context per sequence; None: min(4096, the model's trained context)
    batch_size: int = 512  # most tokens per forward pass
    cache_type: DType | str = DType.F16
    multi_user_cache: bool = True  # prompt-cache slots shared by many users (False: one conversation)
    background: bool = True  # a loop thread runs the engine (False: the thread reading the output does)

    @classmethod
    def from_options(cls, model: str | os.PathLike | None, **options: Any) -> EngineConfig:
        """From flat keyword options: ``BackendParams``' field names set ``backend``, the others this
        class's fields. TypeError names the options that are neither."""
        backend_names = {f.name for f in dataclasses.fields(BackendParams)}
        own = {f.name for f in dataclasses.fields(cls)} - {"model", "backend"}
        unknown = set(options) - backend_names - own
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
        backend = BackendParams(**{k: v for k, v in options.items() if k in backend_names})
        return cls(model, backend, **{k: v for k, v in options.items() if k in own})

    def context_for(self, model: Model) -> int:
        """The context per sequence for ``model``: ``num_ctx``, else its trained context up to 4096."""
        return self.num_ctx or min(DEFAULT_CONTEXT, model.context_length or DEFAULT_CONTEXT)


def open_engine(config: EngineConfig, progress: ProgressFn | None = None) -> Runner:
    """Load ``config.model`` (with its mmproj) and the draft model, and start the Runner serving them
    (``runner.model``; the draft is ``runner.drafter.model``). On failure whatever was loaded is closed.
    The caller closes the runner, then the models (``close_engine``)."""
    if config.model is None:
        raise ValueError("open_engine: the configuration names no model")
    model = _load_model(config, progress)
    draft = None
    try:
        if config.draft is not None:  # local devices only: rpc/tensor_split place the main model's layers
            draft = models.load(config.draft, dataclasses.replace(config.backend, rpc=(), tensor_split=None))
        return Runner(model, parallel=config.parallel, num_ctx=config.context_for(model),
                      batch_size=config.batch_size, cache_type=config.cache_type,
                      multi_user_cache=config.multi_user_cache, background=config.background,
                      draft=draft, draft_max=config.draft_max)
    except BaseException:
        model.close()
        if draft is not None:
            draft.close()
        raise


def close_engine(runner: Runner) -> None:
    """Stop ``runner`` and close the models ``open_engine`` loaded for it."""
    draft = runner.drafter.model if runner.drafter is not None else None
    try:
        runner.close()
    finally:
        try:
            runner.model.close()
        finally:
            if draft is not None:
                draft.close()


def _load_model(config: EngineConfig, progress: ProgressFn | None) -> Model:
    try:
        return models.load(config.model, config.backend, progress=progress, mmproj=config.mmproj)
    except ValueError as exc:
        if config.mmproj is None or not config.mmproj_optional:
            raise
        log.warning("%s: its projector cannot be used (%s); serving it without images", config.model, exc)
        return models.load(config.model, config.backend, progress=progress)
