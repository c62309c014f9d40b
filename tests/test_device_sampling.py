"""Sampling on the device (``Runner(device_sampling=True)``): graphs end in each row's K largest logits;
a step whose sequences all sample plainly reads only those, and every request gets the tokens it gets
from the full logits (greedy and seeded sampling; grammars, logprobs and penalties read the full rows).
On a CPU-only build the head runs on the CPU, which checks the same logic; with PYGGML_TEST_DEVICE=gpu
every layer and the head run on the GPU (the check to pass before ``device_sampling`` defaults to on there)."""

from __future__ import annotations

import pytest

from pyggml import BackendParams, models
from pyggml.runner import CompletionRequest, Runner
from pyggml.synthetic import write_synthetic
from tests.conftest import TEST_DEVICE, gpu_present

if TEST_DEVICE == "gpu":
    pytestmark = pytest.mark.ci_may_skip

PLAIN = [dict(temperature=0.0), dict(seed=1), dict(temperature=1.5, top_k=5, min_p=0.05, seed=2),
         dict(temperature=0.9, top_k=40, top_p=0.5, seed=3), dict(temperature=1.0, top_k=63, top_p=1.0, seed=4)]
FULL = [dict(temperature=1.0, top_k=0, top_p=1.0, seed=5), dict(repeat_penalty=1.3, seed=6),
        dict(temperature=0.0, logprobs=2), dict(seed=7, logit_bias={3: 2.0})]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if TEST_DEVICE == "gpu" and not gpu_present():
        pytest.skip("PYGGML_TEST_DEVICE=gpu but this build of pyggml sees no GPU")
    path = write_synthetic(tmp_path_factory.mktemp("device-sampling") / "tiny.gguf", "tiny", "f32", seed=3)
    m = models.load(path, BackendParams(n_threads=2, gpu_layers="all" if TEST_DEVICE == "gpu" else 0))
    yield m
    m.close()


def run(model, requests: list[dict], device_sampling: bool) -> tuple[list[list[int]], list[str]]:
    """Each request's tokens, all running at once, and the read modes of the steps."""
    with Runner(model, parallel=len(requests), num_ctx=128, device_sampling=device_sampling) as runner:
        reads: list[str] = []
        compute = runner.engine.compute

        def recording(graph, read=True, times=None, **options):
            reads.append(str(read))
            return compute(graph, read, times, **options)

        runner.engine.compute = recording
        streams = [runner.completion(CompletionRequest(prompt=[1, 20 + i, 30 + 2 * i], max_tokens=24, **r))
                   for i, r in enumerate(requests)]
        return [[t for chunk in s for t in chunk.tokens] for s in streams], reads


@pytest.mark.parametrize("requests", [PLAIN, PLAIN + FULL, FULL], ids=["plain", "mixed", "full"])
def test_device_sampling_gives_the_tokens_of_host_sampling(model, requests):
    host, host_reads = run(model, requests, device_sampling=False)
    device, device_reads = run(model, requests, device_sampling=True)
    assert device == host
    assert "top" not in host_reads
    # steps of plain requests (the first one included) read the head's K logits; a step with a request
    # needing full rows reads them all
    if requests is PLAIN:
        assert "top" in device_reads
    if requests is FULL:
        assert "top" not in device_reads
