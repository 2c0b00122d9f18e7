/* methods.h: the Handle's Python face: submit, wait, reap, release, drain, close, the test hooks, the
 * attributes, and the method table and type object that list them.
 * Included once, by aio.c, after the type definitions (a single translation unit keeps setup.py at
 * one source and lets the compiler inline across files). */
#ifndef INFINITY_AIO_METHODS_H
#define INFINITY_AIO_METHODS_H

/* ------------------------------------------------------------------ Python methods */

static int parse_id(Handle *h, PyObject *obj, int *idx, uint32_t *gen) {
    unsigned long long id = PyLong_AsUnsignedLongLong(obj);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *idx = (int)(id & 0xffffffffULL);
    *gen = (uint32_t)(id >> 32);
    return 0;
}

/* [Note: released requests]
 * release(id) ends the id: lookup() no longer finds it, so reap, wait and done treat it as a reaped
 * id (KeyError, True, True) and a second release does nothing. A released request that is complete
 * is freed at once; one in flight is marked detached and, when it completes, goes on the zombie
 * list, the only list it is on from then, which sweep_zombies (at the next submit) empties. So each
 * request is freed exactly once: by reap, release, sweep_zombies or close. */

/* Caller holds the mutex. Returns the request when the id still names a live one, else NULL. */
static req_t *lookup(Handle *h, int idx, uint32_t gen) {
    if (idx < 0 || idx >= h->nchunks * CHUNK) return NULL;
    req_t *r = R(h, idx);
    if (r->state == R_FREE || r->gen != gen || r->detached) return NULL;
    return r;
}

static PyObject *submit_common(Handle *h, int op, int fd, long long file_offset, char *base,
                               unsigned long long nbytes, Py_buffer *view, PyObject *owner) {
    if (op != OP_READ && op != OP_WRITE) {
        PyErr_Format(PyExc_ValueError, "op must be OP_READ (0) or OP_WRITE (1), got %d", op);
        return NULL;
    }
    if (file_offset < 0) {
        PyErr_Format(PyExc_ValueError, "file_offset must be >= 0, got %lld", file_offset);
        return NULL;
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0) return PyErr_SetFromErrno(PyExc_OSError);
    if (check_file(fd) < 0) return NULL;
    int acc = flags & O_ACCMODE;
    if ((op == OP_READ && acc == O_WRONLY) || (op == OP_WRITE && acc == O_RDONLY)) {
        PyObject *exc = Py_BuildValue("(is)", EBADF, op == OP_READ ? "file is not open for reading"
                                                                   : "file is not open for writing");
        if (exc) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    sweep_zombies(h);
    pthread_mutex_lock(&h->mu);
    int i = req_alloc(h);
    if (i < 0) {
        pthread_mutex_unlock(&h->mu);
        return PyErr_NoMemory();
    }
    req_t *r = R(h, i);
    r->op = op;
    r->fd = fd;
    r->direct = (flags & O_DIRECT) != 0;
    r->detached = 0;
    r->base = base;
    r->nbytes = nbytes;
    r->file_offset = file_offset;
    r->issued = r->moved = 0;
    r->inflight = 0;
    r->err = 0;
    r->err_offset = 0;
    r->next = -1;
    r->has_view = view != NULL;
    if (view) r->view = *view;
    r->owner = owner;
    Py_XINCREF(owner);
    if (nbytes == 0) {
        r->state = R_DONE;
        r->in_pending = 0;
    } else {
        r->state = R_ACTIVE;
        h->active++;
        r->in_pending = 1;
        if (h->pend_tail >= 0) R(h, h->pend_tail)->next = i;
        else h->pend_head = i;
        h->pend_tail = i;
        if (h->engine == ENGINE_URING) uring_fill(h);
        else if (nbytes > h->block_size) pthread_cond_broadcast(&h->work_cv);
        else pthread_cond_signal(&h->work_cv);
    }
    uint64_t id = ((uint64_t)r->gen << 32) | (uint32_t)i;
    pthread_mutex_unlock(&h->mu);
    return PyLong_FromUnsignedLongLong(id);
}

static PyObject *Handle_submit(Handle *h, PyObject *args) {
    int op, fd;
    long long off;
    PyObject *buf;
    if (!PyArg_ParseTuple(args, "iiLO", &op, &fd, &off, &buf)) return NULL;
    if (check_open(h) < 0) return NULL;
    Py_buffer view;
    int flags = PyBUF_C_CONTIGUOUS | (op == OP_READ ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(buf, &view, flags) < 0) return NULL;
    PyObject *id = submit_common(h, op, fd, off, view.buf, (unsigned long long)view.len, &view, NULL);
    if (!id) PyBuffer_Release(&view);
    return id;
}

static PyObject *Handle_submit_ptr(Handle *h, PyObject *args) {
    int op, fd;
    long long off;
    unsigned long long addr, nbytes;
    PyObject *owner;
    if (!PyArg_ParseTuple(args, "iiLKKO", &op, &fd, &off, &addr, &nbytes, &owner)) return NULL;
    if (check_open(h) < 0 || check_span(op, addr, nbytes, owner) < 0) return NULL;
    return submit_common(h, op, fd, off, (char *)(uintptr_t)addr, nbytes, NULL, owner);
}

static PyObject *Handle_wait(Handle *h, PyObject *args) {
    PyObject *idobj;
    double timeout = -1.0;
    int idx;
    uint32_t gen;
    if (!PyArg_ParseTuple(args, "O|d", &idobj, &timeout)) return NULL;
    if (parse_id(h, idobj, &idx, &gen) < 0 || check_process(h) < 0 || parse_timeout(timeout) < 0) return NULL;
    if (!h->started || h->closed) Py_RETURN_TRUE;
    int done = 1, rc = 0;
    struct timespec ts;
    int timed = deadline_after(timeout, &ts);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->mu);
    for (;;) {
        req_t *r = lookup(h, idx, gen);
        done = !r || r->state == R_DONE;
        if (done || rc) break; /* after a failed wait, one last look */
        rc = wait_done_cv(h, timed, &ts);
    }
    pthread_mutex_unlock(&h->mu);
    Py_END_ALLOW_THREADS
    if (rc && rc != ETIMEDOUT && !done) return wait_failed(rc);
    return PyBool_FromLong(done);
}

