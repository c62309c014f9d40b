"""Serving many sequences with one model: prompt-cache slots, continuous batching, streaming.

``InputCache`` decides which KV-cache sequence a request uses and what it can skip; ``Runner``
composes one decode loop of a ``Scheduler`` (scheduler.py: the next batch and its logits rows), the
``Engine`` (engine.py: graphs built, reused, computed) and step plug-ins (plugins.py: context shift,
grammar masks; speculative.py; images.py), samples the sequences and streams their text
(sequence.py); ``Embedder`` embeds texts with an embedding model.
"""

from pyggml.runner.embedding import Embedder, EmbeddingsNotSupportedError, GenerationNotSupportedError
from pyggml.runner.inputcache import (
    InputCache,
    InputCacheSlot,
    NoFreeSlotError,
    ReprocessInputsError,
    count_common_prefix,
)
from pyggml.runner.runner import Runner, RunnerClosedError
from pyggml.runner.sequence import CompletionChunk, CompletionRequest, CompletionStream, Timings, TokenLogprob

__all__ = ["CompletionChunk", "CompletionRequest", "CompletionStream", "Embedder", "EmbeddingsNotSupportedError",
           "GenerationNotSupportedError", "InputCache", "InputCacheSlot", "NoFreeSlotError", "ReprocessInputsError",
           "Runner", "RunnerClosedError", "Timings", "TokenLogprob", "count_common_prefix"]
