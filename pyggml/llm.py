"""``pyggml.load(path) -> LLM``: text generation and scoring with one sequence.

The LLM keeps the tokens of its last prompt + generation in the KV cache and reuses the common
prefix on the next call, so a conversation re-sends only what is new. For many concurrent
sequences, use ``pyggml.runner.Runner``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from pyggml import models
from pyggml.backend import BackendParams, ProgressFn
from pyggml.models import Batch, Model
from pyggml.sample import Sampler
from pyggml.tensor import DType

_BACKEND_FIELDS = {f.name for f in fields(BackendParams)}


@dataclass
class Stats:
    """Timings of the last call, for ``--verbose`` and benchmarks."""

    load_seconds: float = 0.0
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    cached_tokens: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    finish_reason: str = ""

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generate_tps(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0


class LLM:
    """A loaded language model with its tokenizer and a single-sequence KV cache."""

    def __init__(self, model: Model, *, num_ctx: int | None = None, batch_size: int = 512,
                 cache_type: DType | str = DType.F16, num_keep: int = 4):
        if model.tokenizer is None:
            raise models.ModelError("the model file has no tokenizer (tokenizer.ggml.* keys)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = model.tokenizer
        trained = getattr(model, "options", None)
        trained_ctx = getattr(trained, "context_length", 0) or 4096
        self.num_ctx = int(num_ctx or min(4096, trained_ctx))
        if self.num_ctx < 2:
            raise ValueError(f"num_ctx must be >= 2, got {self.num_ctx}")
        self.batch_size = min(batch_size, self.num_ctx)
        self.num_keep = num_keep
        self.stats = Stats()
        model.cache.init(model.backend, DType.parse(cache_type), max_sequences=1, capacity=self.num_ctx,
                         max_batch=self.batch_size)
        self._cached: list[int] = []  # tokens whose keys/values are in the cache, in position order

    @classmethod
    def load(cls, path: str | os.PathLike, *, progress: ProgressFn | None = None, **options: Any) -> LLM:
        backend_options = {k: v for k, v in options.items() if k in _BACKEND_FIELDS}
        llm_options = {k: v for k, v in options.items() if k not in _BACKEND_FIELDS}
        unknown = set(llm_options) - {"num_ctx", "batch_size", "cache_type", "num_keep"}
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
        start = time.perf_counter()
        model = models.load(path, BackendParams(**backend_options), progress)
        try:
            llm = cls(model, **llm_options)
        except BaseException:
            model.close()
            raise
        llm.stats.load_seconds = time.perf_counter() - start
        return llm

    # ---- text <-> tokens -------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    # ---- scoring ---------------------------------------------------------------------------
    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits for every position of ``tokens`` as a fresh sequence: (len(tokens), vocab)."""
        tokens = self._check_tokens(tokens)
        if len(tokens) > self.num_ctx:
            raise ValueError(f"{len(tokens)} tokens exceed the context of {self.num_ctx}")
        self._reset()
        rows = []
        for start in range(0, len(tokens), self.batch_size):
            chunk = tokens[start:start + self.batch_size]
            rows.append(self._decode(chunk, start, range(len(chunk))))
        self._cached = list(tokens)
        return np.concatenate(rows, axis=0)

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, *, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.9, min_p: float = 0.0, seed: int | None = None,
                 stop: Sequence[str] = (), stream: bool = False, **sampling: Any) -> str | Iterator[str]:
        """Continue ``prompt``; returns the new text (``stream=True``: an iterator of pieces).

        Extra keyword options go to ``pyggml.sample.Sampler`` (repeat_penalty, typical_p, ...).
        Stops at an end-of-generation token, after ``max_tokens``, or before a ``stop`` string.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            ids = self.tokenize(prompt)
        else:
            ids = self._check_tokens(prompt)
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if len(ids) >= self.num_ctx:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {self.num_ctx} "
                             "(raise num_ctx or shorten the prompt)")
        stops = [s for s in stop if s]
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, **sampling)
        pieces = self._generate(ids, max_tokens, sampler, stops)
        return pieces if stream else "".join(pieces)

    def _generate(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: list[str]) -> Iterator[str]:
        stats = self.stats = Stats(load_seconds=self.stats.load_seconds)
        start = time.perf_counter()
        logits = self._prefill(ids)
        stats.prompt_seconds = time.perf_counter() - start
        history = list(ids)
        decoder = self.tokenizer.stream()
        pending = ""  # text held back while it could still become a stop string
        start = time.perf_counter()
        stats.finish_reason = "length"
        for _ in range(max_tokens):
            token = sampler.sample(logits, history)
            stats.generated_tokens += 1
            if self.tokenizer.is_eog(token):
                stats.finish_reason = "stop"
                break
            history.append(token)
            pending += decoder.feed(token)
            cut = _find_stop(pending, stops)
            if cut is not None:
                pending = pending[:cut]
                stats.finish_reason = "stop"
                break
            emit = len(pending) - _partial_stop(pending, stops)
            if emit:
                yield pending[:emit]
                pending = pending[emit:]
            if len(self._cached) >= self.num_ctx:
                self._shift_context()
            logits = self._decode([token], len(self._cached), [0])[0]
            self._cached.append(token)
        else:
            pending += decoder.flush()
        stats.generate_seconds = time.perf_counter() - start
        if pending:
            cut = _find_stop(pending, stops)
            yield pending if cut is None else pending[:cut]

    def _prefill(self, ids: list[int]) -> np.ndarray:
        """Process the prompt, reusing the cached common prefix; returns the last position's logits."""
        common = 0
        for a, b in zip(self._cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # always evaluate at least one token to get logits
        self.model.cache.remove(0, common)
        self._cached = self._cached[:common]
        self.stats.cached_tokens = common
        self.stats.prompt_tokens = len(ids) - common
        logits = None
        for start in range(common, len(ids), self.batch_size):
            chunk = ids[start:start + self.batch_size]
            logits = self._decode(chunk, start, [len(chunk) - 1])[0]
            self._cached.extend(chunk)
        return logits

    def _shift_context(self) -> None:
        """Drop the older half of the history after ``num_keep`` tokens (positions move down)."""
        keep = min(self.num_keep, self.num_ctx // 2)
        discard = (len(self._cached) - keep) // 2
        self.model.cache.remove(0, keep, keep + discard)
        del self._cached[keep:keep + discard]

    def _decode(self, tokens: list[int], first_pos: int, outputs: Sequence[int]) -> np.ndarray:
        """One forward pass of ``tokens`` at positions first_pos..; logits (len(outputs), vocab)."""
        model = self.model
        batch = Batch(inputs=tokens, outputs=list(outputs), positions=range(first_pos, first_pos + len(tokens)),
                      sequences=[0] * len(tokens))
        with model.backend.new_context() as ctx:
            model.cache.start_forward(ctx, batch)
            logits = model.forward(ctx, batch)
            ctx.compute(logits)
            return logits.numpy()

    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("empty token list")
        vocab = self.tokenizer.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range 0..{vocab - 1}: {bad[:5]}")
        return tokens

    def _reset(self) -> None:
        self.model.cache.remove(0, 0)
        self._cached = []

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def load(path: str | os.PathLike, **options: Any) -> LLM:
    """Load a GGUF model for generation. Options: the ``BackendParams`` fields (n_threads,
    gpu_layers, flash_attention, use_mmap, ...) plus num_ctx, batch_size, cache_type, num_keep."""
    return LLM.load(path, **options)


__all__ = ["LLM", "Stats", "load"]
