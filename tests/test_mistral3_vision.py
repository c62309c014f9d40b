"""Mistral 3 vision (Pixtral): a tiny random ``Mistral3ForConditionalGeneration`` converted by our converter gives
transformers' pixels (PixtralImageProcessor: native aspect ratio, longest edge bounded), vision tower states, image
embeddings and image+text logits for images of several shapes; images of different grids share a batch; the
prompt cache serves a repeated image; the two-file (mmproj) layout gives the same logits."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from tests._models import check_mmproj_split, images_alone_and_together, scaled_error

from .hf_fixtures import make_bpe_tokenizer, png
from .test_convert import needs_llama_cpp

torch = pytest.importorskip("torch", reason="the parity tests need torch (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (`reference` extra)")
Image = pytest.importorskip("PIL.Image", reason="images need Pillow")

LONGEST, PATCH, MERGE = 64, 8, 2  # images up to 64 px a side, in 16 px image tokens (8x8 grids at most)
UNIT = PATCH * MERGE
# Ministral 3's: YaRN and Llama 4's attention temperature (a step every 8 positions: the prompts cross several)
ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
PROMPT = "The cafe is [img-0] naive, 42 people said! Then they left"
SHORT = "a [img-0] cat"
# (width, height): landscape, portrait, larger than the longest edge (scaled down, rounded down, then up to 16 px
# multiples), one row of tokens (no [IMG_BREAK]), a single token
SIZES = {"landscape": (40, 28), "portrait": (20, 60), "large": (150, 90), "one-row": (60, 10), "tiny": (9, 12)}
GRIDS = {"landscape": (3, 2), "portrait": (2, 4), "large": (4, 3), "one-row": (4, 1), "tiny": (1, 1)}  # cols, rows


def build(tmp: Path, text_type: str = "ministral3", hidden_act: str = "silu", merge: int = MERGE):
    """(HF model, its image processor, our converted F32 file, the image token ids) of a tiny random
    Mistral3ForConditionalGeneration: a Ministral 3 (GGUF mistral3) or Mistral Small 3.x (GGUF llama) text decoder,
    a 2-layer Pixtral tower, spatial merge 2, projector biases, a vocabulary with the image tokens."""
    from tokenizers import Tokenizer

    from pyggml.convert import convert_hf

    hf_dir = tmp / "hf"
    hf_dir.mkdir()
    make_bpe_tokenizer(hf_dir, 0)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok.add_special_tokens(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    tok.save(str(hf_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]")}
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    if text_type == "ministral3":
        text_config, extra = transformers.Ministral3Config, {"rope_parameters": dict(ROPE)}
    else:
        text_config, extra = transformers.MistralConfig, {"rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 1e9},
                                                          "sliding_window": None}
    text = text_config(
        vocab_size=-(-n_tokens // 32) * 32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        initializer_range=0.05, bos_token_id=0, eos_token_id=1, pad_token_id=2, **extra)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=LONGEST, patch_size=PATCH,
                                              head_dim=16, hidden_act=hidden_act)
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=ids["[IMG]"],
                                         spatial_merge_size=merge, multimodal_projector_bias=True,
                                         attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "vision_tower" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.copy_(0.5 * torch.randn_like(p))  # sharp attention: the patches' rotary positions matter
    model.save_pretrained(hf_dir)
    processor = transformers.PixtralImageProcessorPil(size={"longest_edge": LONGEST},
                                                      patch_size={"height": PATCH * merge, "width": PATCH * merge})
    processor.save_pretrained(hf_dir)
    path = convert_hf(hf_dir, tmp / "model.gguf", "f32")
    return model, processor, path, ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build(tmp_path_factory.mktemp("mistral3v"))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build(tmp_path_factory.mktemp("mistral-small-v"), "mistral")


def hf_inputs(processor, data: bytes) -> tuple[np.ndarray, list]:
    out = processor(Image.open(io.BytesIO(data)), return_tensors="np")
    return out["pixel_values"][0], [list(map(int, out["image_sizes"][0]))]


@pytest.mark.parametrize("shape", list(SIZES))
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_pixels_equal_the_hf_processor(tiny, shape, mode):
    from pyggml import models

    _, processor, path, _ = tiny
    data = png(1, SIZES[shape], mode=mode)
    model = models.load(path)
    try:
        ours = model.vision.preprocess(data)["pixels"]
    finally:
        model.close()
    cols, rows = GRIDS[shape]
    assert ours.shape == (3, rows * UNIT, cols * UNIT)
    np.testing.assert_array_equal(ours, hf_inputs(processor, data)[0])


@pytest.mark.parametrize("shape", list(SIZES))
def test_vision_tower_and_image_embeddings_match_transformers(tiny, shape):
    check_vision(tiny, shape)


def test_a_gelu_tower_without_merging_matches_transformers(tmp_path):
    """Pixtral's own default activation (clip.use_gelu; the released models use SiLU) and spatial_merge_size 1
    (one token per patch; the merger's norm and linear layer still apply)."""
    import gguf

    converted = build(tmp_path, hidden_act="gelu", merge=1)
    fields = gguf.GGUFReader(converted[2]).fields
    assert fields["clip.use_gelu"].contents() is True and fields["clip.vision.spatial_merge_size"].contents() == 1
    check_vision(converted, "large", merge=1)


def check_vision(converted, shape: str, merge: int = MERGE) -> None:
    from pyggml import BackendParams, models

    model, processor, path, ids = converted
    data = png(3, SIZES[shape])
    pixels, sizes = hf_inputs(processor, data)
    with torch.no_grad():
        ref_states = model.model.vision_tower(torch.tensor(pixels[None]), image_sizes=sizes).last_hidden_state[0]
        # (the projector as get_image_features calls it, whose split of the result fails for one token)
        ref_embeds = model.model.multi_modal_projector(ref_states, torch.tensor(sizes)).numpy()
        break_row = model.get_input_embeddings().weight[ids["[IMG_BREAK]"]].numpy()
    ours = models.load(path, BackendParams(n_threads=2))
    cols, rows = pixels.shape[2] // (PATCH * merge), pixels.shape[1] // (PATCH * merge)
    try:
        v = ours.vision
        with ours.backend.new_context() as ctx:
            states = v.tower(ctx, pixels, v.options)
            embeds = v.projector(ctx, states, cols * merge, rows * merge, v.options)
            ctx.compute(states, embeds)
            states, embeds = states.numpy(), embeds.numpy()
        with ours.backend.new_context() as ctx:
            (item,) = v.encode(ctx, data)
            ctx.compute(item.tensor)
            lines = item.tensor.numpy()
    finally:
        ours.close()
    print(f"{shape}: states {scaled_error(states, ref_states.numpy()):.2e}, "
          f"embeddings {scaled_error(embeds, ref_embeds):.2e}")
    # measured <= 5.3e-7 (states), 3.4e-7 (embeddings); GELU taken for SiLU gives 9e-5, no column frequency 1.5e-2
    assert scaled_error(states, ref_states.numpy()) <= 1e-5
    assert scaled_error(embeds, ref_embeds) <= 1e-5
    # the image's rows as the prompt holds them: each row's embeddings, [IMG_BREAK]'s after all but the last
    assert lines.shape == (rows * (cols + 1) - 1, 64)
    expected = np.concatenate([np.vstack([embeds[r * cols:(r + 1) * cols], break_row[None]]) for r in range(rows)])
    np.testing.assert_array_equal(lines, expected[:-1])


def _hf_ids(llm, ids: dict[str, int], cols: int, rows: int) -> list[int]:
    before, after = PROMPT.split("[img-0]")
    image = ([ids["[IMG]"]] * cols + [ids["[IMG_BREAK]"]]) * rows
    image[-1] = ids["[IMG_END]"]
    return llm.tokenizer.encode(before) + image + llm.tokenizer.encode(after, add_special=False)


@pytest.mark.parametrize("shape", ["landscape", "portrait", "large", "one-row"])  # (HF fails on one token)
def test_image_and_text_logits_match_transformers(tiny, shape):
    check_logits(tiny, shape)


def test_mistral_small_image_and_text_logits_match_transformers(small):
    """Mistral Small 3.x: the text decoder is GGUF llama, the vision part the same."""
    import gguf

    assert gguf.GGUFReader(small[2]).fields["general.architecture"].contents() == "llama"
    check_logits(small, "large")


def check_logits(converted, shape: str) -> None:
    import pyggml
    from pyggml.runner import CompletionRequest

    model, processor, path, ids = converted
    data = png(4, SIZES[shape])
    with pyggml.load(path, n_threads=2, num_ctx=128, cache_type="f32") as llm:
        tokens = _hf_ids(llm, ids, *GRIDS[shape])
        *_, last = llm.runner.completion(CompletionRequest(prompt=PROMPT, images=[data], max_tokens=0,
                                                           prompt_logits=True))
        ours = last.prompt_logits
        assert last.prompt_tokens == len(tokens)
        n_vocab = llm.tokenizer.vocab_size
    pixels, sizes = hf_inputs(processor, data)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens]), pixel_values=torch.tensor(pixels[None]),
                    image_sizes=sizes).logits[0].numpy()[:, :n_vocab]
        text_only = model(input_ids=torch.tensor([tokens])).logits[0].numpy()[:, :n_vocab]
    assert ours.shape == ref.shape
    print(f"{shape}: image+text logits {scaled_error(ours, ref):.2e} (without the image: "
          f"{scaled_error(ours, text_only):.2e})")
    assert scaled_error(ours, ref) <= 1e-5, scaled_error(ours, ref)  # measured <= 3.9e-7
    assert scaled_error(ours, text_only) > 1e-2  # the image's embeddings matter to the logits checked


