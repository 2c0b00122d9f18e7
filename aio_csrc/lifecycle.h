/* lifecycle.h: creating a handle (ring or pool), shutting it down, releasing held buffers.
 * Included once, by aio.c, after the type definitions (a single translation unit keeps setup.py at
 * one source and lets the compiler inline across files). */
#ifndef INFINITY_AIO_LIFECYCLE_H
#define INFINITY_AIO_LIFECYCLE_H

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
    h->inject_op = -1;
    h->ring.fd = -1;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->done_cv, NULL);
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

/* Waits (GIL released) for every request, stops the engine and releases every held buffer. */
static void handle_shutdown(Handle *h) {
    if (!h->started || h->closed) return;
    h->closing = 1;
    if (in_child(h)) {
        /* See [Note: fork]: only this process's copies of the mappings and Python references. */
        if (h->engine == ENGINE_URING) ring_unmap(&h->ring);
        h->nworkers = 0;
        goto release;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->mu);
    while (h->active > 0) pthread_cond_wait(&h->done_cv, &h->mu);
    if (h->engine == ENGINE_URING) {
        ring_prep(&h->ring, IORING_OP_NOP, -1, NULL, 0, 0, STOP_TOKEN);
        ring_submit(&h->ring);
    } else {
        h->stop = 1;
        pthread_cond_broadcast(&h->work_cv);
    }
    pthread_mutex_unlock(&h->mu);
    for (int t = 0; t < h->nworkers; t++) pthread_join(h->workers[t], NULL);
    Py_END_ALLOW_THREADS
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
}

static void Handle_dealloc(Handle *h) {
    handle_shutdown(h);
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
