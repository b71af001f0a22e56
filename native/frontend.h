/*
 * frontend.h: what the front end's files share (see native/README.md for the whole).
 *
 * Owns: the Session object's layout, the worker (a thread serving requests), the names of the
 * ops methods, and the small inline helpers every request uses (the GIL around a call, number
 * conversions). Each .c file below owns one concern and says what it must never do:
 *   session.c   the Session type, the module, the /dev/fuse thread pool, run() and exit()
 *   pycall.c    calling Python from a request's thread: arguments, errors, replies' tuples,
 *               and the FORGETs handed over late
 *   handlers.c  one libfuse low-level handler per request, and WRITE data's memory
 *   dir_attrs.c directories' attributes kept after a change, answered to GETATTR in C
 *   io_uring.c  FUSE over io_uring: the queues' threads and their custom I/O
 *   metrics.c   per-opcode request counters and timings
 * Everything here is hidden from the dynamic linker; PyInit_ckptfs_fuse alone is exported.
 */
#ifndef CKPTFS_FRONTEND_H
#define CKPTFS_FRONTEND_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION FUSE_MAKE_VERSION(3, 17)
#include <fuse_lowlevel.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#pragma GCC visibility push(hidden)

#define WAKE_SIGNAL (SIGRTMIN + 6)

extern PyObject *FuseError; /* ckptfs_fuse.FuseError */

enum op {
    OP_INIT, OP_INIT_REPLIED, OP_LOOKUP, OP_FORGET, OP_GETATTR, OP_SETATTR, OP_READLINK,
    OP_MKNOD, OP_MKDIR, OP_UNLINK, OP_RMDIR, OP_SYMLINK, OP_RENAME, OP_LINK, OP_OPEN, OP_READ,
    OP_WRITE, OP_FLUSH, OP_RELEASE, OP_FSYNC, OP_OPENDIR, OP_READDIR, OP_READDIR_TAKEN,
    OP_RELEASEDIR, OP_FSYNCDIR, OP_STATFS, OP_SETXATTR, OP_GETXATTR, OP_LISTXATTR,
    OP_REMOVEXATTR, OP_CREATE, OP_UNEXPECTED, N_OPS
};

/* Requests counted and timed by the front end (exported as ckptfs_fuse_requests_total and
 * ckptfs_fuse_request_duration_seconds, gateway/metrics.py): by the request's opcode, from
 * the moment a worker has read it until its reply was sent. Names as the Prometheus label. */
#define N_OPCODES 64
#define N_BUCKETS 12 /* and +Inf */
extern const char *const op_names[N_OPS];
extern const char *const opcode_names[N_OPCODES];
extern const double bucket_bounds[N_BUCKETS];

struct op_stat {
    uint64_t count, ns, gil_ns; /* gil_ns: of ns, waiting to run Python */
    uint64_t buckets[N_BUCKETS + 1]; /* not cumulative; the last is above every bound */
};

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

struct session;
struct dir_attrs;

struct worker {
    struct session *s;
    pthread_t tid;
    struct fuse_buf buf;
    PyThreadState *ts;
    int reading;        /* blocked (or about to block) in read(2): may be woken by a signal */
    int init_handled;   /* this worker answered INIT: call ops.init_replied() after the reply */
    uint64_t gil_ns;    /* of the request being served: time spent waiting for the GIL */
    uint64_t changing[2]; /* directories the request being served may change (dir_attrs_begin) */
    int n_changing;
    int give_up_buf;    /* WRITE data in buf was kept by Python: buf.mem is no longer ours */
    char *wcopy;        /* WRITE data copied out of a buffer the transport refills (a ring entry) */
    size_t wcopy_cap;
    int qid;            /* a ring thread: the CPU whose queue it serves */
    int registered;     /* a ring thread: its entry is registered */
    struct worker *next;
};

#define DIR_ATTRS_BUCKETS 256