def test_converter_writes_llama_cpps_pixtral_names_and_keys(tiny):
    import gguf

    _, _, path, _ = tiny
    reader = gguf.GGUFReader(Path(path))
    names = {t.name for t in reader.tensors}
    assert {"v.patch_embd.weight", "v.pre_ln.weight", "v.blk.1.attn_q.weight", "v.blk.1.ffn_gate.weight",
            "v.token_embd.img_break", "mm.input_norm.weight", "mm.patch_merger.weight", "mm.1.weight", "mm.1.bias",
            "mm.2.weight", "mm.2.bias", "token_embd.weight"} <= names
    assert not any(n.startswith("v.post_ln") or "position_embd" in n for n in names)
    fields = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("clip.")}
    assert fields["clip.projector_type"] == "pixtral" and fields["clip.use_silu"] is True
    assert (fields["clip.vision.image_size"], fields["clip.vision.patch_size"],
            fields["clip.vision.spatial_merge_size"], fields["clip.vision.projection_dim"]) == (
        LONGEST, PATCH, MERGE, 64)


def test_two_sequences_with_different_images_in_one_batch_equal_each_alone(tiny):
    _, _, path, _ = tiny
    cases = [(SHORT, png(30, SIZES["landscape"])), ("the [img-0] dog", png(31, SIZES["portrait"]))]
    alone, together, batches, vision_built = images_alone_and_together(path, cases, num_ctx=128, batch_size=64,
                                                                       logit_bias={1: float("-inf")})
    assert vision_built >= 2  # a graph per grid shape
    assert [len(index) for _, index in batches if index] == [2]  # both images in the first batch
    for (tokens_alone, logits_alone), (tokens_both, logits_both) in zip(alone, together, strict=True):
        assert tokens_alone == tokens_both
        print(f"two images in one batch vs alone: {scaled_error(logits_both, logits_alone):.2e}")
        assert scaled_error(logits_both, logits_alone) <= 1e-4, scaled_error(logits_both, logits_alone)


