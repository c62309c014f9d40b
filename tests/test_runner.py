"""Runner: continuous batching gives each request what it gets alone; prompt reuse across
requests; context shift; stops; cancellation; validation. On stories260K (when present) and on a
synthetic random-weight model (always)."""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest

from pyggml import BackendParams, models
from pyggml.backend import Context
from pyggml.input import Input
from pyggml.kvcache import Causal
from pyggml.runner import (
    CompletionRequest,
    EmbeddingsNotSupportedError,
    Runner,
    RunnerClosedError,
    count_common_prefix,
)
from pyggml.runner import runner as runner_module
from pyggml.runner.plugins import StepPlugin
from pyggml.runner.sequence import CompletionChunk, RunningSequence, TokenLogprob
from pyggml.synthetic import write_synthetic

from .conftest import SHARED_MODELS, chained_steps, hold_computes, record_calls

STORIES = SHARED_MODELS / "stories260K.gguf"


def load(path):
    return models.load(path, BackendParams(n_threads=1))


@pytest.fixture(scope="module")
def synthetic_path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("synthetic") / "tiny.gguf", "tiny", "f32")


@pytest.fixture(scope="module")
def stories_path():
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent")
    return STORIES


@pytest.fixture(params=["stories", "synthetic"])
def model_path(request):
    return request.getfixturevalue(f"{request.param}_path")


@pytest.fixture
def stories(stories_path):
    model = load(stories_path)
    yield model
    model.close()


def run(runner: Runner, prompt, **options):
    """(text, chunks) of one completion; greedy unless options say otherwise."""
    options.setdefault("temperature", 0.0)
    chunks = list(runner.completion(CompletionRequest(prompt, **options)))
    return "".join(c.text for c in chunks), chunks


def run_concurrently(runner: Runner, requests: list[dict]) -> list[tuple[str, list]]:
    results: list = [None] * len(requests)

    def work(i):
        results[i] = run(runner, **requests[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def tokens_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.tokens]


def slots_free(runner: Runner) -> bool:
    return all(not s.in_use for s in runner.input_cache.slots) and runner.active_sequences == 0


def test_a_streamed_chunk_is_the_chunk_its_fields_make():
    """``CompletionChunk.streamed`` sets three fields and leaves the rest to the class defaults: the result must
    equal (and print as) the chunk the constructor makes, and setting a field on it must not touch the class."""
    tokens, logprobs = [5, 6], [TokenLogprob(5, -0.5, [(5, -0.5)])]
    for args in (("ab", tokens), ("ab", tokens, logprobs)):
        made, streamed = CompletionChunk(*args), CompletionChunk.streamed(*args)
        assert streamed == made and repr(streamed) == repr(made)
        assert dataclasses.asdict(streamed) == dataclasses.asdict(made)
    streamed.done, streamed.finish_reason = True, "stop"
    assert streamed != made and CompletionChunk.streamed("", []).done is False
    assert CompletionChunk.streamed("", []).finish_reason is None and CompletionChunk().tokens == []


def test_completion_streams_text_then_a_final_chunk(stories):
    with Runner(stories, parallel=2, num_ctx=128, batch_size=32) as runner:
        text, chunks = run(runner, "Once upon a time", max_tokens=24)
    assert text.startswith(", there was a little girl named Lily.")
    assert len(chunks) > 2 and all(not c.done for c in chunks[:-1])
    last = chunks[-1]
    assert last.done and last.finish_reason == "length"
    assert last.generated_tokens == 24 and last.prompt_tokens == 5 and last.cached_tokens == 0
    assert stories.tokenizer.decode(tokens_of(chunks), continuation=True) == text
    assert last.timings.prompt_seconds > 0 and last.timings.generate_seconds > 0


@pytest.mark.parametrize("build_ahead", [True, False])
def test_concurrent_greedy_requests_match_each_request_alone(model_path, build_ahead):
    model = load(model_path)
    requests = [dict(prompt=p, max_tokens=n) for p, n in
                [("Once upon a time", 30), ("Lily went to the", 12), ("The cat", 25), ("Tom had a big red", 18)]]
    with Runner(model, parallel=4, num_ctx=128, batch_size=16, build_ahead=build_ahead) as runner:
        assert runner.build_ahead == build_ahead
        alone = [run(runner, **r) for r in requests]
        together = run_concurrently(runner, requests)
    model.close()
    for (text, chunks), (text2, chunks2) in zip(alone, together, strict=True):
        assert text2 == text and tokens_of(chunks2) == tokens_of(chunks)
        assert chunks2[-1].generated_tokens == chunks[-1].generated_tokens


def test_concurrent_seeded_requests_match_each_request_alone(model_path):
    model = load(model_path)
    requests = [dict(prompt="Once upon a time", max_tokens=20, temperature=1.0, top_k=0, top_p=1.0, seed=s)
                for s in (1, 2, 3)]
    with Runner(model, parallel=3, num_ctx=64, batch_size=16) as runner:
        alone = [run(runner, **r)[0] for r in requests]
        together = [text for text, _ in run_concurrently(runner, requests)]
    model.close()
    assert together == alone
    assert len(set(alone)) > 1  # different seeds, different samples


@pytest.mark.parametrize("multi_user", [True, False])
def test_a_shared_system_prompt_is_processed_once(stories, multi_user):
    system = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    prompts = [system + " One day", system + " Tom came", system + " The sun was"]
    ids = [stories.tokenizer.encode(p) for p in prompts]
    shared = min(count_common_prefix(ids[0], other) for other in ids[1:])  # count_common_prefix works on ints too
    assert shared > 20
    with Runner(stories, parallel=3, num_ctx=128, batch_size=32, multi_user_cache=multi_user) as runner:
        first = run(runner, prompts[0], max_tokens=8)
        if multi_user:
            later = run_concurrently(runner, [dict(prompt=p, max_tokens=8) for p in prompts[1:]])
        else:
            later = [run(runner, p, max_tokens=8) for p in prompts[1:]]
        fresh = [run(runner, p, max_tokens=8, cache_prompt=False) for p in prompts]
    assert first[1][-1].cached_tokens == 0
    for (_, chunks), prompt_ids in zip(later, ids[1:], strict=True):
        last = chunks[-1]
        assert last.prompt_tokens == len(prompt_ids) and last.cached_tokens == shared
    for (text, _), (fresh_text, fresh_chunks) in zip([first, *later], fresh, strict=True):
        assert text == fresh_text and fresh_chunks[-1].cached_tokens == 0


def test_a_repeated_prompt_reuses_all_but_its_last_token(stories):
    with Runner(stories, parallel=1, num_ctx=64, batch_size=16) as runner:
        a, _ = run(runner, "Once upon a time", max_tokens=6)
        b, chunks = run(runner, "Once upon a time", max_tokens=6)
    assert a == b and chunks[-1].cached_tokens == chunks[-1].prompt_tokens - 1


def test_context_shift_keeps_generating_past_num_ctx(stories):
    with Runner(stories, parallel=2, num_ctx=32, batch_size=16) as runner:
        _, long_ctx = run(runner, "Once upon a time", max_tokens=26)
        text, chunks = run(runner, "Once upon a time", max_tokens=80, cache_prompt=False)
        assert all(len(s.inputs) <= 32 for s in runner.input_cache.slots)
    assert chunks[-1].finish_reason == "length" and chunks[-1].generated_tokens == 80
    assert tokens_of(chunks)[:26] == tokens_of(long_ctx)  # identical until the first shift
    assert len(text) > len("".join(c.text for c in long_ctx))


def test_a_prompt_filling_the_whole_context_shifts_before_its_first_token(stories):
    prompt = stories.tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play "
                                      "outside in the park with her friends")[:32]
    with Runner(stories, parallel=1, num_ctx=32, batch_size=16) as runner:
        _, chunks = run(runner, prompt, max_tokens=5, num_keep=-1)  # keeps 31, the most it can
    assert len(prompt) == 32 and chunks[-1].generated_tokens == 5


