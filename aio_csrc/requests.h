/* requests.h: the request table, the pending list, the completion rule ([Note: requests and pieces]), and
 * what a request may address (the files and spans submit accepts).
 * Included once, by aio.c, after the type definitions (a single translation unit keeps setup.py at
 * one source and lets the compiler inline across files). */
#ifndef INFINITY_AIO_REQUESTS_H
#define INFINITY_AIO_REQUESTS_H

/* ------------------------------------------------------------------ request table */

static inline req_t *R(Handle *h, int i) { return &h->chunks[i / CHUNK][i % CHUNK]; }

/* Caller holds the mutex. Returns an index or -1 when out of memory. */
static int req_alloc(Handle *h) {
    if (h->free_head < 0) {
        req_t **chunks = realloc(h->chunks, sizeof(req_t *) * (size_t)(h->nchunks + 1));
        if (!chunks) return -1;
        h->chunks = chunks;
        req_t *c = calloc(CHUNK, sizeof(req_t));
        if (!c) return -1;
        h->chunks[h->nchunks] = c;
        int base = h->nchunks * CHUNK;
        for (int k = CHUNK - 1; k >= 0; k--) {
            c[k].gen = 1;
            c[k].next = h->free_head;
            h->free_head = base + k;
        }
        h->nchunks++;
    }
    int i = h->free_head;
    h->free_head = R(h, i)->next;
    return i;
}

/* Caller holds the mutex; hands back what Python must release after unlocking. */
static void req_free(Handle *h, int i, Py_buffer *view, int *has_view, PyObject **owner) {
    req_t *r = R(h, i);
    *has_view = r->has_view;
    if (r->has_view) *view = r->view;
    *owner = r->owner;
    r->has_view = 0;
    r->owner = NULL;
    r->state = R_FREE;
    r->gen++;
    r->next = h->free_head;
    h->free_head = i;
}

static void release_py(Py_buffer *view, int has_view, PyObject *owner) {
    if (has_view) PyBuffer_Release(view);
    Py_XDECREF(owner);
}

static void pend_unlink(Handle *h, int i) {
    int prev = -1;
    for (int k = h->pend_head; k >= 0; prev = k, k = R(h, k)->next) {
        if (k != i) continue;
        if (prev < 0) h->pend_head = R(h, k)->next;
        else R(h, prev)->next = R(h, k)->next;
        if (h->pend_tail == i) h->pend_tail = prev;
        break;
    }
    R(h, i)->in_pending = 0;
}

/* Caller holds the mutex. Takes the next piece of the oldest request that still has bytes to issue. */
static int take_piece(Handle *h, piece_t *p) {
    while (h->pend_head >= 0) {
        int i = h->pend_head;
        req_t *r = R(h, i);
        if (r->err || r->issued >= r->nbytes) {
            pend_unlink(h, i);
            continue;
        }
        uint64_t len = r->nbytes - r->issued;
        if (len > h->block_size) len = h->block_size;
        p->req = i;
        p->op = r->op;
        p->fd = r->fd;
        p->direct = r->direct;
        p->ptr = r->base + r->issued;
        p->off = r->file_offset + (int64_t)r->issued;
        p->len = len;
        p->inject = 0;
        p->stall_ns = 0;
        if (h->inject_countdown > 0 && (h->inject_op < 0 || h->inject_op == r->op) &&
            --h->inject_countdown == 0)
            p->inject = h->inject_errno;
        if (h->stall_countdown > 0 && (h->stall_op < 0 || h->stall_op == r->op) && --h->stall_countdown == 0)
            p->stall_ns = h->stall_ns;
        r->issued += len;
        r->inflight++;
        h->pieces_issued++;
        h->pieces_in_flight++;
        if (r->issued >= r->nbytes) pend_unlink(h, i);
        return 1;
    }
    return 0;
}

/* Caller holds the mutex. Request i is complete: wake its waiters. A released request goes on the
 * zombie list, its only list from now on, for sweep_zombies to free ([Note: released requests]). */
static void req_complete(Handle *h, int i) {
    req_t *r = R(h, i);
    r->state = R_DONE;
    h->active--;
    if (r->detached) {
        r->next = h->zombie_head;
        h->zombie_head = i;
    }
    pthread_cond_broadcast(&h->done_cv);
}

/* Caller holds the mutex. One piece of request i is finished: err is 0 or -errno. */
static void finish_piece(Handle *h, int i, int err, int64_t err_offset) {
    req_t *r = R(h, i);
    r->inflight--;
    h->pieces_done++;
    h->depth_sum += (uint64_t)h->pieces_in_flight;
    h->pieces_in_flight--;
    if (err && !r->err) {
        r->err = err;
        r->err_offset = err_offset;
        if (r->in_pending) pend_unlink(h, i);
    }
    if (r->inflight == 0 && (r->err || r->issued >= r->nbytes)) req_complete(h, i);
}

