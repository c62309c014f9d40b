/* cffi declarations for the parts of ggml that pyggml uses.
 *
 * Hand-written (the real headers do not parse as a cdef). Structs are partial ("...;") so their
 * layouts come from the compiler; the generated C is compiled with -Werror=incompatible-pointer-types
 * against the real headers, which catches most signature mistakes. Return types are not checked by
 * the compiler: review them against the headers when bumping the ggml pin.
 */

/* ---- ggml.h ------------------------------------------------------------------------------- */
#define GGML_MAX_DIMS ...
#define GGML_MAX_NAME ...
#define GGML_MAX_SRC ...
#define GGML_ROPE_TYPE_NORMAL ...
#define GGML_ROPE_TYPE_NEOX ...
#define GGML_ROPE_TYPE_MROPE ...
#define GGML_ROPE_TYPE_VISION ...

enum ggml_type { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
                 GGML_TYPE_Q8_0, GGML_TYPE_Q8_1, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K,
                 GGML_TYPE_Q6_K, GGML_TYPE_Q8_K, GGML_TYPE_IQ2_XXS, GGML_TYPE_IQ2_XS, GGML_TYPE_IQ3_XXS,
                 GGML_TYPE_IQ1_S, GGML_TYPE_IQ4_NL, GGML_TYPE_IQ3_S, GGML_TYPE_IQ2_S, GGML_TYPE_IQ4_XS,
                 GGML_TYPE_I8, GGML_TYPE_I16, GGML_TYPE_I32, GGML_TYPE_I64, GGML_TYPE_F64, GGML_TYPE_IQ1_M,
                 GGML_TYPE_BF16, GGML_TYPE_TQ1_0, GGML_TYPE_TQ2_0, GGML_TYPE_MXFP4, GGML_TYPE_NVFP4,
                 GGML_TYPE_Q1_0, GGML_TYPE_Q2_0, GGML_TYPE_COUNT, ... };
enum ggml_status { GGML_STATUS_ALLOC_FAILED, GGML_STATUS_FAILED, GGML_STATUS_SUCCESS, GGML_STATUS_ABORTED, ... };
enum ggml_op { GGML_OP_NONE, GGML_OP_DUP, GGML_OP_CPY, GGML_OP_CONT, GGML_OP_RESHAPE, GGML_OP_VIEW,
               GGML_OP_PERMUTE, GGML_OP_TRANSPOSE, GGML_OP_GET_ROWS, GGML_OP_ARGMAX, GGML_OP_ARGSORT,
               GGML_OP_TOP_K, ... };
enum ggml_tensor_flag { GGML_TENSOR_FLAG_INPUT, ... };
enum ggml_prec { GGML_PREC_DEFAULT, GGML_PREC_F32, ... };
enum ggml_sort_order { GGML_SORT_ORDER_ASC, GGML_SORT_ORDER_DESC, ... };
enum ggml_op_pool { GGML_OP_POOL_MAX, GGML_OP_POOL_AVG, ... };
enum ggml_scale_mode { GGML_SCALE_MODE_NEAREST, GGML_SCALE_MODE_BILINEAR, ... };
enum ggml_log_level { GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO, GGML_LOG_LEVEL_WARN,
                      GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT, ... };
enum ggml_sched_priority { GGML_SCHED_PRIO_NORMAL, ... };

struct ggml_context;
struct ggml_cgraph;
struct ggml_backend_buffer;

struct ggml_tensor {
    enum ggml_type type;
    struct ggml_backend_buffer * buffer;
    int64_t ne[4];
    size_t nb[4];
    enum ggml_op op;
    int32_t flags;
    struct ggml_tensor * src[...];
    struct ggml_tensor * view_src;
    size_t view_offs;
    void * data;
    char name[...];
    ...;
};

struct ggml_init_params {
    size_t mem_size;
    void * mem_buffer;
    bool no_alloc;
};

struct ggml_threadpool_params {
    int n_threads;
    enum ggml_sched_priority prio;
    uint32_t poll;
    bool strict_cpu;
    bool paused;
    ...;
};
struct ggml_threadpool;

typedef uint16_t ggml_fp16_t;
typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
struct ggml_type_traits {
    const char * type_name;
    int64_t blck_size;
    size_t type_size;
    bool is_quantized;
    ggml_to_float_t to_float;
    ...;
};
const struct ggml_type_traits * ggml_get_type_traits(enum ggml_type type);
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);