@pytest.mark.parametrize("build_ahead", [True, False])
def test_concurrent_requests_with_shifts_and_cancels_match_solo_runs(stories, build_ahead):
    words = "Lily Tom park sun cat dog played little big red ball happy".split()
    requests = [dict(prompt="Once upon a time " + " ".join(words[i:i + 2 + i]), max_tokens=n, seed=i,
                     temperature=t, stop=stop)
                for i, (n, t, stop) in enumerate([(40, 0.0, ()), (6, 0.9, ()), (35, 0.9, ("park.",)),
                                                  (12, 0.0, ("Lily",)), (30, 0.0, ()), (45, 0.9, ())])]
    with Runner(stories, parallel=1, num_ctx=32, batch_size=8, build_ahead=False) as solo_runner:
        solo = [run(solo_runner, **r, cache_prompt=False) for r in requests]
    with Runner(stories, parallel=3, num_ctx=32, batch_size=8, build_ahead=build_ahead) as runner:
        cancelled = runner.completion(CompletionRequest("Once upon a time", max_tokens=-1))
        next(cancelled)
        together = run_concurrently(runner, requests)
        cancelled.close()
        assert cancelled.wait(30) and slots_free(runner)
    for (text, chunks), (text2, chunks2) in zip(solo, together, strict=True):
        assert (text2, chunks2[-1].finish_reason) == (text, chunks[-1].finish_reason)
    assert any(c[-1].generated_tokens + c[-1].prompt_tokens > 32 for _, c in solo)  # some shifted


def test_a_prefix_copied_on_admission_waits_for_the_step_in_flight(stories, monkeypatch):
    """A new request that forks a cached prefix copies cache cells (a compute on the backend): never while
    the build-ahead worker computes a step (its logits could be overwritten before they are read; over
    RPC two graphs interleaved on one connection and the servers dropped it)."""
    from pyggml.kvcache import causal
    from pyggml.runner.engine import Engine

    slow_compute = Engine.compute

    def compute(self, graph, *args, **kwargs):  # widen the window in which a step is in flight (and started)
        out = slow_compute(self, graph, *args, **kwargs)
        time.sleep(0.02)
        return out

    overlapping = []
    copy_cells = causal.Causal._copy_cells

    def checked_copy(self, copies):
        step = runner.in_flight
        overlapping.append(step is not None and step.future is not None and not step.future.done())
        return copy_cells(self, copies)

    monkeypatch.setattr(Engine, "compute", compute)
    monkeypatch.setattr(causal.Causal, "_copy_cells", checked_copy)
    with Runner(stories, parallel=2, num_ctx=128, batch_size=16, build_ahead=True) as runner:
        first = runner.completion(CompletionRequest("Once upon a time there was", max_tokens=40, temperature=0))
        next(first)
        second = list(runner.completion(CompletionRequest("Once upon a time there was a", max_tokens=4,
                                                          temperature=0)))
        list(first)
    assert second[-1].cached_tokens > 0 and overlapping and not any(overlapping)


