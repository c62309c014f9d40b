"""Qwen 2.5-VL: a tiny random ``Qwen2_5_VLForConditionalGeneration`` converted by our converter gives
transformers' pixels (smart resize, bicubic, normalisation, patch order), vision tower and merger output
and image+text logits (mRoPE positions) for images of several sizes and aspect ratios; two sequences
with images of different grid sizes in one batch equal each alone; a cached image is not encoded again."""

from __future__ import annotations

import io

import numpy as np
import pytest

from .hf_fixtures import make_qwen_tokenizer, png

torch = pytest.importorskip("torch", reason="the parity tests need torch (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (`reference` extra)")
Image = pytest.importorskip("PIL.Image", reason="images need Pillow")

MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 40  # 4 to 40 image tokens
# (width, height): landscape, portrait, square, larger than MAX_PIXELS, smaller than MIN_PIXELS; the
# landscape and large ones span more than one 4x4-token attention window
SIZES = [(250, 70), (60, 170), (90, 90), (700, 500), (30, 20)]
PROMPT = "The cafe is [img-0] naive, 42 people said! Then they left"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tokenizers import Tokenizer

    from pyggml.convert import convert_hf

    tmp = tmp_path_factory.mktemp("qwen25vl")
    hf_dir = tmp / "hf"
    hf_dir.mkdir()
    make_qwen_tokenizer(hf_dir, 0)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok.add_special_tokens(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    tok.save(str(hf_dir / "tokenizer.json"))
    start, end, pad = (tok.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    text = dict(vocab_size=416, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3]})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, spatial_merge_size=2,
                  window_size=112, out_hidden_size=64, fullatt_block_indexes=[1])
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                           vision_start_token_id=start, vision_end_token_id=end,
                                           attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "ln_q" in name or "norm1" in name or "norm2" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    processor = transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    processor.save_pretrained(hf_dir)
    path = convert_hf(hf_dir, tmp / "model.gguf", "f32")
    return model, processor, path, (start, end, pad)


def scaled_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def hf_image(processor, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    out = processor(Image.open(io.BytesIO(data)), return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def image_of(size: tuple[int, int], seed: int = 3) -> bytes:
    return png(seed, size=size)


@pytest.fixture(scope="module")
def ours(tiny):
    from pyggml import BackendParams, models

    model = models.load(tiny[2], BackendParams(n_threads=2))
    yield model
    model.close()


@pytest.mark.parametrize("size", SIZES)
def test_pixels_equal_the_hf_processor(tiny, ours, size):
    from pyggml.models.qwen2vl_vision import PIXELS

    _, processor, _, _ = tiny
    data = image_of(size)
    ref, grid = hf_image(processor, data)
    patches = ours.vision.preprocess(data)[PIXELS]
    rows, cols = patches.shape[:2]
    assert [1, rows * 2, cols * 2] == grid[0].tolist()
    frames = ref.reshape(len(ref), 3, 2, 14 * 14)
    np.testing.assert_array_equal(frames[:, :, 0], frames[:, :, 1])  # a still image: two equal frames
    np.testing.assert_array_equal(patches.reshape(len(ref), -1), frames[:, :, 0].reshape(len(ref), -1))


@pytest.mark.parametrize("size", SIZES)
def test_vision_tower_and_merger_match_transformers(tiny, ours, size):
    model, processor, _, _ = tiny
    data = image_of(size)
    pixels, grid = hf_image(processor, data)
    with torch.no_grad():
        ref = model.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(grid)).pooler_output.numpy()
    with ours.backend.new_context() as ctx:
        (item,) = ours.vision.encode(ctx, data)
        ctx.compute(item.tensor)
        embeds = item.tensor.numpy()
    assert embeds.shape == ref.shape
    print(f"{size}: grid {grid[0].tolist()}, embeddings {scaled_error(embeds, ref):.2e}")
    assert scaled_error(embeds, ref) <= 1e-4, scaled_error(embeds, ref)


def _hf_logits(tiny, llm, prompt: str, data: bytes) -> np.ndarray:
    model, processor, _, (start, end, pad) = tiny
    pixels, grid = hf_image(processor, data)
    n = int(grid[0].prod()) // 4
    before, after = prompt.split("[img-0]")
    ids = llm.tokenizer.encode(before) + [start] + [pad] * n + [end] + llm.tokenizer.encode(after, add_special=False)
    types = [1 if t == pad else 0 for t in ids]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels),
                    image_grid_thw=torch.tensor(grid), mm_token_type_ids=torch.tensor([types]))
    return out.logits[0].numpy()


@pytest.mark.parametrize("size", [SIZES[0], SIZES[1], SIZES[3]])
def test_image_and_text_logits_match_transformers(tiny, size):
    import pyggml
    from pyggml.runner import CompletionRequest

    data = image_of(size)
    with pyggml.load(tiny[2], n_threads=2, num_ctx=256, cache_type="f32") as llm:
        *_, last = llm.runner.completion(CompletionRequest(prompt=PROMPT, images=[data], max_tokens=0,
                                                           prompt_logits=True))
        ref = _hf_logits(tiny, llm, PROMPT, data)
    ours = last.prompt_logits
    assert ours.shape == ref.shape
    print(f"{size}: logits {scaled_error(ours, ref):.2e}")
    assert scaled_error(ours, ref) <= 1e-4, scaled_error(ours, ref)


def test_two_images_of_different_grids_in_one_batch_equal_each_alone(tiny, ours):
    from pyggml.runner import CompletionRequest, Runner

    from .test_multimodal_runner import record_batches

    cases = [("a [img-0] cat", image_of(SIZES[0], 5)), ("the dog [img-0] ran off", image_of(SIZES[1], 6))]

    def request(prompt, data):
        return CompletionRequest(prompt=prompt, images=[data], max_tokens=3, temperature=0, prompt_logits=True)

    def read(stream):
        chunks = list(stream)
        return [t for c in chunks for t in c.tokens], chunks[-1].prompt_logits

    with Runner(ours, parallel=2, num_ctx=128, batch_size=128, cache_type="f32", background=False) as runner:
        alone = [read(runner.completion(request(*case))) for case in cases]
        batches = record_batches(runner)
        streams = [runner.completion(request(*case)) for case in cases]
        together = [read(stream) for stream in streams]
    assert [len(index) for _, index in batches if index] == [2]  # both images (2x9 and 6x2 tokens) in one batch
    for (tokens_alone, logits_alone), (tokens_both, logits_both) in zip(alone, together, strict=True):
        assert tokens_alone == tokens_both
        assert scaled_error(logits_both, logits_alone) <= 1e-5, scaled_error(logits_both, logits_alone)


def test_a_cached_image_is_not_encoded_again(tiny):
    import pyggml
    from pyggml.runner import CompletionRequest

    data = image_of(SIZES[2], 7)
    with pyggml.load(tiny[2], n_threads=2, num_ctx=256, cache_type="f32") as llm:
        engine = llm.runner.engine
        first = list(llm.runner.completion(CompletionRequest(prompt="look [img-0] here", images=[data],
                                                             max_tokens=3, temperature=0)))
        encoded = engine.vision_built + engine.vision_reused
        again = list(llm.runner.completion(CompletionRequest(prompt="look [img-0] here", images=[data],
                                                             max_tokens=3, temperature=0)))
        assert engine.vision_built + engine.vision_reused == encoded  # the prompt cache held the image
        assert again[-1].cached_tokens > 0
        assert [t for c in first for t in c.tokens] == [t for c in again for t in c.tokens]
