/* lifecycle.h: creating a handle (ring or pool), shutting it down, releasing held buffers.
 * Included once, by aio.c, after the type definitions (a single translation unit keeps setup.py at
 * one source and lets the compiler inline across files). */
#ifndef INFINITY_AIO_LIFECYCLE_H
#define INFINITY_AIO_LIFECYCLE_H

/* ------------------------------------------------------------------ waiting */

/* [Note: timeouts]
 * A timeout is seconds from now; below 0 (the Python face's None), infinite, or beyond FOREVER_S
 * it means "until done". A deadline decades away is no deadline, and computing one would overflow
 * time_t or glibc's nanosecond futex time: pthread_cond_timedwait then fails with EINVAL at once,
 * and a waiter that took that for a wake-up would spin holding the mutex, so that no completion
 * could ever be delivered. NaN is refused where a timeout enters (parse_timeout); any error from
 * the wait other than ETIMEDOUT ends the wait and is raised. Deadlines are on CLOCK_MONOTONIC. */
#define FOREVER_S 1e9 /* about 32 years */

/* Returns 1 and the deadline `timeout` seconds from now, or 0 when the wait has no limit. */
static int deadline_after(double timeout, struct timespec *ts) {
    if (!(timeout >= 0.0 && timeout <= FOREVER_S)) return 0;
    clock_gettime(CLOCK_MONOTONIC, ts);
    time_t whole = (time_t)timeout;
    ts->tv_sec += whole;
    ts->tv_nsec += (long)((timeout - (double)whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
    return 1;
}

/* Caller holds the mutex. Returns 0 when woken, ETIMEDOUT when the deadline passed, else the
 * errno the wait failed with ([Note: timeouts]). */
static int wait_done_cv(Handle *h, int timed, struct timespec *ts) {
    if (!timed) return pthread_cond_wait(&h->done_cv, &h->mu);
    return pthread_cond_timedwait(&h->done_cv, &h->mu, ts);
}

/* A timeout argument: seconds, < 0 or inf for no limit ([Note: timeouts]); NaN is refused. */
static int parse_timeout(double timeout) {
    if (!isnan(timeout)) return 0;
    PyErr_SetString(PyExc_ValueError, "timeout must be a number of seconds (< 0 or inf: no limit), got nan");
    return -1;
}

static PyObject *wait_failed(int err) {
    errno = err;
    return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "pthread_cond_timedwait");
}

/* ------------------------------------------------------------------ handle lifecycle */

static int in_child(Handle *h) { return h->started && getpid() != h->pid; }

/* [Note: fork] A forked child (a DataLoader worker, say) inherits the handle's memory but none of its
 * threads, and possibly a mutex some parent thread held at the fork: it must not touch either. */
static int check_process(Handle *h) {
    if (!in_child(h)) return 0;
    PyErr_Format(PyExc_ValueError,
                 "aio handle was created in process %d and cannot be used in process %d (after fork); "
                 "create a new AioHandle in this process",
                 (int)h->pid, (int)getpid());
    return -1;
}

static int check_open(Handle *h) {
    if (check_process(h) < 0) return -1;
    if (h->closing || h->closed || !h->started) {
        PyErr_SetString(PyExc_ValueError, h->started ? "I/O operation on a closed aio handle"
                                                     : "aio handle was not initialised");
        return -1;
    }
    return 0;
}

static int Handle_init(Handle *h, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"engine", "queue_depth", "threads", "block_size", NULL};
    const char *engine = "io_uring";
    int qd = 32, nthreads = 4;
    unsigned long long block = 8ULL << 20;
    if (h->started) {
        PyErr_SetString(PyExc_RuntimeError, "aio handle is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|siiK", kwlist, &engine, &qd, &nthreads, &block))
        return -1;
    if (strcmp(engine, "io_uring") == 0) h->engine = ENGINE_URING;
    else if (strcmp(engine, "threads") == 0) h->engine = ENGINE_THREADS;
    else {
        PyErr_Format(PyExc_ValueError, "engine must be 'io_uring' or 'threads', got '%s'", engine);
        return -1;
    }
    if (qd < 1 || qd > 4096) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be in [1, 4096], got %d", qd);
        return -1;
    }
    if (nthreads < 1 || nthreads > 256) {
        PyErr_Format(PyExc_ValueError, "threads must be in [1, 256], got %d", nthreads);
        return -1;
    }
    if (block < 1 || block > (1ULL << 30)) {
        PyErr_Format(PyExc_ValueError, "block_size must be in [1, 1 GiB], got %llu", block);
        return -1;
    }
    h->queue_depth = qd;
    h->nthreads = nthreads;
    h->block_size = block;
    h->free_head = h->pend_head = h->pend_tail = h->zombie_head = -1;
    h->inject_op = h->stall_op = -1;
    h->ring.fd = -1;
    pthread_mutex_init(&h->mu, NULL);
    /* Waits with a timeout measure it on the monotonic clock: setting the wall clock moves no deadline. */
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&h->done_cv, &attr);
    pthread_condattr_destroy(&attr);
    pthread_cond_init(&h->work_cv, NULL);
    if (h->engine == ENGINE_URING) {
        int rc = ring_init(&h->ring, (unsigned)qd + 1);
        if (rc < 0) {
            errno = -rc;
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, "io_uring_setup");
            return -1;
        }
        h->slots = calloc((size_t)qd, sizeof(piece_t));
        h->free_slots = calloc((size_t)qd, sizeof(int));
        h->workers = calloc(1, sizeof(pthread_t));
        if (!h->slots || !h->free_slots || !h->workers) {
            ring_unmap(&h->ring);
            PyErr_NoMemory();
            return -1;
        }
        for (int s = 0; s < qd; s++) h->free_slots[s] = qd - 1 - s;
        h->nfree_slots = qd;
        int e = pthread_create(&h->workers[0], NULL, uring_reaper, h);
        if (e) {
            ring_unmap(&h->ring);
            errno = e;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        h->nworkers = 1;
    } else {
        h->workers = calloc((size_t)nthreads, sizeof(pthread_t));
        if (!h->workers) {
            PyErr_NoMemory();
            return -1;
        }
        for (int t = 0; t < nthreads; t++) {
            int e = pthread_create(&h->workers[t], NULL, pool_worker, h);
            if (e) {
                pthread_mutex_lock(&h->mu);
                h->stop = 1;
                pthread_cond_broadcast(&h->work_cv);
                pthread_mutex_unlock(&h->mu);
                for (int k = 0; k < t; k++) pthread_join(h->workers[k], NULL);
                errno = e;
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
            h->nworkers++;
        }
    }
    h->pid = getpid();
    h->started = 1;
    return 0;
}