def test_with_build_ahead_a_step_computes_while_the_previous_tokens_stream(stories, monkeypatch):
    """Issue 26 (overlap): once a step's tokens are sampled, the next step (built ahead) launches before
    they are detokenized, stop-matched and streamed, so that host work runs beside the device's; the
    output is what a runner without build-ahead gives (a stop string ends one sequence mid-way). The
    launch returns once the compute runs natively (before, the worker waited for this thread's GIL until
    it blocked), and the next step refills the graph in flight: computing one graph again keeps ggml's
    plan of it, where two graphs in turn were planned anew each step."""
    from pyggml.runner.engine import Engine
    from pyggml.runner.sequence import RunningSequence

    beside, native, computed = [], [], []
    accept, runner_compute, engine_compute = RunningSequence.accept, Runner._compute, Engine.compute

    def spying_accept(self, token, logits):
        step = runner.in_flight
        beside.append(step is not None and step.future is not None)
        if beside[-1]:
            native.append(getattr(step, "native", False))
        return accept(self, token, logits)

    def spying_runner_compute(self, step, started=None):
        class Started:  # the runner's event, noting when it is set
            def set(self):
                step.native = True
                started.set()
        return runner_compute(self, step, None if started is None else Started())

    def spying_engine_compute(self, graph, *args, **kwargs):
        computed.append(graph)
        return engine_compute(self, graph, *args, **kwargs)

    requests = [dict(prompt="Once upon a time", max_tokens=24), dict(prompt="Lily went to the", max_tokens=30,
                                                                     stop=["park"])]
    with Runner(stories, parallel=2, num_ctx=128, batch_size=16, build_ahead=False) as runner:
        plain = run_concurrently(runner, requests)
        built = runner.engine.built
    monkeypatch.setattr(RunningSequence, "accept", spying_accept)
    monkeypatch.setattr(Runner, "_compute", spying_runner_compute)
    monkeypatch.setattr(Engine, "compute", spying_engine_compute)
    fed = record_calls(monkeypatch, Runner, "_feed")
    with Runner(stories, parallel=2, num_ctx=128, batch_size=16, build_ahead=True) as runner:
        ahead = run_concurrently(runner, requests)
        assert runner.engine.built <= built + 1
    assert [(text, tokens_of(chunks)) for text, chunks in ahead] == \
        [(text, tokens_of(chunks)) for text, chunks in plain]
    assert plain[1][1][-1].finish_reason == "stop"
    assert sum(beside) > len(beside) // 2  # most tokens were taken while the next step computed
    assert all(native)  # ... which had begun its native compute
    # the sampled ids went into the next step in one write, before the sequences took them (not at the first
    # decode step, whose placeholders follow prompts, nor once the stop string ended a sequence)
    assert sum(fed) >= len(fed) - 3 and sum(fed) > 20
    again = sum(a is b for a, b in zip(computed, computed[1:], strict=False))
    assert again >= len(computed) - 1 - runner.engine.built  # a new graph only when built


@pytest.mark.parametrize("device_sampling", [False, True])
def test_on_a_slow_device_the_worker_samples_each_step_and_launches_the_next(stories, monkeypatch, device_sampling):
    """Build-ahead on a device slower than the host (each compute held 30 ms): the runner thread offers the step
    it built to the worker computing the one before (``Runner._chain``), which samples that one, writes the ids and
    launches the next itself, with no thread hand-off between the two computes. Greedy, seeded, stop-string and
    logprobs requests stream what the serial runner streams; a grammar request among them is served too (its
    steps are not chained: it takes its token on the runner thread first)."""
    requests = [dict(prompt="Once upon a time", max_tokens=40),
                dict(prompt="Lily went to the", max_tokens=24, stop=["park"]),
                dict(prompt="The dog", max_tokens=16, temperature=0.8, top_k=20, seed=7),
                dict(prompt="Tom had a", max_tokens=12, logprobs=2)]
    try:
        import llguidance  # noqa: F401

        from pyggml.constrain import Grammar
        requests.append(dict(prompt="Yes or no?", max_tokens=30, temperature=1.0, seed=5,
                             grammar=Grammar.regex(r"(yes|no): [a-c]{2,4}!")))
    except ImportError:  # (the other requests still test the chain)
        pass
    with Runner(stories, parallel=5, num_ctx=128, batch_size=16, build_ahead=False) as runner:
        plain = run_concurrently(runner, requests)
    hold_computes(monkeypatch, 0.03)
    chained = chained_steps(monkeypatch)
    with Runner(stories, parallel=5, num_ctx=128, batch_size=16, build_ahead=True,
                device_sampling=device_sampling) as runner:
        ahead = run_concurrently(runner, requests)
    assert [(text, tokens_of(chunks)) for text, chunks in ahead] == \
        [(text, tokens_of(chunks)) for text, chunks in plain]
    assert [c.logprobs for c in ahead[3][1] if c.logprobs] == [c.logprobs for c in plain[3][1] if c.logprobs]
    # all steps but the first and those while the grammar's runs (~10), barring a host slower than 30 ms a step
    assert sum(chained) > 10, "".join("x" if c else "." for c in chained)
    if len(requests) == 5:
        assert re.fullmatch(r"(yes|no): [a-c]{2,4}!", ahead[4][0])


