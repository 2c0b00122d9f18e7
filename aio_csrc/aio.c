/* tiers._aio: asynchronous file I/O for infinity (shared/DESIGN.md, "aio_csrc").
 *
 * One handle type submits reads and writes of (buffer, fd, file offset, nbytes), keeps many of them in
 * flight, and lets Python wait for one, any or all of them with the GIL released. Each completion
 * carries the byte count or -errno. Nothing here knows what a tensor is: Python passes either an object
 * with the buffer protocol or a raw address plus an owner object that is kept referenced.
 *
 * [Note: engines]
 * Two engines sit behind the handle. "io_uring" drives the kernel ring with raw syscalls against
 * <linux/io_uring.h> (no liburing): the submitting thread writes SQEs, and one completion thread per
 * handle blocks in io_uring_enter(GETEVENTS), reaps CQEs, refills the freed slots with the next pieces
 * and wakes Python waiters. "threads" is a pthread pool doing pread/pwrite, the fallback when
 * io_uring_setup is refused (seccomp in many containers). Both share the request table, the pending
 * list and the completion rule below; only the way a piece is issued differs.
 *
 * [Note: requests and pieces]
 * A request is one submit call. It is split into block_size pieces, and at most queue_depth pieces
 * (io_uring) or `threads` pieces (pool) are in flight per handle. Requests are served in submission
 * order: pieces of a later request go out only when the earlier ones have all been issued. A request
 * is complete when every issued piece has come back and either all bytes were issued or an error
 * stopped further issuing. The first error wins and records its file offset. A piece that returns
 * fewer bytes than asked is continued from where it stopped; a read that returns 0 (end of file) is
 * reported as -ENODATA, never as success, and so is a partial O_DIRECT read ending off a sector
 * boundary (the file ended there).
 *
 * [Note: no allocation on the I/O path]
 * Requests live in a table of fixed 64-entry chunks that only grows (chunk memory never moves, so a
 * Py_buffer stored in an entry stays valid); slots are a fixed array of queue_depth pieces. After the
 * table has grown to the peak number of live requests, submit, completion and reap allocate nothing.
 *
 * [Note: locking]
 * One pthread mutex per handle guards all handle state. The GIL is never taken while that mutex is
 * held, and Python objects (buffers, owners) are released only after the mutex is dropped, because
 * releasing them may run arbitrary Python code.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define AIO_VERSION "0.2.0"

#define OP_READ 0
#define OP_WRITE 1
#define ENGINE_URING 0
#define ENGINE_THREADS 1
#define CHUNK 64
#define R_FREE 0
#define R_ACTIVE 1
#define R_DONE 2
#define STOP_TOKEN UINT64_MAX
/* A partial O_DIRECT read ending off this boundary means the file ended there. */
#define SECTOR 512

typedef struct {
    uint32_t gen; /* bumped on reuse so a stale id never matches a new request */
    int state;
    int op, fd, direct, detached;
    char *base;
    uint64_t nbytes;
    int64_t file_offset;
    uint64_t issued; /* bytes handed out as pieces */
    uint64_t moved;  /* bytes completed */
    int inflight;    /* pieces in flight */
    int err;         /* first -errno, 0 when none */
    int64_t err_offset;
    int next; /* link: free list, pending list or zombie list */
    int in_pending;
    int has_view;
    Py_buffer view;
    PyObject *owner;
} req_t;

typedef struct {
    int req;
    int op, fd, direct;
    int inject; /* errno to fail this piece with instead of issuing it (test hook) */
    char *ptr;
    uint64_t len;
    int64_t off;
} piece_t;

typedef struct {
    int fd;
    unsigned *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz, sqe_sz;
    unsigned to_submit; /* SQEs written but not yet accepted by the kernel */
} ring_t;

typedef struct {
    PyObject_HEAD
    int engine;
    int closing, closed, started;
    int queue_depth, nthreads;
    uint64_t block_size;
    pthread_mutex_t mu;
    pthread_cond_t done_cv; /* some request completed */
    pthread_cond_t work_cv; /* threads engine: pieces pending, or stop */
    req_t **chunks;
    int nchunks, free_head, pend_head, pend_tail, zombie_head;
    int active; /* requests submitted and not complete */
    piece_t *slots;
    int *free_slots;
    int nfree_slots;
    ring_t ring;
    pthread_t *workers;
    int nworkers, stop;
    int inject_op, inject_errno, inject_countdown;
    uint64_t pieces_issued;
} Handle;

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
        if (r->issued >= r->nbytes) pend_unlink(h, i);
        return 1;
    }
    return 0;
}

