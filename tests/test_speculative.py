"""Speculative decoding with prompt lookup: greedy output identical to one-token-at-a-time decoding
(alone and among other sequences), rejection sampling that leaves the sampled distribution exactly
the sampler's (chi-square on a small vocabulary), the cache rolled back past rejected drafts,
max_tokens kept, and grammar constraints checked on drafted tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pyggml import BackendParams, models
from pyggml.runner import CompletionRequest, Runner
from pyggml.runner.speculative import lookup_draft, verify_token
from pyggml.sample import Sampler
from pyggml.synthetic import write_synthetic

from .conftest import SHARED_MODELS

PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
          "One day, Lily saw a big red ball in the park. Lily said, ")


def test_lookup_draft():
    assert lookup_draft([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # "1 2" recurs: what followed it
    assert lookup_draft([5, 1, 2, 9, 7, 1, 2], 2) == [9, 7]
    assert lookup_draft([1, 2, 3], 4) == []
    assert lookup_draft([7, 8, 7, 8, 7], 5) == [8, 7]  # the latest earlier match
    assert lookup_draft([4, 4], 0) == [] and lookup_draft([4], 3) == []


def _lookup_reference(history, k, ngram_max=3, ngram_min=1):
    for n in range(min(ngram_max, len(history) - 1), ngram_min - 1, -1):
        suffix = history[len(history) - n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + k]
    return []


def test_lookup_draft_matches_a_plain_scan():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        history = rng.integers(0, int(rng.integers(1, 6)), size=int(rng.integers(0, 40))).tolist()
        k, top = int(rng.integers(0, 6)), int(rng.integers(1, 5))
        want = _lookup_reference(history, k, top) if k > 0 and len(history) >= 2 else []
        assert lookup_draft(history, k, top) == want, (history, k, top)


@pytest.fixture(scope="module", params=["stories", "synthetic"])
def runner(request, tmp_path_factory):
    if request.param == "synthetic":
        path = write_synthetic(tmp_path_factory.mktemp("spec") / "tiny.gguf", "tiny", "f32")
    else:
        path = SHARED_MODELS / "stories260K.gguf"
        if not path.exists():
            pytest.skip(f"{path} is not there")
    model = models.load(path, BackendParams(n_threads=1))
    r = Runner(model, parallel=4, num_ctx=512, batch_size=64)
    yield r
    r.close()
    model.close()


def tokens(runner, **options):
    chunks = list(runner.completion(CompletionRequest(prompt=PROMPT, **options)))
    return [t for c in chunks for t in c.tokens], chunks[-1]


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_is_identical(runner, k):
    eog = {t: float("-inf") for t in runner.tokenizer.vocab.eog}
    plain, _ = tokens(runner, max_tokens=120, temperature=0, logit_bias=eog, cache_prompt=False)
    spec, last = tokens(runner, max_tokens=120, temperature=0, logit_bias=eog, cache_prompt=False, prompt_lookup=k)
    assert spec == plain and last.generated_tokens == 120
    assert last.draft_tokens > 0 and 0 <= last.accepted_tokens <= last.draft_tokens
    again, _ = tokens(runner, max_tokens=120, temperature=0, logit_bias=eog, prompt_lookup=k)  # reuses the cache
    assert again == plain


def test_several_speculating_sequences_at_once(runner):
    eog = {t: float("-inf") for t in runner.tokenizer.vocab.eog}
    prompts = [PROMPT, PROMPT + "Hello", "Lily and Ben went to the park. Lily and Ben", PROMPT[:40]]
    alone = []
    for p in prompts:
        chunks = list(runner.completion(CompletionRequest(prompt=p, max_tokens=60, temperature=0, logit_bias=eog)))
        alone.append([t for c in chunks for t in c.tokens])
    streams = [runner.completion(CompletionRequest(prompt=p, max_tokens=60, temperature=0, logit_bias=eog,
                                                   prompt_lookup=6 if i % 2 == 0 else 3 * i, cache_prompt=False))
               for i, p in enumerate(prompts)]
    together = [[t for c in s for t in c.tokens] for s in streams]
    assert together == alone
    assert runner.prompt_lookups == 0  # (counted while they ran: the runner looks for drafts only then)


def test_sampled_speculation_keeps_max_tokens_and_seeds(runner):
    a, last = tokens(runner, max_tokens=50, temperature=0.9, seed=3, prompt_lookup=5, cache_prompt=False)
    b, _ = tokens(runner, max_tokens=50, temperature=0.9, seed=3, prompt_lookup=5, cache_prompt=False)
    assert a == b and last.generated_tokens <= 50


def test_constrained_speculation(runner):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"a": {"enum": ["Lily", "Ben", "park"]},
                                               "b": {"type": "array", "items": {"enum": ["Lily", "ball"]},
                                                     "maxItems": 6}}, "required": ["a", "b"]}
    plain, _ = tokens(runner, max_tokens=200, temperature=0, format=schema, cache_prompt=False)
    spec, last = tokens(runner, max_tokens=200, temperature=0, format=schema, cache_prompt=False, prompt_lookup=6)
    assert spec == plain
    text = runner.tokenizer.decode(spec)
    assert set(json.loads(text)) == {"a", "b"}
    sampled, _ = tokens(runner, max_tokens=200, temperature=1.0, seed=4, format=schema, prompt_lookup=6)
    assert set(json.loads(runner.tokenizer.decode(sampled))) == {"a", "b"}


@pytest.mark.parametrize("options", [dict(temperature=1.0, top_k=0, top_p=1.0),
                                     dict(temperature=0.7, top_k=5, top_p=0.9)])
@pytest.mark.parametrize("draft", [2, 7, 11])
def test_rejection_sampling_keeps_the_distribution(options, draft):
    """verify_token's output over many draws against the sampler's own distribution (chi-square,
    fixed seeds: deterministic)."""
    logits = np.random.default_rng(0).normal(size=12).astype(np.float32) * 1.5
    sampler = Sampler(seed=1, **options)
    ids, probs = sampler.distribution(logits)
    expected = np.zeros(logits.size)
    expected[ids] = probs
    n = 20000
    counts = np.bincount([verify_token(sampler, logits, [], draft) for _ in range(n)], minlength=logits.size)
    seen = expected > 0
    assert counts[~seen].sum() == 0  # nothing outside the sampler's support
    chi2 = float((((counts - n * expected) ** 2)[seen] / (n * expected[seen])).sum())
    df = int(seen.sum()) - 1
    assert chi2 < df + 5 * np.sqrt(2 * df) + 10, (chi2, df)  # far beyond the 99.9th percentile otherwise
    # and the draft is accepted with its own probability (not always, not never)
    if draft in ids:
        assert abs(counts[draft] / n - expected[draft]) < 0.02


def test_bad_prompt_lookup(runner):
    with pytest.raises(ValueError, match="prompt_lookup"):
        runner.completion(CompletionRequest(prompt="a", prompt_lookup=-1))


# ---- a draft model ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    """A random-weight target (F32) and the same weights in Q8_0 as its draft."""
    folder = tmp_path_factory.mktemp("draft")
    target = models.load(write_synthetic(folder / "t.gguf", "tiny", "f32", seed=5), BackendParams(n_threads=1))
    draft = models.load(write_synthetic(folder / "d.gguf", "tiny", "q8_0", seed=5), BackendParams(n_threads=1))
    yield target, draft
    target.close()
    draft.close()


def test_draft_model_greedy_equivalence_with_several_sequences(target_and_draft):
    target, draft = target_and_draft
    eog = {t: float("-inf") for t in target.tokenizer.vocab.eog}
    prompts = ["hello world", "one two three four", "a b c"]

    def run(runner, p):
        return runner.completion(CompletionRequest(prompt=p, max_tokens=40, temperature=0, logit_bias=eog))

    with Runner(target, parallel=3, num_ctx=256, batch_size=64) as plain:
        alone = [[t for c in run(plain, p) for t in c.tokens] for p in prompts]
    with Runner(target, parallel=3, num_ctx=256, batch_size=64, draft=draft, draft_max=5) as spec:
        streams = [run(spec, p) for p in prompts]
        chunks = [list(s) for s in streams]
    assert [[t for c in cs for t in c.tokens] for cs in chunks] == alone
    drafted = sum(cs[-1].draft_tokens for cs in chunks)
    accepted = sum(cs[-1].accepted_tokens for cs in chunks)
    assert drafted > 0 and accepted > drafted // 2  # the same weights at 8 bits mostly agree


def test_draft_model_must_share_the_vocabulary(target_and_draft):
    target, _ = target_and_draft
    path = SHARED_MODELS / "stories260K.gguf"
    if not path.exists():
        pytest.skip("no stories260K")
    other = models.load(path, BackendParams(n_threads=1))
    try:
        with pytest.raises(models.ModelError, match="same vocabulary"):
            Runner(target, parallel=1, num_ctx=64, draft=other)
    finally:
        other.close()


def test_llm_load_with_a_draft(tmp_path):
    import pyggml
    path = write_synthetic(tmp_path / "t.gguf", "tiny", "f32", seed=2)
    with pyggml.load(path, n_threads=1, num_ctx=128) as plain:
        want = plain.generate("hello", 20, temperature=0)
    with pyggml.load(path, n_threads=1, num_ctx=128, draft=path, draft_max=4) as llm:
        assert llm.generate("hello", 20, temperature=0) == want


# ---- build-ahead (a GPU's default loop) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def stories():
    path = SHARED_MODELS / "stories260K.gguf"
    if not path.exists():
        pytest.skip(f"{path} is not there")
    model = models.load(path, BackendParams(n_threads=1))
    yield model
    model.close()


def _text_tokens(stream):
    return [t for c in stream for t in c.tokens]


def test_speculation_with_build_ahead_chooses_per_step(stories, monkeypatch):
    """Build-ahead forced on: speculating and plain sequences together give the greedy output of
    each alone; a batch is built while another computes only when no sequence sampled in the one
    computing speculates (its draft needs the sampled token)."""
    eog = {t: float("-inf") for t in stories.tokenizer.vocab.eog}
    prompts = [PROMPT, "Lily and Ben went to the park. Lily and Ben", PROMPT[:60], "Once upon a time"]
    with Runner(stories, parallel=1, num_ctx=512, batch_size=64, build_ahead=False) as solo:
        alone = [_text_tokens(solo.completion(CompletionRequest(prompt=p, max_tokens=60, temperature=0,
                                                                logit_bias=eog, cache_prompt=False)))
                 for p in prompts]
    builds = []
    original = Runner._build

    def build(self):
        in_flight = self._in_flight
        builds.append(None if in_flight is None else self.speculation.drafts_after(in_flight))
        return original(self)

    monkeypatch.setattr(Runner, "_build", build)
    with Runner(stories, parallel=4, num_ctx=512, batch_size=64, build_ahead=True) as runner:
        assert runner.build_ahead
        plain = _text_tokens(runner.completion(CompletionRequest(prompt=prompts[3], max_tokens=30, temperature=0,
                                                                 logit_bias=eog, cache_prompt=False)))
        assert plain == alone[3][:30] and builds.count(False) > 10  # alone and plain: it builds ahead
        builds.clear()
        streams = [runner.completion(CompletionRequest(prompt=p, max_tokens=60, temperature=0, logit_bias=eog,
                                                       cache_prompt=False, prompt_lookup=(5, 0, 3, 0)[i]))
                   for i, p in enumerate(prompts)]
        chunks = [list(s) for s in streams]
    assert [[t for c in cs for t in c.tokens] for cs in chunks] == alone
    assert chunks[0][-1].draft_tokens > 0 and chunks[2][-1].draft_tokens > 0
    assert True not in builds  # never built beside a batch whose sampled sequences draft next


def test_draft_model_with_build_ahead(target_and_draft):
    target, draft = target_and_draft
    eog = {t: float("-inf") for t in target.tokenizer.vocab.eog}
    prompts = ["hello world", "one two three four"]

    def run(runner, p):
        return runner.completion(CompletionRequest(prompt=p, max_tokens=30, temperature=0, logit_bias=eog))

    with Runner(target, parallel=2, num_ctx=256, batch_size=64, build_ahead=False) as plain:
        alone = [_text_tokens(run(plain, p)) for p in prompts]
    with Runner(target, parallel=2, num_ctx=256, batch_size=64, draft=draft, draft_max=4, build_ahead=True) as spec:
        assert spec.build_ahead
        streams = [run(spec, p) for p in prompts]
        chunks = [list(s) for s in streams]
    assert [[t for c in cs for t in c.tokens] for cs in chunks] == alone
    assert sum(cs[-1].accepted_tokens for cs in chunks) > 0


@pytest.mark.parametrize("build_ahead", [False, True])
def test_constrained_speculation_masks_beside_the_graph(stories, monkeypatch, build_ahead):
    """Constrained + speculative: greedy output equal to plain constrained decoding, always parsing,
    and the masks of the drafted rows computed in the grammar worker (while the graph computes),
    not on the loop thread after it."""
    pytest.importorskip("llguidance")
    import threading

    from pyggml.constrain import Constraint

    schema = {"type": "object", "properties": {"a": {"enum": ["Lily", "Ben", "park"]},
                                               "b": {"type": "array", "items": {"enum": ["Lily", "ball"]},
                                                     "maxItems": 6}}, "required": ["a", "b"]}
    threads = []
    original = Constraint.compute_mask

    def compute_mask(self):
        threads.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(Constraint, "compute_mask", compute_mask)
    with Runner(stories, parallel=2, num_ctx=512, batch_size=64, build_ahead=build_ahead) as runner:
        plain = _text_tokens(runner.completion(CompletionRequest(prompt=PROMPT, max_tokens=200, temperature=0,
                                                                 format=schema, cache_prompt=False)))
        threads.clear()
        chunks = list(runner.completion(CompletionRequest(prompt=PROMPT, max_tokens=200, temperature=0, format=schema,
                                                          cache_prompt=False, prompt_lookup=6)))
        spec = [t for c in chunks for t in c.tokens]
        assert spec == plain and chunks[-1].accepted_tokens > 0
        assert set(json.loads(stories.tokenizer.decode(spec))) == {"a", "b"}
        assert threads and all(name.startswith("pyggml-grammar") for name in threads)
        for seed in range(3):  # sampled, speculative and constrained: still parses
            out = list(runner.completion(CompletionRequest(prompt=PROMPT, max_tokens=200, temperature=1.0, seed=seed,
                                                           format=schema, prompt_lookup=4)))
            assert set(json.loads(stories.tokenizer.decode([t for c in out for t in c.tokens]))) == {"a", "b"}


def test_draft_model_constrained_with_build_ahead(target_and_draft):
    """A random-weight target (gibberish unconstrained) with its Q8_0 draft, build-ahead on, two
    constrained sequences at once: greedy output equals plain constrained decoding and parses;
    sampled output parses too."""
    pytest.importorskip("llguidance")
    target, draft = target_and_draft
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tags": {"type": "array", "items": {"enum": ["a", "bc"]},
                                                        "maxItems": 4}}, "required": ["n", "tags"]}
    prompts = ["hello world", "one two three four"]

    def run(runner, p, **options):
        return runner.completion(CompletionRequest(prompt=p, max_tokens=120, format=schema, **options))

    with Runner(target, parallel=2, num_ctx=256, batch_size=64, build_ahead=False) as plain:
        alone = [_text_tokens(run(plain, p, temperature=0)) for p in prompts]
    with Runner(target, parallel=2, num_ctx=256, batch_size=64, draft=draft, draft_max=4, build_ahead=True) as spec:
        streams = [run(spec, p, temperature=0) for p in prompts]
        together = [_text_tokens(s) for s in streams]
        sampled = [_text_tokens(run(spec, p, temperature=1.0, seed=i, top_k=0, top_p=1.0))
                   for i, p in enumerate(prompts)]
    assert together == alone
    for out in together + sampled:
        assert set(json.loads(target.tokenizer.decode(out))) == {"n", "tags"}


def test_sampled_speculation_is_the_same_with_build_ahead(stories):
    """Seeded sampling with prompt lookup: the same tokens whether the runner builds ahead or not
    (each speculating step sees the same history, drafts and random draws)."""
    outs = []
    for build_ahead in (False, True):
        with Runner(stories, parallel=2, num_ctx=512, batch_size=64, build_ahead=build_ahead) as runner:
            streams = [runner.completion(CompletionRequest(prompt=PROMPT, max_tokens=50, temperature=0.8, seed=s,
                                                           prompt_lookup=5, cache_prompt=False)) for s in (1, 2)]
            outs.append([_text_tokens(s) for s in streams])
    assert outs[0] == outs[1] and all(outs[0])
