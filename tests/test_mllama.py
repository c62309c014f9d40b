"""Llama 3.2 Vision (mllama): a tiny random ``MllamaForConditionalGeneration`` converted by our converter
gives transformers' pixels, vision encoder states, image embeddings and image+text logits (and text-only
logits); the encoder cache keeps an image for later batches, drops it when its sequence is rewound before
it and takes a later image in its place; images run through ``LLM.generate``; bad input fails clearly."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from ._models import error
from .hf_fixtures import make_bpe_tokenizer, png

torch = pytest.importorskip("torch", reason="the parity tests need torch (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (`reference` extra)")
Image = pytest.importorskip("PIL.Image", reason="images need Pillow")

TILE, TILES = 28, 4  # 2x2 patches of 14 pixels (5 positions with the class token) per tile, up to 4 tiles
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
PROMPT = "[img-0]The cafe is naive, 42 people said! Then they left"
MIDDLE = "Look at this: [img-0] The cafe is naive, 42 people said"
# Tolerances, max |a - b| / max |b|: measured 4.6e-7 .. 6.3e-7 (encoder states), 2.4e-7 (image embeddings),
# 6e-7 .. 1e-6 (logits) on these F32 models (2 threads, x86-64); the margin is for other CPUs' kernels
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, image processor, GGUF path, image token id) of a tiny random Llama 3.2 Vision."""
    from tokenizers import AddedToken, Tokenizer

    from pyggml.convert import convert_hf

    tmp = tmp_path_factory.mktemp("mllama")
    hf_dir = tmp / "hf"
    hf_dir.mkdir()
    n_tokens = make_bpe_tokenizer(hf_dir)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))  # <|image|> right after the vocabulary, as in Meta's
    tok.add_special_tokens([AddedToken("<|image|>", special=True)])
    tok.save(str(hf_dir / "tokenizer.json"))
    text = dict(vocab_size=n_tokens, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, cross_attention_layers=[1, 3], max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_theta=10000.0, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_global_layers=2, attention_heads=2,
                  image_size=TILE, patch_size=14, max_num_tiles=TILES, intermediate_layers_indices=[1, 3],
                  vision_output_dim=96)
    config = transformers.MllamaConfig(text_config=text, vision_config=vision, image_token_index=n_tokens)
    torch.manual_seed(0)
    model = transformers.MllamaForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # gates start at 0 (cross-attention off) and norms at 1: make every part count
        for name, p in model.named_parameters():
            if "gate" in name:
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias") or "class_embedding" in name or ("vision" in name and "embedding" in name):
                p.copy_(0.3 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    processor = transformers.MllamaImageProcessorPil(size={"height": TILE, "width": TILE}, max_image_tiles=TILES,
                                                      image_mean=CLIP_MEAN, image_std=CLIP_STD)
    processor.save_pretrained(hf_dir)
    _meta_intermediate_states(model)
    return model, processor, convert_hf(hf_dir, tmp / "model.gguf", "f32"), n_tokens


def _meta_intermediate_states(model) -> None:
    """transformers 5 reads intermediate_layers_indices as layer *outputs*; Meta's reference, transformers 4
    and Ollama (and pyggml) take the layer *inputs* (transformers 4's hidden_states[i]). Make this instance's
    encoders record inputs, so the comparison is with the model as trained."""
    from transformers.modeling_outputs import BaseModelOutput

    def forward(self, hidden_states, attention_mask=None):
        states = ()
        for layer in self.layers:
            states += (hidden_states,)
            hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=states + (hidden_states,))

    for encoder in (model.model.vision_model.transformer, model.model.vision_model.global_transformer):
        encoder.forward = forward.__get__(encoder)


def hf_inputs(processor, images: list[bytes]) -> dict:
    return processor([[Image.open(io.BytesIO(d)) for d in images]], return_tensors="pt")


@pytest.mark.parametrize("size", [(40, 28), (10, 50), (100, 30), (28, 28), (60, 60), (7, 9), (200, 45)])
def test_tiles_equal_the_hf_processor(tiny, size):
    from pyggml import image

    _, processor, _, _ = tiny
    data = png(1, size)
    ref = hf_inputs(processor, [data])
    pixels, ratio, n_tiles = image.tiles(image.decode(data), TILE, TILES, CLIP_MEAN, CLIP_STD)
    np.testing.assert_array_equal(pixels, ref["pixel_values"][0, 0].numpy())
    assert (ratio, n_tiles) == (int(ref["aspect_ratio_ids"][0, 0]), ref["num_tiles"][0][0])


