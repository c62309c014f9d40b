"""The runner's multimodal path, model-agnostic: images in a request become the inputs the model's
``VisionPart`` places; their vision graph is computed once, outside the text batches, when
their input is first batched; ``same_batch`` keeps an image's inputs together; the prompt cache
reuses a slot whose prefix holds the same image (and only then). A toy vision model stands in."""

from __future__ import annotations

import numpy as np
import pytest

from pyggml import BackendParams, models, nn
from pyggml.input import Input
from pyggml.models import VisionPart
from pyggml.models.llama import Llama
from pyggml.runner import CompletionRequest, Runner
from pyggml.synthetic import write_synthetic

N_IMAGE = 3  # inputs an image takes (its embedding rows)
MARK = 5  # the toy's "start of image" token


class ToyPart(VisionPart):
    """A "vision tower": an image's embedding is a fixed function of its bytes (a sine pattern set by its
    fourth byte), computed in its own graph (not reusable: the pattern is an unnamed input)."""

    reusable = False

    def __init__(self, hidden: int):
        self.hidden = hidden

    def preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        if not data.startswith(b"IMG"):
            raise ValueError("not an image (the toy wants b'IMG...')")
        return {"pattern": np.sin(np.arange(N_IMAGE * self.hidden) * (data[3] / 37.0)).astype(np.float32)}

    def build(self, ctx, inputs) -> list:
        ToyVision.encoded += 1
        return [ctx.from_numpy(inputs["pattern"].reshape(N_IMAGE, -1)).scale(2.0)]

    def placeholders(self, image: Input, tokenizer) -> list[Input]:
        return [Input(token=MARK), Input(multimodal=image.multimodal, multimodal_hash=image.multimodal_hash,
                                         same_batch=N_IMAGE), *(Input(token=0) for _ in range(N_IMAGE - 1))]


class ToyVision(Llama):
    """The tiny llama with the toy vision part; an image's inputs see each other both ways."""

    encoded = 0

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
    model.vision = ToyPart(model.options.hidden_size)
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
    """The toy with a part whose graph is kept per input shape: its "pixels" come in ``k`` copies (the image's
    fifth byte), so images have different input shapes, and the graph averages them back: the same embeddings."""

    built = 0


class ToySplitPart(ToyPart):
    reusable = True

    def preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        pattern = super().preprocess(data)["pattern"]
        copies = data[4] if len(data) > 4 else 1
        return {"pixels": np.repeat(pattern.reshape(N_IMAGE, -1, 1), copies, axis=2)}

    def build(self, ctx, inputs: dict[str, np.ndarray]) -> list:
        ToySplit.built += 1
        pixels = ctx.from_numpy(inputs["pixels"], name="pixels")  # (copies, hidden, N_IMAGE)
        return [pixels.mean().reshape(self.hidden, N_IMAGE).scale(2.0)]

    def worst_case(self) -> dict[str, np.ndarray]:
        return self.preprocess(b"IMG\x00\x04")


def test_the_vision_graph_is_built_once_per_input_shape(toy, path):
    """A model with the split: the runner builds its largest image graph at start-up, one more per new input
    shape, and refills a kept one for each later image of its shape; the results equal a graph per image."""
    images = [b"IMG\x10\x01", b"IMG\x20\x01", b"IMG\x30\x04", b"IMG\x40\x01", b"IMG\x50\x02"]
    with Runner(toy, parallel=1, num_ctx=64, batch_size=16) as runner:  # a graph per image (the part is not reusable)
        expected = [run_all(runner, "a [img-0] b", [data])[:2] for data in images]
        assert runner.engine.vision_built == len(images) and runner.engine.vision_reused == 0
    split = models.load(path, BackendParams(n_threads=1))
    split.__class__ = ToySplit
    split.vision = ToySplitPart(split.options.hidden_size)
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


class TokenImages(VisionPart):
    """A dynamic-resolution toy: the image b"IMG" + ids is one row per id (its own number of inputs and its own
    graph shape), each row the model's embedding of that token id, computed in the vision graph. A prompt with
    such an image must then give the logits of the same prompt with the ids written as text."""

    def __init__(self, model):
        self.model, self.decoded = model, 0

    def preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        if not data.startswith(b"IMG") or len(data) < 4:
            raise ValueError("not an image (the toy wants b'IMG' and token ids)")
        self.decoded += 1
        return {"ids": np.frombuffer(data[3:], np.uint8).astype(np.int32)}

    def build(self, ctx, inputs) -> list:
        return [self.model.weights.token_embd(nn.int32_input(ctx, inputs["ids"], name="ids"))]

    def worst_case(self) -> dict[str, np.ndarray]:
        return {"ids": np.zeros(6, np.int32)}

    def placeholders(self, image: Input, tokenizer) -> list[Input]:
        n = len(image.multimodal[0].data["ids"])
        return [Input(multimodal=image.multimodal, multimodal_hash=image.multimodal_hash, same_batch=n - 1),
                *(Input(token=0) for _ in range(n - 1))]


class TextImages(Llama):
    def forward(self, ctx, batch):  # the tiny llama, with image rows over their placeholders (causal)
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch)
        h = nn.multimodal_embeddings(ctx, w.token_embd(inputs.tokens), batch)
        for i, layer in enumerate(w.blk):
            self.cache.set_layer(i)
            h = layer(ctx, h, inputs.positions, inputs.outputs if i == len(w.blk) - 1 else None, self.cache, o, None)
        return w.output(w.output_norm(h, o.eps))


def test_images_of_different_shapes_through_the_runner_decoded_once(path):
    """Per-image graph shapes and input counts (dynamic resolution) need no runner change: two images of 2 and 5
    rows in one prompt give the logits of the prompt with their ids as text; each shape gets one kept graph
    (and the start-up's largest one); each image's bytes are decoded once, when the request comes."""
    model = models.load(path, BackendParams(n_threads=1))
    model.__class__ = TextImages
    model.vision = part = TokenImages(model)
    images = [bytes([*b"IMG", 7, 9]), bytes([*b"IMG", 11, 12, 13, 14, 15])]
    tok = model.tokenizer
    text = tok.encode("red ", add_special=True) + [7, 9] + tok.encode(" fox ", add_special=False) + \
        [11, 12, 13, 14, 15] + tok.encode(" ran", add_special=False)
    try:
        with Runner(model, parallel=1, num_ctx=64, batch_size=32) as runner:
            engine = runner.engine
            assert (engine.vision_built, runner.image_run) == (1, 6)  # the worst case: 6 rows

            def logits(prompt, images=()):
                *_, last = runner.completion(CompletionRequest(prompt=prompt, images=images, max_tokens=0,
                                                               prompt_logits=True))
                return last.prompt_logits

            with_images = logits("red [img-0] fox [img-1] ran", images)
            assert part.decoded == 2 and (engine.vision_built, engine.vision_reused) == (3, 0)
            as_text = logits(text)
            assert with_images.shape == as_text.shape == (len(text), tok.vocab_size)
            np.testing.assert_allclose(with_images, as_text, rtol=0, atol=1e-5)
            logits("[img-0] [img-0]", [bytes([*b"IMG", 3, 4])])  # the shape of 2 rows again, named twice
            assert part.decoded == 3 and (engine.vision_built, engine.vision_reused) == (3, 2)
    finally:
        model.close()
