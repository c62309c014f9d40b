#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "ggml.h"
#include "ggml-backend.h"
#include "pyggml_helpers.h"

#define LOG_CAP 8192

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char log_text[LOG_CAP];
static size_t log_len = 0;
static int log_echo_level = GGML_LOG_LEVEL_NONE;
static enum ggml_log_level last_level = GGML_LOG_LEVEL_NONE;

static void log_callback(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_CONT) {
        level = last_level;  // a continuation belongs to the previous message
    }
    last_level = level;
    if (log_echo_level != GGML_LOG_LEVEL_NONE && level >= log_echo_level) {
        fputs(text, stderr);
    }
    if (level < GGML_LOG_LEVEL_WARN) {
        return;
    }
    pthread_mutex_lock(&log_lock);
    size_t n = strlen(text);
    if (n >= LOG_CAP) {
        text += n - (LOG_CAP - 1);
        n = LOG_CAP - 1;
    }
    if (log_len + n >= LOG_CAP) {  // drop the oldest text to make room
        size_t drop = log_len + n - (LOG_CAP - 1);
        memmove(log_text, log_text + drop, log_len - drop);
        log_len -= drop;
    }
    memcpy(log_text + log_len, text, n);
    log_len += n;
    pthread_mutex_unlock(&log_lock);
}

void pyggml_log_install(int echo_level) {
    log_echo_level = echo_level;
    ggml_log_set(log_callback, NULL);
}

size_t pyggml_log_take(char * out, size_t cap) {
    pthread_mutex_lock(&log_lock);
    size_t n = log_len < cap ? log_len : cap;
    memcpy(out, log_text, n);
    log_len = 0;
    pthread_mutex_unlock(&log_lock);
    return n;
}

int pyggml_dev_extra_bufts(ggml_backend_dev_t dev, ggml_backend_buffer_type_t * out, int cap) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    if (reg == NULL) {
        return 0;
    }
    ggml_backend_dev_get_extra_bufts_t get_extra =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra == NULL) {
        return 0;
    }
    int n = 0;
    for (ggml_backend_buffer_type_t * it = get_extra(dev); it != NULL && *it != NULL && n < cap; ++it) {
        out[n++] = *it;
    }
    return n;
}

void pyggml_tensor_layout(const struct ggml_tensor * t, int64_t * ne, size_t * nb) {
    for (int i = 0; i < GGML_MAX_DIMS; ++i) {
        ne[i] = t->ne[i];
        nb[i] = t->nb[i];
    }
}

void pyggml_forget_compute_placement(struct ggml_context * ctx) {
    for (struct ggml_tensor * t = ggml_get_first_tensor(ctx); t != NULL; t = ggml_get_next_tensor(ctx, t)) {
        if (t->buffer != NULL && ggml_backend_buffer_get_usage(t->buffer) == GGML_BACKEND_BUFFER_USAGE_COMPUTE) {
            t->data = NULL;
            t->buffer = NULL;
        }
    }
}

#define GRAPH_SLOTS (GGML_MAX_SRC + 1)  /* per node: its sources, then which of them the scheduler allocates */

int pyggml_graph_srcs(struct ggml_cgraph * graph, struct ggml_tensor ** saved, int n_saved, int cap) {
    int n = ggml_graph_n_nodes(graph);
    if (n_saved < 0 || n_saved > n || cap < n) {
        return -n;
    }
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * node = ggml_graph_node(graph, i);
        struct ggml_tensor ** slot = saved + (size_t) i * GRAPH_SLOTS;
        if (i < n_saved) {
            /* as before the first split: the same sources, and no place for what the scheduler placed
             * (its compute buffers may be gone; the buffers themselves are never read here) */
            uintptr_t unplaced = (uintptr_t) slot[GGML_MAX_SRC];
            for (int j = 0; j < GGML_MAX_SRC; j++) {
                node->src[j] = slot[j];
                if (slot[j] != NULL && (unplaced >> j & 1)) {
                    slot[j]->buffer = NULL;
                    slot[j]->data = NULL;
                }
            }
            if (unplaced >> GGML_MAX_SRC & 1) {
                node->buffer = NULL;
                node->data = NULL;
            }
        } else {
            uintptr_t unplaced = node->buffer == NULL ? (uintptr_t) 1 << GGML_MAX_SRC : 0;
            for (int j = 0; j < GGML_MAX_SRC; j++) {
                slot[j] = node->src[j];
                if (slot[j] != NULL && slot[j]->buffer == NULL) {
                    unplaced |= (uintptr_t) 1 << j;
                }
            }
            slot[GGML_MAX_SRC] = (struct ggml_tensor *) unplaced;
        }
    }
    return n;
}

/* the scheduler's index of the device holding weight `w` (a tensor in a weights buffer), or -1 */
static int weight_backend(const struct ggml_tensor * w, ggml_backend_t * backends, int n_backends) {
    if (w == NULL) {
        return -1;
    }
    if (w->view_src != NULL) {
        w = w->view_src;
    }
    if (w->buffer == NULL || ggml_backend_buffer_get_usage(w->buffer) != GGML_BACKEND_BUFFER_USAGE_WEIGHTS) {
        return -1;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(w->buffer);
    for (int i = 0; i < n_backends; i++) {
        if (ggml_backend_supports_buft(backends[i], buft)) {
            return i;
        }
    }
    return -1;
}

static int is_norm(const struct ggml_tensor * t) {
    return t != NULL && (t->op == GGML_OP_RMS_NORM || t->op == GGML_OP_NORM || t->op == GGML_OP_L2_NORM);
}

int pyggml_pin_layer_outputs(ggml_backend_sched_t sched, struct ggml_cgraph * graph, ggml_backend_t * backends,
                             int n_backends) {
    int pinned = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * node = ggml_graph_node(graph, i);
        if (node->op == GGML_OP_ADD) {
            /* a residual add (or bias) after a weight's matmul: where that weight is */
            for (int j = 0; j < 2; j++) {
                const struct ggml_tensor * mm = node->src[j];
                if (mm == NULL || (mm->op != GGML_OP_MUL_MAT && mm->op != GGML_OP_MUL_MAT_ID)) {
                    continue;
                }
                int b = weight_backend(mm->src[0], backends, n_backends);
                if (b >= 0) {
                    ggml_backend_sched_set_tensor_backend(sched, node, backends[b]);
                    pinned++;
                    break;
                }
            }
        } else if (node->op == GGML_OP_MUL) {
            /* a norm scaled by a weight (the first op of a layer): the norm goes where the weight is */
            for (int j = 0; j < 2; j++) {
                int b = weight_backend(node->src[1 - j], backends, n_backends);
                if (b >= 0 && is_norm(node->src[j])) {
                    ggml_backend_sched_set_tensor_backend(sched, node->src[j], backends[b]);
                    pinned++;
                    break;
                }
            }
        }
    }
    return pinned;
}