static PyObject *Handle_done(Handle *h, PyObject *idobj) {
    int idx;
    uint32_t gen;
    if (parse_id(h, idobj, &idx, &gen) < 0 || check_process(h) < 0) return NULL;
    if (!h->started || h->closed) Py_RETURN_TRUE;
    pthread_mutex_lock(&h->mu);
    req_t *r = lookup(h, idx, gen);
    int done = !r || r->state == R_DONE;
    pthread_mutex_unlock(&h->mu);
    return PyBool_FromLong(done);
}

static PyObject *Handle_reap(Handle *h, PyObject *idobj) {
    int idx;
    uint32_t gen;
    if (parse_id(h, idobj, &idx, &gen) < 0 || check_process(h) < 0) return NULL;
    if (!h->started || h->closed) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on a closed aio handle");
        return NULL;
    }
    pthread_mutex_lock(&h->mu);
    req_t *r = lookup(h, idx, gen);
    if (!r || r->state != R_DONE) {
        int live = r != NULL;
        pthread_mutex_unlock(&h->mu);
        PyErr_Format(live ? PyExc_RuntimeError : PyExc_KeyError,
                     live ? "request %S is still in flight" : "unknown, released or already reaped request %S",
                     idobj);
        return NULL;
    }
    long long result = r->err ? (long long)r->err : (long long)r->moved;
    long long err_offset = r->err ? (long long)r->err_offset : -1;
    Py_buffer view;
    int has_view;
    PyObject *owner;
    req_free(h, idx, &view, &has_view, &owner);
    pthread_mutex_unlock(&h->mu);
    release_py(&view, has_view, owner);
    return Py_BuildValue("(LL)", result, err_offset);
}

