/* Checked graph ops (see pyggml_ops.h): the same conditions as tensor.py's Python checks, or
 * stricter, so that a non-NULL result is always a node ggml can build and compute. */

#include "ggml.h"
#include "pyggml_ops.h"

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

struct ggml_tensor * pyg_binary(struct ggml_context * ctx,
                                struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *, struct ggml_tensor *),
                                struct ggml_tensor * a, struct ggml_tensor * b) {
    for (int i = 0; i < 4; i++) {
        if (a->ne[i] % b->ne[i]) {
            return NULL;
        }
    }
    if (!is_float(a->type) || (b->type != a->type && b->type != GGML_TYPE_F32) || !rows_packed(a)) {
        return NULL;
    }
    return fn(ctx, a, b);
}

struct ggml_tensor * pyg_unary(struct ggml_context * ctx,
                               struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *),
                               struct ggml_tensor * a) {
    if (!is_float(a->type) || !rows_packed(a)) {
        return NULL;
    }
    return fn(ctx, a);
}

struct ggml_tensor * pyg_glu(struct ggml_context * ctx,
                             struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *, struct ggml_tensor *),
                             struct ggml_tensor * a, struct ggml_tensor * b) {
    if (!ggml_are_same_shape(a, b) || !is_float(a->type) || b->type != a->type || !contiguous_1(a) ||
        !contiguous_1(b)) {
        return NULL;
    }
    return fn(ctx, a, b);
}

struct ggml_tensor * pyg_norm(struct ggml_context * ctx,
                              struct ggml_tensor * (*fn)(struct ggml_context *, struct ggml_tensor *, float),
                              struct ggml_tensor * a, float eps) {
    if (a->type != GGML_TYPE_F32 || !rows_packed(a)) {
        return NULL;
    }
    return fn(ctx, a, eps);
}

struct ggml_tensor * pyg_scale(struct ggml_context * ctx, struct ggml_tensor * a, float s) {
    /* the kernel walks row i at i * nb[1] (ggml_is_padded_1d), which ggml_is_contiguous does not imply
     * when some dims are 1 */
    int padded_1d = rows_packed(a) && a->nb[2] == a->nb[1] * a->ne[1] && a->nb[3] == a->nb[2] * a->ne[2];
    if (a->type != GGML_TYPE_F32 || !ggml_is_contiguous(a) || !padded_1d) {
        return NULL;
    }
    return ggml_scale(ctx, a, s);
}

struct ggml_tensor * pyg_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b) {
    if (a->ne[0] != b->ne[0] || b->ne[2] % a->ne[2] || b->ne[3] % a->ne[3]) {
        return NULL;
    }
    if (!rows_packed(a) || a->nb[0] > a->nb[1] || !rows_packed(b) || no_matmul(a->type)) {
        return NULL;
    }
    /* the right operand: F32 always, F16 with an F16 left, BF16 with a BF16 or F32 left */
    int ok = b->type == GGML_TYPE_F32 || (b->type == GGML_TYPE_F16 && a->type == GGML_TYPE_F16) ||
             (b->type == GGML_TYPE_BF16 && (a->type == GGML_TYPE_BF16 || a->type == GGML_TYPE_F32));
    return ok ? ggml_mul_mat(ctx, a, b) : NULL;
}

struct ggml_tensor * pyg_reshape(struct ggml_context * ctx, struct ggml_tensor * a, int n,
                                 int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3) {
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
        case 1: return ggml_reshape_1d(ctx, a, ne[0]);
        case 2: return ggml_reshape_2d(ctx, a, ne[0], ne[1]);
        case 3: return ggml_reshape_3d(ctx, a, ne[0], ne[1], ne[2]);
        default: return ggml_reshape_4d(ctx, a, ne[0], ne[1], ne[2], ne[3]);
    }
}

struct ggml_tensor * pyg_view(struct ggml_context * ctx, struct ggml_tensor * a, int n,
                              int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                              int packed, int64_t nb1, int64_t nb2, int64_t nb3, int64_t offset) {
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
        case 1: return ggml_view_1d(ctx, a, ne[0], (size_t) offset);
        case 2: return ggml_view_2d(ctx, a, ne[0], ne[1], (size_t) nb[0], (size_t) offset);
        case 3: return ggml_view_3d(ctx, a, ne[0], ne[1], ne[2], (size_t) nb[0], (size_t) nb[1], (size_t) offset);
        default:
            return ggml_view_4d(ctx, a, ne[0], ne[1], ne[2], ne[3], (size_t) nb[0], (size_t) nb[1], (size_t) nb[2],
                                (size_t) offset);
    }
}

struct ggml_tensor * pyg_permute(struct ggml_context * ctx, struct ggml_tensor * a, int ax0, int ax1, int ax2,
                                 int ax3) {
    int seen = 0;
    int axes[4] = {ax0, ax1, ax2, ax3};
    for (int i = 0; i < 4; i++) {
        if (axes[i] < 0 || axes[i] > 3 || (seen & (1 << axes[i]))) {
            return NULL;
        }
        seen |= 1 << axes[i];
    }
    return ggml_permute(ctx, a, ax0, ax1, ax2, ax3);
}

struct ggml_tensor * pyg_cont(struct ggml_context * ctx, struct ggml_tensor * a) {
    if (a->ne[0] % ggml_blck_size(a->type)) {
        return NULL;
    }
    return ggml_cont(ctx, a);
}

struct ggml_tensor * pyg_get_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * idx) {
    enum ggml_type t = a->type;
    if (idx->type != GGML_TYPE_I32 || t == GGML_TYPE_I8 || t == GGML_TYPE_I16 || t == GGML_TYPE_I64 ||
        t == GGML_TYPE_F64) {
        return NULL;
    }
    if (a->ne[2] != idx->ne[1] || a->ne[3] != idx->ne[2] || idx->ne[3] != 1) {
        return NULL;
    }
    return ggml_get_rows(ctx, a, idx);
}

struct ggml_tensor * pyg_set_rows(struct ggml_context * ctx, struct ggml_tensor * dst, struct ggml_tensor * src,
                                  struct ggml_tensor * idx) {
    const int64_t * a = dst->ne;
    const int64_t * b = src->ne;
    const int64_t * i = idx->ne;
    if ((src->type != GGML_TYPE_F32 && src->type != GGML_TYPE_F16) ||
        (idx->type != GGML_TYPE_I32 && idx->type != GGML_TYPE_I64) || !rows_packed(src)) {
        return NULL;
    }
    if (a[0] != b[0] || b[1] != i[0] || b[2] % a[2] || b[3] % a[3] || i[1] != b[2] || i[2] != b[3]) {
        return NULL;
    }
    switch (dst->type) { /* the destinations ggml can convert F32 rows into (the usual cache types) */
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_IQ4_NL:
            return ggml_set_rows(ctx, dst, src, idx);
        default:
            return NULL;
    }
}

struct ggml_tensor * pyg_soft_max(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * mask,
                                  float scale, float max_bias) {
    if (a->type != GGML_TYPE_F32 || !ggml_is_contiguous(a)) {
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
    return ggml_soft_max_ext(ctx, a, mask, scale, max_bias);
}

struct ggml_tensor * pyg_rope(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * pos,
                              struct ggml_tensor * c, int n_dims, int mode, int n_ctx_orig, float base, float scale,
                              float ext_factor, float attn_factor, float beta_fast, float beta_slow) {
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
    return ggml_rope_ext(ctx, a, pos, c, n_dims, mode, n_ctx_orig, base, scale, ext_factor, attn_factor, beta_fast,
                         beta_slow);
}
