"""The Runner's throughput on a GPU and the share of each run the GPU waits for the host (issue 26).

    python bench/runner_gpu.py MODEL.gguf LABEL OUT.json [--device-sampling 0|1|auto] [--one-consumer]
        [--parallel 1,16,64,128] [--tokens 128]

(docs/gpu.md has the H200 figures: MODEL was ``write_synthetic(path, "tinyllama-1.1b", "q4_0")``, every layer
on the GPU; run it with ``PYTHONPATH`` on another tree to compare trees.) ``--one-consumer``: one thread reads
every stream in turn, as a server's event loop does; otherwise a thread per sequence.

P sequences (threads, one completion each, as a server's clients) generate N tokens greedily; the
GPU is busy at most while a compute call (``Engine.compute``, timed by wrapping it) runs, so
host share = 1 - (sum of compute-call time) / wall time of the run. ``Engine.compute`` also holds some
Python (reading the outputs, and ggml's graph planning when the graph changed); ``backend_host_share``
counts only ``Backend._run`` (writing the inputs and the native compute, of any graph: the cache's copies
of a shared prompt prefix too) as busy. ``chained``: the share of the worker's computed steps after which it
sampled the step and launched the next itself (``Runner._chain``; absent for a runner without it).
"""
import inspect
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
from runner_host import counting_chains, drain  # (bench/, this script's directory)

import pyggml
from pyggml import models
from pyggml.backend import Backend, BackendParams
from pyggml.runner import CompletionRequest, Runner
from pyggml.runner import engine as engine_mod

path, label, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
ds = sys.argv[sys.argv.index("--device-sampling") + 1] if "--device-sampling" in sys.argv else "auto"
parallels = [int(x) for x in (sys.argv[sys.argv.index("--parallel") + 1] if "--parallel" in sys.argv
                              else "1,16,64,128").split(",")]
N = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 128
ONE_CONSUMER = "--one-consumer" in sys.argv
busy = [0.0, 0.0]  # seconds in Engine.compute, in Backend._run


def timing(cls, name, slot):
    original = getattr(cls, name)

    def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            busy[slot] += time.perf_counter() - t

    setattr(cls, name, timed)


timing(engine_mod.Engine, "compute", 0)
timing(Backend, "_run", 1)
model = models.load(path, BackendParams(gpu_layers="all", flash_attention=True))
extra = {}
if ds != "auto" and "device_sampling" in inspect.signature(Runner).parameters:
    extra["device_sampling"] = ds == "1"
res = {"label": label, "one_consumer": ONE_CONSUMER, "pyggml": pyggml.__file__, "device_sampling": ds, "rows": {}}
with counting_chains() as went_on:  # per step the worker computed: whether it launched the next itself
    for P in parallels:
        with Runner(model, parallel=P, num_ctx=512, batch_size=512, **extra) as r:
            def one(i, sink):
                req = CompletionRequest(prompt=[1, 300 + i, 400 + i, 500 + i], max_tokens=N, temperature=0)
                got = 0
                for ch in r.completion(req):
                    got += len(ch.tokens)
                sink.append(got)
            one(0, [])
            walls, shares, backend_shares, rates = [], [], [], []
            went_on.clear()
            for _ in range(3):
                sink = []
                busy[:] = [0.0, 0.0]
                t = time.perf_counter()
                if ONE_CONSUMER:  # one thread reads every stream in turn (as a server's event loop does)
                    sink.append(drain([r.completion(CompletionRequest(prompt=[1, 300 + i, 400 + i, 500 + i],
                                                                      max_tokens=N, temperature=0))
                                       for i in range(P)])[0])
                else:
                    th = [threading.Thread(target=one, args=(i, sink)) for i in range(P)]
                    for x in th:
                        x.start()
                    for x in th:
                        x.join()
                dt = time.perf_counter() - t
                rates.append(sum(sink) / dt)
                shares.append(1 - busy[0] / dt)
                backend_shares.append(1 - busy[1] / dt)
                walls.append(dt)
            row = {"tok_s": round(float(np.median(rates)), 1), "host_share": round(float(np.median(shares)), 3),
                   "backend_host_share": round(float(np.median(backend_shares)), 3),
                   "step_ms": round(1e3 * float(np.median(walls)) / N, 3), "runs_tok_s": [round(x) for x in rates]}
            if hasattr(Runner, "_go_on"):
                row["chained"] = round(float(np.mean(went_on)), 3) if went_on else 0.0
            res["rows"][P] = row
            print(label, "P", P, row, flush=True)
doc = json.loads(out.read_text()) if out.exists() else {}
doc[label] = res
out.write_text(json.dumps(doc, indent=1))
model.close()