@pytest.mark.parametrize("size", [(28, 28), (40, 28), (100, 30)])  # 1, 2 and 4 tiles
def test_vision_encoder_and_image_embeddings_match_transformers(tiny, size):
    from pyggml import BackendParams, image, models

    model, processor, path, _ = tiny
    data = png(3, size)
    ref = hf_inputs(processor, [data])
    with torch.no_grad():
        states = model.model.vision_model(pixel_values=ref["pixel_values"], aspect_ratio_ids=ref["aspect_ratio_ids"],
                                          aspect_ratio_mask=ref["aspect_ratio_mask"]).last_hidden_state
        ref_embeds = model.model.multi_modal_projector(states).reshape(-1, 64).numpy()
        ref_states = states.reshape(-1, states.shape[-1]).numpy()
    ours = models.load(path, BackendParams(n_threads=2))
    try:
        v = ours.vision
        assert ours.takes_images and v.options.n_enc == TILES * 5
        pixels, ratio, n_tiles = image.tiles(image.decode(data), TILE, TILES, CLIP_MEAN, CLIP_STD)
        with ours.backend.new_context() as ctx:
            encoded = v.encoder(ctx, pixels, ratio, n_tiles)
            embeds, mask = ours.vision.encode(ctx, data)
            ctx.compute(encoded, embeds.tensor, mask.tensor)
            encoded, embeds, mask = encoded.numpy(), embeds.tensor.numpy(), mask.tensor.numpy()
    finally:
        ours.close()
    print(f"{n_tiles} tiles: encoder {error(encoded, ref_states):.1e}, "
          f"embeddings {error(embeds, ref_embeds):.1e}")
    assert error(encoded, ref_states) <= TOLERANCE
    assert error(embeds, ref_embeds) <= TOLERANCE
    assert mask.tolist() == [0.0] * 5 * n_tiles + [float("-inf")] * 5 * (TILES - n_tiles)  # padding tiles hidden


def _hf_logits(model, processor, ids: list[int], images: list[bytes], image_token: int) -> np.ndarray:
    """transformers' logits with the cross-attention mask its processor makes (text from each image on sees it)."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    with torch.no_grad():
        if not images:
            return model(input_ids=torch.tensor([ids])).logits[0].numpy()
        ref = hf_inputs(processor, images)
        mask = convert_sparse_cross_attention_mask_to_dense([get_cross_attention_token_mask(ids, image_token)],
                                                            ref["num_tiles"], TILES, len(ids))
        return model(input_ids=torch.tensor([ids]), pixel_values=ref["pixel_values"],
                     aspect_ratio_ids=ref["aspect_ratio_ids"], aspect_ratio_mask=ref["aspect_ratio_mask"],
                     cross_attention_mask=torch.tensor(mask)).logits[0].numpy()


@pytest.mark.parametrize("prompt", [PROMPT, MIDDLE], ids=["image-first", "text-before-image"])
def test_image_and_text_logits_match_transformers(tiny, prompt):
    import pyggml
    from pyggml.runner import CompletionRequest

    model, processor, path, image_token = tiny
    data = png(4, (100, 30))
    with pyggml.load(path, n_threads=2, num_ctx=128, cache_type="f32") as llm:
        *_, last = llm.runner.completion(CompletionRequest(prompt=prompt, images=[data], max_tokens=0,
                                                           prompt_logits=True))
        ours = last.prompt_logits
        before, after = prompt.split("[img-0]")
        ids = llm.tokenizer.encode(before) + [image_token] + llm.tokenizer.encode(after, add_special=False)
        *_, last = llm.runner.completion(CompletionRequest(prompt=after, max_tokens=0, prompt_logits=True))
        text_only, text_ids = last.prompt_logits, llm.tokenizer.encode(after)
    ref = _hf_logits(model, processor, ids, [data], image_token)
    text_ref = _hf_logits(model, processor, text_ids, [], image_token)
    print(f"image+text logits {error(ours, ref):.1e}, text only {error(text_only, text_ref):.1e}")
    assert error(ours, ref) <= TOLERANCE
    assert error(text_only, text_ref) <= TOLERANCE
    assert error(ours[-len(text_ids) + 1:], text_ref[1:]) > 1e-2  # the image changes what follows it


# ---- the encoder cache ---------------------------------------------------------------------------------
@pytest.fixture
def engine(tiny):
    from pyggml import BackendParams, DType, models
    from pyggml.runner.engine import Engine

    _, _, path, _ = tiny
    model = models.load(path, BackendParams(n_threads=2))
    model.cache.init(model.backend, DType.F32, max_sequences=1, capacity=64, max_batch=32)
    engine = Engine(model)
    try:
        yield model, engine
    finally:
        engine.close()
        model.close()


def _encode(model, data: bytes):
    from pyggml.input import Multimodal

    with model.backend.new_context() as ctx:
        parts = model.vision.encode(ctx, data)
        ctx.compute(*[m.tensor for m in parts])
        return [Multimodal(tensor=m.tensor.numpy().copy()) for m in parts]


def _run(engine, tokens: list[int], start: int, image=None, at: int = 0) -> np.ndarray:
    """Every row's logits of one batch of sequence 0 from position ``start`` (``image`` at batch index ``at``)."""
    from pyggml.input import Batch, MultimodalIndex

    return engine.forward(Batch(inputs=tokens, outputs=range(len(tokens)), positions=range(start, start + len(tokens)),
                                sequences=[0] * len(tokens),
                                multimodal=[MultimodalIndex(at, image)] if image is not None else ()))


