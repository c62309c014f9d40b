/* Small C helpers for pyggml where a Python callback or many cffi calls would cost too much.
 * This file is both included by the generated module and read as a cffi cdef: keep it plain. */

/* ggml reports errors only through its log. Captured warnings/errors are kept here (most recent
 * first kept, bounded) so Python can put them into exception messages. */
void pyggml_log_install(int echo_level);
size_t pyggml_log_take(char * out, size_t cap);

/* The CPU device's extra buffer types (CPU_REPACK, ...), obtained through the registry's proc
 * address "ggml_backend_dev_get_extra_bufts". Returns how many were written to out. */
int pyggml_dev_extra_bufts(ggml_backend_dev_t dev, ggml_backend_buffer_type_t * out, int cap);

/* ne[0..3] and nb[0..3] of a tensor in one call. */
void pyggml_tensor_layout(const struct ggml_tensor * t, int64_t * ne, size_t * nb);

/* Forget where a graph's tensors were placed in the scheduler's compute buffers (data and buffer
 * of every tensor of ctx that lies in a COMPUTE buffer), so that allocating the graph again places
 * them afresh. ggml's allocator keeps the address of any tensor whose data is set: without this, a
 * graph computed again after another graph made the scheduler grow (move) its buffers would read
 * and write freed memory. Weights and caches are not in compute buffers and are left alone. */
void pyggml_forget_compute_placement(struct ggml_context * ctx);
