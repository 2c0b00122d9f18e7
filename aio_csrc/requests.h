/* requests.h: the request table, the pending list, and the completion rule ([Note: requests and pieces]).
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
        if (h->inject_countdown > 0 && (h->inject_op < 0 || h->inject_op == r->op) &&
            --h->inject_countdown == 0)
            p->inject = h->inject_errno;
        r->issued += len;
        r->inflight++;
        h->pieces_issued++;
        h->pieces_in_flight++;
        if (r->issued >= r->nbytes) pend_unlink(h, i);
        return 1;
    }
    return 0;
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
    if (r->inflight == 0 && (r->err || r->issued >= r->nbytes)) {
        r->state = R_DONE;
        h->active--;
        if (r->detached) {
            r->next = h->zombie_head;
            h->zombie_head = i;
        }
        pthread_cond_broadcast(&h->done_cv);
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

#endif /* INFINITY_AIO_REQUESTS_H */
