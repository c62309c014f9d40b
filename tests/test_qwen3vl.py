"""Qwen3-VL: a tiny random ``Qwen3VLForConditionalGeneration`` converted by our converter gives
transformers' pixels, vision output (merger and DeepStack features, learned positions resampled per
grid) and image+text logits (interleaved mRoPE, DeepStack added in the first layers) for images of
several sizes and aspect ratios, and llama.cpp's mtmd computes the same embeddings from our mmproj."""

from __future__ import annotations

import numpy as np
import pytest

from tests._models import check_mmproj_split, image_prompt_logits, scaled_error

from .test_convert import needs_llama_cpp
from .test_qwen2vl import (
    PROMPT,
    hf_image,
    hf_logits,
    image_of,
    two_images_in_one_batch_equal_each_alone,
    vision_tokenizer,
)

torch = pytest.importorskip("torch", reason="the parity tests need torch (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (`reference` extra)")
Image = pytest.importorskip("PIL.Image", reason="images need Pillow")

FACTOR = 32  # patch 16 x merge 2
MIN_PIXELS, MAX_PIXELS = FACTOR * FACTOR * 4, FACTOR * FACTOR * 40
SIZES = [(250, 70), (60, 170), (96, 96), (900, 600), (30, 20)]  # landscape, portrait, square, too large, too small


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):

    from pyggml.convert import convert_hf

    tmp = tmp_path_factory.mktemp("qwen3vl")
    hf_dir = tmp / "hf"
    start, end, pad = vision_tokenizer(hf_dir)
    text = dict(vocab_size=416, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, spatial_merge_size=2,
                  out_hidden_size=64, num_position_embeddings=36, deepstack_visual_indexes=[0, 1])
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                        vision_start_token_id=start, vision_end_token_id=end,
                                        attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "pos_embed" in name:
                p.copy_(torch.randn_like(p))
    model.save_pretrained(hf_dir)
    processor = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=16, merge_size=2,
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor.save_pretrained(hf_dir)
    path = convert_hf(hf_dir, tmp / "model.gguf", "f32")
    return model, processor, path, (start, end, pad)


@pytest.fixture(scope="module")
def ours(tiny):
    from pyggml import BackendParams, models

    model = models.load(tiny[2], BackendParams(n_threads=2))
    yield model
    model.close()


@pytest.mark.parametrize("size", SIZES)
def test_pixels_equal_the_hf_processor(tiny, ours, size):
    from pyggml.models.qwen2vl_vision import PIXELS

    data = image_of(size)
    ref, grid = hf_image(tiny[1], data)
    patches = ours.vision.preprocess(data)[PIXELS]
    rows, cols = patches.shape[:2]
    assert [1, rows * 2, cols * 2] == grid[0].tolist()
    frames = ref.reshape(len(ref), 3, 2, 16 * 16)
    np.testing.assert_array_equal(patches.reshape(len(ref), -1), frames[:, :, 0].reshape(len(ref), -1))


