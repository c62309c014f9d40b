"""A completion request checked and tokenized into a ``RunningSequence`` (on the caller's thread,
before it queues: a bad request is a ValueError saying what is wrong, and costs the loop nothing)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from pyggml.constrain import Constraint, grammar_for
from pyggml.input import Input
from pyggml.runner.sequence import MAX_LOGPROBS, CompletionRequest, RunningSequence, check_stops
from pyggml.runner.speculative import MAX_DRAFT

ImageInputs = Callable[[str | Sequence[int], Sequence[bytes]], list[Input]]


def prepare(request: CompletionRequest, tokenizer, num_ctx: int, images: ImageInputs) -> RunningSequence:
    """The sequence of ``request`` for a runner whose slots hold ``num_ctx`` inputs; ``images`` turns
    a prompt with images into its inputs."""
    if not isinstance(request, CompletionRequest):
        raise TypeError(f"completion: expected a CompletionRequest, got {type(request).__name__}")
    ids = _prompt_ids(request.prompt, tokenizer)
    inputs = images(request.prompt, request.images) if request.images else [Input(token=t) for t in ids]
    if len(inputs) > num_ctx:
        raise ValueError(f"prompt of {len(inputs)} tokens does not fit the context of {num_ctx} tokens "
                         "(raise num_ctx or shorten the prompt)")
    check_int("max_tokens", request.max_tokens, -1)
    check_int("num_keep", request.num_keep, -1)
    check_int("logprobs", request.logprobs, 0, MAX_LOGPROBS)
    check_int("prompt_lookup", request.prompt_lookup, 0, MAX_DRAFT)
    stops = check_stops(request.stop)
    _check_bias(request.logit_bias, tokenizer.vocab_size)
    if request.seed is not None:
        check_int("seed", request.seed, 0)
    num_keep = len(inputs) if request.num_keep < 0 else request.num_keep
    grammar = grammar_for(request.format, request.grammar)  # ConstraintError is a ValueError
    constraint = Constraint(grammar, tokenizer) if grammar is not None else None
    try:  # the Sampler checks the sampling options
        return RunningSequence(request, inputs, tokenizer, [s for s in stops if s], min(num_keep, num_ctx - 1),
                               constraint)
    except TypeError as exc:
        raise ValueError(f"bad sampling option: {exc}") from exc


def _prompt_ids(prompt: object, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt")
        ids = tokenizer.encode(prompt, add_special=True)
    elif isinstance(prompt, Sequence) and all(isinstance(t, (int, np.integer)) for t in prompt):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range 0..{tokenizer.vocab_size - 1}: {bad[:5]}")
    else:
        raise ValueError("prompt must be a string or a list of token ids")
    if not ids:
        raise ValueError("empty prompt")
    return ids


def _check_bias(logit_bias: object, vocab_size: int) -> None:
    bias = dict(logit_bias or {})
    if any(not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size for t in bias):
        raise ValueError(f"logit_bias keys must be token ids in 0..{vocab_size - 1}")
    if any(not isinstance(v, (int, float)) or math.isnan(v) for v in bias.values()):
        raise ValueError("logit_bias values must be numbers")


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low or \
            (high is not None and value > high):
        limits = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be an int {limits}, got {value!r}")