def test_on_a_slow_device_the_chain_goes_on_after_a_sequence_stops(stories, monkeypatch):
    """A sequence that stops on a stop string still has a row in the step built before its stop was known (its
    placeholder's), which is not sampled: the worker writes the other rows' tokens into the next step and launches
    it all the same (``Runner._feed``), rather than handing the launch back to the runner thread. Every text is
    the serial runner's."""
    requests = [dict(prompt="Once upon a time", max_tokens=40, stop=["Lily"]),
                dict(prompt="Lily went to the", max_tokens=40, stop=["box"]),
                dict(prompt="The dog", max_tokens=40, stop=["ball"]),
                dict(prompt="Tom had a", max_tokens=40, stop=["toys"]),
                dict(prompt="Once upon a time", max_tokens=40)]
    with Runner(stories, parallel=5, num_ctx=128, batch_size=16, build_ahead=False) as runner:
        plain = run_concurrently(runner, requests)
    assert [chunks[-1].finish_reason for _, chunks in plain] == ["stop"] * 4 + ["length"]
    hold_computes(monkeypatch, 0.05)
    after_stops = []  # per step computed with a row whose sequence stopped and rows still going: whether it chained
    go_on = Runner._go_on

    def recorded(self, step, logits):
        stopped = [seq.done for _, seq in step.rows]
        out = go_on(self, step, logits)
        if any(stopped) and not all(stopped):
            after_stops.append(out[0] is not None)
        return out

    monkeypatch.setattr(Runner, "_go_on", recorded)
    with Runner(stories, parallel=5, num_ctx=128, batch_size=16, build_ahead=True, device_sampling=True) as runner:
        ahead = run_concurrently(runner, requests)
    assert [(text, tokens_of(chunks)) for text, chunks in ahead] == \
        [(text, tokens_of(chunks)) for text, chunks in plain]
    # (a host slower than the held 50 ms could miss a chain; none was taken before _feed skipped such rows)
    assert len(after_stops) >= 2 and sum(after_stops) > len(after_stops) / 2, after_stops


def test_build_ahead_does_not_hold_a_step_for_arrivals_while_sequences_generate(stories, monkeypatch):
    """A sequence that ends frees a slot, and its client's next request may be on its way; with build-ahead
    the loop still builds the next step of the sequences generating at once (on a device the step in flight
    would end and the device wait for that build; requests arriving meanwhile go into the step after).
    A burst that fills every slot starts at once too. The arrival waits are 20 s here: one taken shows."""
    monkeypatch.setattr(runner_module, "ARRIVAL_QUIET_S", 20.0)
    monkeypatch.setattr(runner_module, "ARRIVAL_WAIT_S", 20.0)
    hold_computes(monkeypatch, 0.02)
    with Runner(stories, parallel=3, num_ctx=128, batch_size=16, build_ahead=True) as runner:
        with runner._cond:  # (the loop sees the three requests together: a burst that fills the slots)
            streams = [runner.completion(CompletionRequest("Once upon a time", max_tokens=n, temperature=0.0))
                       for n in (8, 16, 24)]
        start = time.monotonic()
        generated = [[c.generated_tokens for c in stream][-1] for stream in streams]
        took = time.monotonic() - start
    assert generated == [8, 16, 24]
    assert took < 20.0, f"{took:.1f} s: the loop waited for arrivals while sequences were generating"


@pytest.mark.parametrize("device_sampling", [False, True])
def test_build_ahead_with_the_loop_thread_and_a_client_thread_each_gives_the_serial_texts(stories, device_sampling,
                                                                                          monkeypatch):
    """Build-ahead as a server runs it (the loop in its thread, a thread per client, 24 requests over 8 slots,
    stop strings, some cancelled after a few chunks) streams what one request at a time without build-ahead
    streams: the launch hand-shake, the refilled graph in flight and the ids written into it in one pass (rows
    whose sequence stopped meanwhile left out; or placeholder by placeholder, when a placeholder's sequence had no
    row in the step before) change no token."""
    import random

    fed = record_calls(monkeypatch, Runner, "_feed")
    rng = random.Random(5)
    requests = [dict(prompt=rng.choice(["Once upon a time", "Lily went to the", "The dog", "Tom had a"]),
                     max_tokens=rng.randint(1, 60), stop=rng.choice([[], ["park"], ["."], ["the", "a"]]),
                     temperature=0.0) for _ in range(24)]
    cancel_after = {i: rng.randint(1, 5) for i in range(0, 24, 5)}

    def texts(build_ahead: bool, background: bool) -> list[str]:
        out = [""] * len(requests)
        with Runner(stories, parallel=8, num_ctx=256, batch_size=64, build_ahead=build_ahead, background=background,
                    device_sampling=device_sampling) as runner:
            def one(i):
                stream = runner.completion(CompletionRequest(**requests[i]))
                for n, chunk in enumerate(stream, 1):
                    out[i] += chunk.text
                    if n == cancel_after.get(i):
                        stream.cancel()
                        break
            if background:
                clients = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
                for c in clients:
                    c.start()
                for c in clients:
                    c.join()
            else:
                for i in range(len(requests)):
                    one(i)
        return out

    serial = texts(build_ahead=False, background=False)
    assert texts(build_ahead=True, background=True) == serial
    assert sum(bool(t) for t in serial) > 20
    assert any(fed) and not all(fed)  # both ways of filling the placeholders ran


