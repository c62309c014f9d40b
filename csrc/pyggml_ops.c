/* Checked graph ops (see pyggml_ops.h): the same conditions as tensor.py's Python checks, or
 * stricter, so that a non-NULL result is always a node ggml can build and compute. */

#include <math.h>

#include "ggml.h"
#include "pyggml_ops.h"

/* the largest tensor pyggml makes (tensor.py: _MAX_BYTES): far beyond any memory, far below where ggml's
 * size arithmetic (int64 element counts, size_t bytes) overflows */
#define PYG_MAX_BYTES ((int64_t) 1 << 56)

static int is_float(enum ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

/* dim 0 packed (what the CPU kernels assert: nb[0] is the type size) */
static int rows_packed(const struct ggml_tensor * t) {
    return t->nb[0] == ggml_type_size(t->type);
}

/* ggml_is_contiguous_1 with a packed dim 0: rows contiguous, dims 2 and 3 packed after dim 1 */
static int contiguous_1(const struct ggml_tensor * t) {
    if (!rows_packed(t)) {
        return 0;
    }
    size_t next = (size_t) t->ne[1] * t->nb[1];
    for (int i = 2; i < 4; i++) {
        if (t->ne[i] != 1 && t->nb[i] != next) {
            return 0;
        }
        next *= (size_t) t->ne[i];
    }
    return 1;
}

/* types without a CPU dot product (cannot be the left operand of mul_mat) */
static int no_matmul(enum ggml_type t) {
    return t == GGML_TYPE_I8 || t == GGML_TYPE_I16 || t == GGML_TYPE_I32 || t == GGML_TYPE_I64 ||
           t == GGML_TYPE_F64 || t == GGML_TYPE_Q8_1 || t == GGML_TYPE_Q8_K;
}

/* a tensor of this type and shape stays below PYG_MAX_BYTES (dims positive) */
static int size_ok(enum ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
    int64_t ne[4] = {ne0, ne1, ne2, ne3};
    int64_t n = ggml_type_size(type);
    for (int i = 0; i < 4; i++) {
        if (ne[i] <= 0 || ne[i] > PYG_MAX_BYTES / n) {
            return 0;
        }
        n *= ne[i];
    }
    return 1;
}

/* tables ggml's CPU get_rows can read: float, I32, and quantized types it can dequantize (not the
 * intermediate Q8_1 / Q8_K) */
static int rows_table_ok(enum ggml_type t) {
    if (t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || t == GGML_TYPE_I32) {
        return 1;
    }
    return ggml_is_quantized(t) && t != GGML_TYPE_Q8_1 && t != GGML_TYPE_Q8_K && ggml_get_type_traits(t)->to_float != NULL;
}

/* ---- the graph and its operands ---------------------------------------------------------------- */

void pyg_graph_init(struct pyg_graph * g, struct ggml_context * ctx, int64_t max_tensors) {
    g->ctx = ctx;
    g->base = (const char *) ggml_get_mem_buffer(ctx);
    g->end = g->base + ggml_get_mem_size(ctx);
    g->n_tensors = 0;
    g->max_tensors = max_tensors;
    g->closed = 0;
}

void pyg_pool_init(struct pyg_pool * pool, struct ggml_context * ctx, int writable) {
    pool->base = (const char *) ggml_get_mem_buffer(ctx);
    pool->end = pool->base + ggml_get_mem_size(ctx);
    pool->writable = writable;
}

/* compared as integers: the tensor may belong to any context, and C orders pointers only within one object */
static int holds(const char * base, const char * end, const struct ggml_tensor * t) {
    uintptr_t p = (uintptr_t) t;
    return p >= (uintptr_t) base && p < (uintptr_t) end && (uintptr_t) end - p >= sizeof(struct ggml_tensor);
}

enum use { READ, READ_REPACKED, WRITE };

/* A node of this graph, or a tensor of the graph's open backend that the op may use that way: a
 * tensor the CPU backend repacked (its `extra` holds the repack traits) only as mul_mat's left
 * operand, and only a cache (never a weight) as a destination. */
static int usable(const struct pyg_graph * g, const struct ggml_tensor * t, enum use use) {
    if (holds(g->base, g->end, t)) {
        return 1;
    }
    const struct pyg_pools * pools = g->pools;
    if (pools == NULL || pools->closed) {
        return 0;
    }
    for (int i = 0; i < pools->n; i++) {
        const struct pyg_pool * pool = &pools->pool[i];
        if (holds(pool->base, pool->end, t)) {
            return use == WRITE ? pool->writable : use == READ_REPACKED || t->extra == NULL;
        }
    }
    return 0;
}

/* An index tensor whose values are checked at compute: a graph input of this graph, or a reshape,
 * view, permute or transpose of one. tensor.py also accepts indices computed by ops with a known range
 * (argmax, argsort, top_k): those are left to it. */
static int index_is_input(const struct pyg_graph * g, const struct ggml_tensor * t) {
    for (int depth = 0; depth < 16 && t != NULL; depth++) {
        switch (t->op) {
            case GGML_OP_RESHAPE: case GGML_OP_VIEW: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE:
                t = t->src[0];
                break;
            case GGML_OP_NONE:
                return (t->flags & GGML_TENSOR_FLAG_INPUT) && holds(g->base, g->end, t);
            default:
                return 0;
        }
    }
    return 0;
}

/* room for n more tensors in an open graph */
static int room(const struct pyg_graph * g, int64_t n) {
    return !g->closed && g->n_tensors + n <= g->max_tensors;
}

static struct ggml_tensor * counted(struct pyg_graph * g, struct ggml_tensor * t) {
    if (t != NULL) {
        g->n_tensors++;
    }
    return t;
}

/* ---- the ops ------------------------------------------------------------------------------------ */

struct ggml_tensor * pyg_binary(struct pyg_graph * g,
                                struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *, struct ggml_tensor *),
                                struct ggml_tensor * a, struct ggml_tensor * b) {
    if (!room(g, 1) || !usable(g, a, READ) || !usable(g, b, READ)) {
        return NULL;
    }
    for (int i = 0; i < 4; i++) {
        if (a->ne[i] % b->ne[i]) {
            return NULL;
        }
    }
    if (!is_float(a->type) || (b->type != a->type && b->type != GGML_TYPE_F32) || !rows_packed(a)) {
        return NULL;
    }
    return counted(g, fn(g->ctx, a, b));
}