def test_same_image_is_served_from_the_cache_and_another_is_not(tiny):
    import pyggml
    from pyggml.runner import CompletionRequest

    _, _, path, _ = tiny
    with pyggml.load(path, n_threads=2, num_ctx=128) as llm:
        def run(data):
            chunks = list(llm.runner.completion(CompletionRequest(prompt=SHORT, images=[data], max_tokens=2,
                                                                  temperature=0, logit_bias={1: float("-inf")})))
            return [t for c in chunks for t in c.tokens], chunks[-1]

        engine = llm.runner.engine
        encoded = engine.vision_built + engine.vision_reused
        first, a = run(png(5, SIZES["large"]))
        assert engine.vision_built + engine.vision_reused == encoded + 1
        again, b = run(png(5, SIZES["large"]))
        assert engine.vision_built + engine.vision_reused == encoded + 1  # from the cache: not encoded again
        other, c = run(png(6, SIZES["large"]))
        assert engine.vision_built + engine.vision_reused == encoded + 2
        assert a.cached_tokens == 0 and b.cached_tokens == b.prompt_tokens - 1 and first == again
        assert c.cached_tokens < c.prompt_tokens - 12  # the prefix stops before the other image


def test_the_vision_graph_is_kept_per_image_shape(tiny):
    """One graph per grid shape (the largest built at start-up); an image of a shape seen before refills it,
    and a refilled graph computes what a new one does."""
    import pyggml

    _, _, path, _ = tiny
    images = [png(20, (40, 28)), png(21, (44, 30)), png(22, (20, 60)), png(23, (64, 64), "L")]  # grids 3x2 3x2 2x4 4x4
    with pyggml.load(path, n_threads=2, num_ctx=128) as llm:
        engine, model = llm.runner.engine, llm.model
        assert (engine.vision_built, engine.vision_reused) == (1, 0)  # the largest (4x4), at start-up
        counts = []
        for data in images:
            llm.generate(SHORT, images=[data], max_tokens=1)
            counts.append((engine.vision_built, engine.vision_reused))
        assert counts == [(2, 0), (2, 1), (3, 1), (3, 2)]
        for data in images:
            (refilled,) = engine.encode(data)
            with model.backend.new_context() as ctx:
                (fresh,) = model.vision.encode(ctx, data)
                ctx.compute(fresh.tensor)
                np.testing.assert_array_equal(refilled.tensor, fresh.tensor.numpy())


