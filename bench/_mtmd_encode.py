"""llama.cpp's image encode time (mtmd): argv = text.gguf mmproj.gguf raw_rgb side threads [height] (side is the
width then); prints JSON: seconds and the image's tokens."""
import ctypes
import json
import sys
import time

import llama_cpp
from llama_cpp import mtmd_cpp as m

text, mmproj, raw, side, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
height = int(sys.argv[6]) if len(sys.argv) > 6 else side
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(text.encode(), llama_cpp.llama_model_default_params())
params = m.mtmd_context_params_default()
params.use_gpu, params.n_threads, params.warmup = False, threads, False
ctx = m.mtmd_init_from_file(mmproj.encode(), model, params)
assert ctx, "mmproj failed to load"
data = open(raw, "rb").read()
out = {}
for run in range(1):
    bitmap = m.mtmd_bitmap_init(side, height, (ctypes.c_uint8 * len(data)).from_buffer_copy(data))
    chunks = m.mtmd_input_chunks_init()
    t = m.mtmd_input_text()
    t.text = m.mtmd_default_marker()
    t.text_len, t.add_special, t.parse_special = len(t.text), True, True
    assert m.mtmd_tokenize(ctx, chunks, ctypes.byref(t), (m.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
    for i in range(m.mtmd_input_chunks_size(chunks)):
        chunk = m.mtmd_input_chunks_get(chunks, i)
        if m.mtmd_input_chunk_get_type(chunk) == 1:
            start = time.perf_counter()
            assert m.mtmd_encode_chunk(ctx, chunk) == 0
            out[f"llama_cpp_encode_s_{run}"] = time.perf_counter() - start
            out["llama_cpp_tokens"] = m.mtmd_input_chunk_get_n_tokens(chunk)
print(json.dumps(out))
