"""Generate the C source of the cffi API-mode module pyggml._ggml (run by CMake).

Usage: python build_ffi.py OUT.c
The declarations come from ggml_cdef.h (ggml's API as pyggml uses it), pyggml_helpers.h and
pyggml_ops.h.
"""

import sys
from pathlib import Path

import cffi

here = Path(__file__).resolve().parent
ffi = cffi.FFI()
ffi.cdef((here / "ggml_cdef.h").read_text())
ffi.cdef((here / "pyggml_helpers.h").read_text().split("*/", 1)[1])
ffi.cdef((here / "pyggml_ops.h").read_text().split("*/", 1)[1])
ffi.set_source(
    "pyggml._ggml",
    '#include "ggml.h"\n#include "ggml-alloc.h"\n#include "ggml-backend.h"\n#include "ggml-cpu.h"\n'
    '#include "gguf.h"\n#include "pyggml_helpers.h"\n#include "pyggml_ops.h"\n',
)
ffi.emit_c_code(sys.argv[1])