static PyObject *Handle_release(Handle *h, PyObject *idobj) {
    int idx;
    uint32_t gen;
    if (parse_id(h, idobj, &idx, &gen) < 0) return NULL;
    if (!h->started || h->closed || in_child(h)) Py_RETURN_NONE;
    Py_buffer view;
    int has_view = 0;
    PyObject *owner = NULL;
    int freed = 0;
    pthread_mutex_lock(&h->mu);
    req_t *r = lookup(h, idx, gen);
    if (r && r->state == R_DONE) {
        req_free(h, idx, &view, &has_view, &owner);
        freed = 1;
    } else if (r) {
        r->detached = 1;
    }
    pthread_mutex_unlock(&h->mu);
    if (freed) release_py(&view, has_view, owner);
    Py_RETURN_NONE;
}

static PyObject *Handle_wait_any(Handle *h, PyObject *args) {
    PyObject *seq;
    double timeout = -1.0;
    if (!PyArg_ParseTuple(args, "O|d", &seq, &timeout) || check_process(h) < 0 || parse_timeout(timeout) < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "wait_any expects a sequence of request ids");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n == 0) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "wait_any needs at least one request id");
        return NULL;
    }
    int stack_idx[64];
    uint32_t stack_gen[64];
    int *idx = n <= 64 ? stack_idx : PyMem_Malloc(sizeof(int) * (size_t)n);
    uint32_t *gen = n <= 64 ? stack_gen : PyMem_Malloc(sizeof(uint32_t) * (size_t)n);
    if (!idx || !gen) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    Py_ssize_t found = -1;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (parse_id(h, PySequence_Fast_GET_ITEM(fast, k), &idx[k], &gen[k]) < 0) goto out;
    }
    if (!h->started || h->closed) {
        found = 0;
        goto out;
    }
    struct timespec ts;
    int timed = deadline_after(timeout, &ts), rc = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->mu);
    for (;;) {
        for (Py_ssize_t k = 0; k < n && found < 0; k++) {
            req_t *r = lookup(h, idx[k], gen[k]);
            if (!r || r->state == R_DONE) found = k;
        }
        if (found >= 0 || rc) break; /* after a failed wait, one last look */
        rc = wait_done_cv(h, timed, &ts);
    }
    pthread_mutex_unlock(&h->mu);
    Py_END_ALLOW_THREADS
    if (found < 0 && rc && rc != ETIMEDOUT) wait_failed(rc);
out : {
    PyObject *res = NULL;
    if (!PyErr_Occurred()) {
        if (found >= 0) res = Py_NewRef(PySequence_Fast_GET_ITEM(fast, found));
        else res = Py_NewRef(Py_None);
    }
    if (idx != stack_idx) PyMem_Free(idx);
    if (gen != stack_gen) PyMem_Free(gen);
    Py_DECREF(fast);
    return res;
}
}

static PyObject *Handle_wait_all(Handle *h, PyObject *args) {
    double timeout = -1.0;
    if (!PyArg_ParseTuple(args, "|d", &timeout) || check_process(h) < 0 || parse_timeout(timeout) < 0) return NULL;
    if (!h->started || h->closed) Py_RETURN_TRUE;
    int rc = 0, done;
    struct timespec ts;
    int timed = deadline_after(timeout, &ts);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->mu);
    while (h->active > 0 && rc == 0) rc = wait_done_cv(h, timed, &ts);
    done = h->active == 0;
    pthread_mutex_unlock(&h->mu);
    Py_END_ALLOW_THREADS
    if (!done && rc != ETIMEDOUT) return wait_failed(rc);
    return PyBool_FromLong(done);
}

static PyObject *Handle_drain(Handle *h, PyObject *args) {
    double timeout = CLOSE_TIMEOUT_S;
    if (!PyArg_ParseTuple(args, "|d", &timeout) || check_process(h) < 0 || parse_timeout(timeout) < 0) return NULL;
    if (!h->started || h->closed) return PyList_New(0);
    int failed;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->mu);
    drain_locked(h, timeout, &failed);
    pthread_mutex_unlock(&h->mu);
    Py_END_ALLOW_THREADS
    if (failed) return wait_failed(failed);
    return ids_in_flight(h);
}

