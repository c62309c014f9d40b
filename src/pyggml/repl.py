"""``pyggml run MODEL`` with no prompt: an interactive chat in the manner of ``ollama run``.

A model with a chat template gets a conversation: every turn re-sends the whole history, as the
token ids the runner already holds (each reply as it was generated, not re-tokenized), so the
runner's prompt-prefix reuse evaluates only the new turn (the KV cache still holds the rest). A
model without one (or ``--raw``) gets plain completions, one per input. Ollama's slash commands
work (``/?`` lists them), ``\"\"\"`` opens a multi-line input, lines are kept in a readline history.
Ctrl-C stops the reply being written and returns to the prompt; Ctrl-D (or ``/bye``) leaves.
"""

from __future__ import annotations

import math
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from pyggml.thinking import Splitter, Think, check_think, splitter_for, template_thinks, template_variables

PROMPT, CONTINUATION = ">>> ", "... "

HELP = """Available commands:
  /set parameter NAME VALUE   set a sampling parameter, or num_ctx (/set parameter alone lists them)
  /set system TEXT            set the system message (clears the conversation)
  /set verbose | quiet        show or hide timings after each reply
  /set think [LEVEL] | nothink   ask a model that thinks to think (gpt-oss: low, medium, high) or not
  /set format json | noformat    answer in JSON, or freely
  /set wordwrap | nowordwrap     wrap replies at the terminal's width, or not
  /set history | nohistory       keep what is typed in the history file, or not
  /show info | template | parameters | system | license | modelfile
  /clear                      forget the conversation
  /load MODEL                 load another model (a file or a model name) with its parameters and system
  /save MODEL                 save this session's model, parameters, system and conversation as a stored model
  /bye                        exit
  /?, /help                   this help

Use \"\"\" to begin a multi-line message (end it with \"\"\" too).
Ctrl-C stops a reply; Ctrl-D exits."""

# Ollama's parameter names -> (generate() keyword, parser)
PARAMETERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "typical_p": ("typical_p", float),
    "repeat_penalty": ("repeat_penalty", float),
    "repeat_last_n": ("repeat_last_n", int),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "seed": ("seed", int),
    "num_predict": ("max_tokens", int),
    "stop": ("stop", str),
}


def params_to_options(params: dict[str, Any]) -> dict[str, Any]:
    """``generate``/``CompletionRequest`` options from Ollama parameters (a model's params layer:
    {"stop": [...], "temperature": 0.6, "num_predict": -1, ...}); others (num_ctx, ...) are ignored."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name in PARAMETERS and isinstance(value, (int, float, str, list)) and not isinstance(value, bool):
            key = PARAMETERS[name][0]
            out[key] = [str(v) for v in value] if name == "stop" and isinstance(value, list) else value
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] < 0:
        del out["max_tokens"]  # Ollama's -1: no limit of its own
    return out


def parse_duration(value: str | float | int | None) -> float | None:
    """Ollama's ``keep_alive``: seconds as a number, or a duration such as "5m", "30s", "1h", "1h30m";
    a negative value keeps the model loaded for ever (``None``); 0 unloads at once."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _parse_units(text)
    else:
        raise ValueError(f"keep_alive must be a number of seconds or a duration such as '5m', got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"keep_alive must be finite, got {value!r}")
    return None if seconds < 0 else seconds


def _parse_units(text: str) -> float:
    import re

    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"keep_alive must be a number of seconds or a duration such as '5m', '30s', '1h', "
                         f"got {text!r}")
    return sign * sum(float(n) * units[u] for n, u in parts)