/* [Note: shutdown]
 * close must neither lose a write nor hang. It waits for the requests in flight as long as they
 * make progress: every finished piece restarts a `timeout` clock, so a long queue of healthy I/O is
 * never cut short. When no piece finishes for `timeout` seconds, drain() cancels the rest: pieces
 * not yet issued are dropped, and each io_uring piece in the kernel gets an IORING_OP_ASYNC_CANCEL
 * (a stalled device or anything else that never completes ends with -ECANCELED or -EINTR). A pool
 * thread inside pread/pwrite cannot be interrupted; it is waited for. What is still in flight
 * `timeout` seconds after the cancel is reported, never released: close raises TimeoutError naming
 * each such request, and the handle keeps its table, its buffers and its threads (the kernel or a
 * pool thread may still write into them; freeing them would turn a hang into memory corruption).
 * A later close finishes the job once they have ended. Regular files and block devices, the only
 * files submit accepts, complete on a working device: the cancel is for a failing one. */

/* Caller holds the mutex (released while waiting). Waits while the requests in flight make
 * progress, cancels them after `timeout` seconds without any, and waits up to `timeout` more.
 * Returns 0 when none is left in flight, else -1 (or another errno from the wait, in *failed). */
static int drain_locked(Handle *h, double timeout, int *failed) {
    struct timespec ts;
    int timed = deadline_after(timeout, &ts);
    uint64_t seen = h->pieces_done;
    *failed = 0;
    h->closing = 1;
    while (h->active > 0) {
        int rc = wait_done_cv(h, timed, &ts);
        if (rc == 0) continue;
        if (rc != ETIMEDOUT) {
            *failed = rc;
            return -1;
        }
        if (h->pieces_done != seen) { /* progress: restart the clock */
            seen = h->pieces_done;
            deadline_after(timeout, &ts);
            continue;
        }
        if (h->cancelling) return -1;
        h->cancelling = 1;
        cancel_pending(h);
        if (h->engine == ENGINE_URING) uring_cancel(h);
        deadline_after(timeout, &ts);
    }
    return 0;
}

/* Caller holds the mutex. Writes into text the requests still in flight, the first four by name. */
static void describe_stuck(Handle *h, char *text, size_t size) {
    int count = 0, named = 0;
    size_t used = 0;
    text[0] = '\0';
    for (int i = 0; i < h->nchunks * CHUNK; i++) {
        req_t *r = R(h, i);
        if (r->state != R_ACTIVE) continue;
        if (count++ < 4 && used < size) {
            used += (size_t)snprintf(text + used, size - used, "%s%s of %llu bytes at offset %lld of fd %d",
                                     named++ ? "; " : "", r->op == OP_READ ? "read" : "write",
                                     (unsigned long long)r->nbytes, (long long)r->file_offset, r->fd);
        }
    }
    if (count > 4 && used < size) snprintf(text + used, size - used, "; and %d more", count - 4);
}

/* Drains (GIL released), stops the engine and releases every held buffer. Returns 0, or -1 with
 * TimeoutError (or OSError) set when requests could not be ended: the handle then keeps everything. */
