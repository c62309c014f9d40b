"""The runner's multimodal path, model-agnostic: images in a request become inputs the model's
``post_tokenize`` rewrites; their vision graph is computed once, outside the text batches, when
their input is first batched; ``same_batch`` keeps an image's inputs together; the prompt cache
reuses a slot whose prefix holds the same image (and only then). A toy vision model stands in."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml import BackendParams, models, nn
from pyggml.input import Input, Multimodal
from pyggml.models.llama import Llama
from pyggml.runner import CompletionRequest, Runner
from pyggml.synthetic import write_synthetic

N_IMAGE = 3  # inputs an image takes (its embedding rows)
MARK = 5  # the toy's "start of image" token


class ToyVision(Llama):
    """The tiny llama plus a "vision tower": an image's embedding is a fixed function of its bytes
    (a sine pattern set by its fourth byte), computed in its own graph; its inputs see each other both ways."""

    encoded = 0

    def encode_multimodal(self, ctx, data: bytes) -> list[Multimodal]:
        if not data.startswith(b"IMG"):
            raise ValueError("not an image (the toy wants b'IMG...')")
        type(self).encoded += 1
        pattern = np.sin(np.arange(N_IMAGE * self.options.hidden_size) * (data[3] / 37.0)).astype(np.float32)
        rows = ctx.from_numpy(pattern.reshape(N_IMAGE, -1)).scale(2.0)
        return [Multimodal(tensor=rows, data=data)]

    def post_tokenize(self, inputs: list[Input]) -> list[Input]:
        out = []
        for inp in inputs:
            if inp.multimodal is None:
                out.append(inp)
                continue
            out.append(Input(token=MARK))
            out.append(Input(multimodal=inp.multimodal, multimodal_hash=inp.multimodal_hash, same_batch=N_IMAGE))
            out += [Input(token=0) for _ in range(N_IMAGE - 1)]
        return out

    def forward(self, ctx, batch):
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.multimodal_embeddings(ctx, w.token_embd(inputs.tokens), batch)
        for m in batch.multimodal:
            self.cache.set_noncausal(m.index, m.index + N_IMAGE)
        for i, layer in enumerate(w.blk):
            self.cache.set_layer(i)
            last = inputs.outputs if i == len(w.blk) - 1 else None
            h = layer(ctx, h, inputs.positions, last, self.cache, o, None)
        return w.output(w.output_norm(h, o.eps))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("mm") / "tiny.gguf", "tiny", "f32")


@pytest.fixture
def toy(path):
    model = models.load(path, BackendParams(n_threads=1))
    model.__class__ = ToyVision
    ToyVision.encoded = 0
    yield model
    model.close()


def complete(runner, prompt, images, n=6):
    *_, last = runner.completion(CompletionRequest(prompt=prompt, images=images, max_tokens=n, temperature=0,
                                                   logprobs=1, logit_bias={2: float("-inf")}))
    return last


def run_all(runner, prompt, images, n=6):
    chunks = list(runner.completion(CompletionRequest(prompt=prompt, images=images, max_tokens=n, temperature=0,
                                                      logprobs=1, logit_bias={2: float("-inf")})))
    tokens = [t for c in chunks for t in c.tokens]
    logprobs = [lp.logprob for c in chunks for lp in (c.logprobs or [])]
    return tokens, np.array(logprobs), chunks[-1]


def test_the_same_image_is_encoded_once_and_served_from_the_cache(toy):
    with Runner(toy, parallel=1, num_ctx=64, batch_size=16) as runner:
        a, lp_a, first = run_all(runner, "a cat [img-0] says", [b"IMG\x10"])
        assert ToyVision.encoded == 1 and first.cached_tokens == 0
        b, lp_b, second = run_all(runner, "a cat [img-0] says", [b"IMG\x10"])
        assert ToyVision.encoded == 1  # the image's inputs were in the slot's cached prefix
        assert second.cached_tokens == second.prompt_tokens - 1 and a == b
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-4)  # one input recomputed alone: summation order only
        c, lp_c, third = run_all(runner, "a cat [img-0] says", [b"IMG\x50"])  # same text, another image
        assert ToyVision.encoded == 2
        assert third.cached_tokens < third.prompt_tokens - N_IMAGE  # reuse stops at the image
        assert c != a or not np.allclose(lp_c, lp_a, atol=1e-2)


def test_image_changes_the_output_and_markers_place_images(toy):
    with Runner(toy, parallel=1, num_ctx=64, batch_size=16) as runner:
        plain, _, last = run_all(runner, "a cat says", [b"IMG\x10"])  # no marker: the image comes first
        assert last.prompt_tokens == len(toy.tokenizer.encode("a cat says")) + 1 + N_IMAGE
        other, _, _ = run_all(runner, "a cat says", [b"IMG\x70"])
        assert plain != other
        with pytest.raises(ValueError, match=r"names \[img-1\] but the request has 1 image"):
            runner.completion(CompletionRequest(prompt="x [img-1]", images=[b"IMG\x10"]))


def record_batches(runner):
    """Wrap the runner's engine.build: the list it returns gets (batch length, image indices) of each batch."""
    seen, build = [], runner.engine.build

    def recording(batch, *args, **kwargs):
        seen.append((len(batch.inputs), [m.index for m in batch.multimodal]))
        return build(batch, *args, **kwargs)

    runner.engine.build = recording
    return seen