const char * ggml_version(void);
const char * ggml_commit(void);
const char * ggml_status_to_string(enum ggml_status status);
const char * ggml_type_name(enum ggml_type type);
const char * ggml_op_name(enum ggml_op op);
const char * ggml_op_desc(const struct ggml_tensor * t);
int64_t ggml_blck_size(enum ggml_type type);
size_t ggml_type_size(enum ggml_type type);
size_t ggml_row_size(enum ggml_type type, int64_t ne);
bool ggml_is_quantized(enum ggml_type type);
void ggml_log_set(ggml_log_callback log_callback, void * user_data);

void ggml_fp16_to_fp32_row(const ggml_fp16_t * x, float * y, int64_t n);
void ggml_fp32_to_fp16_row(const float * x, ggml_fp16_t * y, int64_t n);
size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start, int64_t nrows,
                           int64_t n_per_row, const float * imatrix);
bool ggml_quantize_requires_imatrix(enum ggml_type type);

int64_t ggml_nelements(const struct ggml_tensor * tensor);
int64_t ggml_nrows(const struct ggml_tensor * tensor);
size_t ggml_nbytes(const struct ggml_tensor * tensor);
int ggml_n_dims(const struct ggml_tensor * tensor);
bool ggml_is_contiguous(const struct ggml_tensor * tensor);
bool ggml_is_contiguous_rows(const struct ggml_tensor * tensor);
bool ggml_is_transposed(const struct ggml_tensor * tensor);
bool ggml_is_permuted(const struct ggml_tensor * tensor);
size_t ggml_tensor_overhead(void);
size_t ggml_graph_overhead_custom(size_t size, bool grads);
bool ggml_validate_row_data(enum ggml_type type, const void * data, size_t nbytes);

struct ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(struct ggml_context * ctx);
size_t ggml_used_mem(const struct ggml_context * ctx);
struct ggml_tensor * ggml_get_first_tensor(const struct ggml_context * ctx);
struct ggml_tensor * ggml_get_next_tensor(const struct ggml_context * ctx, struct ggml_tensor * tensor);
struct ggml_tensor * ggml_get_tensor(struct ggml_context * ctx, const char * name);

struct ggml_tensor * ggml_new_tensor(struct ggml_context * ctx, enum ggml_type type, int n_dims, const int64_t * ne);
struct ggml_tensor * ggml_new_tensor_1d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0);
struct ggml_tensor * ggml_new_tensor_2d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_new_tensor_3d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1,
                                        int64_t ne2);
struct ggml_tensor * ggml_new_tensor_4d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1,
                                        int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_dup_tensor(struct ggml_context * ctx, const struct ggml_tensor * src);
const char * ggml_get_name(const struct ggml_tensor * tensor);
struct ggml_tensor * ggml_set_name(struct ggml_tensor * tensor, const char * name);
void ggml_set_input(struct ggml_tensor * tensor);
void ggml_set_output(struct ggml_tensor * tensor);