/* Caller holds the mutex. Drops every piece not yet issued ([Note: shutdown]): a request with
 * nothing in flight completes now with -ECANCELED, one with pieces in flight when they come back. */
static void cancel_pending(Handle *h) {
    while (h->pend_head >= 0) {
        int i = h->pend_head;
        req_t *r = R(h, i);
        pend_unlink(h, i);
        if (r->err || r->issued >= r->nbytes) continue;
        r->err = -ECANCELED;
        r->err_offset = r->file_offset + (int64_t)r->issued;
        if (r->inflight == 0) req_complete(h, i);
    }
}

/* Decides what a short transfer means. Returns 1 to continue the piece from where it stopped,
 * or 0 with *err set. */
static int short_transfer(const piece_t *p, int64_t n, int *err) {
    if (n == 0) {
        *err = p->op == OP_READ ? -ENODATA : -EIO;
        return 0;
    }
    if (p->op == OP_READ && p->direct && ((p->off + n) % SECTOR) != 0) {
        *err = -ENODATA;
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------ what a request may address */

/* Why fd cannot take part in aio, or NULL when it can: requests address file offsets, which only
 * regular files and block devices have (a pipe would also never complete a read; [Note: shutdown]). */
static const char *unfit_file(const struct stat *st) {
    if (S_ISREG(st->st_mode) || S_ISBLK(st->st_mode)) return NULL;
    if (S_ISFIFO(st->st_mode)) return "a FIFO or pipe";
    if (S_ISSOCK(st->st_mode)) return "a socket";
    if (S_ISCHR(st->st_mode)) return "a character device";
    if (S_ISDIR(st->st_mode)) return "a directory";
    return "not a regular file";
}

/* 0 when fd is a regular file or a block device, else -1 with OSError (ESPIPE, or EISDIR) naming it. */
static int check_file(int fd) {
    struct stat st;
    if (fstat(fd, &st) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    const char *unfit = unfit_file(&st);
    if (!unfit) return 0;
    PyObject *exc = PyUnicode_FromFormat("fd %d is %s: aio reads and writes regular files and block devices only",
                                         fd, unfit);
    PyObject *args = exc ? Py_BuildValue("(iN)", S_ISDIR(st.st_mode) ? EISDIR : ESPIPE, exc) : NULL;
    if (args) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
    }
    return -1;
}

/* [Note: raw spans]
 * submit_ptr trusts an address, so a slip in the caller (0 for a tensor never allocated, a length
 * past the buffer) would let the kernel write over whatever lies there. Refused: a span starting in
 * the null page, one that wraps around the address space, and, when the owner exposes the buffer
 * protocol, one that leaves the owner's buffer or, for a read, one whose owner is read-only. An
 * owner without the buffer protocol (a tensor: this core does not know tensors) is the caller's to
 * check, as tiers/aio.py does from the tensor itself. */
static int check_span(int op, unsigned long long addr, unsigned long long nbytes, PyObject *owner) {
    if (nbytes == 0) return 0;
    char message[256];
    if (addr < NULL_PAGE || addr + nbytes < addr || nbytes > (unsigned long long)PY_SSIZE_T_MAX) {
        snprintf(message, sizeof(message), "submit_ptr: %llu bytes at address %#llx %s", nbytes, addr,
                 addr < NULL_PAGE ? "start in the null page (a NULL pointer?)" : "run past the address space");
        PyErr_SetString(PyExc_ValueError, message);
        return -1;
    }
    if (owner == Py_None || !PyObject_CheckBuffer(owner)) return 0;
    Py_buffer view;
    if (PyObject_GetBuffer(owner, &view, PyBUF_ANY_CONTIGUOUS) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_BufferError)) return -1;
        PyErr_Clear(); /* no contiguous span to hold the request against */
        return 0;
    }
    unsigned long long start = (unsigned long long)(uintptr_t)view.buf, len = (unsigned long long)view.len;
    int readonly = view.readonly;
    PyBuffer_Release(&view);
    if (op == OP_READ && readonly) {
        PyErr_Format(PyExc_ValueError, "submit_ptr: the owner, a %s, is read-only: a read would write into it",
                     Py_TYPE(owner)->tp_name);
        return -1;
    }
    if (addr >= start && nbytes <= len && addr - start <= len - nbytes) return 0;
    snprintf(message, sizeof(message), "submit_ptr: %llu bytes at address %#llx leave the owner's buffer (a %s of "
             "%llu bytes at %#llx)", nbytes, addr, Py_TYPE(owner)->tp_name, len, start);
    PyErr_SetString(PyExc_ValueError, message);
    return -1;
}

#endif /* INFINITY_AIO_REQUESTS_H */
