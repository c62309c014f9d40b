"""Grammars are compiled in a worker process first: llguidance parses and checks them in native
code, where a pathological grammar can overflow the stack (a segfault) or run for minutes. The
worker is one persistent interpreter started on first use with ``subprocess`` (a fresh program,
never a fork of a process that has computed: GGML-NOTES), compiling one grammar at a time under a
time limit on a thread with half the stack the caller's threads get, so a grammar that passes there
has room to spare here. A crash or a timeout costs the worker (started again for the next grammar)
and that grammar (a ``ConstraintError``), never the caller. Answers are cached per tokenizer and
grammar, so a schema sent again is not compiled twice.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

SECONDS = 10.0  # the most one grammar may take to compile and give its first mask
TOKENIZER_SECONDS = 120.0  # the most a tokenizer may take to arrive and be built there (a 262k vocabulary)
STACK_BYTES = 4 << 20  # the worker's compiling thread (callers' threads get 8 MiB on Linux)
MEMORY_BYTES = 8 << 30  # the worker's address space
CACHED = 256  # answers remembered
_HEADER = struct.Struct("<Q")


class GrammarWorker:
    """The parent's side: ``check(grammar, tokenizer)`` -> llguidance's grammar text, or a
    ``ConstraintError`` (invalid, matches nothing, crashed the compiler, too slow)."""

    def __init__(self, seconds: float = SECONDS):
        self.seconds = seconds
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> key
        self._next_key = itertools.count()
        self._sent: set[int] = set()  # tokenizer keys the running worker holds
        self._answers: OrderedDict = OrderedDict()

    def check(self, grammar: Any, tokenizer: Any) -> str:
        from pyggml.constrain import ConstraintError

        with self._lock:
            key = self._keys.get(tokenizer)
            if key is None:
                key = self._keys[tokenizer] = next(self._next_key)
            cache_key = (key, grammar.kind, json.dumps(grammar.source, sort_keys=True))
            answer = self._answers.get(cache_key)
            if answer is None:
                answer, lasting = self._ask(key, tokenizer, grammar)
                if lasting:
                    self._answers[cache_key] = answer
                    if len(self._answers) > CACHED:
                        self._answers.popitem(last=False)
            else:
                self._answers.move_to_end(cache_key)
        ok, text = answer
        if not ok:
            raise ConstraintError(grammar.where(text))
        return text

    def _ask(self, key: int, tokenizer: Any, grammar: Any) -> tuple[tuple[bool, str], bool]:
        """((ok, text or message), whether the answer lasts: a timeout depends on the machine's load)."""
        proc = self._start()
        try:
            if key not in self._sent:
                self._send(proc, ("tokenizer", key, pickle.dumps(tokenizer)))
                self._receive(proc, TOKENIZER_SECONDS)
                self._sent.add(key)
            self._send(proc, ("check", key, grammar.kind, grammar.source))
            return self._receive(proc, self.seconds), True
        except TimeoutError:
            self.stop()
            return (False, f"the {grammar.kind} grammar took longer than {self.seconds:g} s to compile (make it "
                    "smaller or simpler)"), False
        except (OSError, EOFError):  # the worker died: the grammar crashed the compiler
            self.stop()
            code = proc.returncode
            how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit status {code}"
            return (False, f"the {grammar.kind} grammar crashed the grammar compiler ({how}): it is too large or "
                    "nested too deeply"), True

    def _start(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the pyggml we are
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self._proc = subprocess.Popen([sys.executable, "-m", "pyggml.grammar_worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, close_fds=True)
        self._sent = set()
        return self._proc

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _send(self, proc: subprocess.Popen, message: tuple) -> None:
        data = pickle.dumps(message)
        proc.stdin.write(_HEADER.pack(len(data)) + data)
        proc.stdin.flush()

    def _receive(self, proc: subprocess.Popen, seconds: float) -> tuple[bool, str]:
        deadline = time.monotonic() + seconds
        fd = proc.stdout.fileno()

        def read(n: int) -> bytes:
            out = b""
            while len(out) < n:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError
                piece = os.read(fd, n - len(out))
                if not piece:
                    raise EOFError
                out += piece
            return out

        (size,) = _HEADER.unpack(read(_HEADER.size))
        return pickle.loads(read(size))


_worker = GrammarWorker()
atexit.register(_worker.stop)


def check(grammar: Any, tokenizer: Any) -> str:
    """llguidance's text of ``grammar``, compiled and checked in the worker process."""
    return _worker.check(grammar, tokenizer)


# ---- the worker's side ------------------------------------------------------------------------------
def _serve(inp: Any, out: Any) -> None:
    from pyggml.constrain import ConstraintError, Grammar, compile_here, ll_tokenizer

    tokenizers: dict[int, Any] = {}
    while header := inp.read(_HEADER.size):
        message = pickle.loads(inp.read(_HEADER.unpack(header)[0]))
        if message[0] == "tokenizer":
            tokenizers[message[1]] = pickle.loads(message[2])
            ll_tokenizer(tokenizers[message[1]])  # built now, not on the first grammar's time
            answer = (True, "")
        else:
            _, key, kind, source = message
            try:
                answer = (True, compile_here(Grammar(kind, source), tokenizers[key]))
            except ConstraintError as exc:
                answer = (False, str(exc))
        data = pickle.dumps(answer)
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()


def main() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    inp, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything native code prints goes to stderr, not into the answers
    threading.stack_size(STACK_BYTES)
    worker = threading.Thread(target=_serve, args=(inp, out))
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
