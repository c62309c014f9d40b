/* Checked graph ops: the hot ops of a model graph, validated and created in one C call.
 *
 * Each function checks what ggml would assert (or read out of bounds) for its op and returns NULL
 * without touching the context when anything is off; otherwise it returns ggml's new node. They
 * accept a safe subset of what pyggml's Python checks accept, never more: on NULL, tensor.py runs
 * its Python checks, which raise the error that names the problem (or build the node the slow way
 * when the C side was stricter). This saves the per-op field reads through cffi (~0.1 us each).
 *
 * The checks Python would otherwise make per op are here too: the graph is open and has room, and
 * every operand is a node of this graph or a live tensor of the graph's backend (found by address:
 * a tensor's header lies in the memory of the ggml context that made it). The backend lists its
 * weight and cache contexts in a pyg_pools; closing it sets `closed`, and its tensors are refused.
 * Like pyggml_helpers.h, this file is both included and read as a cffi cdef: keep it plain. */

/* One ggml context a backend keeps tensors in (weights, caches). */
struct pyg_pool {
    const char * base;
    const char * end;
    int writable; /* caches: ops may write into them (set_rows); weights may be a read-only mapping */
};

/* A backend's pools; `pool` may be swapped for a longer array, but an old one is never freed. */
struct pyg_pools {
    struct pyg_pool * pool;
    int n;
    int closed;
};

/* A graph under construction. */
struct pyg_graph {
    struct ggml_context * ctx;
    const char * base;
    const char * end;
    const struct pyg_pools * pools; /* the backend's, or NULL */
    int64_t n_tensors;
    int64_t max_tensors;
    int closed;
};

/* Fill base/end from the context's memory. */
void pyg_graph_init(struct pyg_graph * g, struct ggml_context * ctx, int64_t max_tensors);
void pyg_pool_init(struct pyg_pool * pool, struct ggml_context * ctx, int writable);

/* ggml_add/sub/mul/div (any function of that signature): b tiles a, float types, packed rows. */
struct ggml_tensor * pyg_binary(struct pyg_graph * g,
                                struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *, struct ggml_tensor *),
                                struct ggml_tensor * a, struct ggml_tensor * b);

/* Elementwise unary ops on a float tensor with packed rows (ggml_silu, ggml_neg, ...). */
struct ggml_tensor * pyg_unary(struct pyg_graph * g,
                               struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *),
                               struct ggml_tensor * a);

/* ggml_swiglu_split / ggml_geglu_split: gate and up of one float type and shape, contiguous_1. */
struct ggml_tensor * pyg_glu(struct pyg_graph * g,
                             struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *, struct ggml_tensor *),
                             struct ggml_tensor * a, struct ggml_tensor * b);

/* ggml_rms_norm / ggml_norm / ggml_l2_norm on F32 with packed rows; eps finite and >= 0. */
struct ggml_tensor * pyg_norm(struct pyg_graph * g,
                              struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *, float),
                              struct ggml_tensor * a, float eps);

/* ggml_scale on a contiguous F32 tensor whose rows are evenly spaced (ggml_is_padded_1d). */
struct ggml_tensor * pyg_scale(struct pyg_graph * g, struct ggml_tensor * a, float s);

struct ggml_tensor * pyg_mul_mat(struct pyg_graph * g, struct ggml_tensor * a, struct ggml_tensor * b);

/* n (1..4) dims; ne of the unused dims are ignored. */
struct ggml_tensor * pyg_reshape(struct pyg_graph * g, struct ggml_tensor * a, int n,
                                 int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);

/* A view of n dims at a byte offset; nb1..nb3 are the strides of dims 1..n-1, ignored when
 * packed is non-zero (the packed strides of the shape). */
struct ggml_tensor * pyg_view(struct pyg_graph * g, struct ggml_tensor * a, int n,
                              int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                              int packed, int64_t nb1, int64_t nb2, int64_t nb3, int64_t offset);

struct ggml_tensor * pyg_permute(struct pyg_graph * g, struct ggml_tensor * a, int ax0, int ax1, int ax2, int ax3);
struct ggml_tensor * pyg_cont(struct pyg_graph * g, struct ggml_tensor * a);

/* ggml_get_rows with I32 indices (n[, dim2, dim3]) of a float, I32 or dequantizable table; the indices are a
 * graph input (or a reshape/view/permute/transpose of one), whose values tensor.py checks at compute. */
struct ggml_tensor * pyg_get_rows(struct pyg_graph * g, struct ggml_tensor * a, struct ggml_tensor * idx);

/* ggml_set_rows of F32/F16 rows into an F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL destination; indices
 * as for pyg_get_rows. */
struct ggml_tensor * pyg_set_rows(struct pyg_graph * g, struct ggml_tensor * dst, struct ggml_tensor * src,
                                  struct ggml_tensor * idx);

/* ggml_soft_max_ext on a contiguous F32 tensor; mask NULL (then max_bias <= 0) or a contiguous F32/F16
 * (n_kv, >= rows). */
struct ggml_tensor * pyg_soft_max(struct pyg_graph * g, struct ggml_tensor * a, struct ggml_tensor * mask,
                                  float scale, float max_bias);

/* ggml_rope_ext, modes NORMAL (0) and NEOX (2); c (frequency factors) may be NULL. */
struct ggml_tensor * pyg_rope(struct pyg_graph * g, struct ggml_tensor * a, struct ggml_tensor * pos,
                              struct ggml_tensor * c, int n_dims, int mode, int n_ctx_orig, float base, float scale,
                              float ext_factor, float attn_factor, float beta_fast, float beta_slow);

/* tensor.py's scaled_dot_product_attention without a softcap: q (D, T, H[, B]), k (D, KV, Hkv),
 * v (Dv, KV, Hkv), mask NULL or a contiguous (KV, >= T) F32/F16 (F16 with flash); returns
 * (Dv, H, T[, B]). Without flash softmax(K^T Q * scale + mask) V in 7 nodes, with ggml_flash_attn_ext
 * and a reshape. */
struct ggml_tensor * pyg_attention(struct pyg_graph * g, struct ggml_tensor * q, struct ggml_tensor * k,
                                   struct ggml_tensor * v, struct ggml_tensor * mask, float scale, int flash);
