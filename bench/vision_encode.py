"""Gemma 3 image encode time at Gemma-3-4B vision dimensions (SigLIP 896 px, 27 layers, 1152 wide; random
F16 weights written here), pyggml vs llama.cpp's multimodal path (mtmd, llama-cpp-python==0.3.36) on the
same mmproj file, and pyggml's time to first token for a one-image prompt (a 1-layer text model).

    python bench/vision_encode.py [--threads 2] [--dir /tmp/pyggml-vision-bench]

Measured on the shared 2-core machine (2 threads, one 896x896 image, 4096 patches), back to back: pyggml
60.9 s (with ggml's fused attention in the encoder; 112.6 s without, under more load), llama.cpp 51.5 s.
The runner builds this graph (831 nodes, ~29 ms of Python) once, when the model loads (it reserves its
memory then), and refills its pixels for each image; the encode time above is the compute.
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

V = dict(hidden=1152, ffn=4304, layers=27, heads=16, image=896, patch=14, text=2560)


def write_mmproj(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "clip")
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    for key, value in (("embedding_length", V["hidden"]), ("feed_forward_length", V["ffn"]),
                       ("block_count", V["layers"]), ("attention.head_count", V["heads"]),
                       ("image_size", V["image"]), ("patch_size", V["patch"]), ("projection_dim", V["text"])):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5] * 3)
    w.add_array("clip.vision.image_std", [0.5] * 3)
    h, f, p = V["hidden"], V["ffn"], V["patch"]

    def add(name, shape, dtype=np.float16, scale=0.02):
        w.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype))

    add("v.patch_embd.weight", (h, 3, p, p))
    add("v.patch_embd.bias", (h,), np.float32)
    add("v.position_embd.weight", ((V["image"] // p) ** 2, h), np.float32)
    for i in range(V["layers"]):
        for n in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{i}.{n}.weight", np.ones(h, np.float32))
            w.add_tensor(f"v.blk.{i}.{n}.bias", np.zeros(h, np.float32))
        for n, shape in (("attn_q", (h, h)), ("attn_k", (h, h)), ("attn_v", (h, h)), ("attn_out", (h, h)),
                         ("ffn_up", (f, h)), ("ffn_down", (h, f))):
            add(f"v.blk.{i}.{n}.weight", shape)
            add(f"v.blk.{i}.{n}.bias", shape[:1], np.float32)
    w.add_tensor("v.post_ln.weight", np.ones(h, np.float32))
    w.add_tensor("v.post_ln.bias", np.zeros(h, np.float32))
    add("mm.input_projection.weight", (h, V["text"]))
    w.add_tensor("mm.soft_emb_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/pyggml-vision-bench")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    args = ap.parse_args()
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    from PIL import Image

    from pyggml.synthetic import write_synthetic

    mmproj, text = out / "mmproj.gguf", out / "text.gguf"
    if not mmproj.exists():
        write_mmproj(mmproj)
    if not text.exists():
        write_synthetic(text, "gemma3", "f16", hparams={"embedding_length": V["text"], "block_count": 1,
                                                        "feed_forward_length": 256, "attention.head_count": 8})
    pixels = np.random.default_rng(1).integers(0, 256, (V["image"], V["image"], 3), dtype=np.uint8)
    (out / "img.rgb").write_bytes(pixels.tobytes())
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")

    import pyggml
    from pyggml.runner import CompletionRequest

    results = {}
    with pyggml.load(text, mmproj=mmproj, n_threads=args.threads, num_ctx=512) as llm:
        model = llm.model
        start = time.perf_counter()
        with model.backend.new_context() as ctx:
            (item,) = model.vision.encode(ctx, buf.getvalue())
            ctx.compute(item.tensor)
        results["pyggml_encode_s"] = time.perf_counter() - start
        print(json.dumps(results), flush=True)
        model._image_tokens = lambda: ([10], [11], 12)  # the synthetic vocabulary has no image marker tokens
        start = time.perf_counter()
        stream = llm.runner.completion(CompletionRequest(prompt="[img-0] what is this?", images=[buf.getvalue()],
                                                         max_tokens=1, temperature=0))
        next(iter(stream))
        results["pyggml_ttft_s"] = time.perf_counter() - start
        stream.close()
    if not args.skip_llama_cpp:
        script = Path(__file__).with_name("_mtmd_encode.py")
        done = subprocess.run([sys.executable, str(script), str(text), str(mmproj), str(out / "img.rgb"),
                               str(V["image"]), str(args.threads)], capture_output=True, text=True, timeout=900)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
        else:
            results.update(json.loads(done.stdout.strip().splitlines()[-1]))
    print(json.dumps({k: round(v, 2) for k, v in results.items()}))


if __name__ == "__main__":
    main()
