"""Qwen 2.5-VL image encode time at Qwen2.5-VL-3B vision dimensions (32 layers, 1280 wide, windows of 112 px
with full attention every 8th layer; random F16 weights written here), pyggml vs llama.cpp's multimodal path
(mtmd, llama-cpp-python==0.3.36) on the same mmproj file, for one 1024x768 image (each resizes it by its own
rules: the token counts are printed), and pyggml's time to first token for a one-image prompt (a 1-layer
text model).

    python bench/vision_encode_qwen.py [--threads 2] [--dir /tmp/pyggml-qwen-vision-bench] [--layers 32]
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

V = dict(hidden=1280, ffn=3420, layers=32, heads=16, patch=14, merge=2, window=112, full_every=8, text=2048)
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def write_mmproj(path: Path, layers: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "clip")
    w.add_string("clip.projector_type", "qwen2.5vl_merger")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_silu", True)
    h, f, p, merged = V["hidden"], V["ffn"], V["patch"], V["hidden"] * V["merge"] ** 2
    for key, value in (("embedding_length", h), ("feed_forward_length", f), ("block_count", layers),
                       ("attention.head_count", V["heads"]), ("patch_size", p), ("spatial_merge_size", V["merge"]),
                       ("projection_dim", V["text"]), ("n_wa_pattern", V["full_every"]),
                       ("window_size", V["window"]), ("image_size", 560), ("image_min_pixels", 56 * 56),
                       ("image_max_pixels", 28 * 28 * 1280)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", MEAN)
    w.add_array("clip.vision.image_std", STD)

    def add(name, shape, dtype=np.float16, scale=0.02):
        w.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype))

    add("v.patch_embd.weight", (h, 3, p, p))
    add("v.patch_embd.weight.1", (h, 3, p, p))
    for i in range(layers):
        for n in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{i}.{n}.weight", np.ones(h, np.float32))
        for n, shape in (("attn_q", (h, h)), ("attn_k", (h, h)), ("attn_v", (h, h)), ("attn_out", (h, h)),
                         ("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
            add(f"v.blk.{i}.{n}.weight", shape)
            add(f"v.blk.{i}.{n}.bias", shape[:1], np.float32)
    w.add_tensor("v.post_ln.weight", np.ones(h, np.float32))
    add("mm.0.weight", (merged, merged))
    add("mm.0.bias", (merged,), np.float32)
    add("mm.2.weight", (V["text"], merged))
    add("mm.2.bias", (V["text"],), np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/pyggml-qwen-vision-bench")
    ap.add_argument("--layers", type=int, default=V["layers"], help="fewer for a quick run of the script itself")
    ap.add_argument("--size", default="1024x768", help="the image, WIDTHxHEIGHT")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    args = ap.parse_args()
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    from PIL import Image

    from pyggml.models import qwen2vl_vision
    from pyggml.synthetic import write_model

    mmproj, text = out / f"mmproj-{args.layers}.gguf", out / "text.gguf"
    if not mmproj.exists():
        write_mmproj(mmproj, args.layers)
    if not text.exists():
        write_model(text, "qwen2vl", {"embedding_length": V["text"], "block_count": 1, "feed_forward_length": 256,
                                      "attention.head_count": 16, "attention.head_count_kv": 2, "context_length": 4096,
                                      "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6,
                                      "rope.dimension_sections": [16, 24, 24, 0], "vocab_size": 320,
                                      "tokenizer.ggml.model": "gpt2"}, "f16")
    width, height = (int(x) for x in args.size.split("x"))
    pixels = np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)
    (out / "img.rgb").write_bytes(pixels.tobytes())
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")

    import pyggml
    from pyggml.runner import CompletionRequest

    results = {}
    with pyggml.load(text, mmproj=mmproj, n_threads=args.threads, num_ctx=2048, batch_size=2048) as llm:
        vision = llm.model.vision
        inputs = vision.preprocess(buf.getvalue())
        results["pyggml_tokens"] = int(np.prod(inputs[qwen2vl_vision.PIXELS].shape[:2]))
        with llm.model.backend.new_context() as ctx:
            (out_tensor,) = vision.build(ctx, inputs)
            start = time.perf_counter()
            ctx.compute(out_tensor)
        results["pyggml_encode_s"] = time.perf_counter() - start
        print(json.dumps(results), flush=True)
        qwen2vl_vision._image_tokens = lambda tok: (10, 11, 12)  # the synthetic vocabulary has no image tokens
        start = time.perf_counter()
        stream = llm.runner.completion(CompletionRequest(prompt="[img-0] what is this?", images=[buf.getvalue()],
                                                         max_tokens=1, temperature=0))
        next(iter(stream))
        results["pyggml_ttft_s"] = time.perf_counter() - start
        stream.close()
    if not args.skip_llama_cpp:
        script = Path(__file__).with_name("_mtmd_encode.py")
        done = subprocess.run([sys.executable, str(script), str(text), str(mmproj), str(out / "img.rgb"),
                               str(width), str(args.threads), str(height)], capture_output=True, text=True,
                              timeout=1800)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
        else:
            results.update(json.loads(done.stdout.strip().splitlines()[-1]))
    print(json.dumps({k: round(v, 2) for k, v in results.items()}))


if __name__ == "__main__":
    main()