struct ggml_tensor * pyg_unary(struct pyg_graph * g,
                               struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *),
                               struct ggml_tensor * a) {
    if (!room(g, 1) || !usable(g, a, READ)) {
        return NULL;
    }
    if (!is_float(a->type) || !rows_packed(a)) {
        return NULL;
    }
    return counted(g, fn(g->ctx, a));
}

struct ggml_tensor * pyg_glu(struct pyg_graph * g,
                             struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *, struct ggml_tensor *),
                             struct ggml_tensor * a, struct ggml_tensor * b) {
    if (!room(g, 1) || !usable(g, a, READ) || !usable(g, b, READ)) {
        return NULL;
    }
    if (!ggml_are_same_shape(a, b) || !is_float(a->type) || b->type != a->type || !contiguous_1(a) ||
        !contiguous_1(b)) {
        return NULL;
    }
    return counted(g, fn(g->ctx, a, b));
}

struct ggml_tensor * pyg_norm(struct pyg_graph * g,
                              struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *, float),
                              struct ggml_tensor * a, float eps) {
    if (!room(g, 1) || !usable(g, a, READ)) {
        return NULL;
    }
    /* the CPU kernels assert eps >= 0 (NaN fails it) */
    if (a->type != GGML_TYPE_F32 || !rows_packed(a) || !(eps >= 0.0f) || isinf(eps)) {
        return NULL;
    }
    return counted(g, fn(g->ctx, a, eps));
}

struct ggml_tensor * pyg_scale(struct pyg_graph * g, struct ggml_tensor * a, float s) {
    if (!room(g, 1) || !usable(g, a, READ)) {
        return NULL;
    }
    /* the kernel walks row i at i * nb[1] (ggml_is_padded_1d), which ggml_is_contiguous does not imply
     * when some dims are 1 */
    int padded_1d = rows_packed(a) && a->nb[2] == a->nb[1] * a->ne[1] && a->nb[3] == a->nb[2] * a->ne[2];
    if (a->type != GGML_TYPE_F32 || !ggml_is_contiguous(a) || !padded_1d) {
        return NULL;
    }
    return counted(g, ggml_scale(g->ctx, a, s));
}

/* what tensor.py's mulmat accepts for a x b (operands aside) */
static int mul_mat_ok(const struct ggml_tensor * a, const struct ggml_tensor * b) {
    if (a->ne[0] != b->ne[0] || b->ne[2] % a->ne[2] || b->ne[3] % a->ne[3]) {
        return 0;
    }
    if (!rows_packed(a) || a->nb[0] > a->nb[1] || !rows_packed(b) || no_matmul(a->type)) {
        return 0;
    }
    /* the right operand: F32 always, F16 with an F16 left, BF16 with a BF16 or F32 left */
    return b->type == GGML_TYPE_F32 || (b->type == GGML_TYPE_F16 && a->type == GGML_TYPE_F16) ||
           (b->type == GGML_TYPE_BF16 && (a->type == GGML_TYPE_BF16 || a->type == GGML_TYPE_F32));
}