static PyObject *Handle_close(Handle *h, PyObject *args) {
    double timeout = CLOSE_TIMEOUT_S;
    if (!PyArg_ParseTuple(args, "|d", &timeout) || parse_timeout(timeout) < 0) return NULL;
    if (handle_shutdown(h, timeout) < 0) return NULL;
    Py_RETURN_NONE;
}

/* The test hooks' shared checks: op is OP_READ, OP_WRITE or -1 (any), nth >= 0 (0 disarms). */
static int check_hook(Handle *h, const char *hook, int op, long long nth) {
    if (check_open(h) < 0) return -1;
    if ((op != -1 && op != OP_READ && op != OP_WRITE) || nth < 0 || nth > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: op must be -1 (any), OP_READ or OP_WRITE and nth in [0, 2**31) "
                     "(0 disarms), got op=%d nth=%lld", hook, op, nth);
        return -1;
    }
    return 0;
}

static PyObject *Handle_inject(Handle *h, PyObject *args) {
    int op, err;
    long long nth;
    if (!PyArg_ParseTuple(args, "iiL", &op, &err, &nth) || check_hook(h, "_inject", op, nth) < 0) return NULL;
    if (err < 1 || err > 4095) { /* the kernel's errno range; a completion's result is -errno */
        PyErr_Format(PyExc_ValueError, "_inject: errno must be a positive errno value (1..4095), got %d", err);
        return NULL;
    }
    pthread_mutex_lock(&h->mu);
    h->inject_op = op;
    h->inject_errno = err;
    h->inject_countdown = (int)nth;
    pthread_mutex_unlock(&h->mu);
    Py_RETURN_NONE;
}

static PyObject *Handle_stall(Handle *h, PyObject *args) {
    int op;
    long long nth;
    double seconds;
    if (!PyArg_ParseTuple(args, "iLd", &op, &nth, &seconds) || check_hook(h, "_stall", op, nth) < 0) return NULL;
    if (!(seconds > 0.0 && seconds <= 86400.0)) {
        PyErr_Format(PyExc_ValueError, "_stall: seconds must be in (0, 86400], got %R", PyTuple_GET_ITEM(args, 2));
        return NULL;
    }
    pthread_mutex_lock(&h->mu);
    h->stall_op = op;
    h->stall_ns = (int64_t)(seconds * 1e9);
    h->stall_countdown = (int)nth;
    pthread_mutex_unlock(&h->mu);
    Py_RETURN_NONE;
}

static PyObject *Handle_get_engine(Handle *h, void *c) {
    return PyUnicode_FromString(h->engine == ENGINE_URING ? "io_uring" : "threads");
}
static PyObject *Handle_get_qd(Handle *h, void *c) { return PyLong_FromLong(h->queue_depth); }
static PyObject *Handle_get_threads(Handle *h, void *c) { return PyLong_FromLong(h->nthreads); }
static PyObject *Handle_get_block(Handle *h, void *c) { return PyLong_FromUnsignedLongLong(h->block_size); }
static PyObject *Handle_get_closed(Handle *h, void *c) { return PyBool_FromLong(h->closed || h->closing); }
static PyObject *Handle_get_pid(Handle *h, void *c) { return PyLong_FromLong((long)h->pid); }
static PyObject *Handle_get_active(Handle *h, void *c) {
    if (!h->started || h->closed || in_child(h)) return PyLong_FromLong(0);
    pthread_mutex_lock(&h->mu);
    int n = h->active;
    pthread_mutex_unlock(&h->mu);
    return PyLong_FromLong(n);
}
static PyObject *Handle_get_pieces(Handle *h, void *c) {
    if (!h->started || in_child(h)) return PyLong_FromLong(0);
    pthread_mutex_lock(&h->mu);
    uint64_t n = h->pieces_issued;
    pthread_mutex_unlock(&h->mu);
    return PyLong_FromUnsignedLongLong(n);
}

/* Mean queue occupancy tells whether the engine kept its queue full: a figure well under
 * queue_depth (or threads) at full load means refills lag behind completions. */
