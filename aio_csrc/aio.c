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
 * A request is one submit call. Python chooses block_size and queue_depth (the policy); the split
 * itself happens here because a 128 KiB piece at 3 GB/s comes every 40 us, too often to cross into
 * Python and back for each one. A request is split into block_size pieces, and at most queue_depth pieces
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
#include <math.h>
#include <sys/mman.h>
#include <sys/stat.h>
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
#define STOP_TOKEN UINT64_MAX       /* user_data of the NOP that stops the completion thread */
#define CANCEL_TOKEN (UINT64_MAX - 1) /* user_data of an IORING_OP_ASYNC_CANCEL's own completion */
/* A partial O_DIRECT read ending off this boundary means the file ended there. */
#define SECTOR 512
/* No user buffer starts in the first page: an address below it is a null pointer plus an offset. */
#define NULL_PAGE 4096
/* How long close waits without any piece finishing before it cancels ([Note: shutdown]). */
#define CLOSE_TIMEOUT_S 10.0

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
    int inject;       /* errno to fail this piece with instead of issuing it (test hook) */
    int64_t stall_ns; /* wait this long before issuing it (test hook, [Note: shutdown]) */
    struct __kernel_timespec stall; /* io_uring: the stall as an IORING_OP_TIMEOUT's timespec */
    int busy;         /* io_uring: this slot is in the kernel (close cancels it) */
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
    int started;
    int closing;    /* no new requests: close or drain began */
    int cancelling; /* drain cancelled what was in flight ([Note: shutdown]) */
    int shutting;   /* a close is under way (it waits with the GIL released) */
    int closed;     /* engine stopped, every buffer released */
    pid_t pid; /* process that created the handle: a fork child has the memory but not the threads */
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
    int stall_op, stall_countdown;
    int64_t stall_ns;
    uint64_t pieces_issued;
    uint64_t pieces_done, depth_sum; /* depth_sum / pieces_done: pieces in flight seen by each completion */
    int pieces_in_flight;
} Handle;

#include "ring.h"
#include "requests.h"
#include "engines.h"
#include "lifecycle.h"
#include "methods.h"

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