@pytest.mark.parametrize("size", SIZES)
def test_vision_output_and_deepstack_features_match_transformers(tiny, ours, size):
    model, processor, _, _ = tiny
    data = image_of(size)
    pixels, grid = hf_image(processor, data)
    with torch.no_grad():
        out = model.model.visual(torch.tensor(pixels), grid_thw=torch.tensor(grid))
        ref = np.concatenate([out.pooler_output.numpy(), *(f.numpy() for f in out.deepstack_features)], axis=1)
    with ours.backend.new_context() as ctx:
        (item,) = ours.vision.encode(ctx, data)
        ctx.compute(item.tensor)
        embeds = item.tensor.numpy()
    assert embeds.shape == ref.shape == (int(grid[0].prod()) // 4, 64 * 3)
    print(f"{size}: grid {grid[0].tolist()}, embeddings {scaled_error(embeds, ref):.2e}")
    assert scaled_error(embeds, ref) <= 1e-4, scaled_error(embeds, ref)  # measured <= 2.5e-6


@pytest.mark.parametrize("size", [SIZES[0], SIZES[1], SIZES[3]])
def test_image_and_text_logits_match_transformers(tiny, size):
    import pyggml

    data = image_of(size)
    with pyggml.load(tiny[2], n_threads=2, num_ctx=256, cache_type="f32") as llm:
        ours = image_prompt_logits(llm, PROMPT, data)
        ref = hf_logits(tiny, llm, PROMPT, data)
    assert ours.shape == ref.shape
    print(f"{size}: logits {scaled_error(ours, ref):.2e}")
    assert scaled_error(ours, ref) <= 1e-4, scaled_error(ours, ref)  # measured <= 2.5e-6


def test_text_file_plus_mmproj_gives_the_same_logits(tiny, tmp_path):
    check_mmproj_split(tiny[2], tmp_path, PROMPT, image_of(SIZES[1], 10))


@needs_llama_cpp
@pytest.mark.parametrize("size", [(128, 64), (64, 192)])
def test_llama_cpp_reads_our_mmproj_and_computes_the_same_image_embeddings(tiny, ours, tmp_path, size):
    """llama.cpp's mtmd on the split files (sides multiples of 32 within the bounds: no resizing on
    either side); its output is the merger's embeddings and the DeepStack features side by side, as ours."""
    import io
    import json
    import subprocess
    import sys

    from pyggml.convert.gemma3_vision import split_mmproj

    from .test_gemma3_vision import _MTMD

    text, mmproj = split_mmproj(tiny[2], tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    width, height = size
    pixels = np.random.default_rng(3).integers(0, 256, (height, width, 3), dtype=np.uint8)
    (tmp_path / "img.rgb").write_bytes(pixels.tobytes())
    script = _MTMD.replace("n_embd = llama_cpp.llama_model_n_embd(model)", "n_embd = int(sys.argv[6])")
    assert script != _MTMD  # each image row: 64 x (1 merger + 2 DeepStack layers)
    done = subprocess.run([sys.executable, "-c", script, str(text), str(mmproj), str(tmp_path / "img.rgb"),
                           str(width), str(height), "192"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    with ours.backend.new_context() as ctx:
        (item,) = ours.vision.encode(ctx, out.getvalue())
        ctx.compute(item.tensor)
        mine = item.tensor.numpy()
    theirs = np.array(json.loads(done.stdout.strip().splitlines()[-1]), np.float32)
    theirs = theirs.reshape(len(mine), -1)
    assert mine.shape == theirs.shape
    print(f"{size}: vs llama.cpp {scaled_error(mine, theirs):.2e}")
    assert scaled_error(mine, theirs) <= 2e-3


def test_two_images_of_different_grids_in_one_batch_equal_each_alone(ours):
    """DeepStack adds each image's features at its own rows, whichever sequence it belongs to."""
    two_images_in_one_batch_equal_each_alone(ours, SIZES[0], SIZES[1])  # 2x8 and 5x2 tokens


def test_moe_image_and_text_logits_match_transformers(tmp_path):
    """Qwen3-VL-MoE (GGUF qwen3vlmoe): the same vision part and positions, Qwen 3 MoE's experts."""

    import pyggml
    from pyggml.convert import convert_hf
    from pyggml.runner import CompletionRequest

    hf_dir = tmp_path / "hf"
    start, end, pad = vision_tokenizer(hf_dir)
    text = dict(vocab_size=416, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, spatial_merge_size=2,
                  out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0])
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=pad,
                                           vision_start_token_id=start, vision_end_token_id=end,
                                           tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(1)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias") or "experts" in name or "mlp.gate" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    processor = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=16, merge_size=2,
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor.save_pretrained(hf_dir)
    path = convert_hf(hf_dir, tmp_path / "model.gguf", "f32")
    data = image_of(SIZES[0])
    with pyggml.load(path, n_threads=2, num_ctx=256, cache_type="f32") as llm:
        assert llm.model.architecture == "qwen3vlmoe"
        *_, last = llm.runner.completion(CompletionRequest(prompt=PROMPT, images=[data], max_tokens=0,
                                                           prompt_logits=True))
        pixels, grid = hf_image(processor, data)
        before, after = PROMPT.split("[img-0]")
        ids = llm.tokenizer.encode(before) + [start] + [pad] * (int(grid[0].prod()) // 4) + [end] + \
            llm.tokenizer.encode(after, add_special=False)
    types = [1 if t == pad else 0 for t in ids]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid),
                    mm_token_type_ids=torch.tensor([types])).logits[0].numpy()
    print(f"moe logits {scaled_error(last.prompt_logits, ref):.2e}")
    assert scaled_error(last.prompt_logits, ref) <= 1e-4, scaled_error(last.prompt_logits, ref)


def test_f16_and_q8_0_files_and_the_cli_mmproj_layout(tiny, tmp_path, capsys):
    """The converter's other types quantise the vision matrices too (the patch kernels and the position
    table stay F32); `pyggml convert --mmproj` writes llama.cpp's two files, which `run` and `show` read."""
    from pyggml import BackendParams, models
    from pyggml.cli import main
    from pyggml.convert import convert_hf

    hf_dir = tiny[2].parent / "hf"
    data = image_of(SIZES[0], 15)
    outputs = {}
    for kind in ("f32", "f16", "q8_0"):
        path = tiny[2] if kind == "f32" else convert_hf(hf_dir, tmp_path / f"{kind}.gguf", kind)
        model = models.load(path, BackendParams(n_threads=2))
        try:
            with model.backend.new_context() as ctx:
                (item,) = model.vision.encode(ctx, data)
                ctx.compute(item.tensor)
                outputs[kind] = item.tensor.numpy()
        finally:
            model.close()
    errors = {kind: scaled_error(out, outputs["f32"]) for kind, out in outputs.items()}
    assert errors["f16"] <= 2e-3 and errors["q8_0"] <= 2e-2, errors  # measured 1.3e-4, 3.3e-3
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(hf_dir), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    picture = tmp_path / "p.png"
    picture.write_bytes(data)
    assert main(["run", str(text), "--mmproj", str(mmproj), "--image", str(picture), "what [img-0] is",
                 "--max-tokens", "3", "--temperature", "0", "--threads", "1"]) == 0
    assert main(["show", str(mmproj)]) == 0
    assert "qwen3vl_merger projector, 3 layers" in capsys.readouterr().out