def test_rewinding_before_the_image_drops_it_and_a_later_image_replaces_it(tiny, engine):
    model, processor, _, image_token = tiny
    ours, eng = engine
    encoder = ours.cache.caches[0]
    first, second = png(5, (40, 28)), png(6, (28, 60))
    tok = ours.tokenizer
    text, more = tok.encode("The cafe is naive", add_special=False), tok.encode(" then they left", add_special=False)
    prompt = [tok.bos, image_token, *text]
    # the image's batch, then a decode step (the cached keys/values serve it)
    logits = [_run(eng, prompt, 0, _encode(ours, first), at=1), _run(eng, more[:1], len(prompt))]
    assert encoder.position(0) == 1
    ref = _hf_logits(model, processor, prompt + more[:1], [first], image_token)
    assert error(np.concatenate(logits), ref) <= TOLERANCE
    # rewinding after the image keeps it: the step again gives the same logits
    ours.cache.remove(0, len(prompt))
    np.testing.assert_allclose(_run(eng, more[:1], len(prompt)), logits[1], rtol=0, atol=1e-5)
    # rewinding to the image drops it: the text after it runs without cross-attention (layers skipped) ...
    ours.cache.remove(0, 1)
    assert encoder.position(0) is None
    _run(eng, text, 1)
    assert not encoder.encoder_cached
    # ... and a whole text-only sequence is transformers' text-only model
    ours.cache.remove(0, 0)
    plain = _run(eng, [tok.bos, *text], 0)
    assert error(plain, _hf_logits(model, processor, [tok.bos, *text], [], image_token)) <= TOLERANCE
    # a later image replaces the first: text after it sees only it, as transformers' mask has it (no text before
    # the first image: transformers lets such text attend to every image of the prompt, later ones too)
    ours.cache.remove(0, 0)
    ids = [image_token, *text, image_token, *more]
    both = [_run(eng, ids[:len(text) + 1], 0, _encode(ours, first), at=0),
            _run(eng, ids[len(text) + 1:], len(text) + 1, _encode(ours, second), at=0)]
    assert encoder.position(0) == len(text) + 1
    ref = _hf_logits(model, processor, ids, [first, second], image_token)
    assert error(np.concatenate(both), ref) <= TOLERANCE


# ---- the runner and bad input ----------------------------------------------------------------------------
def test_llm_generate_takes_an_image_and_text(tiny):
    import pyggml

    _, _, path, _ = tiny
    greedy = dict(max_tokens=3, temperature=0, logit_bias={1: float("-inf")})
    with pyggml.load(path, n_threads=2, num_ctx=128) as llm:
        assert llm.model.takes_images
        assert sorted(llm.model.cache.caches[0].keys) == [1, 3]  # image keys/values allocated at start-up
        with_image = llm.generate("what is this?", images=[png(7)], **greedy)
        again = llm.generate("what is this?", images=[png(7)], **greedy)
        assert with_image == again and llm.stats.cached_tokens > 0  # the same image: the prompt from the cache
        assert isinstance(llm.generate("what is this?", **greedy), str)
        with pytest.raises(ValueError, match="one image at a time"):
            llm.generate("[img-0] and [img-1]", images=[png(7), png(8)], max_tokens=1)
        with pytest.raises(ValueError, match="not an image"):
            llm.generate("what is this?", images=[b"not an image"], max_tokens=1)
        assert llm.generate("what is this?", images=[png(9, (60, 60))], **greedy) is not None  # the slot is free


def test_converter_writes_ollamas_layout(tiny):
    import gguf

    model, _, path, _ = tiny
    reader = gguf.GGUFReader(Path(path))
    tensors = {t.name: t for t in reader.tensors}
    assert {"v.class_embd", "v.global.blk.1.attn_gate", "blk.1.cross_attn_q_norm.weight", "blk.3.cross_attn_mlp_gate",
            "mm.0.weight", "v.tile_position_embd.weight"} <= set(tensors)
    assert "blk.1.attn_q.weight" not in tensors and "blk.0.cross_attn_q_proj.weight" not in tensors
    assert list(reader.fields["mllama.attention.cross_attention_layers"].contents()) == [1, 3]
    gate = model.model.vision_model.gated_positional_embedding.gate.item()
    assert np.allclose(tensors["v.position_embd.gate"].data, 1 - np.tanh(gate))  # stored as the model uses it
    assert np.allclose(tensors["v.tile_position_embd.gate"].data, np.tanh(gate))
    attn_gate = model.model.language_model.layers[1].cross_attn_attn_gate.item()
    assert np.allclose(tensors["blk.1.cross_attn_attn_gate"].data, attn_gate)  # text gates: tanh at run time


