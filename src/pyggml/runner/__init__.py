"""Serving many sequences with one model: prompt-cache slots, continuous batching, streaming.

``InputCache`` decides which KV-cache sequence a request uses and what it can skip; ``Runner``
batches the running sequences, samples them and streams their text; ``Embedder`` embeds texts
with an embedding model.
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