struct ggml_tensor * pyg_mul_mat(struct pyg_graph * g, struct ggml_tensor * a, struct ggml_tensor * b) {
    if (!room(g, 1) || !usable(g, a, READ_REPACKED) || !usable(g, b, READ) || !mul_mat_ok(a, b) ||
        !size_ok(GGML_TYPE_F32, a->ne[1], b->ne[1], b->ne[2], b->ne[3])) {
        return NULL;
    }
    return counted(g, ggml_mul_mat(g->ctx, a, b));
}

struct ggml_tensor * pyg_reshape(struct pyg_graph * g, struct ggml_tensor * a, int n,
                                 int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
    if (!room(g, 1) || !usable(g, a, READ)) {
        return NULL;
    }
    int64_t ne[4] = {ne0, n > 1 ? ne1 : 1, n > 2 ? ne2 : 1, n > 3 ? ne3 : 1};
    if (n < 1 || n > 4) {
        return NULL;
    }
    int64_t count = 1;
    for (int i = 0; i < 4; i++) {
        if (ne[i] <= 0 || ne[i] > INT64_MAX / count) {
            return NULL;
        }
        count *= ne[i];
    }
    if (count != ggml_nelements(a) || !ggml_is_contiguous(a) || ne[0] % ggml_blck_size(a->type)) {
        return NULL;
    }
    switch (n) {
        case 1: return counted(g, ggml_reshape_1d(g->ctx, a, ne[0]));
        case 2: return counted(g, ggml_reshape_2d(g->ctx, a, ne[0], ne[1]));
        case 3: return counted(g, ggml_reshape_3d(g->ctx, a, ne[0], ne[1], ne[2]));
        default: return counted(g, ggml_reshape_4d(g->ctx, a, ne[0], ne[1], ne[2], ne[3]));
    }
}

struct ggml_tensor * pyg_view(struct pyg_graph * g, struct ggml_tensor * a, int n,
                              int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                              int packed, int64_t nb1, int64_t nb2, int64_t nb3, int64_t offset) {
    if (!room(g, 1) || !usable(g, a, READ)) {
        return NULL;
    }
    const int64_t limit = (int64_t) 1 << 48; /* no tensor is that large: keeps the sums below from overflowing */
    int64_t ne[4] = {ne0, n > 1 ? ne1 : 1, n > 2 ? ne2 : 1, n > 3 ? ne3 : 1};
    int64_t nb[3] = {nb1, nb2, nb3};
    if (n < 1 || n > 4 || offset < 0 || offset > limit) {
        return NULL;
    }
    for (int i = 0; i < 4; i++) {
        if (ne[i] <= 0 || ne[i] > limit) {
            return NULL;
        }
    }
    const int64_t block = ggml_blck_size(a->type);
    const int64_t size = (int64_t) ggml_type_size(a->type);
    if (ne[0] % block) {
        return NULL;
    }
    const int64_t row = ne[0] / block * size;
    if (packed) {
        nb[0] = row;
        nb[1] = row * ne[1];
        nb[2] = nb[1] * ne[2];
    }
    if (offset % size) {
        return NULL;
    }
    /* ggml checks only a packed-size bound: check the strided extent too */
    int64_t extent = offset + row;
    for (int i = 0; i < n - 1; i++) {
        if (nb[i] < 0 || nb[i] > limit || nb[i] % size) {
            return NULL;
        }
        extent += (ne[i + 1] - 1) * nb[i];
    }
    const int64_t nbytes = (int64_t) ggml_nbytes(a);
    if (extent > nbytes) {
        return NULL;
    }
    /* ...and ggml asserts the packed size after the offset within the viewed base tensor */
    int64_t packed_size = row;
    for (int i = 1; i < n; i++) {
        if (packed_size > limit / ne[i]) {
            return NULL;
        }
        packed_size *= ne[i];
    }
    if (a->view_src == NULL ? offset + packed_size > nbytes
                            : offset + (int64_t) a->view_offs + packed_size > (int64_t) ggml_nbytes(a->view_src)) {
        return NULL;
    }
    switch (n) {
        case 1: return counted(g, ggml_view_1d(g->ctx, a, ne[0], (size_t) offset));
        case 2: return counted(g, ggml_view_2d(g->ctx, a, ne[0], ne[1], (size_t) nb[0], (size_t) offset));
        case 3: return counted(g, ggml_view_3d(g->ctx, a, ne[0], ne[1], ne[2], (size_t) nb[0], (size_t) nb[1], (size_t) offset));
        default:
            return counted(g, ggml_view_4d(g->ctx, a, ne[0], ne[1], ne[2], ne[3], (size_t) nb[0], (size_t) nb[1], (size_t) nb[2],
                                (size_t) offset));
    }
}