static int handle_shutdown(Handle *h, double timeout) {
    if (!h->started || h->closed || h->shutting) return 0;
    h->closing = 1;
    if (in_child(h)) {
        /* See [Note: fork]: only this process's copies of the mappings and Python references. */
        if (h->engine == ENGINE_URING) ring_unmap(&h->ring);
        h->nworkers = 0;
        goto release;
    }
    h->shutting = 1;
    int stuck, failed, count = 0;
    char text[512];
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->mu);
    stuck = drain_locked(h, timeout, &failed) < 0;
    if (stuck) {
        count = h->active;
        describe_stuck(h, text, sizeof(text));
    } else if (h->engine == ENGINE_URING) {
        ring_prep(&h->ring, IORING_OP_NOP, -1, NULL, 0, 0, STOP_TOKEN);
        ring_submit(&h->ring);
    } else {
        h->stop = 1;
        pthread_cond_broadcast(&h->work_cv);
    }
    pthread_mutex_unlock(&h->mu);
    if (!stuck)
        for (int t = 0; t < h->nworkers; t++) pthread_join(h->workers[t], NULL);
    Py_END_ALLOW_THREADS
    h->shutting = 0;
    if (stuck) {
        if (failed) {
            errno = failed;
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, "pthread_cond_timedwait");
        } else {
            int one = count == 1;
            char message[1024];
            snprintf(message, sizeof(message),
                     "aio close: %d request%s still in flight %g s after %s cancelled (%s); the handle keeps %s "
                     "and %s buffer%s, which the kernel or a pool thread may still write into; close again once "
                     "%s ended",
                     count, one ? " is" : "s are", timeout, one ? "it was" : "they were", text, one ? "it" : "them",
                     one ? "its" : "their", one ? "" : "s", one ? "it has" : "they have");
            PyErr_SetString(PyExc_TimeoutError, message);
        }
        return -1;
    }
    if (h->engine == ENGINE_URING) ring_unmap(&h->ring);
release:
    for (int i = 0; i < h->nchunks * CHUNK; i++) {
        if (R(h, i)->state == R_FREE) continue;
        Py_buffer view;
        int has_view;
        PyObject *owner;
        req_free(h, i, &view, &has_view, &owner);
        release_py(&view, has_view, owner);
    }
    h->closed = 1;
    return 0;
}

/* The ids of the requests in flight, not released, as a list (after drain: nothing is submitted any
 * more, so their number can only fall). Copied under the mutex; Python objects made after it. */
static PyObject *ids_in_flight(Handle *h) {
    pthread_mutex_lock(&h->mu);
    int most = h->active, count = 0;
    pthread_mutex_unlock(&h->mu);
    uint64_t *ids = PyMem_Malloc(sizeof(uint64_t) * (size_t)(most > 0 ? most : 1));
    if (!ids) return PyErr_NoMemory();
    pthread_mutex_lock(&h->mu);
    for (int i = 0; i < h->nchunks * CHUNK && count < most; i++) {
        req_t *r = R(h, i);
        if (r->state == R_ACTIVE && !r->detached) ids[count++] = ((uint64_t)r->gen << 32) | (uint32_t)i;
    }
    pthread_mutex_unlock(&h->mu);
    PyObject *left = PyList_New(count);
    for (int k = 0; left && k < count; k++) {
        PyObject *id = PyLong_FromUnsignedLongLong(ids[k]);
        if (!id) Py_CLEAR(left);
        else PyList_SET_ITEM(left, k, id);
    }
    PyMem_Free(ids);
    return left;
}

static void Handle_dealloc(Handle *h) {
    if (handle_shutdown(h, CLOSE_TIMEOUT_S) < 0) {
        /* [Note: shutdown]: requests still in flight may write into the table and the buffers, so
         * the handle is never freed. */
        PyErr_WriteUnraisable(NULL);
        return;
    }
    for (int c = 0; c < h->nchunks; c++) free(h->chunks[c]);
    free(h->chunks);
    free(h->slots);
    free(h->free_slots);
    free(h->workers);
    if (h->started && !in_child(h)) {
        pthread_mutex_destroy(&h->mu);
        pthread_cond_destroy(&h->done_cv);
        pthread_cond_destroy(&h->work_cv);
    }
    Py_TYPE(h)->tp_free((PyObject *)h);
}

/* Releases requests whose futures were dropped before completion; needs the GIL. */
static void sweep_zombies(Handle *h) {
    for (;;) {
        Py_buffer view;
        int has_view = 0;
        PyObject *owner = NULL;
        pthread_mutex_lock(&h->mu);
        int i = h->zombie_head;
        if (i >= 0) {
            h->zombie_head = R(h, i)->next;
            req_free(h, i, &view, &has_view, &owner);
        }
        pthread_mutex_unlock(&h->mu);
        if (i < 0) return;
        release_py(&view, has_view, owner);
    }
}

#endif /* INFINITY_AIO_LIFECYCLE_H */
