"""MoE decode cost: qwen3moe-small with its 8 of 64 experts per token, the same file with all 64
used, and the dense twin with the same active parameters (qwen3-small-dense), decoding in turn in one
process (the order rotating per round), so that all three see the same machine even when it is noisy.

    python bench/moe_decode.py [--type q4_0] [--rounds 9]

Prints the median seconds per token and the per-round ratios: moe/dense near 1 and all-experts/moe
well above 1 mean a decode step multiplies by the chosen experts only.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from pyggml.bench import Session, synthetic_model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--type", default="q4_0")
parser.add_argument("--rounds", type=int, default=9)
args = parser.parse_args()
moe, dense = synthetic_model("qwen3moe-small", args.type), synthetic_model("qwen3-small-dense", args.type)
s = {"moe-k8": Session(moe, n_threads=2, cache_type="f16", n_ctx=256, max_batch=8),
     "moe-k64": Session(moe, n_threads=2, cache_type="f16", n_ctx=256, max_batch=8),
     "dense": Session(dense, n_threads=2, cache_type="f16", n_ctx=256, max_batch=8)}
every = s["moe-k64"].model  # every expert for every token: what a step would cost without routing
every.options = dataclasses.replace(every.options, n_experts_used=every.options.n_experts)
for x in s.values():
    x.generate(1)
per = {k: [] for k in s}  # wall seconds per token
per_cpu = {k: [] for k in s}  # CPU seconds (both threads) per token: less hit by other load
names = list(s)
for r in range(args.rounds):
    for k in names[r % 3:] + names[:r % 3]:
        cpu = time.process_time()
        wall = s[k].generate(2).wall_ns / 2e9
        per[k].append(wall)
        per_cpu[k].append((time.process_time() - cpu) / 2)
for label, table in (("wall", per), ("cpu", per_cpu)):
    for k, v in table.items():
        print(f"{label} {k}: median s/token {statistics.median(v):.4f}", [round(x, 3) for x in v])
    for a, b in (("moe-k8", "dense"), ("moe-k64", "moe-k8")):
        r = [x / y for x, y in zip(table[a], table[b], strict=True)]
        print(f"{label} {a}/{b}: per-round median {statistics.median(r):.2f}", [round(x, 2) for x in r])