def test_an_image_is_never_split_across_batches(toy):
    """Prompt chunks of 4 inputs: the image's 3 inputs start a new batch rather than straddle two, and
    the result equals a run with room for everything in one batch."""
    with Runner(toy, parallel=1, num_ctx=64, batch_size=4) as small:
        batches = record_batches(small)
        split, lp_split, _ = run_all(small, "one two three [img-0] four", [b"IMG\x20"])
    ((n, (index,)),) = [(n, index) for n, index in batches if index]
    assert index + N_IMAGE + 1 <= n <= 4  # the image and the input after it in one batch, which keeps to 4
    with Runner(toy, parallel=1, num_ctx=64, batch_size=32) as big:
        whole, lp_whole, _ = run_all(big, "one two three [img-0] four", [b"IMG\x20"])
    assert split == whole
    np.testing.assert_allclose(lp_split, lp_whole, atol=1e-4)


def test_an_image_longer_than_a_batch_grows_that_batch(toy):
    """batch_size 2, an image needing 4 inputs together (its 3 rows and the token after them, same_batch=3):
    the runner reserved batches of up to 2 - 1 + 4 at start-up, the batch holding the image grows to take all
    of it (never split, as Ollama's runner does), the other batches keep to 2, and the output equals the unsplit run."""
    prompt, images = "one two three [img-0] four five", [b"IMG\x20"]
    with Runner(toy, parallel=1, num_ctx=64, batch_size=2) as tiny:
        assert tiny.image_run == N_IMAGE + 1 and tiny.max_batch == 2 - 1 + N_IMAGE + 1
        batches = record_batches(tiny)
        split, lp_split, last = run_all(tiny, prompt, images)
    with_image = [(n, index) for n, index in batches if index]
    assert len(with_image) == 1
    (n, (index,)) = with_image[0]
    assert index + N_IMAGE + 1 <= n <= tiny.max_batch and n > 2  # the whole image, in one grown batch
    assert all(n <= 2 for n, index in batches if not index)
    assert sum(n for n, _ in batches) == last.prompt_tokens + len(split) - 1
    with Runner(toy, parallel=1, num_ctx=64, batch_size=32) as big:
        whole, lp_whole, _ = run_all(big, prompt, images)
    assert split == whole
    np.testing.assert_allclose(lp_split, lp_whole, atol=1e-4)


def test_two_sequences_with_different_images_equal_each_alone(toy):
    prompts = [("red [img-0] fox", [b"IMG\x11"]), ("red [img-0] fox", [b"IMG\x66"])]
    with Runner(toy, parallel=2, num_ctx=64, batch_size=32) as runner:
        alone = [run_all(runner, p, im)[:2] for p, im in prompts]
        streams = [runner.completion(CompletionRequest(prompt=p, images=im, max_tokens=6, temperature=0, logprobs=1,
                                                       cache_prompt=False, logit_bias={2: float("-inf")}))
                   for p, im in prompts]
        together = []
        for s in streams:
            chunks = list(s)
            together.append(([t for c in chunks for t in c.tokens],
                             np.array([lp.logprob for c in chunks for lp in c.logprobs or []])))
    for (t_alone, lp_alone), (t_both, lp_both) in zip(alone, together, strict=True):
        assert t_alone == t_both
        np.testing.assert_allclose(lp_alone, lp_both, atol=1e-4)


