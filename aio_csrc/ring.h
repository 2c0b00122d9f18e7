/* ring.h: raw io_uring syscalls, mapping the rings, preparing and submitting SQEs.
 * Included once, by aio.c, after the type definitions (a single translation unit keeps setup.py at
 * one source and lets the compiler inline across files). */
#ifndef INFINITY_AIO_RING_H
#define INFINITY_AIO_RING_H

/* ------------------------------------------------------------------ io_uring syscalls */

static int sys_uring_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

static void ring_unmap(ring_t *r) {
    if (r->sqes && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqe_sz);
    if (r->cq_ptr && r->cq_ptr != MAP_FAILED && r->cq_ptr != r->sq_ptr) munmap(r->cq_ptr, r->cq_sz);
    if (r->sq_ptr && r->sq_ptr != MAP_FAILED) munmap(r->sq_ptr, r->sq_sz);
    if (r->fd >= 0) close(r->fd);
    memset(r, 0, sizeof(*r));
    r->fd = -1;
}

/* Returns 0 or -errno. */
static int ring_init(ring_t *r, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    memset(r, 0, sizeof(*r));
    r->fd = sys_uring_setup(entries, &p);
    if (r->fd < 0) {
        int e = errno;
        r->fd = -1;
        return -e;
    }
    r->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_sz > r->sq_sz) r->sq_sz = r->cq_sz;
        r->cq_sz = r->sq_sz;
    }
    r->sq_ptr = mmap(NULL, r->sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED) goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                         IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED) goto fail;
    }
    r->sqe_sz = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqe_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                   IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) goto fail;
    r->sq_tail = (unsigned *)((char *)r->sq_ptr + p.sq_off.tail);
    r->sq_mask = (unsigned *)((char *)r->sq_ptr + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)((char *)r->sq_ptr + p.sq_off.array);
    r->cq_head = (unsigned *)((char *)r->cq_ptr + p.cq_off.head);
    r->cq_tail = (unsigned *)((char *)r->cq_ptr + p.cq_off.tail);
    r->cq_mask = (unsigned *)((char *)r->cq_ptr + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)((char *)r->cq_ptr + p.cq_off.cqes);
    return 0;
fail: {
    int e = errno;
    ring_unmap(r);
    return -e;
}
}

/* Caller holds the mutex; the SQ never overflows because at most queue_depth pieces (plus the one
 * stop NOP, sent only when nothing is in flight) are outstanding and the ring has >= queue_depth + 1
 * entries. */
static void ring_prep(ring_t *r, int opcode, int fd, void *addr, unsigned len, int64_t off, uint64_t ud) {
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = (uint8_t)opcode;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)addr;
    sqe->len = len;
    sqe->off = (uint64_t)off;
    sqe->user_data = ud;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    r->to_submit++;
}

static void ring_submit(ring_t *r) {
    int tries = 0;
    while (r->to_submit > 0) {
        int n = sys_uring_enter(r->fd, r->to_submit, 0, 0);
        if (n >= 0) {
            r->to_submit -= (unsigned)n < r->to_submit ? (unsigned)n : r->to_submit;
            if (n == 0 && ++tries > 1000) return;
            continue;
        }
        /* Transient refusals (memory pressure, a full completion queue): retry a bounded number of
         * times; anything left is retried by the next submit or completion. */
        if ((errno == EINTR || errno == EAGAIN || errno == EBUSY) && ++tries <= 1000) {
            sched_yield();
            continue;
        }
        return;
    }
}

#endif /* INFINITY_AIO_RING_H */
