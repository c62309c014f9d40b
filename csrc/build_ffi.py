"""Generate the C source of the cffi API-mode module pyggml._ggml (run by CMake).

Usage: python build_ffi.py OUT.c
The declarations come from ggml_cdef.h (ggml's API as pyggml uses it), pyggml_helpers.h and
pyggml_ops.h.
"""

import sys
from pathlib import Path

import cffi

here = Path(__file__).resolve().parent
# ggml-rpc.h when CMake builds the RPC backend (PYGGML_RPC), else stubs with the same signatures
RPC = """
#ifdef PYGGML_RPC
#include "ggml-rpc.h"
#define PYGGML_HAS_RPC 1
#else
#define PYGGML_HAS_RPC 0
#define RPC_PROTO_MAJOR_VERSION 0
#define RPC_PROTO_MINOR_VERSION 0
#define RPC_PROTO_PATCH_VERSION 0
#define GGML_RPC_MAX_SERVERS 0
static ggml_backend_t ggml_backend_rpc_init(const char * e, uint32_t d) { (void)e; (void)d; return NULL; }
static bool ggml_backend_is_rpc(ggml_backend_t b) { (void)b; return false; }
static ggml_backend_buffer_type_t ggml_backend_rpc_buffer_type(const char * e, uint32_t d) {
    (void)e; (void)d; return NULL; }
static void ggml_backend_rpc_get_device_memory(const char * e, uint32_t d, size_t * f, size_t * t) {
    (void)e; (void)d; *f = 0; *t = 0; }
static void ggml_backend_rpc_start_server(const char * e, const char * c, size_t n, size_t nd,
                                          ggml_backend_dev_t * ds) { (void)e; (void)c; (void)n; (void)nd; (void)ds; }
static ggml_backend_reg_t ggml_backend_rpc_reg(void) { return NULL; }
static ggml_backend_reg_t ggml_backend_rpc_add_server(const char * e) { (void)e; return NULL; }
#endif
"""

ffi = cffi.FFI()
ffi.cdef((here / "ggml_cdef.h").read_text())
ffi.cdef((here / "pyggml_helpers.h").read_text().split("*/", 1)[1])
ffi.cdef((here / "pyggml_ops.h").read_text().split("*/", 1)[1])
ffi.set_source(
    "pyggml._ggml",
    '#include "ggml.h"\n#include "ggml-alloc.h"\n#include "ggml-backend.h"\n#include "ggml-cpu.h"\n'
    '#include "gguf.h"\n#include "pyggml_helpers.h"\n#include "pyggml_ops.h"\n' + RPC,
)
ffi.emit_c_code(sys.argv[1])
