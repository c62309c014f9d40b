"""The engine's graph reuse with composed caches: a real model forward pass through
Wrapper(Causal(sliding window), Causal), Wrapper(Causal(chunked), Causal) and
Wrapper(Encoder, Causal) reuses its graph on decode steps and gives exactly the logits of a graph
rebuilt for every step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pyggml import BackendParams, models, nn
from pyggml.input import Batch, Multimodal, MultimodalIndex
from pyggml.kvcache import Causal, Encoder, Wrapper
from pyggml.models.llama import Llama
from pyggml.runner.engine import Engine
from pyggml.synthetic import write_synthetic
from pyggml.tensor import DType


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("engine") / "tiny.gguf", "tiny", "f32")


class CrossLlama(Llama):
    """The tiny llama with layer 0 turned into cross-attention over an "image" (mllama-like):
    its keys and values come from the multimodal embedding of the batch that carries it, kept by
    the Encoder cache for later batches; batches whose sequence saw no image skip the layer."""

    def forward(self, ctx, batch):
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = w.token_embd(inputs.tokens)
        encoder = self.cache.caches[0]
        for i, layer in enumerate(w.blk):
            self.cache.set_layer(i)
            if i == 0:
                self.cache.set_layer_type(0)
                if batch.multimodal or encoder.encoder_cached:
                    h = h + self._cross(ctx, layer, h, batch, encoder, o)
                continue
            self.cache.set_layer_type(1)
            last = inputs.outputs if i == len(w.blk) - 1 else None
            h = layer(ctx, h, inputs.positions, last, self.cache, o, None)
        return w.output(w.output_norm(h, o.eps))

    @staticmethod
    def _cross(ctx, layer, h, batch, encoder, o):
        a = layer.attention
        x = layer.attn_norm(h, o.eps)
        q = a.attn_q(x).reshape(o.head_dim, o.n_heads, x.shape[1]).permute(0, 2, 1, 3)
        if batch.multimodal:
            image = ctx.from_numpy(batch.multimodal[0].multimodal[0].tensor)  # (hidden, n_enc)
            n_enc = image.shape[1]
            encoder.put(ctx, a.attn_k(image).reshape(o.head_dim, o.n_kv_heads, n_enc),
                        a.attn_v(image).reshape(o.head_dim, o.n_kv_heads, n_enc))
        key, value, _ = encoder.get(ctx)
        out = q.scaled_dot_product_attention(key, value, None, 1.0 / math.sqrt(o.head_dim))
        return a.attn_output(out.reshape(o.head_dim * o.n_heads, x.shape[1]))


CACHES = {
    "sliding window + global": (Llama, lambda m: Wrapper(Causal(m.shift, swa_window=4), Causal(m.shift),
                                                         layer_types=[0, 1])),
    "chunked + global": (Llama, lambda m: Wrapper(Causal(m.shift, chunk_size=4), Causal(m.shift),
                                                  layer_types=[0, 1])),
    "encoder + causal": (CrossLlama, lambda m: Wrapper(Encoder(), Causal(m.shift))),
}


def load(path, cls, make_cache):
    model = models.load(path, BackendParams(n_threads=1))
    model.__class__ = cls
    model.cache = make_cache(model)
    model.cache.init(model.backend, DType.F32, max_sequences=2, capacity=64, max_batch=16)
    return model


def run(model, engine, with_image):
    """A 6-token prompt (an image in front when ``with_image``), then 14 decode steps past the
    window/chunk size; every step's logits."""
    rng = np.random.default_rng(0)
    mm = []
    if with_image:
        image = rng.standard_normal((3, 256)).astype(np.float32)  # numpy (n_enc, hidden)
        mm = [MultimodalIndex(0, [Multimodal(tensor=image)])]
    prompt = [int(t) for t in rng.integers(1, 1000, 6)]
    out = [engine.forward(Batch(inputs=prompt, outputs=[5], positions=range(6), sequences=[0] * 6,
                                multimodal=mm))]
    for pos in range(6, 20):
        token = int(rng.integers(1, 1000))
        out.append(engine.forward(Batch(inputs=[token], outputs=[0], positions=[pos], sequences=[0])))
    return np.concatenate(out)


@pytest.mark.parametrize("name", list(CACHES))
def test_composed_caches_reuse_decode_graphs_and_match_a_rebuild(path, name):
    cls, make_cache = CACHES[name]
    reused, rebuilt = load(path, cls, make_cache), load(path, cls, make_cache)
    try:
        keep, fresh = Engine(reused, keep=2), Engine(rebuilt, keep=0)
        a = run(reused, keep, name.startswith("encoder"))
        b = run(rebuilt, fresh, name.startswith("encoder"))
        assert fresh.reused == 0 and fresh.built == 15
        # 14 decode steps: the attention width moves at most every 32 cells (the padding), the
        # first decode step builds its graph; so nearly all are refills
        assert keep.reused >= 12, (keep.built, keep.reused)
        np.testing.assert_array_equal(a, b)
    finally:
        for model in (reused, rebuilt):
            model.close()


