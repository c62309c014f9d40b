"""Gemma 3 vision: a tiny random ``Gemma3ForConditionalGeneration`` converted by our converter gives
transformers' pixels, vision tower states, image embeddings and image+text logits; images go through
the runner's cache; bad images fail their request with a clear error."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tests._models import check_mmproj_split, images_alone_and_together, scaled_error

from .hf_fixtures import make_spm_tokenizer, png
from .test_convert import needs_llama_cpp

torch = pytest.importorskip("torch", reason="the parity tests need torch (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (`reference` extra)")
Image = pytest.importorskip("PIL.Image", reason="images need Pillow")

SYMBOLS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
SIZE, PATCH, TOKENS = 32, 8, 4  # a 4x4 patch grid pooled to 2x2 image tokens
PROMPT = "The cafe is [img-0] naive, 42 people said! Then they left"
SHORT = "a [img-0] cat"  # prompt + output within the sliding window (16): a cached prefix can be resumed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pyggml.convert import convert_hf

    tmp = tmp_path_factory.mktemp("gemma3v")
    hf_dir = tmp / "hf"
    hf_dir.mkdir()
    n_tokens = make_spm_tokenizer(hf_dir, 0, symbols=SYMBOLS)
    text = dict(vocab_size=-(-n_tokens // 32) * 32, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                max_position_embeddings=256, sliding_window=16, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                pad_token_id=0, initializer_range=0.05)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  image_size=SIZE, patch_size=PATCH, layer_norm_eps=1e-6)
    boi, eoi, soft = 4, 5, 6  # the user-defined symbols follow <unk> <s> </s> <tool>
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS,
                                       boi_token_index=boi, eoi_token_index=eoi, image_token_index=soft,
                                       attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight") or "soft_emb_norm" in name:
                p.copy_(0.2 * torch.randn_like(p))  # Gemma's norms scale by 1 + weight
            elif "mm_input_projection" in name:  # initialised to zeros
                p.copy_(0.2 * torch.randn_like(p))
            elif "vision" in name and name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    processor = transformers.Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE})
    processor.save_pretrained(hf_dir)
    path = convert_hf(hf_dir, tmp / "model.gguf", "f32")
    return model, processor, path, (boi, eoi, soft)


def hf_pixels(processor, data: bytes) -> np.ndarray:
    return processor(Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "CMYK"])
def test_pixels_equal_the_hf_processor(tiny, mode):
    from pyggml import image

    _, processor, _, _ = tiny
    data = png(1, mode=mode) if mode != "CMYK" else _jpeg_cmyk()
    ours = image.resize_normalize(image.decode(data), (SIZE, SIZE), [0.5] * 3, [0.5] * 3)
    np.testing.assert_array_equal(ours, hf_pixels(processor, data))


def _jpeg_cmyk() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (20, 30, 3), dtype=np.uint8)).convert("CMYK").save(
        out, format="JPEG")
    return out.getvalue()


def test_vision_tower_and_image_embeddings_match_transformers(tiny):
    from pyggml import BackendParams, models

    model, processor, path, _ = tiny
    data = png(3)
    pixels = hf_pixels(processor, data)
    with torch.no_grad():
        ref_states = model.model.vision_tower(pixel_values=torch.tensor(pixels[None])).last_hidden_state[0].numpy()
        ref_embeds = model.model.get_image_features(pixel_values=torch.tensor(pixels[None]))
        ref_embeds = getattr(ref_embeds, "pooler_output", ref_embeds)
        ref_embeds = np.asarray(ref_embeds).reshape(-1, 64)
    ours = models.load(path, BackendParams(n_threads=2))
    try:
        v = ours.vision
        assert ours.takes_images and v.options.tokens_per_image == TOKENS
        with ours.backend.new_context() as ctx:
            states = v.tower(ctx, pixels, v.options)
            embeds = v.projector(ctx, states, v.options)
            ctx.compute(states, embeds)
            states, embeds = states.numpy(), embeds.numpy()
        with ours.backend.new_context() as ctx:
            (item,) = ours.vision.encode(ctx, data)
            ctx.compute(item.tensor)
            np.testing.assert_array_equal(item.tensor.numpy(), embeds)  # decode + preprocess + both parts
    finally:
        ours.close()
    # measured: 3.1e-4 (states), 1.7e-4 (embeddings): ggml's GELU looks its values up in an F16 table
    print(f"vision: states {scaled_error(states, ref_states):.2e}, embeddings {scaled_error(embeds, ref_embeds):.2e}")
    assert scaled_error(states, ref_states) <= 1e-3, scaled_error(states, ref_states)
    assert scaled_error(embeds, ref_embeds) <= 1e-3, scaled_error(embeds, ref_embeds)


def _hf_ids(llm, boi: int, eoi: int, soft: int) -> tuple[list[int], list[int]]:
    before, after = PROMPT.split("[img-0]")
    nn = llm.tokenizer.encode("\n\n", add_special=False)
    ids = llm.tokenizer.encode(before) + nn + [boi] + [soft] * TOKENS + [eoi] + nn + \
        llm.tokenizer.encode(after, add_special=False)
    types = [1 if t == soft else 0 for t in ids]
    return ids, types


def test_image_and_text_logits_match_transformers(tiny):
    import pyggml
    from pyggml.runner import CompletionRequest

    model, processor, path, (boi, eoi, soft) = tiny
    data = png(4)
    with pyggml.load(path, n_threads=2, num_ctx=128, cache_type="f32") as llm:
        ids, types = _hf_ids(llm, boi, eoi, soft)
        *_, last = llm.runner.completion(CompletionRequest(prompt=PROMPT, images=[data], max_tokens=0,
                                                           prompt_logits=True))
        ours = last.prompt_logits
        n_vocab = llm.tokenizer.vocab_size
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(hf_pixels(processor, data)[None]),
                    token_type_ids=torch.tensor([types])).logits[0].numpy()[:, :n_vocab]
        causal = model(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(hf_pixels(processor, data)[None]),
                       ).logits[0].numpy()[:, :n_vocab]  # no token types: image tokens attend causally
    assert ours.shape == ref.shape
    print(f"image+text logits: {scaled_error(ours, ref):.2e} (causal image: {scaled_error(ours, causal):.2e})")
    assert scaled_error(ours, ref) <= 1e-3, scaled_error(ours, ref)
    assert scaled_error(ours, causal) > 1e-2  # so the parity above checks the image's both-ways attention


def test_same_image_is_served_from_the_cache_and_another_is_not(tiny):
    import pyggml
    from pyggml.runner import CompletionRequest

    _, _, path, _ = tiny
    with pyggml.load(path, n_threads=2, num_ctx=128) as llm:
        def run(data):
            chunks = list(llm.runner.completion(CompletionRequest(prompt=SHORT, images=[data], max_tokens=2,
                                                                  temperature=0, logit_bias={2: float("-inf")})))
            return [t for c in chunks for t in c.tokens], chunks[-1]

        engine = llm.runner.engine
        first, a = run(png(5))
        assert engine.vision_reused == 1
        again, b = run(png(5))
        assert engine.vision_reused == 1  # the image's inputs came from the cache: it was not encoded again
        other, c = run(png(6))
        assert engine.vision_reused == 2 and engine.vision_built == 1
        assert a.cached_tokens == 0 and b.cached_tokens == b.prompt_tokens - 1 and first == again
        assert c.cached_tokens < c.prompt_tokens - TOKENS  # the prefix stops before the other image


def _one_pixel() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (1, 1)).save(out, format="PNG")
    return out.getvalue()


def _huge() -> bytes:
    out = io.BytesIO()
    Image.new("L", (9000, 9000)).save(out, format="PNG")  # 81 Mpixel, a small file
    return out.getvalue()


def test_bad_images_fail_clearly_and_free_the_slot(tiny):
    import pyggml

    _, _, path, _ = tiny
    good = png(7)
    cases = [(b"not an image at all", "not an image"), (good[: len(good) // 2], "not an image"),
             (_one_pixel(), "at least 2 pixels"), (_huge(), "over the limit")]
    with pyggml.load(path, n_threads=2, num_ctx=128) as llm:
        for data, message in cases:
            with pytest.raises(ValueError, match=message):
                llm.generate(PROMPT, images=[data], max_tokens=2)
        assert llm.generate(PROMPT, images=[good], max_tokens=2, temperature=0) is not None


def test_text_only_gemma3_takes_no_images(tmp_path):
    import pyggml
    from pyggml.synthetic import write_synthetic

    path = write_synthetic(tmp_path / "g3.gguf", "gemma3", "f32")
    with pyggml.load(path, n_threads=1, num_ctx=64) as llm:
        assert not llm.model.takes_images
        with pytest.raises(ValueError, match="takes no images"):
            llm.generate("look", images=[png(1)], max_tokens=2)


def test_converter_writes_the_vision_part(tiny):
    import gguf

    _, _, path, _ = tiny
    reader = gguf.GGUFReader(Path(path))
    names = {t.name for t in reader.tensors}
    assert {"v.patch_embd.weight", "v.blk.1.ffn_down.bias", "v.post_ln.weight", "mm.input_projection.weight",
            "mm.soft_emb_norm.weight"} <= names
    assert reader.fields["clip.projector_type"].contents() == "gemma3"
    assert reader.fields["clip.vision.projector.scale_factor"].contents() == 2


def test_llm_generate_and_chat_take_images(tiny, tmp_path):
    import base64

    import pyggml

    _, _, path, _ = tiny
    data = png(8)
    file = tmp_path / "cat.png"
    file.write_bytes(data)
    greedy = dict(max_tokens=2, temperature=0, logit_bias={2: float("-inf")})
    with pyggml.load(path, n_threads=2, num_ctx=128) as llm:
        by_bytes = llm.generate(SHORT, images=[data], **greedy)
        assert llm.generate(SHORT, images=[file], **greedy) == by_bytes
        assert llm.stats.cached_tokens > 0  # the same image: the prompt came from the cache
        b64 = base64.b64encode(data).decode()
        ollama = llm.chat([{"role": "user", "content": "what is this?", "images": [b64]}], **greedy)
        openai = llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
            {"type": "text", "text": "what is this?"}]}], **greedy)
        assert ollama == openai  # the marker goes first either way; the template's newline joins the parts
        with pytest.raises(ValueError, match="remote image URLs are not fetched"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])


def test_server_takes_images_through_both_apis_and_refuses_bad_ones(tiny):
    import base64

    import httpx

    from ._server import image_through_chat_completions, image_through_generate_and_chat, post, running_server

    _, _, path, _ = tiny
    b64 = base64.b64encode(png(9)).decode()
    options = {"temperature": 0, "num_predict": 3}
    with running_server(path, parallel=1, num_ctx=128) as server:
        base, served = server
        gen, chat = image_through_generate_and_chat(server, b64)
        assert gen["response"] == chat["message"]["content"]  # the same rendered prompt
        openai = image_through_chat_completions(server, b64)
        assert openai["choices"][0]["message"]["content"] is not None
        bad = [("/api/generate", {"prompt": "x", "images": ["not base64!"]}, "base64"),
               ("/api/generate", {"prompt": "x", "images": [base64.b64encode(b"GIF89a junk").decode()]},
                "not an image"),
               ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": [b64[: len(b64) // 2]]}]},
                ""),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, "not fetched"),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}]}, "not fetched"),
               ("/api/generate", {"prompt": "x", "images": ["http://example.com/cat.png"]}, "not fetched"),
               ("/api/generate", {"prompt": "x", "images": [base64.b64encode(_one_pixel()).decode()]},
                "at least 2 pixels"),
               ("/api/chat", {"messages": [{"role": "user", "content": "x",
                                            "images": [base64.b64encode(_huge()).decode()]}]}, "over the limit")]
        for route, body, words in bad:
            response = httpx.post(base + route, json={"model": served.name, "stream": False, **body}, timeout=60)
            assert response.status_code == 400, (route, response.status_code, response.text)
            assert words in response.text
        again = post(server, "/api/generate", {"prompt": "what is this?", "images": [b64], "options": options})
        assert again["response"] == gen["response"]  # the slot was freed and works


def test_anthropic_and_responses_images_read_like_chat_completions(tiny):
    """Issue 29: an image block (Anthropic) and an input_image part (Responses) take the image path of
    chat completions: the same prompt (image tokens included) and the same greedy text."""
    import base64

    from ._server import post, running_server

    _, _, path, _ = tiny
    b64 = base64.b64encode(png(9)).decode()
    url = f"data:image/png;base64,{b64}"
    with running_server(path, parallel=1, num_ctx=128) as server:
        chat = post(server, "/v1/chat/completions", {"max_tokens": 3, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]})
        claude = post(server, "/v1/messages", {"max_tokens": 3, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": b64}}]}]})
        response = post(server, "/v1/responses", {"max_output_tokens": 3, "temperature": 0, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                         {"type": "input_image", "image_url": url}]}]})
    text = chat["choices"][0]["message"]["content"]
    assert "".join(b["text"] for b in claude["content"] if b["type"] == "text") == text
    assert response["output"][0]["content"][0]["text"] == text
    prompt = chat["usage"]["prompt_tokens"]
    assert prompt > TOKENS and response["usage"]["input_tokens"] == prompt
    assert claude["usage"]["input_tokens"] + claude["usage"]["cache_read_input_tokens"] == prompt


def test_the_server_decodes_each_image_once(tiny, monkeypatch):
    """An image is decoded once per request: the runner's completion decodes and preprocesses it (a bad one is
    still a 400 before any work, above); neither the server nor the encoder decodes it again."""
    import base64

    from pyggml import image

    from ._server import post, running_server

    _, _, path, _ = tiny
    calls, decode = [], image.decode
    monkeypatch.setattr(image, "decode", lambda data, *a, **k: calls.append(len(data)) or decode(data, *a, **k))
    data = png(13)
    with running_server(path, parallel=1, num_ctx=128) as server:
        post(server, "/api/generate", {"prompt": "what is this?", "images": [base64.b64encode(data).decode()],
                                       "options": {"temperature": 0, "num_predict": 2}})
    assert calls == [len(data)]


def test_text_file_plus_mmproj_gives_the_same_logits(tiny, tmp_path):
    import pyggml

    _, _, path, _ = tiny
    check_mmproj_split(path, tmp_path, PROMPT, png(10))
    with pytest.raises(ValueError, match="not an mmproj file"):
        pyggml.load(tmp_path / "text.gguf", n_threads=1, num_ctx=64, mmproj=tmp_path / "text.gguf")


_MTMD = """
import ctypes, json, sys
import numpy as np
import llama_cpp
from llama_cpp import mtmd_cpp as m