static PyObject *Handle_get_stats(Handle *h, void *c) {
    uint64_t issued = 0, done = 0, sum = 0;
    if (h->started && !in_child(h)) {
        pthread_mutex_lock(&h->mu);
        issued = h->pieces_issued;
        done = h->pieces_done;
        sum = h->depth_sum;
        pthread_mutex_unlock(&h->mu);
    }
    return Py_BuildValue("{sKsKsd}", "pieces_issued", (unsigned long long)issued, "pieces_done",
                         (unsigned long long)done, "mean_depth", done ? (double)sum / (double)done : 0.0);
}

static PyMethodDef Handle_methods[] = {
    {"submit", (PyCFunction)Handle_submit, METH_VARARGS,
     "submit(op, fd, file_offset, buffer) -> id: start a read/write of a buffer-protocol object."},
    {"submit_ptr", (PyCFunction)Handle_submit_ptr, METH_VARARGS,
     "submit_ptr(op, fd, file_offset, address, nbytes, owner) -> id: owner is kept referenced."},
    {"wait", (PyCFunction)Handle_wait, METH_VARARGS,
     "wait(id, timeout=-1) -> bool: block (GIL released) until the request completes."},
    {"done", (PyCFunction)Handle_done, METH_O, "done(id) -> bool"},
    {"reap", (PyCFunction)Handle_reap, METH_O,
     "reap(id) -> (result, err_offset): result is nbytes or -errno; frees the id and the buffer."},
    {"release", (PyCFunction)Handle_release, METH_O,
     "release(id): forget a request; its buffer is released once it completes."},
    {"wait_any", (PyCFunction)Handle_wait_any, METH_VARARGS,
     "wait_any(ids, timeout=-1) -> id | None: the first completed id among ids."},
    {"wait_all", (PyCFunction)Handle_wait_all, METH_VARARGS,
     "wait_all(timeout=-1) -> bool: block until no request is in flight."},
    {"drain", (PyCFunction)Handle_drain, METH_VARARGS,
     "drain(timeout=10) -> ids: refuse new requests, wait while those in flight progress, cancel them when "
     "none finishes for timeout s; the ids still in flight timeout s after that."},
    {"close", (PyCFunction)Handle_close, METH_VARARGS,
     "close(timeout=10): drain, stop the engine, release every buffer; TimeoutError naming what could not "
     "be ended (the handle then keeps it)."},
    {"_inject", (PyCFunction)Handle_inject, METH_VARARGS,
     "_inject(op, errno, nth): test hook, the nth next piece of op (-1: any) fails with errno (> 0)."},
    {"_stall", (PyCFunction)Handle_stall, METH_VARARGS,
     "_stall(op, nth, seconds): test hook, the nth next piece of op (-1: any) waits seconds before it is "
     "issued: a kernel timer that close cancels (io_uring), or a sleep nothing interrupts (threads)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Handle_getset[] = {
    {"engine", (getter)Handle_get_engine, NULL, "io_uring or threads", NULL},
    {"queue_depth", (getter)Handle_get_qd, NULL, NULL, NULL},
    {"threads", (getter)Handle_get_threads, NULL, NULL, NULL},
    {"block_size", (getter)Handle_get_block, NULL, NULL, NULL},
    {"closed", (getter)Handle_get_closed, NULL, NULL, NULL},
    {"owner_pid", (getter)Handle_get_pid, NULL, "process that created the handle", NULL},
    {"active", (getter)Handle_get_active, NULL, "requests submitted and not yet complete", NULL},
    {"pieces_issued", (getter)Handle_get_pieces, NULL, "pieces issued since creation", NULL},
    {"stats", (getter)Handle_get_stats, NULL, "pieces issued and done, mean pieces in flight at completion", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tiers._aio.Handle",
    .tp_basicsize = sizeof(Handle),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Handle(engine='io_uring', queue_depth=32, threads=4, block_size=8 MiB)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Handle_init,
    .tp_dealloc = (destructor)Handle_dealloc,
    .tp_methods = Handle_methods,
    .tp_getset = Handle_getset,
};

#endif /* INFINITY_AIO_METHODS_H */
