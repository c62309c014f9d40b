"""llama-cpp-python's ``Llama`` methods on ``LLM``: ``create_completion`` (and calling the LLM),
``create_chat_completion`` and ``create_embedding``, with llama-cpp-python's argument names and
defaults, answering the same OpenAI-shaped dicts (or, with ``stream=True``, iterators of chunk dicts).

The work is the LLM's own (one Runner, its chat template, tool-call formats and constrained output,
as ``pyggml serve`` runs them); this module only translates arguments and shapes answers.
llama-cpp-python's options that pyggml has no counterpart for (``mirostat_mode``, ``tfs_z``,
``logits_processor``, ...) are accepted at their default values and refused otherwise.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pyggml.runner import CompletionChunk, CompletionRequest, TokenLogprob

# llama-cpp-python arguments without a pyggml counterpart, and the defaults that mean "not used"
_UNUSED = {"tfs_z": 1.0, "mirostat_mode": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "stopping_criteria": None,
           "logits_processor": None, "functions": None, "function_call": None}


def completion_logprobs(lps: Sequence[TokenLogprob], top: int, piece: Callable[[int], str],
                        offset: list[int]) -> dict[str, Any]:
    """OpenAI's legacy completion logprobs (as llama-cpp-python returns them) of tokens ``lps``: each token's text
    (``piece``), its offset in the text so far (``offset[0]``, advanced past them), its logprob, and its ``top``
    alternatives by text."""
    tokens = [piece(lp.token) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset[0])
        offset[0] += len(t)
    return {"tokens": tokens, "text_offset": offsets, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{piece(t): p for t, p in lp.top[:top]} for lp in lps]}


def _check_unused(op: str, extra: Mapping[str, Any]) -> None:
    unknown = sorted(k for k in extra if k not in _UNUSED)
    if unknown:
        raise TypeError(f"{op}() got unexpected keyword argument(s): {', '.join(unknown)}")
    used = sorted(k for k, v in extra.items() if v != _UNUSED[k])
    if used:
        raise ValueError(f"{op}: {', '.join(used)} {'is' if len(used) == 1 else 'are'} not supported by pyggml "
                         "(leave at the default)")


def _max_tokens(value: int | None) -> int:
    return -1 if value is None or value <= 0 else value  # llama-cpp-python: None or <= 0 runs to the end


class LlamaCppMethods:
    """Mixed into ``LLM`` (which supplies ``runner``, ``tokenizer``, ``model``, ``embed`` and the chat template)."""

    def __call__(self, prompt: str | Sequence[int], **options: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``create_completion`` (llama-cpp-python's ``llm(prompt, ...)``)."""
        return self.create_completion(prompt, **options)

    def create_completion(self, prompt: str | Sequence[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                          logprobs: int | None = None, echo: bool = False, stop: str | Sequence[str] | None = (),
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                          top_k: int = 40, stream: bool = False, seed: int | None = None, model: str | None = None,
                          grammar: Any = None, logit_bias: Mapping[int, float] | None = None, **unused: Any
                          ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """A text completion as llama-cpp-python answers it: ``{"id", "object": "text_completion",
        "created", "model", "choices": [{"text", "index", "logprobs", "finish_reason"}], "usage"}``.
        ``logprobs=n``: each token's log-probability and its ``n`` best alternatives in OpenAI's legacy
        shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""
        _check_unused("create_completion", unused)
        if suffix:
            raise ValueError("create_completion: suffix (fill-in-the-middle) is not supported")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
            raise ValueError(f"create_completion: logprobs must be an int >= 0, got {logprobs!r}")
        prompt = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
        request = CompletionRequest(
            prompt=prompt, max_tokens=_max_tokens(max_tokens), stop=stop or (), logprobs=max(logprobs or 0, 1)
            if logprobs is not None else 0, num_keep=self.num_keep, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, typical_p=typical_p, repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, logit_bias=logit_bias, grammar=grammar)
        head = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": model or self._model_name}
        prompt_text = prompt if isinstance(prompt, str) else self.detokenize(prompt)
        prefix = prompt_text if echo else ""
        offset = [len(prompt_text)]  # llama-cpp-python counts offsets from the start of the prompt

        def choice(chunk: CompletionChunk, text: str, lps: list[TokenLogprob]) -> dict[str, Any]:
            shaped = None if logprobs is None else completion_logprobs(lps, logprobs, self._piece, offset)
            return {"text": text, "index": 0, "logprobs": shaped, "finish_reason": _finish(chunk)}

        chunks = self._chunks(self.runner.completion(request))  # validates the request now
        if stream:
            return self._stream(head, chunks, choice, prefix)
        return self._whole(head, chunks, choice, prefix)

    def create_chat_completion(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
                               = None, tool_choice: Any = None, temperature: float = 0.2, top_p: float = 0.95,
                               top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                               stop: str | Sequence[str] | None = (), seed: int | None = None,
                               response_format: Mapping[str, Any] | None = None, max_tokens: int | None = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, model: str | None = None, grammar: Any = None,
                               logit_bias: Mapping[int, float] | None = None, logprobs: bool | None = None,
                               top_logprobs: int | None = None, **unused: Any
                               ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """A chat completion as llama-cpp-python answers it: ``{"id", "object": "chat.completion", ...,
        "choices": [{"index", "message": {"role", "content", "tool_calls"?}, "logprobs", "finish_reason"}],
        "usage"}``, rendered with the model's chat template. ``tools`` (OpenAI function tools) are
        rendered by the template and calls read back per model family; ``tool_choice`` "required" or a
        function forces a call. ``response_format``: ``{"type": "json_object"}`` (with an optional
        ``"schema"``, as llama-cpp-python takes it) or OpenAI's ``{"type": "json_schema", "json_schema":
        {"schema": ...}}``. A model that thinks puts its reasoning in ``message.reasoning_content``.
        Images (vision models): ``image_url`` content parts with ``data:`` URLs, as in ``chat``."""
        from pyggml.chat import encode_prompt, strip_bos_text
        from pyggml.image import split_chat_images
        from pyggml.thinking import splitter_for
        from pyggml.tools import ToolOutput, check_tools, detect_format, forced_grammar, tool_choice_name

        _check_unused("create_chat_completion", unused)
        if top_logprobs is not None and not logprobs:
            raise ValueError("create_chat_completion: top_logprobs needs logprobs=True")
        forced, name = tool_choice_name(tool_choice)
        tools = check_tools(tools) if tool_choice != "none" else []
        template = self._chat_template()
        fmt = detect_format(template.source)
        constraint = _response_format(response_format)
        if forced:
            if constraint or grammar is not None:
                raise ValueError("create_chat_completion: a forced tool call cannot have a response_format or "
                                 "grammar too")
            grammar = forced_grammar(fmt, tools, name).named("tools")
        messages, images = split_chat_images(messages)
        text = self._render_chat(messages, tools=tools or None)
        top = (top_logprobs or 0) if logprobs else None
        # with images the runner tokenizes around them (and adds the BOS itself)
        prompt = strip_bos_text(self.tokenizer, text) if images else encode_prompt(self.tokenizer, text)
        request = CompletionRequest(
            prompt=prompt, images=images, max_tokens=_max_tokens(max_tokens), stop=stop or (),
            logprobs=max(top, 1) if top is not None else 0, num_keep=self.num_keep, temperature=temperature,
            top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, repeat_penalty=repeat_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed, logit_bias=logit_bias,
            grammar=grammar, **constraint)
        head = {"id": f"chatcmpl-{uuid.uuid4()}", "object": "chat.completion", "created": int(time.time()),
                "model": model or self._model_name}
        splitter = splitter_for(template.source, text)
        calls_out = ToolOutput(fmt, self.tokenizer) if tools else None

        def choice(chunk: CompletionChunk, text: str, lps: list[TokenLogprob], streaming: bool) -> dict[str, Any]:
            thinking = ""
            if splitter is not None:
                thinking, text = splitter.feed(text)
                if chunk.done:
                    more, rest = splitter.flush()
                    thinking, text = thinking + more, text + rest
            calls = []
            if calls_out is not None:
                text, calls = calls_out.feed(chunk, text)
            message: dict[str, Any] = {"content": text} if streaming else {"role": "assistant", "content": text}
            if streaming and chunk.done and not text:
                message = {}
            if thinking:
                message["reasoning_content"] = thinking
            if calls:
                if not streaming:
                    message["content"] = text or None
                message["tool_calls"] = [c.openai(i if streaming else None) for i, c in enumerate(calls)]
            shaped = {"content": [self._chat_logprob(lp, top) for lp in lps], "refusal": None} \
                if top is not None else None
            return {"index": 0, "delta" if streaming else "message": message, "logprobs": shaped,
                    "finish_reason": "tool_calls" if calls else _finish(chunk)}

        chunks = self._chunks(self.runner.completion(request))
        if not stream:
            return self._whole(head, chunks, lambda c, t, lps: choice(c, t, lps, False))
        head["object"] = "chat.completion.chunk"
        first = {"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}
        return self._stream(head, chunks, lambda c, t, lps: choice(c, t, lps, True), first=first)

    def create_embedding(self, input: str | Sequence[str], model: str | None = None) -> dict[str, Any]:
        """Embeddings as llama-cpp-python answers them: ``{"object": "list", "data": [{"object":
        "embedding", "embedding", "index"}], "model", "usage"}``; the vectors are not normalised (as
        llama-cpp-python's; ``embed`` normalises by default)."""
        texts = [input] if isinstance(input, str) else list(input)
        vectors = self.embed(texts, normalize=False)
        n = sum(len(self.runner.embedder.tokenize(t)) for t in texts)
        return {"object": "list", "model": model or self._model_name,
                "data": [{"object": "embedding", "embedding": v.tolist(), "index": i} for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    # ---- shaping ----------------------------------------------------------------------------------
    def _whole(self, head: dict[str, Any], chunks: Iterator[CompletionChunk], choice: Any,
               prefix: str = "") -> dict[str, Any]:
        text, lps, last = [prefix], [], None
        for last in chunks:
            text.append(last.text)
            lps.extend(last.logprobs or [])
        answer = choice(last, "".join(text), lps)
        return {**head, "choices": [answer], "usage": _usage(last)}

    def _stream(self, head: dict[str, Any], chunks: Iterator[CompletionChunk], choice: Any, prefix: str = "",
                first: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        if first is not None:
            yield {**head, "choices": [first]}
        for chunk in chunks:
            text, prefix = prefix + chunk.text, ""
            if text or chunk.done or chunk.logprobs:
                yield {**head, "choices": [choice(chunk, text, chunk.logprobs or [])]}

    def _piece(self, token: int) -> str:
        return self.tokenizer.token_to_piece(token).decode("utf-8", "replace")

    def _chat_logprob(self, lp: TokenLogprob, top: int) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self._piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top[:top]]}

    @property
    def _model_name(self) -> str:
        return self.model_path or self.model.architecture


def _finish(chunk: CompletionChunk) -> str | None:
    if not chunk.done:
        return None
    return "length" if chunk.finish_reason == "length" else "stop"


def _usage(chunk: CompletionChunk) -> dict[str, int]:
    return {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": chunk.generated_tokens,
            "total_tokens": chunk.prompt_tokens + chunk.generated_tokens}


def _response_format(value: Mapping[str, Any] | None) -> dict[str, Any]:
    """``format=`` for a chat ``response_format`` (llama-cpp-python's or OpenAI's shape)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError("response_format must be a dict such as {'type': 'json_object'}")
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"format": value.get("schema") or "json"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ValueError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
        return {"format": dict(spec["schema"])}
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