@pytest.mark.parametrize("which", ["tiny", "small"])
def test_text_file_plus_mmproj_gives_the_same_logits(which, request, tmp_path):
    _, _, path, _ = request.getfixturevalue(which)
    check_mmproj_split(path, tmp_path, PROMPT, png(10, SIZES["portrait"]))


@needs_llama_cpp
@pytest.mark.parametrize("which", ["tiny", "small"])
def test_llama_cpp_reads_our_text_and_mmproj_files_and_computes_the_same_image_embeddings(which, request, tmp_path):
    """llama.cpp's mtmd on the split files: the image chunk (rows with [IMG_BREAK] between them) of an image
    already at a size it keeps (64x48: 4x3 tokens, above its minimum of 8), so its own resizing does not enter."""
    import subprocess
    import sys

    from pyggml import BackendParams, models
    from pyggml.convert.gemma3_vision import split_mmproj

    from .test_gemma3_vision import _MTMD

    _, _, path, _ = request.getfixturevalue(which)
    text, mmproj = split_mmproj(path, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    width, height = 64, 48
    pixels = np.random.default_rng(3).integers(0, 256, (height, width, 3), dtype=np.uint8)
    (tmp_path / "img.rgb").write_bytes(pixels.tobytes())
    done = subprocess.run([sys.executable, "-c", _MTMD, str(text), str(mmproj), str(tmp_path / "img.rgb"),
                           str(width), str(height)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = np.array(json.loads(done.stdout.strip().splitlines()[-1]), np.float32).reshape(-1, 64)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    model = models.load(path, BackendParams(n_threads=2))
    try:
        with model.backend.new_context() as ctx:
            (item,) = model.vision.encode(ctx, out.getvalue())
            ctx.compute(item.tensor)
            ours = item.tensor.numpy()
    finally:
        model.close()
    assert ours.shape == theirs.shape == (3 * 5 - 1, 64)
    print(f"vs llama.cpp mtmd: {scaled_error(ours, theirs):.2e}")
    assert scaled_error(ours, theirs) <= 2e-3


def test_llm_generate_and_chat_take_images(tiny, tmp_path):
    import base64

    import pyggml

    _, _, path, _ = tiny
    data = png(8, SIZES["landscape"])
    file = tmp_path / "cat.png"
    file.write_bytes(data)
    greedy = dict(max_tokens=2, temperature=0, logit_bias={1: float("-inf")})
    with pyggml.load(path, n_threads=2, num_ctx=128) as llm:
        by_bytes = llm.generate(SHORT, images=[data], **greedy)
        assert llm.generate(SHORT, images=[file], **greedy) == by_bytes
        assert llm.stats.cached_tokens > 0  # the same image: the prompt came from the cache
        b64 = base64.b64encode(data).decode()
        ollama = llm.chat([{"role": "user", "content": "what is this?", "images": [b64]}], **greedy)
        openai = llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
            {"type": "text", "text": "what is this?"}]}], **greedy)
        assert ollama == openai