/* ops */
struct ggml_tensor * ggml_dup(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_add(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_add_id(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
                                 struct ggml_tensor * ids);
struct ggml_tensor * ggml_sub(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_mul(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_div(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_sqr(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_sqrt(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_log(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_exp(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_sin(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_cos(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_abs(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_neg(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_tanh(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_relu(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_sigmoid(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_softplus(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_gelu(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_gelu_erf(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_gelu_quick(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_silu(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_swiglu_split(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_geglu_split(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_swiglu_oai(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
                                     float alpha, float limit);
struct ggml_tensor * ggml_sum(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_sum_rows(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_mean(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_argmax(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_repeat_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
                                    int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_concat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, int dim);
struct ggml_tensor * ggml_norm(struct ggml_context * ctx, struct ggml_tensor * a, float eps);
struct ggml_tensor * ggml_rms_norm(struct ggml_context * ctx, struct ggml_tensor * a, float eps);
struct ggml_tensor * ggml_l2_norm(struct ggml_context * ctx, struct ggml_tensor * a, float eps);
struct ggml_tensor * ggml_gated_delta_net(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                          struct ggml_tensor * v, struct ggml_tensor * g, struct ggml_tensor * beta,
                                          struct ggml_tensor * state, int64_t K);
struct ggml_tensor * ggml_group_norm(struct ggml_context * ctx, struct ggml_tensor * a, int n_groups, float eps);
struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_mul_mat_id(struct ggml_context * ctx, struct ggml_tensor * as, struct ggml_tensor * b,
                                     struct ggml_tensor * ids);
bool ggml_prec_set_acc(struct ggml_tensor * a, enum ggml_prec prec);
struct ggml_tensor * ggml_scale(struct ggml_context * ctx, struct ggml_tensor * a, float s);
struct ggml_tensor * ggml_scale_bias(struct ggml_context * ctx, struct ggml_tensor * a, float s, float b);
struct ggml_tensor * ggml_clamp(struct ggml_context * ctx, struct ggml_tensor * a, float min, float max);
struct ggml_tensor * ggml_cpy(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_cast(struct ggml_context * ctx, struct ggml_tensor * a, enum ggml_type type);
struct ggml_tensor * ggml_cont(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_reshape_1d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0);
struct ggml_tensor * ggml_reshape_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_reshape_3d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
                                     int64_t ne2);
struct ggml_tensor * ggml_reshape_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
                                     int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_view_1d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, size_t offset);
struct ggml_tensor * ggml_view_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
                                  size_t nb1, size_t offset);
struct ggml_tensor * ggml_view_3d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
                                  int64_t ne2, size_t nb1, size_t nb2, size_t offset);
struct ggml_tensor * ggml_view_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
                                  int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset);
struct ggml_tensor * ggml_permute(struct ggml_context * ctx, struct ggml_tensor * a, int axis0, int axis1, int axis2,
                                  int axis3);
struct ggml_tensor * ggml_transpose(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_get_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_set_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
                                   struct ggml_tensor * c);
struct ggml_tensor * ggml_diag_mask_inf(struct ggml_context * ctx, struct ggml_tensor * a, int n_past);
struct ggml_tensor * ggml_soft_max_ext(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * mask,
                                       float scale, float max_bias);
void ggml_soft_max_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks);
struct ggml_tensor * ggml_rope_ext(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
                                   struct ggml_tensor * c, int n_dims, int mode, int n_ctx_orig, float freq_base,
                                   float freq_scale, float ext_factor, float attn_factor, float beta_fast,
                                   float beta_slow);
struct ggml_tensor * ggml_im2col(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, int s0,
                                 int s1, int p0, int p1, int d0, int d1, bool is_2D, enum ggml_type dst_type);
struct ggml_tensor * ggml_ssm_scan(struct ggml_context * ctx, struct ggml_tensor * s, struct ggml_tensor * x,
                                   struct ggml_tensor * dt, struct ggml_tensor * A, struct ggml_tensor * B,
                                   struct ggml_tensor * C, struct ggml_tensor * ids, int64_t K);
struct ggml_tensor * ggml_conv_2d(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, int s0,
                                  int s1, int p0, int p1, int d0, int d1);
struct ggml_tensor * ggml_pool_2d(struct ggml_context * ctx, struct ggml_tensor * a, enum ggml_op_pool op, int k0,
                                  int k1, int s0, int s1, float p0, float p1);
struct ggml_tensor * ggml_pad(struct ggml_context * ctx, struct ggml_tensor * a, int p0, int p1, int p2, int p3);
struct ggml_tensor * ggml_argsort(struct ggml_context * ctx, struct ggml_tensor * a, enum ggml_sort_order order);
struct ggml_tensor * ggml_top_k(struct ggml_context * ctx, struct ggml_tensor * a, int k);
struct ggml_tensor * ggml_arange(struct ggml_context * ctx, float start, float stop, float step);
struct ggml_tensor * ggml_flash_attn_ext(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, struct ggml_tensor * mask, float scale,
                                         float max_bias, float logit_softcap);
void ggml_flash_attn_ext_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks);

/* graphs */
struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
int ggml_graph_n_nodes(struct ggml_cgraph * cgraph);
int ggml_graph_size(struct ggml_cgraph * cgraph);
struct ggml_tensor * ggml_graph_node(struct ggml_cgraph * cgraph, int i);

/* ---- ggml-backend.h / ggml-alloc.h -------------------------------------------------------- */
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
typedef struct ggml_backend_buffer * ggml_backend_buffer_t;
typedef struct ggml_backend * ggml_backend_t;
typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_backend_sched * ggml_backend_sched_t;

enum ggml_backend_dev_type { GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU,
                             GGML_BACKEND_DEVICE_TYPE_IGPU, GGML_BACKEND_DEVICE_TYPE_ACCEL, ... };
enum ggml_backend_buffer_usage { GGML_BACKEND_BUFFER_USAGE_ANY, GGML_BACKEND_BUFFER_USAGE_WEIGHTS,
                                 GGML_BACKEND_BUFFER_USAGE_COMPUTE, ... };

const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft);
ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size);
size_t ggml_backend_buft_get_alignment(ggml_backend_buffer_type_t buft);
size_t ggml_backend_buft_get_alloc_size(ggml_backend_buffer_type_t buft, const struct ggml_tensor * tensor);
bool ggml_backend_buft_is_host(ggml_backend_buffer_type_t buft);

const char * ggml_backend_buffer_name(ggml_backend_buffer_t buffer);
void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
void * ggml_backend_buffer_get_base(ggml_backend_buffer_t buffer);
size_t ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer);
void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value);
bool ggml_backend_buffer_is_host(ggml_backend_buffer_t buffer);
void ggml_backend_buffer_set_usage(ggml_backend_buffer_t buffer, enum ggml_backend_buffer_usage usage);
ggml_backend_buffer_type_t ggml_backend_buffer_get_type(ggml_backend_buffer_t buffer);
enum ggml_status ggml_backend_tensor_alloc(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, void * addr);
ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors_from_buft(struct ggml_context * ctx,
                                                               ggml_backend_buffer_type_t buft);

const char * ggml_backend_name(ggml_backend_t backend);
void ggml_backend_free(ggml_backend_t backend);
ggml_backend_buffer_type_t ggml_backend_get_default_buffer_type(ggml_backend_t backend);
ggml_backend_dev_t ggml_backend_get_device(ggml_backend_t backend);
void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
void ggml_backend_tensor_memset(struct ggml_tensor * tensor, uint8_t value, size_t offset, size_t size);
void ggml_backend_synchronize(ggml_backend_t backend);
enum ggml_status ggml_backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * cgraph);
bool ggml_backend_supports_op(ggml_backend_t backend, const struct ggml_tensor * op);

const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
ggml_backend_t ggml_backend_dev_init(ggml_backend_dev_t device, const char * params);
ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
ggml_backend_buffer_type_t ggml_backend_dev_host_buffer_type(ggml_backend_dev_t device);
ggml_backend_buffer_t ggml_backend_dev_buffer_from_host_ptr(ggml_backend_dev_t device, void * ptr, size_t size,
                                                            size_t max_tensor_size);
bool ggml_backend_dev_supports_op(ggml_backend_dev_t device, const struct ggml_tensor * op);
bool ggml_backend_dev_supports_buft(ggml_backend_dev_t device, ggml_backend_buffer_type_t buft);

const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
void ggml_backend_register(ggml_backend_reg_t reg);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type type);

ggml_backend_sched_t ggml_backend_sched_new(ggml_backend_t * backends, ggml_backend_buffer_type_t * bufts,
                                            int n_backends, size_t graph_size, bool parallel, bool op_offload);
void ggml_backend_sched_free(ggml_backend_sched_t sched);
bool ggml_backend_sched_reserve(ggml_backend_sched_t sched, struct ggml_cgraph * measure_graph);
bool ggml_backend_sched_alloc_graph(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
enum ggml_status ggml_backend_sched_graph_compute(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
enum ggml_status ggml_backend_sched_graph_compute_async(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
void ggml_backend_sched_synchronize(ggml_backend_sched_t sched);
void ggml_backend_sched_reset(ggml_backend_sched_t sched);
int ggml_backend_sched_get_n_splits(ggml_backend_sched_t sched);
size_t ggml_backend_sched_get_buffer_size(ggml_backend_sched_t sched, ggml_backend_t backend);
void ggml_backend_sched_set_tensor_backend(ggml_backend_sched_t sched, struct ggml_tensor * node,
                                           ggml_backend_t backend);

/* ---- ggml-cpu.h --------------------------------------------------------------------------- */
struct ggml_threadpool_params ggml_threadpool_params_default(int n_threads);
struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params * params);
void ggml_threadpool_free(struct ggml_threadpool * threadpool);
void ggml_cpu_init(void);
bool ggml_backend_is_cpu(ggml_backend_t backend);
void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
void ggml_backend_cpu_set_threadpool(ggml_backend_t backend_cpu, struct ggml_threadpool * threadpool);
int ggml_cpu_has_avx(void);
int ggml_cpu_has_avx2(void);
int ggml_cpu_has_avx512(void);
int ggml_cpu_has_avx512_vnni(void);
int ggml_cpu_has_avx512_bf16(void);
int ggml_cpu_has_f16c(void);
int ggml_cpu_has_fma(void);
int ggml_cpu_has_neon(void);
int ggml_cpu_has_llamafile(void);

/* ---- ggml-rpc.h --------------------------------------------------------------------------
 * Checked against the pinned header. Built with -DPYGGML_RPC=OFF these are stubs (PYGGML_HAS_RPC is 0,
 * the versions are 0). The client functions that take an endpoint connect and GGML_ABORT when the server
 * is unreachable or drops the connection: pyggml only ever hands them the address of its own relay
 * (pyggml/rpc.py), never a remote address. */
#define PYGGML_HAS_RPC ...
#define RPC_PROTO_MAJOR_VERSION ...
#define RPC_PROTO_MINOR_VERSION ...
#define RPC_PROTO_PATCH_VERSION ...
#define GGML_RPC_MAX_SERVERS ...
ggml_backend_t ggml_backend_rpc_init(const char * endpoint, uint32_t device);
bool ggml_backend_is_rpc(ggml_backend_t backend);
ggml_backend_buffer_type_t ggml_backend_rpc_buffer_type(const char * endpoint, uint32_t device);
void ggml_backend_rpc_get_device_memory(const char * endpoint, uint32_t device, size_t * free, size_t * total);
void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads, size_t n_devices,
                                   ggml_backend_dev_t * devices);
ggml_backend_reg_t ggml_backend_rpc_reg(void);
ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);

/* ---- gguf.h ------------------------------------------------------------------------------- */
enum gguf_type { GGUF_TYPE_UINT8, GGUF_TYPE_INT8, GGUF_TYPE_UINT16, GGUF_TYPE_INT16, GGUF_TYPE_UINT32,
                 GGUF_TYPE_INT32, GGUF_TYPE_FLOAT32, GGUF_TYPE_BOOL, GGUF_TYPE_STRING, GGUF_TYPE_ARRAY,
                 GGUF_TYPE_UINT64, GGUF_TYPE_INT64, GGUF_TYPE_FLOAT64, ... };
struct gguf_context;
struct gguf_init_params {
    bool no_alloc;
    struct ggml_context ** ctx;
};
struct gguf_context * gguf_init_from_file(const char * fname, struct gguf_init_params params);
void gguf_free(struct gguf_context * ctx);
uint32_t gguf_get_version(const struct gguf_context * ctx);
size_t gguf_get_alignment(const struct gguf_context * ctx);
size_t gguf_get_data_offset(const struct gguf_context * ctx);
int64_t gguf_get_n_kv(const struct gguf_context * ctx);
int64_t gguf_find_key(const struct gguf_context * ctx, const char * key);
const char * gguf_get_key(const struct gguf_context * ctx, int64_t key_id);
enum gguf_type gguf_get_kv_type(const struct gguf_context * ctx, int64_t key_id);
enum gguf_type gguf_get_arr_type(const struct gguf_context * ctx, int64_t key_id);
uint8_t gguf_get_val_u8(const struct gguf_context * ctx, int64_t key_id);
int8_t gguf_get_val_i8(const struct gguf_context * ctx, int64_t key_id);
uint16_t gguf_get_val_u16(const struct gguf_context * ctx, int64_t key_id);
int16_t gguf_get_val_i16(const struct gguf_context * ctx, int64_t key_id);
uint32_t gguf_get_val_u32(const struct gguf_context * ctx, int64_t key_id);
int32_t gguf_get_val_i32(const struct gguf_context * ctx, int64_t key_id);
float gguf_get_val_f32(const struct gguf_context * ctx, int64_t key_id);
uint64_t gguf_get_val_u64(const struct gguf_context * ctx, int64_t key_id);
int64_t gguf_get_val_i64(const struct gguf_context * ctx, int64_t key_id);
double gguf_get_val_f64(const struct gguf_context * ctx, int64_t key_id);
bool gguf_get_val_bool(const struct gguf_context * ctx, int64_t key_id);
const char * gguf_get_val_str(const struct gguf_context * ctx, int64_t key_id);
size_t gguf_get_arr_n(const struct gguf_context * ctx, int64_t key_id);
const void * gguf_get_arr_data(const struct gguf_context * ctx, int64_t key_id);
const char * gguf_get_arr_str(const struct gguf_context * ctx, int64_t key_id, size_t i);
int64_t gguf_get_n_tensors(const struct gguf_context * ctx);
int64_t gguf_find_tensor(const struct gguf_context * ctx, const char * name);
size_t gguf_get_tensor_offset(const struct gguf_context * ctx, int64_t tensor_id);
const char * gguf_get_tensor_name(const struct gguf_context * ctx, int64_t tensor_id);
enum ggml_type gguf_get_tensor_type(const struct gguf_context * ctx, int64_t tensor_id);
size_t gguf_get_tensor_size(const struct gguf_context * ctx, int64_t tensor_id);