/* Caller holds the mutex. One piece of request i is finished: err is 0 or -errno. */
static void finish_piece(Handle *h, int i, int err, int64_t err_offset) {
    req_t *r = R(h, i);
    r->inflight--;
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

/* ------------------------------------------------------------------ io_uring engine */

static void uring_issue_slot(Handle *h, int s) {
    piece_t *p = &h->slots[s];
    ring_prep(&h->ring, p->op == OP_READ ? IORING_OP_READ : IORING_OP_WRITE, p->fd, p->ptr,
              (unsigned)p->len, p->off, (uint64_t)s);
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
    if (res < 0) {
        err = res;
    } else {
        r->moved += (uint64_t)res;
        if ((uint64_t)res < p->len) {
            if (short_transfer(p, res, &err)) {
                p->ptr += res;
                p->off += res;
                p->len -= (uint64_t)res;
                uring_issue_slot(h, s);
                return;
            }
            err_offset = p->off + res;
        }
    }
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
            else uring_complete(h, (int)cqe->user_data, cqe->res);
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

/* ------------------------------------------------------------------ handle lifecycle */

static int check_open(Handle *h) {
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
    h->started = 1;
    return 0;
}

/* Waits (GIL released) for every request, stops the engine and releases every held buffer. */
static void handle_shutdown(Handle *h) {
    if (!h->started || h->closed) return;
    h->closing = 1;
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
    if (h->started) {
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

/* ------------------------------------------------------------------ Python methods */

static int parse_id(Handle *h, PyObject *obj, int *idx, uint32_t *gen) {
    unsigned long long id = PyLong_AsUnsignedLongLong(obj);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *idx = (int)(id & 0xffffffffULL);
    *gen = (uint32_t)(id >> 32);
    return 0;
}

/* Caller holds the mutex. Returns the request when the id still names a live one, else NULL. */
static req_t *lookup(Handle *h, int idx, uint32_t gen) {
    if (idx < 0 || idx >= h->nchunks * CHUNK) return NULL;
    req_t *r = R(h, idx);
    if (r->state == R_FREE || r->gen != gen) return NULL;
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
    if (check_open(h) < 0) return NULL;
    if (addr == 0 && nbytes > 0) {
        PyErr_SetString(PyExc_ValueError, "address is NULL");
        return NULL;
    }
    return submit_common(h, op, fd, off, (char *)(uintptr_t)addr, nbytes, NULL, owner);
}

static void deadline_after(double timeout, struct timespec *ts) {
    clock_gettime(CLOCK_REALTIME, ts);
    double whole = (double)(long long)timeout;
    ts->tv_sec += (time_t)whole;
    ts->tv_nsec += (long)((timeout - whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* Caller holds the mutex. Returns 0 when woken or -1 when the deadline passed. */
static int wait_done_cv(Handle *h, int timed, struct timespec *ts) {
    if (!timed) {
        pthread_cond_wait(&h->done_cv, &h->mu);
        return 0;
    }
    return pthread_cond_timedwait(&h->done_cv, &h->mu, ts) == ETIMEDOUT ? -1 : 0;
}

static PyObject *Handle_wait(Handle *h, PyObject *args) {
    PyObject *idobj;
    double timeout = -1.0;
    int idx;
    uint32_t gen;
    if (!PyArg_ParseTuple(args, "O|d", &idobj, &timeout)) return NULL;
    if (parse_id(h, idobj, &idx, &gen) < 0) return NULL;
    if (!h->started || h->closed) Py_RETURN_TRUE;
    int done = 1;
    struct timespec ts;
    int timed = timeout >= 0;
    if (timed) deadline_after(timeout, &ts);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->mu);
    for (;;) {
        req_t *r = lookup(h, idx, gen);
        if (!r || r->state == R_DONE) break;
        if (wait_done_cv(h, timed, &ts) < 0) {
            r = lookup(h, idx, gen);
            done = !r || r->state == R_DONE;
            break;
        }
    }
    pthread_mutex_unlock(&h->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *Handle_done(Handle *h, PyObject *idobj) {
    int idx;
    uint32_t gen;
    if (parse_id(h, idobj, &idx, &gen) < 0) return NULL;
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
    if (parse_id(h, idobj, &idx, &gen) < 0) return NULL;
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
                     live ? "request %S is still in flight" : "unknown or already reaped request %S",
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
    if (!h->started || h->closed) Py_RETURN_NONE;
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
    if (!PyArg_ParseTuple(args, "O|d", &seq, &timeout)) return NULL;
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
    int timed = timeout >= 0;
    if (timed) deadline_after(timeout, &ts);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->mu);
    for (;;) {
        for (Py_ssize_t k = 0; k < n && found < 0; k++) {
            req_t *r = lookup(h, idx[k], gen[k]);
            if (!r || r->state == R_DONE) found = k;
        }
        if (found >= 0 || wait_done_cv(h, timed, &ts) < 0) break;
    }
    pthread_mutex_unlock(&h->mu);
    Py_END_ALLOW_THREADS
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
    if (!PyArg_ParseTuple(args, "|d", &timeout)) return NULL;
    if (!h->started || h->closed) Py_RETURN_TRUE;
    int done = 1;
    struct timespec ts;
    int timed = timeout >= 0;
    if (timed) deadline_after(timeout, &ts);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&h->mu);
    while (h->active > 0) {
        if (wait_done_cv(h, timed, &ts) < 0) {
            done = h->active == 0;
            break;
        }
    }
    pthread_mutex_unlock(&h->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *Handle_close(Handle *h, PyObject *noargs) {
    if (h->closing) Py_RETURN_NONE;
    handle_shutdown(h);
    Py_RETURN_NONE;
}

static PyObject *Handle_inject(Handle *h, PyObject *args) {
    int op, err, nth;
    if (!PyArg_ParseTuple(args, "iii", &op, &err, &nth)) return NULL;
    if (check_open(h) < 0) return NULL;
    pthread_mutex_lock(&h->mu);
    h->inject_op = op;
    h->inject_errno = err;
    h->inject_countdown = nth;
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
static PyObject *Handle_get_active(Handle *h, void *c) {
    if (!h->started || h->closed) return PyLong_FromLong(0);
    pthread_mutex_lock(&h->mu);
    int n = h->active;
    pthread_mutex_unlock(&h->mu);
    return PyLong_FromLong(n);
}
static PyObject *Handle_get_pieces(Handle *h, void *c) {
    if (!h->started) return PyLong_FromLong(0);
    pthread_mutex_lock(&h->mu);
    uint64_t n = h->pieces_issued;
    pthread_mutex_unlock(&h->mu);
    return PyLong_FromUnsignedLongLong(n);
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
    {"close", (PyCFunction)Handle_close, METH_NOARGS,
     "close(): wait for all requests, stop the engine, release every buffer."},
    {"_inject", (PyCFunction)Handle_inject, METH_VARARGS,
     "_inject(op, errno, nth): test hook, the nth next piece of op (-1: any) fails with errno."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Handle_getset[] = {
    {"engine", (getter)Handle_get_engine, NULL, "io_uring or threads", NULL},
    {"queue_depth", (getter)Handle_get_qd, NULL, NULL, NULL},
    {"threads", (getter)Handle_get_threads, NULL, NULL, NULL},
    {"block_size", (getter)Handle_get_block, NULL, NULL, NULL},
    {"closed", (getter)Handle_get_closed, NULL, NULL, NULL},
    {"active", (getter)Handle_get_active, NULL, "requests submitted and not yet complete", NULL},
    {"pieces_issued", (getter)Handle_get_pieces, NULL, "pieces issued since creation", NULL},
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

/* ------------------------------------------------------------------ module */

static PyObject *engines(PyObject *self, PyObject *noargs) {
    ring_t r;
    int rc = ring_init(&r, 2);
    if (rc == 0) {
        ring_unmap(&r);
        return Py_BuildValue("[ss]", "io_uring", "threads");
    }
    return Py_BuildValue("[s]", "threads");
}

static PyObject *buffer_info(PyObject *self, PyObject *args) {
    PyObject *buf;
    int writable = 0;
    if (!PyArg_ParseTuple(args, "O|p", &buf, &writable)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    PyObject *res = Py_BuildValue("(Kn)", (unsigned long long)(uintptr_t)view.buf, view.len);
    PyBuffer_Release(&view);
    return res;
}

static PyMethodDef methods[] = {
    {"engines", engines, METH_NOARGS, "I/O engines this kernel allows, best first."},
    {"buffer_info", buffer_info, METH_VARARGS,
     "buffer_info(obj, writable=False) -> (address, nbytes) of a C-contiguous buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_aio",
                                    "Asynchronous file I/O core (io_uring and a thread pool).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__aio(void) {
    if (PyType_Ready(&HandleType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddStringConstant(m, "__version__", AIO_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "OP_READ", OP_READ) < 0 ||
        PyModule_AddIntConstant(m, "OP_WRITE", OP_WRITE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&HandleType);
    if (PyModule_AddObject(m, "Handle", (PyObject *)&HandleType) < 0) {
        Py_DECREF(&HandleType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