def test_context_shift_reprocesses_when_the_cache_cannot_shift(stories_path):
    model = load(stories_path)
    model.cache = Causal(None)  # a model without a key-shift function
    with Runner(model, parallel=1, num_ctx=32, batch_size=16) as runner:
        text, chunks = run(runner, "Once upon a time", max_tokens=60)
        slot = runner.input_cache.slots[0]
        assert 0 < len(slot.inputs) <= 32
    model.close()
    assert chunks[-1].generated_tokens == 60 and text


def test_stop_string_split_across_tokens_is_held_back_and_cut(stories):
    with Runner(stories, parallel=1, num_ctx=128, batch_size=32) as runner:
        whole, _ = run(runner, "Once upon a time", max_tokens=40)
        assert len(stories.tokenizer.encode(" girl named", add_special=False)) > 1
        text, chunks = run(runner, "Once upon a time", max_tokens=40, stop=["girl named", "zzz"])
        assert text == whole[:whole.index("girl named")]
        assert chunks[-1].finish_reason == "stop"
        assert not any("girl" in c.text for c in chunks)  # "girl" was held back, never sent
        text, _ = run(runner, "Once upon a time", max_tokens=40, stop="Lily")
        assert text == whole[:whole.index("Lily")]


def test_the_final_chunk_names_the_stop_string_that_ended_it(stories):
    """``stop_sequence`` (Anthropic's stop_reason "stop_sequence" needs it): the stop that ended the
    output, None for an end-of-generation token or the length limit."""
    with Runner(stories, parallel=1, num_ctx=128, batch_size=32) as runner:
        _, chunks = run(runner, "Once upon a time", max_tokens=40, stop=["zzz", "girl named", "girl"])
        assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_sequence == "girl"
        _, chunks = run(runner, "Once upon a time", max_tokens=40, stop=["zzz", " named"])
        assert chunks[-1].stop_sequence == " named"
        _, chunks = run(runner, "Once upon a time", max_tokens=4, stop=["zzz"])
        assert chunks[-1].finish_reason == "length" and chunks[-1].stop_sequence is None
        _, chunks = run(runner, "Once upon a time", max_tokens=4, logit_bias={stories.tokenizer.eos: 1000.0})
        assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_sequence is None


def test_end_of_generation_token_stops(model_path):
    model = load(model_path)
    eos = model.tokenizer.eos
    with Runner(model, parallel=1, num_ctx=64, batch_size=16) as runner:
        text, chunks = run(runner, "Once upon a time", max_tokens=10, logit_bias={eos: 1000.0})
    model.close()
    assert text == "" and chunks[-1].finish_reason == "stop" and chunks[-1].generated_tokens == 1
    assert tokens_of(chunks) == []


def test_logprobs_are_reported_per_token(stories):
    with Runner(stories, parallel=1, num_ctx=64, batch_size=16) as runner:
        _, chunks = run(runner, "Once upon a time", max_tokens=5, logprobs=3)
    entries = [lp for c in chunks for lp in (c.logprobs or [])]
    assert [e.token for e in entries] == tokens_of(chunks) and len(entries) == 5
    for e in entries:
        assert e.logprob <= 0 and len(e.top) == 3
        assert e.top[0][0] == e.token  # greedy picks the most likely
        assert [p for _, p in e.top] == sorted((p for _, p in e.top), reverse=True)


def test_max_tokens_zero_only_caches_the_prompt(stories):
    with Runner(stories, parallel=1, num_ctx=64, batch_size=16) as runner:
        text, chunks = run(runner, "Once upon a time, Lily", max_tokens=0)
        _, again = run(runner, "Once upon a time, Lily went", max_tokens=3)
    assert text == "" and chunks[-1].finish_reason == "length" and chunks[-1].generated_tokens == 0
    assert again[-1].cached_tokens == len(stories.tokenizer.encode("Once upon a time, Lily"))


def test_prompt_as_token_ids(stories):
    with Runner(stories, parallel=1, num_ctx=64, batch_size=16) as runner:
        by_text, _ = run(runner, "Once upon a time", max_tokens=8)
        by_ids, _ = run(runner, stories.tokenizer.encode("Once upon a time"), max_tokens=8)
    assert by_ids == by_text


