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