struct ggml_tensor * pyg_permute(struct pyg_graph * g, struct ggml_tensor * a, int ax0, int ax1, int ax2,
                                 int ax3) {
    if (!room(g, 1) || !usable(g, a, READ)) {
        return NULL;
    }
    int seen = 0;
    int axes[4] = {ax0, ax1, ax2, ax3};
    for (int i = 0; i < 4; i++) {
        if (axes[i] < 0 || axes[i] > 3 || (seen & (1 << axes[i]))) {
            return NULL;
        }
        seen |= 1 << axes[i];
    }
    return counted(g, ggml_permute(g->ctx, a, ax0, ax1, ax2, ax3));
}

struct ggml_tensor * pyg_cont(struct pyg_graph * g, struct ggml_tensor * a) {
    if (!room(g, 1) || !usable(g, a, READ)) {
        return NULL;
    }
    if (a->ne[0] % ggml_blck_size(a->type)) {
        return NULL;
    }
    return counted(g, ggml_cont(g->ctx, a));
}

struct ggml_tensor * pyg_get_rows(struct pyg_graph * g, struct ggml_tensor * a, struct ggml_tensor * idx) {
    if (!room(g, 1) || !usable(g, a, READ) || !usable(g, idx, READ)) {
        return NULL;
    }
    if (idx->type != GGML_TYPE_I32 || !rows_table_ok(a->type) || !index_is_input(g, idx)) {
        return NULL;
    }
    if (a->ne[2] != idx->ne[1] || a->ne[3] != idx->ne[2] || idx->ne[3] != 1 ||
        !size_ok(GGML_TYPE_F32, a->ne[0], idx->ne[0], idx->ne[1], idx->ne[2])) {
        return NULL;
    }
    return counted(g, ggml_get_rows(g->ctx, a, idx));
}

struct ggml_tensor * pyg_set_rows(struct pyg_graph * g, struct ggml_tensor * dst, struct ggml_tensor * src,
                                  struct ggml_tensor * idx) {
    if (!room(g, 1) || !usable(g, dst, WRITE) || !usable(g, src, READ) || !usable(g, idx, READ)) {
        return NULL;
    }
    const int64_t * a = dst->ne;
    const int64_t * b = src->ne;
    const int64_t * i = idx->ne;
    if ((src->type != GGML_TYPE_F32 && src->type != GGML_TYPE_F16) ||
        (idx->type != GGML_TYPE_I32 && idx->type != GGML_TYPE_I64) || !rows_packed(src) || !index_is_input(g, idx)) {
        return NULL;
    }
    if (a[0] != b[0] || b[1] != i[0] || b[2] % a[2] || b[3] % a[3] || i[1] != b[2] || i[2] != b[3]) {
        return NULL;
    }
    switch (dst->type) { /* the destinations ggml can convert F32 rows into (the usual cache types) */
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_IQ4_NL:
            return counted(g, ggml_set_rows(g->ctx, dst, src, idx));
        default:
            return NULL;
    }
}

struct ggml_tensor * pyg_soft_max(struct pyg_graph * g, struct ggml_tensor * a, struct ggml_tensor * mask,
                                  float scale, float max_bias) {
    if (!room(g, 1) || !usable(g, a, READ) || (mask != NULL && !usable(g, mask, READ))) {
        return NULL;
    }
    /* ggml asserts a mask when max_bias > 0 (ALiBi slopes are added through it) */
    if (a->type != GGML_TYPE_F32 || !ggml_is_contiguous(a) || (max_bias > 0.0f && mask == NULL)) {
        return NULL;
    }
    if (mask != NULL) {
        if ((mask->type != GGML_TYPE_F32 && mask->type != GGML_TYPE_F16) || !ggml_is_contiguous(mask)) {
            return NULL;
        }
        if (mask->ne[0] != a->ne[0] || mask->ne[1] < a->ne[1] || a->ne[2] % mask->ne[2] ||
            a->ne[3] % mask->ne[3]) {
            return NULL;
        }
    }
    return counted(g, ggml_soft_max_ext(g->ctx, a, mask, scale, max_bias));
}

