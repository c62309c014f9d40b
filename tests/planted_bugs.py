"""Plant known bugs one at a time in a copy of the repository and check that the tests meant to catch
each one fail (a hand-written mutation run; see tests/README.md). Not a test module, not run in CI.

    python -m tests.planted_bugs                # every bug; a table of caught / MISSED / stale
    python -m tests.planted_bugs --list         # the bugs and their target tests
    python -m tests.planted_bugs -b top-p-64 -b make-model-type   # only these
    python -m tests.planted_bugs --baseline     # first check the targets pass on the unmodified copy
    python -m tests.planted_bugs --check        # only check that every bug still applies (no tests run)

A bug is "caught" when pytest fails on its target tests (exit status 1, or the process crashed),
"MISSED" when they pass,
"stale" when its text is no longer in the source (update the entry), "error" for anything else
(e.g. the tests could not be collected). The exit status is 0 only if every bug was caught.

Add an entry whenever a review finds a bug the suite let through: the smallest edit that reproduces
it, and the tests that now catch it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


@dataclass(frozen=True)
class Bug:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    targets: tuple[str, ...]  # pytest node ids or files
    what: str = ""


HTTP = "tests/test_http_options.py"
BUGS = [
    Bug("openai-stop-dropped", "src/pyggml/server/params.py",
        '    if f.has("stop"):\n        out["stop"] = f.stops("stop")\n    bias = f.mapping("logit_bias")',
        '    f.stops("stop")\n    bias = f.mapping("logit_bias")',
        (f"{HTTP}::test_stop_string_ends_the_text",), "the server silently drops OpenAI `stop`"),
    Bug("openai-seed-dropped", "src/pyggml/server/params.py",
        '        out["seed"] = f.integer("seed", low=0)', '        f.integer("seed", low=0)',
        (f"{HTTP}::test_same_seed_same_text_and_another_seed_another_text",), "the server drops OpenAI `seed`"),
    Bug("ollama-seed-dropped", "src/pyggml/server/params.py",
        '        out["seed"] = seed if seed >= 0 else None', '        _ = seed',
        (f"{HTTP}::test_same_seed_same_text_and_another_seed_another_text",), "the server drops Ollama `seed`"),
    Bug("ollama-stop-dropped", "src/pyggml/server/params.py",
        '    if f.has("stop"):\n        out["stop"] = f.stops("stop")\n'
        '    out.update(prompt_lookup(f))\n    return out',
        '    out.update(prompt_lookup(f))\n    return out',
        (f"{HTTP}::test_stop_string_ends_the_text",), "the server drops Ollama `stop`"),
    Bug("ollama-num-keep-dropped", "src/pyggml/server/params.py",
        '        out["num_keep"] = f.integer("num_keep", low=-1)', '        f.integer("num_keep", low=-1)',
        (f"{HTTP}::test_num_keep_survives_a_context_shift",), "the server drops Ollama `num_keep`"),
    Bug("openai-chat-no-template", "src/pyggml/server/openai.py",
        "    prepare = prompt.prepare(max_tokens, sampling, top)",
        '    prompt.text = lambda: prompt.messages[-1]["content"]\n'
        "    prepare = prompt.prepare(max_tokens, sampling, top)",
        ("tests/test_chat_e2e.py",), "OpenAI chat uses the raw last message, not the chat template"),
    Bug("ollama-chat-no-template", "src/pyggml/server/ollama.py",
        "    prompt = chat_prompt(served, raw_messages, tools, think=think)",
        "    prompt = chat_prompt(served, raw_messages[-1:], tools, think=think)",
        ("tests/test_chat_e2e.py",), "Ollama chat renders only the last message"),
    Bug("llm-chat-last-message", "src/pyggml/llm.py",
        "self._template.render(messages, add_generation_prompt=True)",
        "self._template.render(messages[-1:], add_generation_prompt=False)",
        ("tests/test_chat_e2e.py",), "LLM.chat renders only the last message, without the generation prompt"),
    Bug("shift-without-rope-freqs", "src/pyggml/models/llama.py",
        "        return self.options.rope(key, shift, freq_factors)",
        "        return self.options.rope(key, shift, None)",
        ("tests/test_shift_e2e.py",), "context shift re-applies rope without rope_freqs"),
    Bug("top-p-64", "src/pyggml/sample.py",
        "        if cum[-1] >= p or k == probs.size:", "        if True:",
        ("tests/test_sample.py",), "the top-p nucleus is capped at the 64 most likely tokens"),
    Bug("make-model-type", "src/pyggml/bench.py",
        "write_synthetic(args.out, args.shape, args.type, seed=args.seed",
        'write_synthetic(args.out, args.shape, "q4_0", seed=args.seed',
        ("tests/test_bench.py",), "make-model ignores --type"),
    Bug("rope-refuses-f16", "src/pyggml/tensor.py",
        '        if self._p.type not in (DType.F32, DType.F16):\n            raise TypeError(f"rope: needs F32 or F16',
        '        if self._p.type not in (DType.F32,):\n            raise TypeError(f"rope: needs F32 or F16',
        ("tests/test_checked_ops.py",), "the Python rope check refuses F16 that the C path accepts"),
    # beyond issue 18: bugs the suite already caught, kept here so it stays that way
    Bug("logit-bias-ignored", "src/pyggml/sample.py",
        "    biased = [i for i in rows if samplers[i]._bias_ids.size and i not in errors]\n",
        "    biased = []\n",
        ("tests/test_sample.py",), "the sampler ignores logit_bias"),
    Bug("temperature-ignored", "src/pyggml/sample.py",
        "    scaled = vals / np.float32(temperature)\n", "    scaled = vals\n",
        ("tests/test_sample.py",), "sampling ignores the temperature"),
    Bug("stop-prefix-not-held-back", "src/pyggml/runner/sequence.py",
        "        emit = len(self._text) - self.matcher.partial", "        emit = len(self._text)",
        ("tests/test_runner.py::test_stop_string_split_across_tokens_is_held_back_and_cut",),
        "streamed text that may begin a stop string is not held back"),
    Bug("chat-double-bos", "src/pyggml/chat.py", "        del ids[0]", "        pass",
        ("tests/test_chat.py", "tests/test_chat_e2e.py"), "a template's BOS is doubled by the tokenizer's"),
    Bug("runner-num-keep-ignored", "src/pyggml/runner/sequence.py",
        "min(num_keep, num_ctx - 1)", "min(4, num_ctx - 1)",
        (f"{HTTP}::test_num_keep_survives_a_context_shift",), "the runner ignores a request's num_keep"),
    # the alignment and block-size checks of Backend._check_tensors cannot be caught: ggml's gguf reader
    # refuses those files first (test_crafted_bad_files pins its reasons); the size check is ours alone
    Bug("gguf-size-check-removed", "src/pyggml/backend.py",
        "            if data_offset + offset + size > file_size:", "            if False:",
        ("tests/test_gguf.py::test_crafted_bad_files",), "the GGUF check of tensor data against the file size is gone"),
    # issue 25 item 8: a probe's bugs that no test caught directly
    Bug("shift-skips-swa-cache", "src/pyggml/kvcache/wrapper.py",
        "        commits = [cache.plan_remove(seq, begin, end) for cache in self.caches]",
        "        commits = [cache.plan_remove(seq, begin, end) for cache in self.caches\n"
        "                   if getattr(cache, 'swa_window', None) is None]",
        ("tests/test_shift_swa.py",), "a context shift leaves the sliding-window cache as it was"),
    Bug("shift-sliding-with-global-rope", "src/pyggml/models/gemma2.py",
        "        return self._rope(layer)(key, shift)", "        return self.options.rope(key, shift)",
        ("tests/test_shift_swa.py",), "a context shift re-rotates sliding layers' keys with the global rope"),
    Bug("min-p-after-temperature", "src/pyggml/sample.py",
        "                    keep = vals >= (vals.max(axis=1) + np.log(min_p).astype(vals.dtype))[:, None]",
        "                    t = np.array([samplers[i].temperature for i in group], vals.dtype)[:, None]\n"
        "                    keep = vals / t >= vals.max(axis=1)[:, None] / t + np.log(min_p)[:, None]",
        ("tests/test_sample.py::test_min_p_judges_the_probabilities_before_temperature",),
        "min_p judges the probabilities after temperature"),
    Bug("repeat-window-one-too-long", "src/pyggml/sample.py",
        "history if s.repeat_last_n == -1 else history[-s.repeat_last_n:]",
        "history if s.repeat_last_n == -1 else history[-s.repeat_last_n - 1:]",
        ("tests/test_sample.py::test_repeat_presence_and_frequency_penalties",),
        "the repeat penalties look at one token more than repeat_last_n"),
    Bug("llama3-forced-call-arguments", "src/pyggml/tools.py",
        '    key = "parameters" if fmt.name == "llama3" else "arguments"', '    key = "arguments"',
        ("tests/test_tools.py::test_forced_llama3_call_takes_parameters",),
        "a forced llama3-format tool call must say arguments instead of parameters"),
    Bug("hf-exact-name-not-preferred", "src/pyggml/store.py",
        "        files = exact or tagged", "        files = tagged",
        ("tests/test_store.py::test_hugging_face_cache_prefers_the_exact_file_name",),
        "a Hugging Face org/repo:FILE no longer prefers the file named exactly"),
    Bug("group-width-of-first-stream", "src/pyggml/kvcache/causal.py",
        "                g.n_kv = max(int(extents[g.stream:g.stream + g.n_seqs].max()), 1)",
        "                g.n_kv = max(int(extents[g.stream]), 1)",
        ("tests/test_kvcache.py::test_a_group_attends_over_its_longest_stream",),
        "a group of sequences attends over its first sequence's cache width"),
    Bug("groups-drop-softcap", "src/pyggml/nn.py",
        "            return _grouped_attention(query, groups, scale, flash, softcap, sinks)",
        "            return _grouped_attention(query, groups, scale, flash, 0.0, sinks)",
        ("tests/test_gemma.py::test_logits_match_with_several_sequence_slots",),
        "attention with several sequence slots drops Gemma 2's soft-capping"),
    Bug("groups-drop-sinks", "src/pyggml/nn.py",
        "            return _grouped_attention(query, groups, scale, flash, softcap, sinks)",
        "            return _grouped_attention(query, groups, scale, flash, softcap, None)",
        ("tests/test_gptoss.py::test_logits_match_with_several_sequence_slots",),
        "attention with several sequence slots drops gpt-oss's sinks"),
    Bug("swa-window-one-wider", "src/pyggml/kvcache/cells.py",
        "            visible &= tok_pos - cell_pos < self.swa_window",
        "            visible &= tok_pos - cell_pos <= self.swa_window",
        ("tests/test_gptoss.py::test_greedy_decoding_past_the_window_matches_transformers",),
        "the sliding window shows one position more than transformers' and llama.cpp's (issue 25 item 7)"),
    Bug("argsort-stale-plan", "src/pyggml/backend.py",
        "                if not lib.ggml_backend_sched_reserve(sched, state.graph):\n"
        "                    raise MemoryError(with_ggml_log(\"could not reserve memory for the graph\"))\n"
        "                if not lib.ggml_backend_sched_alloc_graph(sched, state.graph):",
        "                if not lib.ggml_backend_sched_alloc_graph(sched, state.graph):",
        ("tests/test_graph_plans.py",), "a new graph computes with the last graph's memory plan (issue 25 item 5)"),
]


def _copy_repo(dest: Path) -> Path:
    """A copy of what the tests import and read (the compiled module included) at dest/repo,
    with dest/shared pointing at the real shared models (tests find them beside the repo)."""
    repo = dest / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for part in ("src", "tests", "bench", "docs"):
        if (ROOT / part).exists():
            shutil.copytree(ROOT / part, repo / part, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, repo / name)
    if SHARED.exists():
        (dest / "shared").symlink_to(SHARED)
    return repo


def _plant(repo: Path, bug: Bug) -> bool:
    path = repo / bug.path
    text = path.read_text()
    if text.count(bug.old) != 1:
        return False
    path.write_text(text.replace(bug.old, bug.new))
    return True


def _pytest(repo: Path, targets: tuple[str, ...], extra: list[str]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *targets]
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    lines = (out.stdout + out.stderr).strip().splitlines()
    return out.returncode, lines[-1] if lines else ""


def run(bugs: list[Bug], baseline: bool, extra: list[str]) -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="pyggml-planted-") as tmp:
        pristine = _copy_repo(Path(tmp) / "pristine")
        if baseline:
            targets = tuple(sorted({t for b in bugs for t in b.targets}))
            code, last = _pytest(pristine, targets, extra)
            print(f"baseline: {'pass' if code == 0 else 'FAIL'} ({last})", flush=True)
            if code != 0:
                return 2
        for bug in bugs:
            work = Path(tmp) / bug.name
            shutil.copytree(pristine, work / "repo", symlinks=True)
            if SHARED.exists():
                (work / "shared").symlink_to(SHARED)
            start = time.perf_counter()
            if not _plant(work / "repo", bug):
                status, last = "stale", f"text not found once in {bug.path}"
            else:
                code, last = _pytest(work / "repo", bug.targets, extra)
                # a crash (killed by a signal) fails the suite too
                status = "MISSED" if code == 0 else "caught" if code == 1 or code < 0 else "error"
            rows.append((bug, status, time.perf_counter() - start, last))
            print(f"{status:7} {bug.name:32} {time.perf_counter() - start:6.1f}s  {last}", flush=True)
            shutil.rmtree(work)
    print("\n| planted bug | where | caught? |\n|---|---|---|")
    for bug, status, _, _ in rows:
        print(f"| {bug.what or bug.name} | `{bug.path}` | {status} |")
    return 0 if all(status == "caught" for _, status, _, _ in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-b", "--bug", action="append", help="run only this bug (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the bugs and their targets")
    parser.add_argument("--baseline", action="store_true", help="check the targets pass unmodified first")
    parser.add_argument("--check", action="store_true", help="only check that each bug's text is in the source")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    bugs = BUGS
    if args.bug:
        unknown = set(args.bug) - {b.name for b in BUGS}
        if unknown:
            parser.error(f"unknown bug(s): {', '.join(sorted(unknown))}")
        bugs = [b for b in BUGS if b.name in args.bug]
    if args.list:
        for b in bugs:
            print(f"{b.name:32} {b.path:28} {' '.join(b.targets)}")
        return 0
    if args.check:
        stale = [b for b in bugs if (ROOT / b.path).read_text().count(b.old) != 1]
        for b in stale:
            print(f"stale   {b.name:32} the text to replace is not in {b.path} exactly once")
        print(f"{len(bugs) - len(stale)} of {len(bugs)} bugs apply")
        return 1 if stale else 0
    return run(bugs, args.baseline, args.pytest_args)


if __name__ == "__main__":
    sys.exit(main())