def test_bad_images_fail_their_request_only(toy, path):
    with Runner(toy, parallel=1, num_ctx=64, batch_size=16) as runner:
        with pytest.raises(ValueError, match="not an image"):
            run_all(runner, "look [img-0]", [b"PNG garbage"])
        with pytest.raises(ValueError, match="non-empty byte strings"):
            runner.completion(CompletionRequest(prompt="look", images=["a path"]))
        tokens, _, last = run_all(runner, "look [img-0]", [b"IMG\x33"])  # the slot was freed
        assert last.finish_reason == "length" and len(tokens) == 6
    text_only = models.load(path, BackendParams(n_threads=1))
    try:
        with Runner(text_only, parallel=1, num_ctx=64) as runner:
            with pytest.raises(ValueError, match="takes no images"):
                runner.completion(CompletionRequest(prompt="look", images=[b"IMG\x33"]))
    finally:
        text_only.close()


class ToySplit(ToyVision):
    """The toy with the optional split of ``encode_multimodal``: its "pixels" come in ``k`` copies (the image's
    fifth byte), so images have different input shapes, and the graph averages them back: the same embeddings."""

    built = 0

    def preprocess_multimodal(self, data: bytes) -> dict[str, np.ndarray]:
        if not data.startswith(b"IMG"):
            raise ValueError("not an image (the toy wants b'IMG...')")
        pattern = np.sin(np.arange(N_IMAGE * self.options.hidden_size) * (data[3] / 37.0)).astype(np.float32)
        copies = data[4] if len(data) > 4 else 1
        return {"pixels": np.repeat(pattern.reshape(N_IMAGE, -1, 1), copies, axis=2)}

    def build_multimodal(self, ctx, inputs: dict[str, np.ndarray]) -> list:
        type(self).built += 1
        pixels = ctx.from_numpy(inputs["pixels"], name="pixels")  # (copies, hidden, N_IMAGE)
        return [pixels.mean().reshape(self.options.hidden_size, N_IMAGE).scale(2.0)]

    def multimodal_worst_case(self) -> dict[str, np.ndarray]:
        return self.preprocess_multimodal(b"IMG\x00\x04")

    def encode_multimodal(self, ctx, data: bytes) -> list[Multimodal]:
        return [Multimodal(tensor=t, data=data) for t in self.build_multimodal(ctx, self.preprocess_multimodal(data))]


def test_the_vision_graph_is_built_once_per_input_shape(toy, path):
    """A model with the split: the runner builds its largest image graph at start-up, one more per new input
    shape, and refills a kept one for each later image of its shape; the results equal a graph per image."""
    images = [b"IMG\x10\x01", b"IMG\x20\x01", b"IMG\x30\x04", b"IMG\x40\x01", b"IMG\x50\x02"]
    with Runner(toy, parallel=1, num_ctx=64, batch_size=16) as runner:  # a graph per image (encode_multimodal)
        expected = [run_all(runner, "a [img-0] b", [data])[:2] for data in images]
        assert runner.engine.vision_built == len(images) and runner.engine.vision_reused == 0
    split = models.load(path, BackendParams(n_threads=1))
    split.__class__ = ToySplit
    ToySplit.built = 0
    try:
        with Runner(split, parallel=1, num_ctx=64, batch_size=16) as runner:
            engine = runner.engine
            assert ToySplit.built == engine.vision_built == 1  # the worst case (4 copies), reserved at start-up
            got = []
            for data, built, reused in zip(images, (2, 2, 2, 2, 3), (0, 1, 2, 3, 3), strict=True):
                got.append(run_all(runner, "a [img-0] b", [data])[:2])
                assert (engine.vision_built, engine.vision_reused) == (built, reused), data
            assert ToySplit.built == 3
    finally:
        split.close()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
