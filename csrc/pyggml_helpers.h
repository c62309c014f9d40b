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

/* ggml_backend_sched splitting a graph over several backends changes the graph's own tensors: a source
 * on another backend is replaced by a copy that lives in the scheduler (gone after its next reset), and
 * every tensor keeps the place the allocator gave it (in compute buffers that later graphs reuse or that
 * a new scheduler frees). Splitting the same graph again then aborts or computes garbage. Before a graph's
 * first split this saves, per node, its GGML_MAX_SRC sources and which of them (and itself) have no place
 * yet; before a later split it puts those back: the same sources, no place. `saved` has room for `cap`
 * nodes of GGML_MAX_SRC + 1 pointers each; the first n_saved nodes are restored, the others saved.
 * Returns the node count, or -(node count) without touching anything when cap is too small. */
int pyggml_graph_srcs(struct ggml_cgraph * graph, struct ggml_tensor ** saved, int n_saved, int cap);

/* For a graph split over several devices, so that only a layer's output crosses to the next device: pins
 * every ADD that consumes a weight's matmul (the residual add that ends a layer, a bias) to the device of that
 * weight, and every norm that a weight scales (the first op of a layer) to the device of that weight. Left to
 * itself, ggml's scheduler puts one or the other on the neighbouring device, and two tensors cross instead
 * of one. `backends` in the scheduler's priority order. Call after ggml_backend_sched_reset, before the
 * split. Returns how many nodes were pinned. */
int pyggml_pin_layer_outputs(ggml_backend_sched_t sched, struct ggml_cgraph * graph, ggml_backend_t * backends,
                             int n_backends);
