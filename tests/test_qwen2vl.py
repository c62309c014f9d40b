"""Qwen 2.5-VL: a tiny random ``Qwen2_5_VLForConditionalGeneration`` converted by our converter gives
transformers' pixels (smart resize, bicubic, normalisation, patch order), vision tower and merger output
and image+text logits (mRoPE positions) for images of several sizes and aspect ratios; two sequences
with images of different grid sizes in one batch equal each alone; a cached image is not encoded again."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest

from tests._models import check_mmproj_split, image_prompt_logits, images_alone_and_together, scaled_error

from .hf_fixtures import make_qwen_tokenizer, png
from .test_convert import needs_llama_cpp

torch = pytest.importorskip("torch", reason="the parity tests need torch (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (`reference` extra)")
Image = pytest.importorskip("PIL.Image", reason="images need Pillow")

MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 40  # 4 to 40 image tokens
# (width, height): landscape, portrait, square, larger than MAX_PIXELS, smaller than MIN_PIXELS; the
# landscape and large ones span more than one 4x4-token attention window
SIZES = [(250, 70), (60, 170), (90, 90), (700, 500), (30, 20)]
PROMPT = "The cafe is [img-0] naive, 42 people said! Then they left"



def vision_tokenizer(hf_dir: Path) -> tuple[int, int, int]:
    """Write Qwen's tokenizer with the vision tokens into the new folder ``hf_dir``: the ids of
    <|vision_start|>, <|vision_end|> and <|image_pad|> (qwen3vl's fixtures too)."""
    from tokenizers import Tokenizer

    hf_dir.mkdir()
    make_qwen_tokenizer(hf_dir, 0)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok.add_special_tokens(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    tok.save(str(hf_dir / "tokenizer.json"))
    return tuple(tok.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):

    from pyggml.convert import convert_hf

    tmp = tmp_path_factory.mktemp("qwen25vl")
    hf_dir = tmp / "hf"
    start, end, pad = vision_tokenizer(hf_dir)
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
    largest = ours.vision.worst_case()[PIXELS].shape  # what the runner reserves and sizes its batches by
    assert rows * cols <= largest[0] * largest[1] == MAX_PIXELS // 28 ** 2
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


def hf_logits(tiny, llm, prompt: str, data: bytes) -> np.ndarray:
    """Transformers' logits of ``prompt`` with image ``data`` at its ``[img-0]`` (tokens of ``llm``'s tokenizer),
    for ``tiny`` = (HF model, processor, path, (vision start, end, pad ids)) (qwen3vl too)."""
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

    data = image_of(size)
    with pyggml.load(tiny[2], n_threads=2, num_ctx=256, cache_type="f32") as llm:
        ours = image_prompt_logits(llm, PROMPT, data)
        ref = hf_logits(tiny, llm, PROMPT, data)
    assert ours.shape == ref.shape
    print(f"{size}: logits {scaled_error(ours, ref):.2e}")
    assert scaled_error(ours, ref) <= 1e-4, scaled_error(ours, ref)


def test_two_images_of_different_grids_in_one_batch_equal_each_alone(tiny, ours):
    two_images_in_one_batch_equal_each_alone(ours, SIZES[0], SIZES[1])  # 2x9 and 6x2 tokens


def two_images_in_one_batch_equal_each_alone(ours, size_a: tuple[int, int], size_b: tuple[int, int]) -> None:
    """Two prompts with one image each, of different grids, computed alone and then together: both images
    go in one batch and every prompt logit and generated token is the one computed alone (qwen3vl too)."""
    cases = [("a [img-0] cat", image_of(size_a, 5)), ("the dog [img-0] ran off", image_of(size_b, 6))]
    alone, together, batches, _ = images_alone_and_together(ours, cases, num_ctx=128, batch_size=128)
    assert [len(index) for _, index in batches if index] == [2]  # both images in one batch
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


def test_text_file_plus_mmproj_gives_the_same_logits(tiny, tmp_path):
    check_mmproj_split(tiny[2], tmp_path, PROMPT, image_of(SIZES[0], 10))


@needs_llama_cpp
@pytest.mark.parametrize("size", [(112, 56), (252, 56), (56, 168)])
def test_llama_cpp_reads_our_mmproj_and_computes_the_same_image_embeddings(tiny, tmp_path, size):
    """llama.cpp's multimodal path (mtmd) on the split files; the images' sides are multiples of 28
    within the pixel bounds, so neither side resizes them (llama.cpp resizes its own way). (252, 56) has
    three attention windows; (56, 168) two, one above the other."""

    mine, theirs = _ours_and_mtmd(tiny[2], tmp_path, size)
    print(f"{size}: vs llama.cpp {scaled_error(mine, theirs):.2e}")
    assert scaled_error(mine, theirs) <= 2e-3


def _ours_and_mtmd(path, tmp_path, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One random image's embeddings from our single file and from llama.cpp's mtmd on its split files."""
    import json
    import subprocess
    import sys

    from pyggml import BackendParams, models
    from pyggml.convert.gemma3_vision import split_mmproj

    from .test_gemma3_vision import _MTMD

    text, mmproj = split_mmproj(path, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    width, height = size
    pixels = np.random.default_rng(3).integers(0, 256, (height, width, 3), dtype=np.uint8)
    (tmp_path / "img.rgb").write_bytes(pixels.tobytes())
    done = subprocess.run([sys.executable, "-c", _MTMD, str(text), str(mmproj), str(tmp_path / "img.rgb"),
                           str(width), str(height)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    model = models.load(path, BackendParams(n_threads=2))
    try:
        with model.backend.new_context() as ctx:
            (item,) = model.vision.encode(ctx, out.getvalue())
            ctx.compute(item.tensor)
            mine = item.tensor.numpy()
    finally:
        model.close()
    theirs = np.array(json.loads(done.stdout.strip().splitlines()[-1]), np.float32)
    assert theirs.size == mine.size, (theirs.size, mine.shape)
    return mine, theirs.reshape(mine.shape)


def test_api_cli_and_server_take_images(tiny, tmp_path, capsys):
    import base64

    import httpx

    import pyggml
    from pyggml.cli import main

    from ._server import image_through_generate_and_chat, running_server

    data = image_of(SIZES[1], 12)
    b64 = base64.b64encode(data).decode()
    greedy = dict(max_tokens=2, temperature=0)
    with pyggml.load(tiny[2], n_threads=2, num_ctx=256) as llm:
        by_bytes = llm.generate("what [img-0] is", images=[data], **greedy)
        assert llm.generate("what [img-0] is", images=[data], **greedy) == by_bytes
        assert llm.stats.cached_tokens > 0  # the same image: the prompt came from the cache
        ollama = llm.chat([{"role": "user", "content": "what is this?", "images": [b64]}], **greedy)
        openai = llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
            {"type": "text", "text": "what is this?"}]}], **greedy)
        assert ollama == openai
    picture = tmp_path / "p.png"
    picture.write_bytes(data)
    assert main(["run", str(tiny[2]), "--image", str(picture), "what [img-0] is", "--max-tokens", "3",
                 "--temperature", "0", "--threads", "1"]) == 0
    capsys.readouterr()
    with running_server(tiny[2], parallel=1, num_ctx=256) as server:
        base, served = server
        gen, chat = image_through_generate_and_chat(server, b64)
        assert gen["response"] == chat["message"]["content"]  # the same rendered prompt
        bad = httpx.post(base + "/api/generate", json={"model": served.name, "stream": False, "prompt": "x",
                                                       "images": [base64.b64encode(b"GIF89a junk").decode()]},
                         timeout=60)
        assert bad.status_code == 400 and "not an image" in bad.text


def test_context_shift_past_an_image_processes_the_rest_again(tiny):
    """A full slot drops its oldest inputs after num_keep. Re-rotating the keys after a dropped image
    by the number of inputs dropped would be wrong (its mRoPE positions moved the text after it by its
    shape): the slot is cleared and what is kept is processed again; text alone shifts as usual. And a
    generation that shifts past its image runs to its end."""
    from pyggml.input import Input
    from pyggml.runner.inputcache import InputCache, ReprocessInputsError

    cache = InputCache(16, 1)
    slot, _ = cache.load_cache_slot([Input(token=1)] * 2)
    image = [Input(token=9, same_batch=3, rope_step=0), Input(token=9, rope_step=0), Input(token=9, rope_step=2),
             Input(token=8)]
    slot.inputs = [Input(token=1), *image, *(Input(token=t) for t in range(20, 31))]

    class Shifts:
        removed = []

        def remove(self, seq, begin, end=None):
            self.removed.append((begin, end))

    cache.cache = Shifts()
    with pytest.raises(ReprocessInputsError) as raised:
        cache.shift_cache_slot(slot, 1)
    assert Shifts.removed == [(0, None)] and slot.inputs == []  # the whole slot goes; the kept inputs come back
    assert [i.token for i in raised.value.inputs][:1] == [1]
    slot.inputs = [Input(token=1), *(Input(token=t) for t in range(20, 35))]  # text only: a plain shift
    Shifts.removed.clear()
    cache.shift_cache_slot(slot, 1)
    assert Shifts.removed and Shifts.removed[0][0] == 1 and Shifts.removed[0][1] is not None

    import pyggml
    from pyggml.runner import CompletionRequest

    with pyggml.load(tiny[2], n_threads=2, num_ctx=32, batch_size=32) as llm:
        eos = sorted(llm.tokenizer.vocab.eog)
        chunks = list(llm.runner.completion(CompletionRequest(
            prompt="a [img-0] cat", images=[image_of(SIZES[4], 13)], max_tokens=60, temperature=0, num_keep=1,
            logit_bias={t: float("-inf") for t in eos})))
    assert chunks[-1].generated_tokens == 60 and chunks[-1].finish_reason == "length"


def test_qwen2_vl_vision_and_logits_match_transformers(tmp_path):
    """Qwen2-VL (projector qwen2vl_merger): LayerNorms, QuickGELU, full attention in every layer."""

    import pyggml
    from pyggml.convert import convert_hf
    from pyggml.runner import CompletionRequest

    hf_dir = tmp_path / "hf"
    start, end, pad = vision_tokenizer(hf_dir)
    text = dict(vocab_size=416, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                        vision_start_token_id=start, vision_end_token_id=end,
                                        attn_implementation="eager")
    torch.manual_seed(2)
    model = transformers.Qwen2VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    processor = transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    processor.save_pretrained(hf_dir)
    path = convert_hf(hf_dir, tmp_path / "model.gguf", "f32")
    data = image_of(SIZES[0])  # 2x9 tokens: more than one window, were there windows
    pixels, grid = hf_image(processor, data)
    with torch.no_grad():
        ref_embeds = model.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(grid)).pooler_output.numpy()
    with pyggml.load(path, n_threads=2, num_ctx=256, cache_type="f32") as llm:
        assert llm.model.vision.options.layer_norm
        with llm.model.backend.new_context() as ctx:
            (item,) = llm.model.vision.encode(ctx, data)
            ctx.compute(item.tensor)
            embeds = item.tensor.numpy()
        *_, last = llm.runner.completion(CompletionRequest(prompt=PROMPT, images=[data], max_tokens=0,
                                                           prompt_logits=True))
        before, after = PROMPT.split("[img-0]")
        ids = llm.tokenizer.encode(before) + [start] + [pad] * (int(grid[0].prod()) // 4) + [end] + \
            llm.tokenizer.encode(after, add_special=False)
    types = [1 if t == pad else 0 for t in ids]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid),
                    mm_token_type_ids=torch.tensor([types])).logits[0].numpy()
    print(f"qwen2-vl: embeddings {scaled_error(embeds, ref_embeds):.2e}, "
          f"logits {scaled_error(last.prompt_logits, ref):.2e}")
    assert scaled_error(embeds, ref_embeds) <= 1e-4, scaled_error(embeds, ref_embeds)
    assert scaled_error(last.prompt_logits, ref) <= 1e-4, scaled_error(last.prompt_logits, ref)
    if importlib.util.find_spec("llama_cpp") is not None:  # llama.cpp's mtmd reads our mmproj alike
        mine, theirs = _ours_and_mtmd(path, tmp_path, (252, 56))
        assert scaled_error(mine, theirs) <= 2e-3, scaled_error(mine, theirs)


def test_prompt_lookup_drafts_after_an_image_give_the_same_output(ours):
    """Drafted tokens after an image get the moved rope positions too (a rejected draft's rollback:
    tests/test_scheduler.py)."""
    from pyggml.runner import CompletionRequest, Runner

    data = image_of(SIZES[0], 14)
    prompt = "one two three [img-0] one two three one two three one two"

    def run(runner, lookup):
        chunks = list(runner.completion(CompletionRequest(prompt=prompt, images=[data], max_tokens=12, temperature=0,
                                                          prompt_lookup=lookup, cache_prompt=False,
                                                          logit_bias={t: float("-inf")
                                                                      for t in ours.tokenizer.vocab.eog})))
        return [t for c in chunks for t in c.tokens], chunks[-1]

    with Runner(ours, parallel=1, num_ctx=128, batch_size=64, cache_type="f32", background=False) as runner:
        plain, _ = run(runner, 0)
        drafted, last = run(runner, 4)
    assert drafted == plain
    assert last.draft_tokens > 0


def test_ollamas_qwen25vl_layout_gives_the_same_logits(tiny, tmp_path):
    """A file written the way Ollama's converter writes Qwen 2.5-VL (architecture qwen25vl, its key and tensor
    names, one file) runs as ours does (the image is within both files' pixel bounds)."""
    import gguf

    import pyggml
    from pyggml.models.qwen25vl import RENAMED
    from pyggml.runner import CompletionRequest

    reader = gguf.GGUFReader(tiny[2])
    path = tmp_path / "ollama.gguf"
    writer = gguf.GGUFWriter(path, "qwen25vl")
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "clip.")) or key == "general.architecture":
            continue
        key = key.replace("qwen2vl.rope.dimension_sections", "qwen25vl.rope.mrope_section").replace(
            "qwen2vl.", "qwen25vl.")
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    c = {key: reader.fields[key].contents() for key in reader.fields if key.startswith("clip.vision.")}
    for key in ("block_count", "embedding_length", "attention.head_count", "patch_size", "spatial_merge_size",
                "window_size"):
        writer.add_uint32(f"qwen25vl.vision.{key}", c[f"clip.vision.{key}"])
    writer.add_float32("qwen25vl.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_float32("qwen25vl.vision.rope.freq_base", 10000.0)
    writer.add_array("qwen25vl.vision.fullatt_block_indexes", [1])
    for t in reader.tensors:
        writer.add_tensor(RENAMED.get(t.name, t.name), t.data, raw_shape=list(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = image_of(SIZES[0], 16)

    def logits(file):
        with pyggml.load(file, n_threads=2, num_ctx=128, cache_type="f32") as llm:
            assert llm.model.takes_images
            *_, last = llm.runner.completion(CompletionRequest(prompt=PROMPT, images=[data], max_tokens=0,
                                                               prompt_logits=True))
            return last.prompt_logits

    np.testing.assert_array_equal(logits(path), logits(tiny[2]))


def test_an_image_too_thin_fails_its_request_clearly(tiny):
    """Hugging Face refuses an aspect ratio over 200; so does the request, before anything computes."""
    import pyggml
    from pyggml.runner import CompletionRequest

    with pyggml.load(tiny[2], n_threads=1, num_ctx=128) as llm:
        with pytest.raises(ValueError, match="aspect ratio"):
            list(llm.runner.completion(CompletionRequest(prompt="a [img-0]", images=[image_of((1000, 4))])))
        assert llm.generate("a [img-0]", images=[image_of((4, 800))], max_tokens=1) is not None  # ratio 200: taken


def test_real_head_sizes_match_transformers(tmp_path):
    """The real models' head sizes: text heads of 128 with mRoPE sections 16/24/24 and base 1e6, vision heads
    of 80 (20 rotated pairs per axis), windows and full attention every second layer."""

    import pyggml
    from pyggml.convert import convert_hf
    from pyggml.runner import CompletionRequest

    hf_dir = tmp_path / "hf"
    start, end, pad = vision_tokenizer(hf_dir)
    text = dict(vocab_size=416, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    vision = dict(depth=4, hidden_size=160, intermediate_size=256, num_heads=2, patch_size=14, spatial_merge_size=2,
                  window_size=112, out_hidden_size=256, fullatt_block_indexes=[1, 3])
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                           vision_start_token_id=start, vision_end_token_id=end,
                                           attn_implementation="eager")
    torch.manual_seed(3)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).float().eval()
    model.save_pretrained(hf_dir)
    processor = transformers.Qwen2VLImageProcessorPil()
    processor.save_pretrained(hf_dir)
    path = convert_hf(hf_dir, tmp_path / "model.gguf", "f32")
    data = image_of((300, 170), 17)
    pixels, grid = hf_image(processor, data)
    prompt = PROMPT + " and so on" * 10
    with pyggml.load(path, n_threads=2, num_ctx=512, cache_type="f32") as llm:
        *_, last = llm.runner.completion(CompletionRequest(prompt=prompt, images=[data], max_tokens=0,
                                                           prompt_logits=True))
        before, after = prompt.split("[img-0]")
        ids = llm.tokenizer.encode(before) + [start] + [pad] * (int(grid[0].prod()) // 4) + [end] + \
            llm.tokenizer.encode(after, add_special=False)
    types = [1 if t == pad else 0 for t in ids]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid),
                    mm_token_type_ids=torch.tensor([types])).logits[0].numpy()
    assert grid[0].tolist() == [1, 12, 22]  # 6 x 11 tokens: two windows high, three wide
    assert scaled_error(last.prompt_logits, ref) <= 1e-4, scaled_error(last.prompt_logits, ref)  # measured 8e-7