typedef struct session {
    PyObject_HEAD
    struct fuse_session *se;
    PyObject *ops;
    PyObject *methods[N_OPS];
    PyInterpreterState *interp;
    int fd;
    int mounted;
    /* requested at construction, read in the INIT handler */
    int want_passthrough, want_writeback, want_atomic_o_trunc, want_dio_mmap, want_export;
    int user_xattrs_only;   /* getxattr of other names is ENODATA without calling Python */
    int want_splice_write;  /* READ replies from a file range are spliced into /dev/fuse */
    unsigned splice_max_read; /* 0, or the max_read that keeps a READ reply within one pipe */
    unsigned max_backing_stack_depth;
    /* what INIT negotiated */
    int passthrough_granted, writeback_granted, dio_mmap_granted;
    /* the worker pool */
    pthread_mutex_t lock;
    pthread_cond_t ended;   /* a worker ended */
    struct worker *workers; /* all started, for signals and clean-up */
    int max_threads, n_workers, n_running, n_idle;
    volatile int exiting;
    volatile int running;   /* run() in progress */
    int error;              /* errno that ended the loop, 0 for an unmount or exit() */
    const char *error_what; /* what failed with it (NULL: reading /dev/fuse) */
    struct op_stat stats[N_OPCODES]; /* [0]: opcodes without a name */
    /* directory attributes after a change, answered to GETATTR without Python */
    pthread_mutex_t dir_attrs_lock;
    struct dir_attrs *dir_attrs[DIR_ATTRS_BUCKETS];
    unsigned n_dir_attrs;
    uint64_t dir_attrs_hits;
    /* FUSE over io_uring (want_ring: asked for; see "FUSE over io_uring") */
    int want_ring, ring_entries, ring_active, ring_error;
    struct worker *rings;   /* ring threads */
    int rings_pending;      /* started, not yet registered (or failed) */
    int n_rings_running;
    size_t ring_payload_len;
    uint64_t ring_requests; /* served from a ring */
    /* FORGETs taken and not yet handed to Python (see queue_forgets) */
    pthread_mutex_t forget_lock;
    struct forget_item { uint64_t ino, nlookup; } *forgets;
    size_t n_forgets, cap_forgets;
} Session;

/* Bits of an open reply's flags (module constants of the same names). */
#define OPEN_KEEP_CACHE 1 /* keep the page cache of earlier opens (FOPEN_KEEP_CACHE) */
#define OPEN_DIRECT_IO 2  /* no page cache: each read/write is a request (FOPEN_DIRECT_IO) */
#define OPEN_NOFLUSH 4    /* close(2) sends no FLUSH (FOPEN_NOFLUSH): RELEASE alone ends it */

/* ---- pycall.c: calling Python from a request's thread ---- */
int take_error(Session *s, enum op op);
PyObject *call(Session *s, enum op op, PyObject **args, size_t nargs);
int call_void(Session *s, enum op op, PyObject **args, size_t nargs);
int item_u64(PyObject *t, Py_ssize_t i, uint64_t *out);
int item_i64(PyObject *t, Py_ssize_t i, int64_t *out);
int item_double(PyObject *t, Py_ssize_t i, double *out);
int entry_from(PyObject *t, struct fuse_entry_param *e);
int open_from(PyObject *t, struct fuse_file_info *fi);
PyObject *ctx_args(fuse_req_t req, PyObject **args);
void queue_forgets(Session *s, const struct forget_item *items, size_t n);
void forget_unanswered(Session *s, const uint64_t *inos, size_t n);
void flush_forgets(Session *s);

/* ---- dir_attrs.c ---- */
void dir_attrs_begin(Session *s, uint64_t ino);
void dir_attrs_end(Session *s);
int dir_attrs_get(Session *s, uint64_t ino, struct stat *st, double *timeout);
void dir_attrs_clear(Session *s);
void dir_attrs_free(Session *s);
PyObject *remember_dir_attrs(PyObject *module, PyObject *entry);
PyObject *forget_dir_attrs(PyObject *module, PyObject *unused);

/* ---- handlers.c ---- */
extern const struct fuse_lowlevel_ops ll_ops;
extern PyTypeObject WriteDataType;

/* ---- session.c ---- */
extern __thread struct worker *this_worker; /* the worker this thread is, NULL elsewhere */
void session_failed(Session *s, int err, const char *what);
sigset_t wake_set(void);
sigset_t blocked_in_workers(void);

/* ---- metrics.c ---- */
void account(Session *s, uint32_t opcode, uint64_t ns, uint64_t gil_ns);
PyObject *Session_request_stats(Session *self, PyObject *unused);

/* ---- io_uring.c ---- */
int rings_take_replies(Session *s);
void start_rings(Session *s);
void wake_rings(Session *s);

/* ---- the GIL around a request ---- */
static inline void enter(void)
{
    uint64_t t0 = now_ns();
    PyEval_RestoreThread(this_worker->ts);
    this_worker->gil_ns += now_ns() - t0;
    if (__atomic_load_n(&this_worker->s->n_forgets, __ATOMIC_RELAXED) != 0)
        flush_forgets(this_worker->s);
}
static inline void leave(void) { (void)PyEval_SaveThread(); }

static inline PyObject *u64(uint64_t v) { return PyLong_FromUnsignedLongLong(v); }
static inline PyObject *i64(int64_t v) { return PyLong_FromLongLong(v); }
static inline PyObject *name_of(const char *name) { return PyBytes_FromString(name); }
static inline Session *session_of(fuse_req_t req) { return (Session *)fuse_req_userdata(req); }

#pragma GCC visibility pop

#endif