struct ggml_tensor * pyg_rope(struct pyg_graph * g, struct ggml_tensor * a, struct ggml_tensor * pos,
                              struct ggml_tensor * c, int n_dims, int mode, int n_ctx_orig, float base, float scale,
                              float ext_factor, float attn_factor, float beta_fast, float beta_slow) {
    if (!room(g, 1) || !usable(g, a, READ) || !usable(g, pos, READ) || (c != NULL && !usable(g, c, READ))) {
        return NULL;
    }
    if (pos->type != GGML_TYPE_I32 || pos->ne[0] != a->ne[2] || pos->ne[1] != 1 || pos->ne[2] != 1 ||
        pos->ne[3] != 1) {
        return NULL;
    }
    if (n_dims <= 0 || n_dims % 2 || n_dims > a->ne[0] || (mode != 0 && mode != 2)) {
        return NULL;
    }
    if ((a->type != GGML_TYPE_F32 && a->type != GGML_TYPE_F16) || !rows_packed(a)) {
        return NULL;
    }
    if (c != NULL && (c->type != GGML_TYPE_F32 || c->ne[0] < n_dims / 2)) {
        return NULL;
    }
    return counted(g, ggml_rope_ext(g->ctx, a, pos, c, n_dims, mode, n_ctx_orig, base, scale, ext_factor, attn_factor, beta_fast,
                         beta_slow));
}

struct ggml_tensor * pyg_attention(struct pyg_graph * g, struct ggml_tensor * q, struct ggml_tensor * k,
                                   struct ggml_tensor * v, struct ggml_tensor * mask, float scale, int flash) {
    if (!room(g, flash ? 2 : 7) || !usable(g, q, READ) || !usable(g, k, READ) || !usable(g, v, READ) ||
        (mask != NULL && !usable(g, mask, READ))) {
        return NULL;
    }
    const int64_t * a = q->ne;
    const int64_t * b = k->ne;
    const int64_t * c = v->ne;
    if (a[0] != b[0] || b[1] != c[1] || b[2] != c[2] || a[2] % b[2] || a[3] != b[3] || b[3] != c[3] ||
        !size_ok(GGML_TYPE_F32, b[1], a[1], a[2], a[3])) {
        return NULL;
    }
    if (mask != NULL) {
        const int64_t * m = mask->ne;
        /* tensor.py converts a mask of another type or layout first: left to it */
        if (m[0] != b[1] || m[1] < a[1] || a[2] % m[2] || a[3] % m[3] || !ggml_is_contiguous(mask) ||
            (mask->type != GGML_TYPE_F16 && (flash || mask->type != GGML_TYPE_F32))) {
            return NULL;
        }
    }
    if (flash) {
        if (q->type != GGML_TYPE_F32 || no_matmul(k->type) || no_matmul(v->type) || !rows_packed(q) ||
            !rows_packed(k) || !rows_packed(v)) {
            return NULL;
        }
        struct ggml_tensor * out = counted(g, ggml_flash_attn_ext(g->ctx, q, k, v, mask, scale, 0.0f, 0.0f));
        ggml_prec_set_acc(out, GGML_PREC_F32);
        return counted(g, a[3] > 1 ? ggml_reshape_4d(g->ctx, out, c[0], a[2], a[1], a[3])
                                   : ggml_reshape_3d(g->ctx, out, c[0], a[2], a[1]));
    }
    /* softmax(K^T Q * scale + mask) V; a quantized V is dequantized first by tensor.py: left to it */
    if (!mul_mat_ok(k, q) || !is_float(v->type)) {
        return NULL;
    }
    struct ggml_tensor * probs = counted(g, ggml_soft_max_ext(g->ctx, counted(g, ggml_mul_mat(g->ctx, k, q)), mask,
                                                              scale, 0.0f));
    /* V^T: a copy, unless the cache stores V transposed (then the permuted view has packed rows) */
    struct ggml_tensor * v_t = counted(g, ggml_permute(g->ctx, v, 1, 0, 2, 3));
    if (!rows_packed(v_t)) {
        v_t = counted(g, ggml_cont(g->ctx, v_t));
    }
    struct ggml_tensor * out = counted(g, ggml_mul_mat(g->ctx, v_t, probs)); /* (Dv, T, H) */
    return counted(g, ggml_cont(g->ctx, counted(g, ggml_permute(g->ctx, out, 0, 2, 1, 3))));
}