def test_closing_the_stream_cancels_and_frees_the_slot(model_path):
    model = load(model_path)
    endless = {t: -100.0 for t in model.tokenizer.vocab.eog}  # a random model could pick one (rounding)
    with Runner(model, parallel=2, num_ctx=64, batch_size=16) as runner:
        stream = runner.completion(CompletionRequest("Once upon a time", max_tokens=-1, temperature=0,
                                                     logit_bias=endless))
        first = next(stream)
        assert not first.done
        stream.close()
        assert stream.wait(30) and slots_free(runner)
        with pytest.raises(StopIteration):
            next(stream)
        text, chunks = run(runner, "Once upon a time", max_tokens=4, logit_bias=endless)  # the runner goes on
        assert chunks[-1].finish_reason == "length"
    model.close()


def test_cancel_reports_a_cancelled_final_chunk(stories):
    with Runner(stories, parallel=1, num_ctx=64, batch_size=16) as runner:
        stream = runner.completion(CompletionRequest("Once upon a time", max_tokens=-1, temperature=0))
        chunks = [next(stream)]
        stream.cancel()
        chunks += list(stream)
        assert chunks[-1].done and chunks[-1].finish_reason == "cancelled"
        assert slots_free(runner)


def test_more_requests_than_parallel_wait_their_turn(stories):
    with Runner(stories, parallel=2, num_ctx=64, batch_size=16) as runner:
        results = run_concurrently(runner, [dict(prompt="Once upon a time", max_tokens=n) for n in (3, 5, 7, 9, 11)])
        blocker = runner.completion(CompletionRequest("Lily", max_tokens=-1))
        waiting = [runner.completion(CompletionRequest("Tom", max_tokens=-1)) for _ in range(2)]
        waiting[1].cancel()  # cancelled before it got a slot
        assert waiting[1].wait(30)
        blocker.close()
        waiting[0].close()
        assert blocker.wait(30) and waiting[0].wait(30) and slots_free(runner)
    assert [r[1][-1].generated_tokens for r in results] == [3, 5, 7, 9, 11]
    assert [c.finish_reason for c in waiting[1]][-1] == "cancelled"


def test_an_error_in_one_sequence_fails_only_that_sequence(stories):
    banned = {t: float("-inf") for t in range(stories.tokenizer.vocab_size)}
    with Runner(stories, parallel=2, num_ctx=64, batch_size=16) as runner:
        other = runner.completion(CompletionRequest("Once upon a time", max_tokens=20, temperature=0))
        with pytest.raises(ValueError, match="every token has logit -inf"):
            list(runner.completion(CompletionRequest("Lily", logit_bias=banned)))
        assert [c.finish_reason for c in other][-1] == "length"
        assert slots_free(runner)


@pytest.mark.parametrize("build_ahead", [False, True])
def test_a_failed_compute_fails_the_running_sequences_and_the_runner_goes_on(stories, monkeypatch, build_ahead):
    """(With build-ahead the computes are slowed so that the worker launches the steps itself, ``_chain``: the
    one that fails is such a step, and the runner had built the next one on its graph.)"""
    compute = Context.compute
    calls = []

    def flaky(self, *tensors, **options):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("compute failed: simulated")
        out = compute(self, *tensors, **options)
        if build_ahead:  # a slow device: the runner thread waits for the step, offering the next one
            time.sleep(0.05)
        return out

    monkeypatch.setattr(Context, "compute", flaky)
    chained = chained_steps(monkeypatch)
    with Runner(stories, parallel=2, num_ctx=64, batch_size=16, build_ahead=build_ahead) as runner:
        with pytest.raises(RuntimeError, match="simulated"):
            list(runner.completion(CompletionRequest("Once upon a time", max_tokens=10)))
        assert slots_free(runner) and all(s.inputs == [] for s in runner.input_cache.slots)
        assert any(chained) == build_ahead  # the worker launched steps (the one that failed among them)
        text, chunks = run(runner, "Once upon a time", max_tokens=24)
    assert text.startswith(", there was a little girl named Lily.") and chunks[-1].cached_tokens == 0


@pytest.mark.parametrize("options, match", [
    (dict(prompt=""), "empty prompt"),
    (dict(prompt=[]), "empty prompt"),
    (dict(prompt="Lily " * 200), "does not fit the context of 64"),
    (dict(prompt=[1, 99999]), "token ids out of range"),
    (dict(prompt=3.5), "prompt must be a string or a list of token ids"),
    (dict(prompt="Lily", top_p=2.0), "top_p"),
    (dict(prompt="Lily", temperature=float("nan")), "temperature"),
    (dict(prompt="Lily", max_tokens=-2), "max_tokens must be an int >= -1"),
    (dict(prompt="Lily", logprobs=21), "logprobs must be an int in 0..20"),
    (dict(prompt="Lily", num_keep=-5), "num_keep"),
    (dict(prompt="Lily", stop=[1]), "stop must be a string or a list of strings"),
    (dict(prompt="Lily", logit_bias={99999: 1.0}), "logit_bias keys"),
    (dict(prompt="Lily", seed=-1), "seed must be an int >= 0"),
    (dict(prompt="Lily", top_k="many"), "bad sampling option|top_k"),
])
def test_bad_requests_are_value_errors(stories, options, match):
    with Runner(stories, parallel=1, num_ctx=64, batch_size=16) as runner:
        with pytest.raises(ValueError, match=match):
            runner.completion(CompletionRequest(**options))
        assert slots_free(runner)