def test_a_missing_vision_tensor_is_named(tiny, tmp_path):
    import gguf

    from pyggml import BackendParams, models

    _, _, path, _ = tiny
    reader = gguf.GGUFReader(Path(path))
    out = tmp_path / "broken.gguf"
    writer = gguf.GGUFWriter(out, "mllama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name != "v.global.blk.1.ffn_gate":
            writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(models.ModelError, match=r"v\.global\.blk\.1\.ffn_gate"):
        models.load(out, BackendParams(n_threads=1))


def test_the_vision_encoder_refuses_wrong_tiles(tiny):
    from pyggml import BackendParams, models

    _, _, path, _ = tiny
    ours = models.load(path, BackendParams(n_threads=1))
    try:
        with ours.backend.new_context() as ctx:
            pixels = np.zeros((TILES, 3, TILE, TILE), np.float32)
            for bad in ((pixels[:2], 1, 1), (pixels, 1, TILES + 1), (pixels, 0, 1), (pixels, 9, 1)):
                with pytest.raises(ValueError, match="tiles"):
                    ours.vision.encoder(ctx, *bad)
    finally:
        ours.close()


def test_the_runner_serves_one_sequence_at_a_time(tiny):
    """The encoder cache holds one image for all sequences, so mllama runs alone (as in Ollama): concurrent
    requests, one with an image and one without, queue and give what each gives alone."""
    import threading

    from pyggml import BackendParams, models
    from pyggml.runner import CompletionRequest, Runner

    _, _, path, _ = tiny
    model = models.load(path, BackendParams(n_threads=2))
    runner = Runner(model, parallel=4, num_ctx=128, batch_size=64)
    try:
        assert runner.parallel == 1
        requests = {"image": dict(prompt="what is this?", images=[png(10)]), "text": dict(prompt="hello there")}
        greedy = dict(max_tokens=4, temperature=0, logit_bias={1: float("-inf")})

        def run(name, out):
            chunks = runner.completion(CompletionRequest(**requests[name], **greedy))
            out[name] = [t for c in chunks for t in c.tokens]

        alone, together = {}, {}
        for name in requests:
            run(name, alone)
        threads = [threading.Thread(target=run, args=(name, together)) for name in requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert together == alone and len(alone["image"]) == 4
    finally:
        runner.close()
        model.close()


def test_mllama_has_no_mmproj_layout(tiny, tmp_path):
    from pyggml.convert.gemma3_vision import split_mmproj

    _, _, path, _ = tiny
    with pytest.raises(ValueError, match="no llama.cpp mmproj layout"):
        split_mmproj(path, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")


def test_server_reports_vision_and_takes_an_image(tiny):
    import base64

    import httpx

    from ._server import image_through_generate_and_chat, running_server

    _, _, path, _ = tiny
    b64 = base64.b64encode(png(11)).decode()
    with running_server(path, parallel=2, num_ctx=128) as server:
        base, served = server
        gen, chat = image_through_generate_and_chat(server, b64)
        assert gen["done"] and chat["done"]
        two = httpx.post(base + "/api/generate", json={"model": served.name, "prompt": "[img-0] [img-1]",
                                                        "images": [b64, b64], "stream": False}, timeout=60)
        assert two.status_code == 400 and "one image at a time" in two.text


def test_transformers_4_checkpoint_names_convert_alike(tiny, tmp_path):
    """Checkpoints saved before transformers 5 (language_model.model.*, vision_model.*) give the same file."""
    import gguf
    from safetensors.numpy import load_file, save_file

    from pyggml.convert import convert_hf

    _, _, path, _ = tiny
    hf_dir, old = Path(path).parent / "hf", tmp_path / "old"
    old.mkdir()
    renamed = {}
    for name, value in load_file(hf_dir / "model.safetensors").items():
        if name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        renamed["language_model.lm_head.weight" if name == "lm_head.weight" else name.removeprefix("model.")] = value
    save_file(renamed, old / "model.safetensors", metadata={"format": "pt"})
    for f in hf_dir.glob("*.json"):
        (old / f.name).write_bytes(f.read_bytes())
    ours = {t.name: t.data for t in gguf.GGUFReader(convert_hf(old, tmp_path / "old.gguf", "f32")).tensors}
    ref = {t.name: t.data for t in gguf.GGUFReader(Path(path)).tensors}
    assert ours.keys() == ref.keys() and all(np.array_equal(ours[n], ref[n]) for n in ref)