def test_server_takes_images_through_both_apis(tiny):
    import base64

    import httpx

    from ._server import image_through_chat_completions, image_through_generate_and_chat, running_server

    _, _, path, _ = tiny
    b64 = base64.b64encode(png(9, SIZES["portrait"])).decode()
    with running_server(path, parallel=1, num_ctx=128) as server:
        base, served = server
        gen, chat = image_through_generate_and_chat(server, b64)
        assert gen["response"] == chat["message"]["content"]  # the same rendered prompt
        openai = image_through_chat_completions(server, b64)
        assert openai["choices"][0]["message"]["content"] is not None
        assert openai["usage"]["prompt_tokens"] > 2 * 5 - 1  # the portrait's 2x4 tokens and 3 breaks
        response = httpx.post(base + "/api/generate", json={"model": served.name, "stream": False, "prompt": "x",
                                                            "images": [base64.b64encode(b"junk").decode()]},
                              timeout=60)
        assert response.status_code == 400 and "not an image" in response.text


def test_cli_converts_to_text_plus_mmproj_and_runs_with_an_image(tiny, tmp_path, capsys):
    from pyggml.cli import main

    _, _, path, _ = tiny
    hf_dir = Path(path).parent / "hf"
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(hf_dir), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    picture = tmp_path / "p.png"
    picture.write_bytes(png(11, SIZES["large"]))
    assert main(["run", str(text), "--mmproj", str(mmproj), "--image", str(picture), "what [img-0] is",
                 "--max-tokens", "3", "--temperature", "0"]) == 0
    assert main(["show", str(mmproj)]) == 0
    assert "pixtral projector, 2 layers" in capsys.readouterr().out
    assert main(["run", str(text), "--image", str(picture), "what is"]) == 1  # no vision part: a clear error
    assert "takes no images" in capsys.readouterr().err


def test_a_vocabulary_without_image_tokens_converts_the_text_only(tmp_path):
    """A checkpoint whose tokenizer lacks [IMG_BREAK] etc. cannot place images: its text decoder is converted alone."""
    import pyggml
    from pyggml.convert import convert_hf

    from .hf_fixtures import make_tiny_mistral3_with_vision

    hf_dir, _ = make_tiny_mistral3_with_vision(tmp_path, ROPE)
    with pyggml.load(convert_hf(hf_dir, tmp_path / "m.gguf", "f32"), n_threads=1, num_ctx=64) as llm:
        assert not llm.model.takes_images


def test_an_mmproj_for_another_model_is_refused_clearly(tiny, tmp_path):
    """A pixtral mmproj on a model built on Llama's graph that is not Mistral's (qwen2), a gemma3 mmproj on a
    llama file: a clear error at load; on a llama file whose vocabulary lacks [IMG]: a clear error per request."""
    import pyggml
    from pyggml.convert.gemma3_vision import split_mmproj
    from pyggml.synthetic import write_synthetic

    from .test_gemma3_vision import _mmproj

    _, _, path, _ = tiny
    _, mmproj = split_mmproj(path, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    qwen2 = write_synthetic(tmp_path / "q.gguf", "qwen2", "f32")
    llama = write_synthetic(tmp_path / "l.gguf", "llama", "f32")
    with pytest.raises(ValueError, match="takes no mmproj file"):
        pyggml.load(qwen2, n_threads=1, num_ctx=64, mmproj=mmproj)
    with pyggml.load(llama, n_threads=1, num_ctx=64, mmproj=mmproj) as llm:  # (of the same width, 64)
        assert llm.model.takes_images
        with pytest.raises(ValueError, match=r"no \[IMG\] token"):  # its vocabulary cannot place images
            llm.generate("x", images=[png(1)], max_tokens=1)
    gemma = _mmproj(tmp_path / "gemma-mmproj.gguf", image=32, patch=8)
    with pytest.raises(ValueError, match="'gemma3', not 'pixtral'"):
        pyggml.load(llama, n_threads=1, num_ctx=64, mmproj=gemma)