text, mmproj, raw, nx, ny = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(text.encode(), llama_cpp.llama_model_default_params())
assert model, "text model failed to load"
params = m.mtmd_context_params_default()
params.use_gpu, params.n_threads, params.warmup = False, 2, False
ctx = m.mtmd_init_from_file(mmproj.encode(), model, params)
assert ctx, "mmproj failed to load"
data = open(raw, "rb").read()
bitmap = m.mtmd_bitmap_init(nx, ny, (ctypes.c_uint8 * len(data)).from_buffer_copy(data))
chunks = m.mtmd_input_chunks_init()
t = m.mtmd_input_text()
t.text = b"look " + m.mtmd_default_marker() + b" here"
t.text_len, t.add_special, t.parse_special = len(t.text), True, True
assert m.mtmd_tokenize(ctx, chunks, ctypes.byref(t), (m.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
n_embd = llama_cpp.llama_model_n_embd(model)
for i in range(m.mtmd_input_chunks_size(chunks)):
    chunk = m.mtmd_input_chunks_get(chunks, i)
    if m.mtmd_input_chunk_get_type(chunk) == 1:  # an image
        n = m.mtmd_input_chunk_get_n_tokens(chunk)
        assert m.mtmd_encode_chunk(ctx, chunk) == 0
        print(json.dumps(np.ctypeslib.as_array(m.mtmd_get_output_embd(ctx), shape=(n * n_embd,)).tolist()))
"""


@needs_llama_cpp
def test_llama_cpp_reads_our_text_and_mmproj_files_and_computes_the_same_image_embeddings(tiny, tmp_path):
    """llama.cpp's multimodal path (mtmd) on the split files; the image is already SIZE x SIZE, so
    its own resizing does not enter."""
    import json
    import subprocess
    import sys

    from pyggml import BackendParams, models
    from pyggml.convert.gemma3_vision import split_mmproj

    _, _, path, _ = tiny
    text, mmproj = split_mmproj(path, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    pixels = np.random.default_rng(3).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    (tmp_path / "img.rgb").write_bytes(pixels.tobytes())
    done = subprocess.run([sys.executable, "-c", _MTMD, str(text), str(mmproj), str(tmp_path / "img.rgb"),
                           str(SIZE), str(SIZE)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = np.array(json.loads(done.stdout.strip().splitlines()[-1]), np.float32).reshape(TOKENS, -1)
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
    assert scaled_error(ours, theirs) <= 2e-3  # measured 5.9e-4


def test_cli_converts_to_text_plus_mmproj_and_runs_with_an_image(tiny, tmp_path, capsys):
    from pyggml.cli import main

    model, _, path, _ = tiny
    hf_dir = Path(path).parent / "hf"
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(hf_dir), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    picture = tmp_path / "p.png"
    picture.write_bytes(png(11))
    assert main(["run", str(text), "--mmproj", str(mmproj), "--image", str(picture), "what [img-0] is",
                 "--max-tokens", "3", "--temperature", "0"]) == 0
    assert main(["show", str(mmproj)]) == 0
    assert "gemma3 projector, 2 layers" in capsys.readouterr().out
    assert main(["run", str(text), "--image", str(picture), "what is"]) == 1  # no vision part: a clear error
    assert "takes no images" in capsys.readouterr().err


def test_server_refuses_images_for_a_text_only_model(tmp_path):
    import base64

    import httpx

    from pyggml.synthetic import write_synthetic

    from ._server import running_server

    path = write_synthetic(tmp_path / "g3.gguf", "gemma3", "f32")
    b64 = base64.b64encode(png(1)).decode()
    with running_server(path, parallel=1, num_ctx=64) as (base, served):
        show = httpx.post(base + "/api/show", json={"model": served.name}, timeout=30).json()
        assert "vision" not in show["capabilities"]
        for route, body in (("/api/generate", {"prompt": "x", "images": [b64]}),
                            ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": [b64]}]})):
            response = httpx.post(base + route, json={"model": served.name, "stream": False, **body}, timeout=60)
            assert response.status_code == 400 and "takes no images" in response.text, response.text


def test_exif_orientation_is_applied():
    from pyggml import image

    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :20] = 255  # left half white
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: show rotated 90 degrees clockwise
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", exif=exif.tobytes(), quality=95)
    upright = np.asarray(image.decode(out.getvalue()))
    assert upright.shape == (40, 20, 3)  # width and height swapped
    assert upright[:20].mean() > 200 and upright[20:].mean() < 50  # the white half is now on top


# ---- the runner's image path: one vision graph per image shape, memory reserved at start-up, batching


def _mmproj(path: Path, image: int, patch: int, text_hidden: int = 64, seed: int = 0) -> Path:
    """A random gemma3 mmproj file (one SigLIP layer, 32 wide) for ``image`` px images in ``patch`` px patches."""
    import gguf

    rng = np.random.default_rng(seed)
    h, f = 32, 48
    w = gguf.GGUFWriter(path, "clip")
    w.add_string("general.type", "mmproj")
    w.add_string("clip.projector_type", "gemma3")
    for key, value in (("embedding_length", h), ("feed_forward_length", f), ("block_count", 1),
                       ("attention.head_count", 2), ("image_size", image), ("patch_size", patch),
                       ("projection_dim", text_hidden)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5] * 3)
    w.add_array("clip.vision.image_std", [0.5] * 3)

    def add(name, *shape):
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))

    add("v.patch_embd.weight", h, 3, patch, patch)
    add("v.patch_embd.bias", h)
    add("v.position_embd.weight", (image // patch) ** 2, h)
    for name, shape in (("ln1", (h,)), ("ln2", (h,)), ("attn_q", (h, h)), ("attn_k", (h, h)), ("attn_v", (h, h)),
                        ("attn_out", (h, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
        add(f"v.blk.0.{name}.weight", *shape)
        add(f"v.blk.0.{name}.bias", shape[0])
    add("v.post_ln.weight", h)
    add("v.post_ln.bias", h)
    add("mm.input_projection.weight", h, text_hidden)
    add("mm.soft_emb_norm.weight", h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _graph_bytes(llm) -> int:
    return sum(device["graph"] for device in llm.model.backend.memory().values())


def test_the_vision_graph_is_built_once_and_refilled_for_each_image(tiny):
    """The runner builds the (only) image graph shape at start-up; each image, whatever its file's size and
    mode, refills its pixels: no graph is built per image, and a refilled graph computes what a new one does."""
    import pyggml

    _, _, path, _ = tiny
    images = [png(20, (40, 28)), png(21, (13, 50)), png(22, (32, 32), "L")]
    with pyggml.load(path, n_threads=2, num_ctx=128) as llm:
        engine, model = llm.runner.engine, llm.model
        assert (engine.vision_built, engine.vision_reused) == (1, 0)  # built and reserved at start-up
        for k, data in enumerate(images):
            llm.generate(SHORT, images=[data], max_tokens=1)
            assert (engine.vision_built, engine.vision_reused) == (1, k + 1)
        for data in images:
            (refilled,) = engine.encode(data)
            with model.backend.new_context() as ctx:
                (fresh,) = model.vision.encode(ctx, data)
                ctx.compute(fresh.tensor)
                np.testing.assert_array_equal(refilled.tensor, fresh.tensor.numpy())
        assert engine.vision_built == 1


def test_image_memory_is_reserved_at_start_up(tiny, tmp_path, monkeypatch):
    """A vision model's runner reserves its image graph's compute memory when it starts (the scheduler's buffers
    then hold enough for an image and do not grow during a request), and memory too small for an image is an
    error at load, not in a request. An mmproj for 448 px images (1024 patches, 64 image tokens) makes the image
    graph the largest one; batch_size 8 < 64 image tokens: the start-up also reserves the grown batch."""
    import pyggml
    from pyggml.backend import Context
    from pyggml.convert.gemma3_vision import split_mmproj
    from pyggml.runner.engine import Engine

    _, _, path, _ = tiny
    text, _ = split_mmproj(path, tmp_path / "text.gguf", tmp_path / "small-mmproj.gguf")
    mmproj = _mmproj(tmp_path / "mmproj.gguf", image=448, patch=14)
    options = dict(n_threads=2, num_ctx=128, batch_size=8, mmproj=mmproj)
    with pyggml.load(text, **options) as llm:
        engine = llm.runner.engine
        assert llm.runner.max_batch == 8 - 1 + 64 + 1  # the image's 64 rows and the token after them
        assert (engine.vision_built, engine.vision_reused) == (1, 0)
        reserved = _graph_bytes(llm)
        llm.generate(SHORT, images=[png(11)], max_tokens=1)
        assert (engine.vision_built, engine.vision_reused) == (1, 1)  # the start-up's graph served the image
        assert _graph_bytes(llm) == reserved  # the request needed nothing beyond the start-up's reservation
    with monkeypatch.context() as patch:
        patch.setattr(Engine, "reserve_multimodal", lambda self: [])
        with pyggml.load(text, **options) as llm:
            assert llm.runner.engine.vision_built == 0
            assert _graph_bytes(llm) < reserved  # the image graph is what needed the memory reserved above
    reserve = Context.reserve

    def too_little(ctx):  # a device whose memory holds the text batches but not the image graph
        if ctx.input_shape("pixels") is not None:
            raise MemoryError("could not reserve memory for the graph")
        return reserve(ctx)

    monkeypatch.setattr(Context, "reserve", too_little)
    with pytest.raises(MemoryError, match="not enough memory to encode an image"):
        pyggml.load(text, **options)


def test_an_image_longer_than_batch_size_gives_the_logits_of_one_batch(tiny):
    """The image's 4 rows and the token after them must be in one batch (they attend both ways): with
    batch_size 3 that batch grows to hold them, and every prompt position's logits equal those of one batch."""
    import pyggml
    from pyggml.runner import CompletionRequest

    _, _, path, _ = tiny
    data = png(12)

    def logits(batch_size):
        with pyggml.load(path, n_threads=2, num_ctx=128, batch_size=batch_size, cache_type="f32") as llm:
            assert llm.runner.max_batch == (batch_size + TOKENS if batch_size <= TOKENS else batch_size)
            *_, last = llm.runner.completion(CompletionRequest(prompt=PROMPT, images=[data], max_tokens=0,
                                                               prompt_logits=True))
            return last.prompt_logits

    split, whole = logits(3), logits(64)
    assert split.shape == whole.shape
    print(f"image longer than a batch: {scaled_error(split, whole):.2e}")
    # measured: 2.0e-4 of the largest logit (a text-only prompt split in batches of 7 differs by 3.4e-4: the
    # attention's summation over another cache length); an image split in two would differ by > 1e-2
    assert scaled_error(split, whole) <= 1e-3, scaled_error(split, whole)


def test_two_sequences_with_different_images_in_one_batch_equal_each_alone(tiny):
    _, _, path, _ = tiny
    cases = [(SHORT, png(30)), ("the [img-0] dog", png(31, (20, 60)))]
    alone, together, batches, _ = images_alone_and_together(path, cases, num_ctx=64, batch_size=64,
                                                            logit_bias={2: float("-inf")})
    assert [len(index) for _, index in batches if index] == [2]  # both images in the first batch
    for (tokens_alone, logits_alone), (tokens_both, logits_both) in zip(alone, together, strict=True):
        assert tokens_alone == tokens_both
        print(f"two images in one batch vs alone: {scaled_error(logits_both, logits_alone):.2e}")  # measured <= 2.4e-6
        assert scaled_error(logits_both, logits_alone) <= 1e-3, scaled_error(logits_both, logits_alone)


def test_cli_chat_places_images_where_the_prompt_says(tiny, tmp_path, capsys, monkeypatch):
    from pyggml import cli
    from pyggml.repl import image_content

    _, _, path, _ = tiny
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(png(3))
    b.write_bytes(png(4))
    assert image_content("x [img-1] y [img-0]", [a, b]) == [
        {"type": "text", "text": "x "}, {"type": "image", "image": b}, {"type": "text", "text": " y "},
        {"type": "image", "image": a}]
    assert image_content("what is it", [a]) == [{"type": "image", "image": a}, {"type": "text", "text": "what is it"}]
    with pytest.raises(ValueError, match=r"\[img-2\]"):
        image_content("[img-2]", [a])
    monkeypatch.setattr(cli, "_has_template", lambda llm: True)  # the chat path (the tiny model has no template)
    assert cli.main(["run", str(path), "--image", str(a), "--image", str(b), "compare [img-0] and [img-1]",
                     "--max-tokens", "3", "--temperature", "0", "--threads", "1"]) == 0
    assert cli.main(["run", str(path), "--image", str(a), "[img-1]?", "--max-tokens", "3"]) == 1
    assert "[img-1]" in capsys.readouterr().err


def test_serve_uses_an_ollama_models_projector_layer(tiny, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from pyggml.cli import main

    from .test_cli_errors import _serving, _stop, spawn
    from .test_store import make_ollama

    _, _, path, _ = tiny
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(Path(path).parent / "hf"), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    store = tmp_path / "ollama"
    make_ollama(store, text, name="vis", projector=mmproj)
    make_ollama(store, text, name="bad", projector=text)  # not an mmproj: served as a text model
    proc = spawn(tmp_path, "serve", "--port", "0", "--threads", "1", "--ctx", "128", OLLAMA_MODELS=str(store))
    try:
        url = _serving(proc)
        caps = {name: httpx.post(f"{url}/api/show", json={"model": name}, timeout=120).json()["capabilities"]
                for name in ("vis", "bad")}
    finally:
        err = _stop(proc)
    assert "vision" in caps["vis"] and "vision" not in caps["bad"], caps
    assert "projector cannot be used" in err and "Traceback" not in err, err