@dataclass
class Session:
    """One interactive conversation. ``load(ref)`` returns a loaded ``LLM`` (``/load`` uses it too)."""

    load: Callable[[str], Any]
    model_ref: str
    options: dict[str, Any]
    system: str | None = None
    raw: bool = False
    verbose: bool = False
    keep_alive: float | None = None  # seconds idle before the model is unloaded (None: never)
    images: list[Any] = field(default_factory=list)  # --image: sent with the first message
    think: Think = None  # Ollama's think (None: the template's default)
    hide_thinking: bool = False  # think, but do not show it
    wordwrap: bool = True  # at the terminal's width (a terminal only)
    history: bool = True  # keep typed lines in the readline history
    num_ctx: int | None = None  # /set parameter num_ctx: the model is reloaded with this context
    # the stored model (pyggml.store.ModelRef) a name stands for, where ``lookup`` finds one; /load takes
    # its parameters (as ``defaults(params)`` turns them into options), system message and first messages
    lookup: Callable[[str], Any] | None = None
    defaults: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda params: params_to_options(params))
    ref: Any = None
    out: TextIO = field(default=sys.stdout)
    err: TextIO = field(default=sys.stderr)
    messages: list[dict[str, Any]] = field(default_factory=list)
    llm: Any = None
    _interrupted: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _timer: threading.Timer | None = None
    # the conversation as the runner last saw it: its rendered text, its token ids (prompt and reply),
    # and the LLM they belong to; the next turn sends these ids and tokenizes only what is new
    _history: tuple[str, list[int], Any] | None = None
    _template: tuple[Any, Any] | None = None  # (llm, its ChatTemplate)

    # ---- the model ---------------------------------------------------------------------------
    def ensure_loaded(self) -> Any:
        with self._lock:
            if self.llm is None:
                self.llm = self.load(self.model_ref, num_ctx=self.num_ctx) if self.num_ctx else \
                    self.load(self.model_ref)
            return self.llm

    def unload(self) -> None:
        with self._lock:
            if self.llm is not None:
                self.llm.close()
                self.llm = None

    def _arm_keep_alive(self) -> None:
        self._disarm_keep_alive()
        if self.keep_alive is not None and self.llm is not None:
            self._timer = threading.Timer(self.keep_alive, self.unload)
            self._timer.daemon = True
            self._timer.start()

    def _disarm_keep_alive(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def chat(self) -> bool:
        """A conversation (chat template) rather than plain completions."""
        return not self.raw and bool(self.ensure_loaded().model.config.get("tokenizer.chat_template"))

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, read: Callable[[str], str] = input) -> int:
        _setup_readline()
        self.ensure_loaded()
        mode = "chat" if self.chat else "completion (no chat template)" if not self.raw else "completion (--raw)"
        print(f"pyggml: {mode}; /? for help, Ctrl-D or /bye to exit", file=self.err)
        try:
            while True:
                self._arm_keep_alive()
                try:
                    text = self._read_message(read)
                except KeyboardInterrupt:
                    print("\nUse Ctrl + d or /bye to exit.", file=self.err)
                    continue
                except EOFError:
                    print(file=self.err)
                    return 0
                finally:
                    self._disarm_keep_alive()
                if not self.history:
                    _forget_typed()
                if text is None or not text.strip():
                    continue
                if text.startswith("/"):
                    if self.command(text.strip()) == "bye":
                        return 0
                    continue
                try:
                    self.reply(text)
                except KeyboardInterrupt:  # a second Ctrl-C, outside the reply's own handler
                    print("\n(stopped)", file=self.err)
                except (ValueError, TypeError) as exc:  # a bad option, a prompt too long, ...
                    print(f"error: {exc}", file=self.err)
        finally:
            self._disarm_keep_alive()
            self.unload()

    def _read_message(self, read: Callable[[str], str]) -> str | None:
        line = read(PROMPT)
        if not line.lstrip().startswith('"""'):
            return line
        first = line.lstrip()[3:]
        if first.endswith('"""') and first:  # """one line"""
            return first[:-3]
        lines = [first] if first else []
        while True:
            line = read(CONTINUATION)
            if line.rstrip().endswith('"""'):
                lines.append(line.rstrip()[:-3])
                return "\n".join(lines)
            lines.append(line)

    # ---- one turn ----------------------------------------------------------------------------
    def reply(self, text: str) -> str:
        """Generate the answer to ``text``, streamed to ``out``; Ctrl-C stops it (the turn is then
        forgotten, as a reply cut short is not part of the conversation)."""
        llm = self.ensure_loaded()
        start = time.perf_counter()
        self._interrupted = False
        previous = _install_sigint(self._on_sigint)
        try:
            images, content = self.images, text
            prompt = None
            if self.chat:
                content = image_content(text, images) if images else text
                messages = self._conversation() + [{"role": "user", "content": content}]
                if images or any(not isinstance(m["content"], str) for m in messages):
                    pieces = llm.chat(messages, stream=True, **self.options)  # images: tokenized around them
                else:
                    prompt = self._prompt(llm, messages)
                    pieces = llm.generate(prompt[1], stream=True, **self.options)
            else:
                messages = None
                pieces = llm.generate(text, stream=True, images=images, **self.options)
            splitter = splitter_for(self._template[1].source, prompt[0]) if prompt is not None else None
            answer = self._stream(pieces, splitter)
        finally:
            _install_sigint(previous)
        if answer is None:
            print("\n(stopped)", file=self.err)
            return ""
        self.images = []  # sent once; in a chat they stay in the history
        self._remember(llm, prompt, answer)
        if messages is not None:
            reply: dict[str, Any] = {"role": "assistant", "content": answer}
            if prompt is not None and (again := splitter_for(self._template[1].source, prompt[0])) is not None:
                (thinking, text), (more, rest) = again.feed(answer), again.flush()
                reply.update(content=text + rest, thinking=thinking + more)  # as a template expects a turn back
            self.messages += [{"role": "user", "content": content}, reply]
        if self.verbose:
            print_stats(llm.stats, time.perf_counter() - start, self.err)
        return answer

    def _prompt(self, llm: Any, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The chat prompt of ``messages`` as text and token ids. When it extends the conversation
        the runner last saw, those ids are kept as they were (the reply as generated, not re-tokenized)
        and only the new text is tokenized: the KV cache then covers every earlier turn."""
        from pyggml.chat import ChatTemplate, encode_prompt

        if self._template is None or self._template[0] is not llm:
            self._template = (llm, ChatTemplate.from_model(llm.model))
        text = self._template[1].render(messages, add_generation_prompt=True,
                                        **template_variables(self._template[1].source, self.think))
        if self._history is not None and self._history[2] is llm and text.startswith(self._history[0]):
            seen, ids, _ = self._history
            return text, ids + llm.tokenizer.encode(text[len(seen):], add_special=False)
        return text, encode_prompt(llm.tokenizer, text)

    def _remember(self, llm: Any, prompt: tuple[str, list[int]] | None, answer: str) -> None:
        """Keep the ids of this turn for the next when the reply's tokens decode to exactly its text
        (not when a stop string cut it, say)."""
        self._history = None
        if prompt is None:
            return
        generated = list(llm.stats.tokens)
        while generated and llm.tokenizer.is_eog(generated[-1]):  # the template writes the end of the turn
            generated.pop()
        if llm.tokenizer.decode(generated) == answer:
            self._history = (prompt[0] + answer, prompt[1] + generated, llm)

    def _stream(self, pieces: Any, splitter: Splitter | None = None) -> str | None:
        """Write ``pieces`` (a thinking model's thinking apart, under "Thinking..."); the whole text, or
        ``None`` when Ctrl-C stopped them. While a reply is made, SIGINT only sets a flag checked between
        pieces: the engine is never interrupted in the middle of a step."""
        text = []
        wrap = WordWrap(shutil.get_terminal_size().columns) if self.wordwrap and _isatty(self.out) else None
        shown = ReplyWriter(self.out, wrap, show_thinking=self.think is not False and not self.hide_thinking)
        try:
            for piece in pieces:
                if self._interrupted:
                    break
                shown.write(*splitter.feed(piece) if splitter is not None else ("", piece))
                text.append(piece)
        finally:
            pieces.close()
        if self._interrupted:
            return None
        shown.write(*splitter.flush() if splitter is not None else ("", ""))
        shown.close()
        return "".join(text)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self._interrupted = True

    def _conversation(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    # ---- slash commands ----------------------------------------------------------------------
    def command(self, line: str) -> str | None:
        """Run one slash command; returns "bye" to leave."""
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if word in ("/bye", "/exit"):
            return "bye"
        if word in ("/?", "/help"):
            print(HELP, file=self.out)
        elif word == "/clear":
            self.messages.clear()
            print("Cleared session context", file=self.out)
        elif word == "/set":
            self._set(rest)
        elif word == "/show":
            self._show(rest)
        elif word == "/load":
            self._load(rest)
        elif word == "/save":
            self._save(rest)
        else:
            print(f"Unknown command '{word}'. Type /? for help", file=self.out)
        return None

    def _set(self, rest: str) -> None:
        what, _, value = rest.partition(" ")
        value = value.strip()
        if what == "parameter":
            self._set_parameter(value)
        elif what == "system":
            self.system = value.strip('"') or None
            self.messages.clear()
            print("Set system message.", file=self.out)
        elif what == "verbose":
            self.verbose = True
            print("Set 'verbose' mode.", file=self.out)
        elif what == "quiet":
            self.verbose = False
            print("Set 'quiet' mode.", file=self.out)
        elif what in ("think", "nothink"):
            self._set_think(what, value)
        elif what == "format" and value == "json":
            self.options["format"] = "json"
            print("Set format to 'json' mode.", file=self.out)
        elif what == "noformat":
            self.options.pop("format", None)
            print("Disabled format.", file=self.out)
        elif what in ("wordwrap", "nowordwrap", "history", "nohistory"):
            setattr(self, what.removeprefix("no"), not what.startswith("no"))
            print(f"Set '{what}' mode.", file=self.out)
        else:
            print("Usage: /set parameter NAME VALUE | system TEXT | verbose | quiet | think [LEVEL] | nothink | "
                  "format json | noformat | wordwrap | nowordwrap | history | nohistory", file=self.out)

    def _set_think(self, what: str, value: str) -> None:
        try:
            think = check_think(value or True, "/set think") if what == "think" else False
            template = self._chat_template()
            if template is None or not template_thinks(template.source):
                raise ValueError("the model does not think (its chat template has no <think> block or harmony "
                                 "channels)")
            template_variables(template.source, think)
        except ValueError as exc:
            print(f"Couldn't set thinking: {exc}", file=self.out)
            return
        self.think = think
        print(f"Set '{what}' mode." if not isinstance(think, str) else f"Set 'think' mode to '{think}'.", file=self.out)

    def _chat_template(self) -> Any:
        """The loaded model's chat template (None for plain completion)."""
        from pyggml.chat import ChatTemplate

        llm = self.ensure_loaded()
        if not self.chat:
            return None
        if self._template is None or self._template[0] is not llm:
            self._template = (llm, ChatTemplate.from_model(llm.model))
        return self._template[1]

    def _set_parameter(self, text: str) -> None:
        try:
            words = shlex.split(text)
        except ValueError as exc:
            print(f"Couldn't set parameter: {exc}", file=self.out)
            return
        if len(words) == 2 and words[0] == "num_ctx":
            if not words[1].isdigit() or int(words[1]) < 2:
                print(f"Couldn't set parameter: num_ctx must be an integer >= 2, got {words[1]!r}", file=self.out)
                return
            self.num_ctx = int(words[1])
            self.unload()  # reloaded with the new context on the next turn; the conversation stays
            print(f"Set parameter 'num_ctx' to '{self.num_ctx}'", file=self.out)
            return
        if len(words) < 2 or words[0] not in PARAMETERS:
            print("Usage: /set parameter NAME VALUE\nParameters: " + ", ".join([*PARAMETERS, "num_ctx"]),
                  file=self.out)
            return
        name, values = words[0], words[1:]
        key, parse = PARAMETERS[name]
        try:
            value = values if name == "stop" else parse(values[0])
            if name == "temperature":
                check_temperature(value)
            if name == "num_predict" and value < 0:
                value = 10**9  # Ollama's -1: until the end of generation
            if name == "seed" and value < 0:
                value = None
        except ValueError as exc:
            print(f"Couldn't set parameter: {name} must be {parse.__name__}: {exc}", file=self.out)
            return
        self.options[key] = value
        print(f"Set parameter '{name}' to '{', '.join(values)}'", file=self.out)

    def _show(self, what: str) -> None:
        llm = self.ensure_loaded()
        config = llm.model.config
        if what == "info":
            from pyggml.store import describe

            for key, value in describe(llm.model).items():
                print(f"  {key:<18}{value}", file=self.out)
            print(f"  {'context':<18}{llm.num_ctx} (trained {llm.model.context_length or '?'})", file=self.out)
        elif what == "template":
            print(config.get("tokenizer.chat_template") or "(no chat template: plain completion)", file=self.out)
        elif what in ("parameters", "params"):
            inverse = {key: name for name, (key, _) in PARAMETERS.items()}
            for key, value in sorted(self.options.items()):
                if key in inverse and value is not None:
                    print(f"  {inverse[key]:<18}{value}", file=self.out)
        elif what == "system":
            print(self.system or "No system message was specified for this model.", file=self.out)
        elif what == "license":
            stored = "\n\n".join(self.ref.license) if self.ref is not None else ""
            print(stored or config.get("general.license") or "No license was specified for this model.",
                  file=self.out)
        elif what == "modelfile":
            from pyggml.modelfile import render

            ref = self.ref
            print(render(self.model_ref, str(llm.model.backend.path or self.model_ref),
                         template=ref.template if ref is not None else None, system=self.system,
                         parameters=self.parameters(), license=ref.license if ref is not None else None,
                         messages=ref.messages if ref is not None else None), file=self.out, end="")
        else:
            print("Usage: /show info | template | parameters | system | license | modelfile", file=self.out)

    def parameters(self) -> dict[str, Any]:
        """The session's options as Ollama's parameters (a params layer, a Modelfile's PARAMETER lines)."""
        out: dict[str, Any] = {"num_ctx": self.num_ctx} if self.num_ctx else {}
        for name, (key, _) in PARAMETERS.items():
            value = self.options.get(key)
            if value is None or (name == "num_predict" and value >= 10**9):
                continue
            out[name] = [value] if name == "stop" and isinstance(value, str) else value
        return out

    def _load(self, ref: str) -> None:
        if not ref:
            print("Usage: /load MODEL", file=self.out)
            return
        try:
            stored = self.lookup(ref) if self.lookup is not None else None
            num_ctx = stored.params.get("num_ctx") if stored is not None else None
            llm = self.load(ref, num_ctx=num_ctx) if isinstance(num_ctx, int) and num_ctx > 1 else self.load(ref)
        except (OSError, ValueError, TypeError, SystemExit) as exc:
            print(f"Couldn't load model '{ref}': {exc}", file=self.out)
            return
        self.unload()
        with self._lock:
            self.llm, self.model_ref, self.num_ctx = llm, ref, num_ctx
        print(f"Loading model '{ref}'", file=self.out)
        self.apply(stored)

    def apply(self, stored: Any) -> None:
        """Take a stored model's parameters, system message and first messages (a fresh conversation)."""
        self.ref, self.messages = stored, []
        if stored is None:
            return
        self.options = self.defaults(stored.params)
        self.system = stored.system
        self.messages = [dict(m) for m in stored.messages]
        for m in self.messages:  # Ollama shows a model's MESSAGE lines as the conversation so far
            print(f"{PROMPT if m.get('role') == 'user' else ''}{m.get('content', '')}", file=self.out)

    def _save(self, name: str) -> None:
        """A stored model of this session (Ollama's /save): the model, its parameters, system message and
        the conversation's text turns."""
        from pyggml import manifest
        from pyggml.modelfile import Modelfile

        if not name:
            print("Usage: /save MODEL", file=self.out)
            return
        turns = [{"role": m["role"], "content": m["content"]} for m in self.messages if isinstance(m["content"], str)]
        spec = Modelfile(base=self.model_ref, parameters=self.parameters(), system=self.system, messages=turns)
        try:
            manifest.create(name, spec)
        except (OSError, ValueError) as exc:
            print(f"Couldn't save model '{name}': {exc}", file=self.out)
            return
        print(f"Created new model '{name}'", file=self.out)


class WordWrap:
    """Streamed text wrapped at ``width`` columns between words (a word longer than a line stays whole)."""

    def __init__(self, width: int):
        self.width, self.col, self.word = max(width, 10), 0, ""

    def feed(self, text: str) -> str:
        out = []
        for char in text:
            if char in " \n":
                out += [self._place(self.word), char]
                self.word, self.col = "", 0 if char == "\n" else self.col + 1
            else:
                self.word += char
                if len(self.word) >= self.width:  # text without spaces (code, CJK) is not held back
                    out.append(self._place(self.word))
                    self.word = ""
        return "".join(out)

    def flush(self) -> str:
        word, self.word = self.word, ""
        return self._place(word)

    def _place(self, word: str) -> str:
        if word and self.col and self.col + len(word) > self.width:
            self.col = len(word)
            return "\n" + word
        self.col += len(word)
        return word


class ReplyWriter:
    """A reply as it streams: the thinking (when shown) between "Thinking..." and "...done thinking.",
    then the answer; wrapped by ``wrap`` when given; ends with a blank line."""

    def __init__(self, out: TextIO, wrap: WordWrap | None = None, show_thinking: bool = True):
        self.out, self.wrap, self.show_thinking = out, wrap, show_thinking
        self._thinking, self._last = False, ""

    def write(self, thinking: str, answer: str) -> None:
        if thinking and self.show_thinking:
            if not self._thinking:
                self._emit("Thinking...\n")
                self._thinking = True
            self._emit(thinking)
        if answer:
            self._end_thinking()
            self._emit(answer)

    def end(self) -> None:
        """Write what is held (the end of a thinking, a word waiting to be wrapped)."""
        self._end_thinking()
        if self.wrap is not None:
            self._emit(self.wrap.flush(), wrapped=True)

    def close(self) -> None:
        self.end()
        self.out.write("\n\n" if self._last and not self._last.endswith("\n") else "\n")
        self.out.flush()

    def _end_thinking(self) -> None:
        if self._thinking:
            self._thinking = False
            self._emit("\n...done thinking.\n\n")

    def _emit(self, text: str, wrapped: bool = False) -> None:
        if self.wrap is not None and not wrapped:
            text = self.wrap.feed(text)
        if text:
            self.out.write(text)
            self.out.flush()
            self._last = text


def shown(pieces: Any, splitter: Splitter, show_thinking: bool = True) -> Iterator[str]:
    """A thinking model's output ``pieces`` as ``ReplyWriter`` shows them (closing it closes ``pieces``)."""
    import io

    buffer = io.StringIO()
    writer = ReplyWriter(buffer, show_thinking=show_thinking)

    def take() -> str:
        text = buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
        return text

    try:
        for piece in pieces:
            writer.write(*splitter.feed(piece))
            yield take()
        writer.write(*splitter.flush())
        writer.end()
        yield take()
    finally:
        pieces.close()


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def _forget_typed() -> None:
    """Drop the line just typed from the readline history (``/set nohistory``)."""
    try:
        import readline
    except ImportError:
        return
    if not sys.stdin.isatty():  # input() kept nothing
        return
    length = readline.get_current_history_length()
    if length:
        readline.remove_history_item(length - 1)


def image_content(prompt: str, images: list[Any]) -> list[dict[str, Any]]:
    """A user message's content parts: the images where the prompt says ``[img-N]``, else before its text."""
    import re

    if not re.search(r"\[img-\d+\]", prompt):
        return [*({"type": "image", "image": p} for p in images), {"type": "text", "text": prompt}]
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(re.split(r"\[img-(\d+)\]", prompt)):
        if i % 2 == 0:
            if piece:
                parts.append({"type": "text", "text": piece})
        elif int(piece) < len(images):
            parts.append({"type": "image", "image": images[int(piece)]})
        else:
            raise ValueError(f"the prompt names [img-{piece}] but {len(images)} image(s) were given with --image")
    return parts


def check_temperature(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {value}")
    return value


def print_stats(stats: Any, reply_seconds: float, out: TextIO) -> None:
    """Timings as ``ollama run --verbose`` prints them: the total is the reply's time and the load's
    when this reply loaded the model (``stats.load_seconds``; the load happens before the reply)."""
    rows = [
        ("total duration", _duration(reply_seconds + stats.load_seconds)),
        ("load duration", _duration(stats.load_seconds)),
        ("prompt eval count", f"{stats.prompt_tokens} token(s)"),
        ("prompt eval duration", _duration(stats.prompt_seconds)),
        ("prompt eval rate", f"{stats.prompt_tps:.2f} tokens/s"),
        ("prompt cache", f"{stats.cached_tokens} token(s) reused"),
        ("eval count", f"{stats.generated_tokens} token(s)"),
        ("eval duration", _duration(stats.generate_seconds)),
        ("eval rate", f"{stats.generate_tps:.2f} tokens/s"),
    ]
    for name, value in rows:
        print(f"{name + ':':<22}{value}", file=out)


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f}s"
    return f"{seconds * 1e3:.3f}ms"


def _install_sigint(handler: Any) -> Any:
    """Install ``handler`` for SIGINT (main thread only); returns the previous one."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if handler is None:
        return None
    return signal.signal(signal.SIGINT, handler)


def _setup_readline() -> None:
    """Line editing and a history file (``<cache dir>/history``) where readline exists."""
    if not sys.stdin.isatty():
        return
    try:
        import atexit
        import readline
    except ImportError:  # Windows without pyreadline
        return
    from pyggml.tiny import cache_dir

    path = cache_dir() / "history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            readline.read_history_file(path)
    except OSError:
        return
    readline.set_history_length(1000)

    def save() -> None:
        try:
            readline.write_history_file(path)
        except OSError:
            pass

    atexit.register(save)
