"""The runner's notify hand-off (``CompletionStream.set_notify`` / ``poll``), which the server's
event loop uses instead of a thread per stream: every chunk is announced, the end included, and at
most one notify per sequence per forward pass. Counts only, no timing."""

from __future__ import annotations

import threading

import pytest

from pyggml import BackendParams, models
from pyggml.runner import CompletionRequest, Runner
from pyggml.synthetic import write_synthetic


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("streaming") / "tiny.gguf", "tiny", "f32")
    model = models.load(path, BackendParams(n_threads=1))
    yield model
    model.close()


def _ban_eog(model) -> dict[int, float]:
    return {t: float("-inf") for t in model.tokenizer.vocab.eog}


def test_notify_announces_every_chunk_and_the_end(tiny):
    with Runner(tiny, parallel=3, num_ctx=128) as runner:
        streams, seen, calls = [], [], []
        for i in range(3):
            request = CompletionRequest(f"a b c {i}", max_tokens=12 + i, temperature=0, logit_bias=_ban_eog(tiny))
            alone = [c for c in runner.completion(request)]  # the same request read the blocking way
            ready = threading.Event()
            stream = runner.completion(request)
            calls.append(0)

            def notify(i=i, ready=ready):
                calls[i] += 1
                ready.set()

            stream.set_notify(notify)
            streams.append((stream, ready, alone))
        for i, (stream, ready, alone) in enumerate(streams):
            chunks = []
            while not chunks or not chunks[-1].done:
                chunk = stream.poll()
                if chunk is None:
                    assert ready.wait(60), "a chunk was queued without a notify"
                    ready.clear()
                    continue
                chunks.append(chunk)
            with pytest.raises(StopIteration):  # over: nothing after the end
                stream.poll()
            seen.append(chunks)
            assert [t for c in chunks for t in c.tokens] == [t for c in alone for t in c.tokens]
            assert chunks[-1].generated_tokens == 12 + i and chunks[-1].finish_reason == "length"
            assert stream.finished and stream.backlog == 0
            # one notify per forward pass at most (plus the one that may precede set_notify's chunks)
            assert 1 <= calls[i] <= chunks[-1].generated_tokens + 1


def test_a_notified_stream_is_cancelled_and_ends(tiny):
    with Runner(tiny, parallel=1, num_ctx=128) as runner:
        ready = threading.Event()
        stream = runner.completion(CompletionRequest("a b", max_tokens=-1, temperature=0,
                                                     logit_bias=_ban_eog(tiny)))
        stream.set_notify(ready.set)
        assert ready.wait(60)
        stream.cancel()
        assert stream.wait(60)
        last = None
        while last is None or not last.done:
            last = stream.poll()
            assert last is not None, "the end was queued before finished was set"
        assert last.finish_reason == "cancelled"