def test_runner_options_are_checked(stories):
    with pytest.raises(ValueError, match="parallel must be an int >= 1"):
        Runner(stories, parallel=0)
    with pytest.raises(ValueError, match="num_ctx"):
        Runner(stories, num_ctx=1)


def test_reserve_fails_fast_with_a_clear_error(stories, monkeypatch):
    def no_memory(self):
        raise MemoryError("could not reserve memory for the graph")

    monkeypatch.setattr(Context, "reserve", no_memory)
    with pytest.raises(MemoryError, match="not enough memory for 2 sequences of 64 tokens and batches of 16"):
        Runner(stories, parallel=2, num_ctx=64, batch_size=16)


def test_embedding_is_not_supported_yet(stories):
    with Runner(stories, parallel=1, num_ctx=64, batch_size=16) as runner:
        with pytest.raises(EmbeddingsNotSupportedError, match="no embedding output"):
            runner.embedding("hello")
        assert isinstance(EmbeddingsNotSupportedError("x"), NotImplementedError)


def test_close_stops_the_loop_and_refuses_new_requests(stories):
    runner = Runner(stories, parallel=1, num_ctx=64, batch_size=16)
    stream = runner.completion(CompletionRequest("Once upon a time", max_tokens=-1))
    next(stream)
    runner.close()
    assert not runner._thread.is_alive()
    assert [c.finish_reason for c in stream][-1] == "cancelled"
    with pytest.raises(RunnerClosedError):
        runner.completion(CompletionRequest("Lily"))


def test_streamed_text_waits_for_whole_utf8_characters(synthetic_path):
    model = load(synthetic_path)
    tok = model.tokenizer
    seq = RunningSequence(CompletionRequest("x"), [Input(token=1)], tok, stops=[], num_keep=0)
    euro = [tok.vocab.tokens.index(f"<0x{b:02X}>") for b in "€".encode()]
    for t in euro[:-1]:
        assert seq.accept(t, None) is None and seq.out.empty()
    seq.accept(euro[-1], None)
    chunk = seq.out.get()
    assert chunk.text == "€" and chunk.tokens == euro
    model.close()


def test_decode_tokens_are_packed_by_slot(stories, monkeypatch):
    """Decode tokens lead each batch in slot order whatever order the requests came in, so that
    their sequences attend as one group over their own KV streams (kvcache.Causal)."""
    with Runner(stories, parallel=3, num_ctx=128, batch_size=32) as runner:
        batches = []
        build = runner.engine.build
        monkeypatch.setattr(runner.engine, "build", lambda batch, *a, **k: batches.append(list(batch.sequences))
                            or build(batch, *a, **k))
        results = run_concurrently(runner, [dict(prompt=f"Once upon a time {i}", max_tokens=n)
                                            for i, n in enumerate((2, 9, 4, 12, 3, 8, 5, 10))])
    assert [r[1][-1].generated_tokens for r in results] == [2, 9, 4, 12, 3, 8, 5, 10]
    several = 0
    for seqs in batches:
        counts = {s: seqs.count(s) for s in seqs}
        lead = []
        for s in seqs:
            if counts[s] > 1:
                break
            lead.append(s)
        assert lead == sorted(lead), seqs
        several += len(lead) > 1
    assert several > 5  # many steps decoded several sequences at once


def test_a_burst_of_requests_starts_its_prompts_in_one_step(stories, monkeypatch):
    """While a request is on its way (``Runner.arriving``: a server rendering its template), the
    loop holds a batch that would start new prompts with slots free, so the requests of a burst
    share one prompt step instead of the later ones waiting through the first one's."""
    monkeypatch.setattr(runner_module, "ARRIVAL_WAIT_S", 30.0)  # the test's pause, not the bound, decides
    with Runner(stories, parallel=4, num_ctx=128, batch_size=64) as runner:
        batches = []
        build = runner.engine.build
        monkeypatch.setattr(runner.engine, "build", lambda batch, *a, **k: batches.append(list(batch.sequences))
                            or build(batch, *a, **k))
        with runner.arriving():
            first = runner.completion(CompletionRequest("Once upon a time", max_tokens=3, temperature=0.0))
            time.sleep(0.3)  # the first request waits in the queue; the loop must not start it alone
            second = runner.completion(CompletionRequest("The little dog", max_tokens=3, temperature=0.0))
        assert [c.generated_tokens for c in first][-1] == 3 and [c.generated_tokens for c in second][-1] == 3
    assert len(set(batches[0])) == 2, batches[:3]


