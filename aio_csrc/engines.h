/* engines.h: how a piece is issued and completed: the io_uring engine and the thread pool ([Note: engines]).
 * Included once, by aio.c, after the type definitions (a single translation unit keeps setup.py at
 * one source and lets the compiler inline across files). */
#ifndef INFINITY_AIO_ENGINES_H
#define INFINITY_AIO_ENGINES_H

/* ------------------------------------------------------------------ io_uring engine */

static void uring_issue_slot(Handle *h, int s) {
    piece_t *p = &h->slots[s];
    p->busy = 1;
    if (p->stall_ns) { /* the test hook's stall: a kernel timer in the piece's place, cancellable as I/O is */
        p->stall.tv_sec = p->stall_ns / 1000000000LL;
        p->stall.tv_nsec = p->stall_ns % 1000000000LL;
        ring_prep(&h->ring, IORING_OP_TIMEOUT, -1, &p->stall, 1, 0, (uint64_t)s);
        return;
    }
    ring_prep(&h->ring, p->op == OP_READ ? IORING_OP_READ : IORING_OP_WRITE, p->fd, p->ptr,
              (unsigned)p->len, p->off, (uint64_t)s);
}

/* Caller holds the mutex: asks the kernel to cancel every piece in flight ([Note: shutdown]). Each
 * comes back through uring_complete with -ECANCELED (or -EINTR, or its result when it was already
 * done); the cancel requests' own completions carry CANCEL_TOKEN and are ignored. */
static void uring_cancel(Handle *h) {
    for (int s = 0; s < h->queue_depth; s++) {
        if (!h->slots[s].busy) continue;
        ring_prep(&h->ring, IORING_OP_ASYNC_CANCEL, -1, (void *)(uintptr_t)s, 0, 0, CANCEL_TOKEN);
        ring_submit(&h->ring); /* one at a time: the SQ holds queue_depth + 1 entries */
    }
}

/* Caller holds the mutex: fills free slots with pending pieces and submits them. */
static void uring_fill(Handle *h) {
    while (h->nfree_slots > 0) {
        piece_t p;
        if (!take_piece(h, &p)) break;
        if (p.inject) {
            finish_piece(h, p.req, -p.inject, p.off);
            continue;
        }
        int s = h->free_slots[--h->nfree_slots];
        h->slots[s] = p;
        uring_issue_slot(h, s);
    }
    ring_submit(&h->ring);
}

static void uring_complete(Handle *h, int s, int res) {
    piece_t *p = &h->slots[s];
    req_t *r = R(h, p->req);
    int err = 0;
    int64_t err_offset = p->off;
    if (p->stall_ns) { /* the stall's timer: expired (-ETIME), so issue the piece itself, or cancelled */
        p->stall_ns = 0;
        if (res == -ETIME && !h->cancelling) {
            uring_issue_slot(h, s);
            return;
        }
        res = -ECANCELED;
    }
    if (res < 0) {
        err = res;
    } else {
        r->moved += (uint64_t)res;
        if ((uint64_t)res < p->len) {
            if (h->cancelling) {
                err = -ECANCELED;
                err_offset = p->off + res;
            } else if (short_transfer(p, res, &err)) {
                p->ptr += res;
                p->off += res;
                p->len -= (uint64_t)res;
                uring_issue_slot(h, s);
                return;
            }
            err_offset = p->off + res;
        }
    }
    p->busy = 0;
    h->free_slots[h->nfree_slots++] = s;
    finish_piece(h, p->req, err, err_offset);
}

static void *uring_reaper(void *arg) {
    Handle *h = arg;
    ring_t *ring = &h->ring;
    for (;;) {
        int n = sys_uring_enter(ring->fd, 0, 1, IORING_ENTER_GETEVENTS);
        if (n < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) sched_yield();
        int stop = 0;
        pthread_mutex_lock(&h->mu);
        unsigned head = *ring->cq_head;
        unsigned tail = __atomic_load_n(ring->cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            struct io_uring_cqe *cqe = &ring->cqes[head & *ring->cq_mask];
            if (cqe->user_data == STOP_TOKEN) stop = 1;
            else if (cqe->user_data != CANCEL_TOKEN) uring_complete(h, (int)cqe->user_data, cqe->res);
        }
        __atomic_store_n(ring->cq_head, head, __ATOMIC_RELEASE);
        if (!stop) uring_fill(h);
        pthread_mutex_unlock(&h->mu);
        if (stop) return NULL;
    }
}

/* ------------------------------------------------------------------ thread-pool engine */

static uint64_t do_piece(piece_t *p, int *err, int64_t *err_offset) {
    uint64_t moved = 0;
    *err = 0;
    if (p->inject) {
        *err = -p->inject;
        *err_offset = p->off;
        return 0;
    }
    while (p->len > 0) {
        ssize_t n = p->op == OP_READ ? pread(p->fd, p->ptr, p->len, p->off)
                                     : pwrite(p->fd, p->ptr, p->len, p->off);
        if (n < 0) {
            if (errno == EINTR) continue;
            *err = -errno;
            *err_offset = p->off;
            return moved;
        }
        moved += (uint64_t)n;
        if ((uint64_t)n < p->len && !short_transfer(p, n, err)) {
            *err_offset = p->off + n;
            return moved;
        }
        p->ptr += n;
        p->off += n;
        p->len -= (uint64_t)n;
    }
    return moved;
}

static void *pool_worker(void *arg) {
    Handle *h = arg;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        piece_t p;
        while (!h->stop && !take_piece(h, &p)) pthread_cond_wait(&h->work_cv, &h->mu);
        if (h->stop) break;
        pthread_mutex_unlock(&h->mu);
        if (p.stall_ns) { /* the test hook's stall: as a pread in a stalled device, nothing interrupts it */
            struct timespec left = {p.stall_ns / 1000000000LL, p.stall_ns % 1000000000LL};
            while (nanosleep(&left, &left) < 0 && errno == EINTR) {
            }
        }
        int err;
        int64_t err_offset = 0;
        uint64_t moved = do_piece(&p, &err, &err_offset);
        pthread_mutex_lock(&h->mu);
        R(h, p.req)->moved += moved;
        finish_piece(h, p.req, err, err_offset);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

#endif /* INFINITY_AIO_ENGINES_H */