def test_two_causal_caches_name_their_inputs_apart(path):
    """Two caches of the same kind in one graph: each names its own inputs (this failed with
    'this graph already has an input named kv_cells' when the names were fixed)."""
    model = load(path, Llama, CACHES["sliding window + global"][1])
    try:
        engine = Engine(model)
        logits = engine.forward(Batch(inputs=[1, 2, 3], outputs=[2], positions=[0, 1, 2], sequences=[0, 0, 0]))
        assert logits.shape == (1, 1024)
    finally:
        model.close()


def test_sliding_window_really_masks(path):
    """With a window smaller than the history, the windowed model's logits differ from the plain
    causal model's (the window is not a no-op)."""
    plain = load(path, Llama, lambda m: Causal(m.shift))
    windowed = load(path, Llama, lambda m: Wrapper(Causal(m.shift, swa_window=4), Causal(m.shift),
                                                   layer_types=[0, 1]))
    try:
        a, b = run(plain, Engine(plain), False), run(windowed, Engine(windowed), False)
        assert not np.allclose(a[-1], b[-1], atol=1e-4)
    finally:
        plain.close()
        windowed.close()


def test_engine_refuses_nothing_silently_when_a_refill_raises(path):
    """A batch the cache refuses while refilling (position beyond the context) raises, and the
    engine drops its kept graphs rather than keeping a half-refilled one."""
    model = load(path, Llama, lambda m: Causal(m.shift))
    try:
        engine = Engine(model)
        engine.forward(Batch(inputs=[1], outputs=[0], positions=[0], sequences=[0]))
        engine.forward(Batch(inputs=[2], outputs=[0], positions=[1], sequences=[0]))
        with pytest.raises(ValueError, match="beyond the cache's context"):
            engine.build(Batch(inputs=[3], outputs=[0], positions=[64], sequences=[0]))
        assert not engine._kept
    finally:
        model.close()


_STALE = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from tests.test_multimodal_runner import ToyVision
from pyggml import BackendParams, models
from pyggml.input import Batch, Multimodal, MultimodalIndex
from pyggml.runner.engine import Engine
model = models.load(sys.argv[1], BackendParams(n_threads=1))
model.__class__ = ToyVision
model.cache.init(model.backend, "f16", max_sequences=1, capacity=64, max_batch=4)
engine, pos = Engine(model), 0
def step(tokens, mm=()):
    global pos
    n = len(tokens)
    engine.forward(Batch(inputs=tokens, outputs=[n - 1], positions=range(pos, pos + n), sequences=[0] * n,
                         multimodal=mm))
    pos += n
for _ in range(4):
    step([10, 11, 12, 13])  # kept graph A
step([14])  # kept graph B
image = np.sin(np.arange(3 * 256)).astype(np.float32).reshape(3, 256)
step([0, 0, 0, 9], [MultimodalIndex(0, [Multimodal(tensor=image)])])  # bigger: the buffers grow (move)
step([10, 11, 12, 13])  # A again: its tensors' old places were in the buffer that moved
for _ in range(6):
    step([15])
engine.close()
model.close()
print("ok")
"""


def test_a_graph_computed_again_after_the_compute_buffer_moved(path):
    """A kept graph computed again after a bigger graph grew the scheduler's buffers must be placed
    afresh (ggml's allocator keeps any tensor whose data is set: it wrote into freed memory, which
    glibc reported as heap corruption). In a subprocess, with glibc's heap checks on."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
    root = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run([sys.executable, "-c", _STALE, str(path), root], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_started_busy_graph_is_refilled_and_never_closed(path):
    """Build-ahead: the graph computing now (``busy``) is refilled for the next batch once its compute
    has started (``busy_started``: its inputs are written), so the same graph computes again; before, or
    when it no longer fits (the attention width moved), another graph is built and the busy one is left
    open for its compute (closing it would free memory the device is reading)."""
    model = load(path, Llama, lambda m: Causal(m.shift))
    try:
        engine = Engine(model)
        engine.forward(Batch(inputs=[5, 6, 7], outputs=[2], positions=range(3), sequences=[0] * 3))
        decode = engine.build(Batch(inputs=[8], outputs=[0], positions=[3], sequences=[0]))
        engine.compute(decode)
        waiting = engine.build(Batch(inputs=[9], outputs=[0], positions=[4], sequences=[0]), busy=decode)
        assert waiting is not decode  # not started: its inputs may not be written yet
        engine.compute(waiting)
        again = engine.build(Batch(inputs=[10], outputs=[0], positions=[5], sequences=[0]), busy=waiting,
                             busy_started=True)
        assert again is waiting and engine.built == 3
        engine.compute(again)
        for start in (6, 21):
            engine.forward(Batch(inputs=list(range(1, 16)), outputs=[14], positions=range(start, start + 15),
                                 sequences=[0] * 15))
        wide = engine.build(Batch(inputs=[10], outputs=[0], positions=[36], sequences=[0]), busy=again,
                            busy_started=True)  # 37 cells: the decode graph's 32 no longer do
        assert wide is not again and not again.ctx._state.closed and again in engine._kept
        engine.compute(wide)
    finally:
        model.close()