def test_a_request_that_never_arrives_holds_the_loop_only_briefly(stories, monkeypatch):
    """An ``arriving`` mark that is never followed by a request (a template rendering for
    seconds) delays batches by at most ARRIVAL_WAIT_S after it was made, not every step."""
    monkeypatch.setattr(runner_module, "ARRIVAL_WAIT_S", 1.0)
    with Runner(stories, parallel=4, num_ctx=128, batch_size=64) as runner, runner.arriving():
        start = time.monotonic()
        _, chunks = run(runner, "Once upon a time", max_tokens=12)
        took = time.monotonic() - start
    assert chunks[-1].generated_tokens == 12
    assert took < 6.0, f"{took:.1f} s: the mark held up more than its one second"  # 12 s if every step waited


@pytest.mark.parametrize("build_ahead", [True, False])
def test_decode_steps_recompute_kept_graphs(stories, monkeypatch, build_ahead):
    """Decode steps of the same shape refill a kept graph instead of building one (two graphs
    alternate with build-ahead: one computes while the other is refilled), and the text is the
    same as without any reuse."""
    with Runner(stories, parallel=1, num_ctx=256, batch_size=16, build_ahead=build_ahead) as runner:
        runner.engine.keep = 0  # every step builds its graph
        reference, chunks = run(runner, "Once upon a time", max_tokens=60)
        assert runner.engine.reused == 0
    assert chunks[-1].generated_tokens == 60, "the reference must run all 60 steps"
    built = []
    new_context = stories.backend.new_context
    monkeypatch.setattr(stories.backend, "new_context", lambda *a, **k: built.append(1) or new_context(*a, **k))
    with Runner(stories, parallel=1, num_ctx=256, batch_size=16, build_ahead=build_ahead) as runner:
        text, _ = run(runner, "Once upon a time", max_tokens=60)
        # the prompt and 59 decode steps (the 60th token is not fed back)
        assert runner.engine.reused >= 48 and runner.engine.built + runner.engine.reused == 60
    assert text == reference
    # 60 steps; new graphs only for the prompt, the first decode steps and each time n_kv grows
    assert len(built) <= 12, f"{len(built)} graphs built for 60 tokens"


def test_build_ahead_defaults_to_gpus_only(stories):
    with Runner(stories, parallel=1, num_ctx=64, batch_size=8) as runner:
        assert runner.build_ahead is stories.backend.has_gpu


class Recorder(StepPlugin):
    """A step plug-in the loop knows nothing of (a recurrent-state checkpoint would hook in here): it records
    the hooks it is called with."""

    def __init__(self):
        self.events = []

    def before_build(self):
        self.events.append(("before", None, None))

    def launched(self, step):
        self.events.append(("launched", id(step), len(step.tokens)))

    def after_logits(self, step, logits):
        self.events.append(("logits", id(step), None if logits is None else len(logits)))


@pytest.mark.parametrize("build_ahead", [True, False])
def test_a_step_plug_in_sees_every_step_without_changing_the_loop(synthetic_path, build_ahead):
    """A plug-in added to ``Runner.plugins`` is called before each batch is packed, when each step launches and
    once each step's logits are read (in launch order, with or without build-ahead); one that only watches
    changes no token."""
    model = load(synthetic_path)
    no_end = {t: float("-inf") for t in model.tokenizer.vocab.eog}
    try:
        with Runner(model, parallel=2, num_ctx=64, batch_size=4, build_ahead=build_ahead) as runner:
            plain, _ = run(runner, "Once upon a time there was", max_tokens=6, logit_bias=no_end, cache_prompt=False)
        with Runner(model, parallel=2, num_ctx=64, batch_size=4, build_ahead=build_ahead) as runner:
            recorder = Recorder()
            runner.plugins.append(recorder)  # before any request: the loop is idle
            text, chunks = run(runner, "Once upon a time there was", max_tokens=6, logit_bias=no_end,
                               cache_prompt=False)
    finally:
        model.close()
    assert text == plain and chunks[-1].generated_tokens == 6
    launched = [step for kind, step, _ in recorder.events if kind == "launched"]
    completed = [step for kind, step, _ in recorder.events if kind == "logits"]
    assert launched == completed and len(launched) > 6  # prompt chunks of 4, then 5 decode steps
    assert sum(rows is not None for kind, _, rows in recorder.events if kind == "logits") == 6  # one per token
    kinds = [kind for kind, _, _ in recorder.events]
    assert kinds[0] == "before" and kinds.count("before") >= len(launched)


class _PlannedSeq:
    """What a row plan reads of a sequence (compared by identity, as a RunningSequence is)."""

    def __init__(self, greedy: bool = True):
        self.top_need, self.sampler, self.greedy = 1, object(), greedy


def test_a_step_with_the_last_steps_rows_reuses_their_plan():
    """``Runner._plan``: the same (row, sequence) pairs as the last step's (the usual decode step) get the same
    plan; any other rows (another sequence, or the same ones at other rows) get their own."""
    a, b, c = _PlannedSeq(), _PlannedSeq(), _PlannedSeq(greedy=False)
    runner = type("R", (), {"_last_plan": None})()
    first = Runner._plan(runner, [(0, a), (1, b)])
    assert Runner._plan(runner, [(0, a), (1, b)]) is first and first.greedy
    other = Runner._plan(runner, [(0, a), (1, c)])
    assert other is not first and other.samplers == [a.sampler, c.sampler] and not other.greedy
    assert Runner._plan(runner, [(1, a), (2, c)]).pick == slice(1, 3)
