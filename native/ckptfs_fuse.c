/*
 * ckptfs_fuse: the gateway's FUSE front end, a CPython extension over libfuse's low-level API.
 *
 * Why it exists (docs/DESIGN.md, "Metadata operation performance"): with pyfuse3 every request
 * went through a trio task and then a hop to a worker thread, about 0.5 ms of CPU per request
 * against 20-110 us of work in the core. Here a pool of C threads reads /dev/fuse; each request
 * is decoded in C, the thread takes the GIL and calls one synchronous method of the Python
 * "ops" object (gateway/fuse_ops.py, which calls the core), then drops the GIL and sends the
 * reply. No event loop and no thread hop are on the path of a request.
 *
 * The Python side:
 *   Session(ops, mountpoint, options, *, passthrough, writeback_cache, atomic_o_trunc,
 *           direct_io_mmap, export_support, max_threads, max_backing_stack_depth)
 *       fuse_session_new + fuse_session_mount. ``options`` are "-o" strings.
 *   .run()     serve requests until the file system is unmounted or .exit() is called; the
 *              calling thread waits without the GIL. Returns after every worker has ended.
 *   .exit()    ask run() to return (wakes the workers blocked reading /dev/fuse).
 *   .unmount(), .destroy(), .fd
 *   .passthrough_granted, .direct_io_mmap_granted, .writeback_cache_granted: set at INIT.
 *   FuseError(errno): what an ops method raises to answer an errno.
 *   remember_dir_attrs(entry), forget_dir_attrs(): from within a request that changes a
 *              directory, its attributes for the GETATTR that follows (see "Directory
 *              attributes after a change" below).
 *
 * The ops methods and their results are listed in gateway/fuse_ops.py (``CkptOperations``).
 * An entry is a tuple (ino, entry_timeout, attr_timeout, mode, nlink, uid, gid, rdev, size,
 * blksize, blocks, atime_ns, mtime_ns, ctime_ns); ino 0 is a negative entry (only the first two
 * items are read). Any exception other than FuseError is reported through
 * ``ops.unexpected(opname, exc)`` and answered EIO.
 *
 * Threads: a worker blocks in read(2) on /dev/fuse; when it takes a request and no other worker
 * is idle, it starts another, up to max_threads (requests may block for long: a fetch, room in
 * the cache). Each worker keeps one Python thread state for its life. To end, .exit() sets a
 * flag and signals the idle workers with WAKE_SIGNAL, which they block except while reading,
 * so a signal never interrupts a request's work.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define FUSE_USE_VERSION FUSE_MAKE_VERSION(3, 17)
#include <fuse_lowlevel.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define WAKE_SIGNAL (SIGRTMIN + 6)

static PyObject *FuseError; /* ckptfs_fuse.FuseError */

enum op {
    OP_INIT, OP_INIT_REPLIED, OP_LOOKUP, OP_FORGET, OP_GETATTR, OP_SETATTR, OP_READLINK,
    OP_MKNOD, OP_MKDIR, OP_UNLINK, OP_RMDIR, OP_SYMLINK, OP_RENAME, OP_LINK, OP_OPEN, OP_READ,
    OP_WRITE, OP_FLUSH, OP_RELEASE, OP_FSYNC, OP_OPENDIR, OP_READDIR, OP_READDIR_TAKEN,
    OP_RELEASEDIR, OP_FSYNCDIR, OP_STATFS, OP_SETXATTR, OP_GETXATTR, OP_LISTXATTR,
    OP_REMOVEXATTR, OP_CREATE, OP_UNEXPECTED, N_OPS
};

static const char *const op_names[N_OPS] = {
    "init", "init_replied", "lookup", "forget", "getattr", "setattr", "readlink",
    "mknod", "mkdir", "unlink", "rmdir", "symlink", "rename", "link", "open", "read",
    "write", "flush", "release", "fsync", "opendir", "readdir", "readdir_taken",
    "releasedir", "fsyncdir", "statfs", "setxattr", "getxattr", "listxattr",
    "removexattr", "create", "unexpected",
};

/* Requests counted and timed by the front end (exported as ckptfs_fuse_requests_total and
 * ckptfs_fuse_request_duration_seconds, gateway/metrics.py): by the request's opcode, from
 * the moment a worker has read it until its reply was sent. Names as the Prometheus label. */
#define N_OPCODES 64
static const char *const opcode_names[N_OPCODES] = {
    [1] = "lookup", [2] = "forget", [3] = "getattr", [4] = "setattr", [5] = "readlink",
    [6] = "symlink", [8] = "mknod", [9] = "mkdir", [10] = "unlink", [11] = "rmdir",
    [12] = "rename", [13] = "link", [14] = "open", [15] = "read", [16] = "write",
    [17] = "statfs", [18] = "release", [20] = "fsync", [21] = "setxattr", [22] = "getxattr",
    [23] = "listxattr", [24] = "removexattr", [25] = "flush", [26] = "init", [27] = "opendir",
    [28] = "readdir", [29] = "releasedir", [30] = "fsyncdir", [31] = "getlk", [32] = "setlk",
    [33] = "setlkw", [34] = "access", [35] = "create", [36] = "interrupt", [37] = "bmap",
    [38] = "destroy", [39] = "ioctl", [40] = "poll", [41] = "notify_reply", [42] = "forget",
    [43] = "fallocate", [44] = "readdir", [45] = "rename", [46] = "lseek",
    [47] = "copy_file_range", [48] = "setupmapping", [49] = "removemapping", [50] = "syncfs",
    [51] = "tmpfile", [52] = "statx",
};
#define N_BUCKETS 12 /* and +Inf */
static const double bucket_bounds[N_BUCKETS] = {0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5,
                                                1, 5, 30, 300};
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

/* A directory's attributes as a request that changed it left them (see "Directory attributes
 * after a change" below). */
struct dir_attrs {
    struct dir_attrs *next;
    uint64_t ino;
    int changing;        /* requests changing the directory now */
    int overlapped;      /* two of them overlapped: keep nothing until none is left */
    int valid;
    uint64_t expires_ns; /* CLOCK_MONOTONIC */
    struct stat st;
};
#define DIR_ATTRS_BUCKETS 256
#define DIR_ATTRS_MAX 4096

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

static __thread struct worker *this_worker;

static void flush_forgets(Session *s);
static void forget_unanswered(Session *s, const uint64_t *inos, size_t n);

/* ---- the GIL around a request -------------------------------------------------------------- */

static inline uint64_t now_ns(void);
static inline void enter(void)
{
    uint64_t t0 = now_ns();
    PyEval_RestoreThread(this_worker->ts);
    this_worker->gil_ns += now_ns() - t0;
    if (__atomic_load_n(&this_worker->s->n_forgets, __ATOMIC_RELAXED) != 0)
        flush_forgets(this_worker->s);
}
static inline void leave(void) { (void)PyEval_SaveThread(); }

/* Report the pending exception: FuseError gives its errno; anything else goes to
 * ops.unexpected(opname, exc) and is EIO. Called with the GIL held; clears the exception. */
static int take_error(Session *s, enum op op)
{
    PyObject *type, *value, *tb;
    int code = EIO;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL)
        return code;
    PyErr_NormalizeException(&type, &value, &tb);
    if (PyErr_GivenExceptionMatches(type, FuseError)) {
        PyObject *e = PyObject_GetAttrString(value, "errno");
        if (e != NULL && PyLong_Check(e)) {
            long v = PyLong_AsLong(e);
            if (v > 0 && v < 4096)
                code = (int)v;
        }
        Py_XDECREF(e);
        PyErr_Clear();
    } else {
        if (tb != NULL && value != NULL)
            PyException_SetTraceback(value, tb);
        PyObject *name = PyUnicode_FromString(op_names[op]);
        PyObject *r = NULL;
        if (name != NULL && s->methods[OP_UNEXPECTED] != NULL)
            r = PyObject_CallFunctionObjArgs(s->methods[OP_UNEXPECTED], name, value ? value : Py_None, NULL);
        else if (name != NULL) {
            PyErr_Restore(Py_NewRef(type), Py_XNewRef(value), Py_XNewRef(tb));
            PyErr_WriteUnraisable(name);
            r = Py_NewRef(Py_None);
        }
        if (r == NULL)
            PyErr_WriteUnraisable(name);
        Py_XDECREF(r);
        Py_XDECREF(name);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return code;
}

/* ops.<op>(*args); steals the references in args (NULL items mean "building failed"). */
static PyObject *call(Session *s, enum op op, PyObject **args, size_t nargs)
{
    PyObject *r = NULL;
    for (size_t i = 0; i < nargs; i++)
        if (args[i] == NULL)
            goto out;
    if (s->methods[op] == NULL) {
        if (op == OP_INIT || op == OP_INIT_REPLIED || op == OP_FORGET || op == OP_READDIR_TAKEN) {
            r = Py_NewRef(Py_None); /* nothing to do */
        } else {
            PyObject *e = PyObject_CallFunction(FuseError, "i", ENOSYS);
            if (e != NULL) {
                PyErr_SetObject(FuseError, e);
                Py_DECREF(e);
            }
        }
        goto out;
    }
    r = PyObject_Vectorcall(s->methods[op], args, nargs, NULL);
out:
    for (size_t i = 0; i < nargs; i++)
        Py_XDECREF(args[i]);
    return r;
}

/* ops.<op>(*args) for its effect only: 0, or the errno of what it raised (reported as
 * take_error does). Steals the references in args; the GIL must be held. */
static int call_void(Session *s, enum op op, PyObject **args, size_t nargs)
{
    PyObject *r = call(s, op, args, nargs);
    if (r == NULL)
        return take_error(s, op);
    Py_DECREF(r);
    return 0;
}

static inline PyObject *u64(uint64_t v) { return PyLong_FromUnsignedLongLong(v); }
static inline PyObject *i64(int64_t v) { return PyLong_FromLongLong(v); }
static inline PyObject *name_of(const char *name) { return PyBytes_FromString(name); }

static int item_u64(PyObject *t, Py_ssize_t i, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, i));
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static int item_i64(PyObject *t, Py_ssize_t i, int64_t *out)
{
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static int item_double(PyObject *t, Py_ssize_t i, double *out)
{
    double v = PyFloat_AsDouble(PyTuple_GET_ITEM(t, i));
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static void set_ns(struct timespec *ts, int64_t ns)
{
    ts->tv_sec = ns / 1000000000;
    ts->tv_nsec = ns % 1000000000;
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000;
        ts->tv_sec -= 1;
    }
}

/* An entry tuple (see the top of this file) into a fuse_entry_param. */
static int entry_from(PyObject *t, struct fuse_entry_param *e)
{
    uint64_t ino, mode, nlink, uid, gid, rdev, size, blksize, blocks;
    int64_t atime, mtime, ctime;
    memset(e, 0, sizeof(*e));
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 2) {
        PyErr_SetString(PyExc_TypeError, "an entry must be a tuple");
        return -1;
    }
    if (item_u64(t, 0, &ino) < 0 || item_double(t, 1, &e->entry_timeout) < 0)
        return -1;
    e->ino = ino;
    if (ino == 0)
        return 0; /* negative entry: only its timeout counts */
    if (PyTuple_GET_SIZE(t) != 14) {
        PyErr_SetString(PyExc_TypeError, "an entry must have 14 items");
        return -1;
    }
    if (item_double(t, 2, &e->attr_timeout) < 0 || item_u64(t, 3, &mode) < 0 || item_u64(t, 4, &nlink) < 0
        || item_u64(t, 5, &uid) < 0 || item_u64(t, 6, &gid) < 0 || item_u64(t, 7, &rdev) < 0
        || item_u64(t, 8, &size) < 0 || item_u64(t, 9, &blksize) < 0 || item_u64(t, 10, &blocks) < 0
        || item_i64(t, 11, &atime) < 0 || item_i64(t, 12, &mtime) < 0 || item_i64(t, 13, &ctime) < 0)
        return -1;
    e->generation = 0; /* inode numbers are never reused */
    e->attr.st_ino = ino;
    e->attr.st_mode = mode;
    e->attr.st_nlink = nlink;
    e->attr.st_uid = uid;
    e->attr.st_gid = gid;
    e->attr.st_rdev = rdev;
    e->attr.st_size = size;
    e->attr.st_blksize = blksize;
    e->attr.st_blocks = blocks;
    set_ns(&e->attr.st_atim, atime);
    set_ns(&e->attr.st_mtim, mtime);
    set_ns(&e->attr.st_ctim, ctime);
    return 0;
}

/* Bits of an open reply's flags (module constants of the same names). */
#define OPEN_KEEP_CACHE 1 /* keep the page cache of earlier opens (FOPEN_KEEP_CACHE) */
#define OPEN_DIRECT_IO 2  /* no page cache: each read/write is a request (FOPEN_DIRECT_IO) */
#define OPEN_NOFLUSH 4    /* close(2) sends no FLUSH (FOPEN_NOFLUSH): RELEASE alone ends it */

/* (fh, backing_id, flags) into a fuse_file_info */
static int open_from(PyObject *t, struct fuse_file_info *fi)
{
    uint64_t fh, flags;
    int64_t bid;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 3) {
        PyErr_SetString(PyExc_TypeError, "an open reply must be (fh, backing_id, flags)");
        return -1;
    }
    if (item_u64(t, 0, &fh) < 0 || item_i64(t, 1, &bid) < 0 || item_u64(t, 2, &flags) < 0)
        return -1;
    fi->fh = fh;
    fi->backing_id = (int32_t)bid;
    /* the kernel rejects keep_cache on a passthrough open */
    fi->keep_cache = bid > 0 ? 0 : !!(flags & OPEN_KEEP_CACHE);
    fi->direct_io = !!(flags & OPEN_DIRECT_IO);
    fi->noflush = !!(flags & OPEN_NOFLUSH);
    return 0;
}

static PyObject *ctx_args(fuse_req_t req, PyObject **args)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    args[0] = u64(ctx->uid);
    args[1] = u64(ctx->gid);
    args[2] = u64(ctx->umask);
    args[3] = i64(ctx->pid);
    return args[0];
}

static inline Session *session_of(fuse_req_t req) { return (Session *)fuse_req_userdata(req); }

/* ---- directory attributes after a change ----------------------------------------------------
 *
 * With default_permissions, every create, unlink, rename, mkdir, ... makes the kernel drop the
 * attributes it holds of the directory (fuse_dir_changed marks them stale), and its next
 * permission check in that directory asks for them again: one GETATTR per namespace change,
 * answered by Python. So a request that changes a directory may hand the front end the
 * directory's attributes as the change left them (ckptfs_fuse.remember_dir_attrs, from within
 * the request), and the GETATTR that follows is answered here, without the GIL.
 *
 * What keeps this coherent:
 *  - only a request that names the directory as the one it changes (the parent of create,
 *    mknod, mkdir, symlink, unlink, rmdir, link, both parents of rename, the inode of setattr,
 *    setxattr, removexattr) may store its attributes, and only while it runs; while any such
 *    request runs, GETATTR goes to Python;
 *  - when two of them overlap on one directory, nothing is kept until both have ended: the
 *    first one's attributes could miss the second one's change (a guard: the kernel holds a
 *    directory's inode lock through each change in it, so they do not overlap today);
 *  - rmdir, and a rename that moved or replaced a directory, drop everything kept
 *    (ckptfs_fuse.forget_dir_attrs): the directory they removed or moved may be kept;
 *  - what is kept is answered for at most the attribute timeout it came with, counted from when
 *    it was stored, and with what is left of it: the kernel could have kept the same reply that
 *    long. A change made by something else in that time (a bucket listing, another process
 *    writing fsmeta) shows as late as it would have with the kernel's own cache.
 * The entry is stored before the request's reply goes out, so the kernel's GETATTR, sent after
 * the reply, finds it. */

static struct dir_attrs **dir_attrs_slot(Session *s, uint64_t ino)
{
    struct dir_attrs **p = &s->dir_attrs[ino % DIR_ATTRS_BUCKETS];
    while (*p != NULL && (*p)->ino != ino)
        p = &(*p)->next;
    return p;
}

/* Unlink and free *p (dir_attrs_lock held). */
static void dir_attrs_drop(Session *s, struct dir_attrs **p)
{
    struct dir_attrs *e = *p;
    *p = e->next;
    free(e);
    s->n_dir_attrs--;
}

/* Drop the entries that have expired and that no request is changing (dir_attrs_lock held). */
static void dir_attrs_sweep(Session *s)
{
    uint64_t now = now_ns();
    for (int b = 0; b < DIR_ATTRS_BUCKETS; b++) {
        struct dir_attrs **p = &s->dir_attrs[b];
        while (*p != NULL) {
            if ((*p)->changing == 0 && now >= (*p)->expires_ns)
                dir_attrs_drop(s, p);
            else
                p = &(*p)->next;
        }
    }
}

/* The request in this thread may change directory ino: what is kept of it goes, and GETATTR
 * goes to Python until the request has ended. */
static void dir_attrs_begin(Session *s, uint64_t ino)
{
    struct worker *w = this_worker;
    if (w == NULL || w->n_changing == 2 || (w->n_changing == 1 && w->changing[0] == ino))
        return;
    pthread_mutex_lock(&s->dir_attrs_lock);
    struct dir_attrs **p = dir_attrs_slot(s, ino);
    struct dir_attrs *e = *p;
    if (e == NULL && s->n_dir_attrs >= DIR_ATTRS_MAX) {
        dir_attrs_sweep(s); /* entries of directories nobody asked about again */
        p = dir_attrs_slot(s, ino);
    }
    if (e == NULL && s->n_dir_attrs < DIR_ATTRS_MAX && (e = calloc(1, sizeof(*e))) != NULL) {
        e->ino = ino;
        *p = e;
        s->n_dir_attrs++;
    }
    if (e != NULL) {
        e->changing++;
        e->valid = 0;
        if (e->changing > 1)
            e->overlapped = 1;
        w->changing[w->n_changing++] = ino;
    }
    pthread_mutex_unlock(&s->dir_attrs_lock);
}

/* The request in this thread has ended (before its reply goes out). */
static void dir_attrs_end(Session *s)
{
    struct worker *w = this_worker;
    if (w == NULL || w->n_changing == 0)
        return;
    pthread_mutex_lock(&s->dir_attrs_lock);
    for (int i = 0; i < w->n_changing; i++) {
        struct dir_attrs **p = dir_attrs_slot(s, w->changing[i]);
        struct dir_attrs *e = *p;
        if (e == NULL)
            continue;
        if (--e->changing == 0) {
            if (e->overlapped)
                e->valid = e->overlapped = 0;
            if (!e->valid)
                dir_attrs_drop(s, p);
        }
    }
    w->n_changing = 0;
    pthread_mutex_unlock(&s->dir_attrs_lock);
}

/* GETATTR of ino from what a change left, if that is still good: 1 and *st, *timeout. */
static int dir_attrs_get(Session *s, uint64_t ino, struct stat *st, double *timeout)
{
    int found = 0;
    pthread_mutex_lock(&s->dir_attrs_lock);
    if (s->n_dir_attrs > 0) {
        struct dir_attrs **p = dir_attrs_slot(s, ino);
        struct dir_attrs *e = *p;
        if (e != NULL && e->valid && e->changing == 0) {
            uint64_t now = now_ns();
            if (now < e->expires_ns) {
                *st = e->st;
                *timeout = (double)(e->expires_ns - now) / 1e9;
                __atomic_fetch_add(&s->dir_attrs_hits, 1, __ATOMIC_RELAXED);
                found = 1;
            } else {
                dir_attrs_drop(s, p);
            }
        }
    }
    pthread_mutex_unlock(&s->dir_attrs_lock);
    return found;
}

/* ckptfs_fuse.remember_dir_attrs(entry) -> bool */
static PyObject *remember_dir_attrs(PyObject *module, PyObject *entry)
{
    (void)module;
    struct worker *w = this_worker;
    struct fuse_entry_param e;
    if (entry_from(entry, &e) < 0)
        return NULL;
    if (e.ino == 0 || !S_ISDIR(e.attr.st_mode)) {
        PyErr_SetString(PyExc_ValueError, "remember_dir_attrs takes a directory's entry");
        return NULL;
    }
    int stored = 0;
    if (w != NULL && e.attr_timeout > 0) {
        Session *s = w->s;
        pthread_mutex_lock(&s->dir_attrs_lock);
        for (int i = 0; i < w->n_changing; i++) {
            if (w->changing[i] != e.ino)
                continue;
            struct dir_attrs *d = *dir_attrs_slot(s, e.ino);
            if (d != NULL && !d->overlapped) {
                d->st = e.attr;
                d->expires_ns = now_ns() + (uint64_t)(e.attr_timeout * 1e9);
                d->valid = 1;
                stored = 1;
            }
        }
        pthread_mutex_unlock(&s->dir_attrs_lock);
    }
    return PyBool_FromLong(stored);
}

/* Drop everything kept: every entry not being changed goes, and those being changed keep
 * nothing until their requests have ended. */
static void dir_attrs_clear(Session *s)
{
    pthread_mutex_lock(&s->dir_attrs_lock);
    for (int b = 0; b < DIR_ATTRS_BUCKETS && s->n_dir_attrs > 0; b++) {
        struct dir_attrs **p = &s->dir_attrs[b];
        while (*p != NULL) {
            if ((*p)->changing == 0) {
                dir_attrs_drop(s, p);
            } else {
                (*p)->valid = 0;
                (*p)->overlapped = 1;
                p = &(*p)->next;
            }
        }
    }
    pthread_mutex_unlock(&s->dir_attrs_lock);
}

/* ckptfs_fuse.forget_dir_attrs() */
static PyObject *forget_dir_attrs(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    if (this_worker != NULL)
        dir_attrs_clear(this_worker->s);
    Py_RETURN_NONE;
}

/* ---- handlers ------------------------------------------------------------------------------- */

static void ll_init(void *userdata, struct fuse_conn_info *conn)
{
    Session *s = userdata;
    /* readdirplus always (the kernel takes a reference to each entry: no LOOKUP after ls -l) */
    fuse_unset_feature_flag(conn, FUSE_CAP_READDIRPLUS_AUTO);
    s->passthrough_granted = 0;
    if (s->want_passthrough && (conn->capable_ext & FUSE_CAP_PASSTHROUGH)) {
        fuse_set_feature_flag(conn, FUSE_CAP_PASSTHROUGH);
        conn->max_backing_stack_depth = s->max_backing_stack_depth;
        s->passthrough_granted = 1;
    }
    s->dio_mmap_granted = 0;
    if (s->want_dio_mmap && (conn->capable_ext & FUSE_CAP_DIRECT_IO_ALLOW_MMAP)) {
        fuse_set_feature_flag(conn, FUSE_CAP_DIRECT_IO_ALLOW_MMAP);
        s->dio_mmap_granted = 1;
    }
    if (s->want_export && (conn->capable_ext & FUSE_CAP_EXPORT_SUPPORT))
        fuse_set_feature_flag(conn, FUSE_CAP_EXPORT_SUPPORT);
    s->writeback_granted = 0;
    /* the kernel refuses passthrough opens on a connection with the writeback cache */
    if (s->want_writeback && !s->passthrough_granted && (conn->capable_ext & FUSE_CAP_WRITEBACK_CACHE)) {
        fuse_set_feature_flag(conn, FUSE_CAP_WRITEBACK_CACHE);
        s->writeback_granted = 1;
        if (!s->want_atomic_o_trunc)
            fuse_unset_feature_flag(conn, FUSE_CAP_ATOMIC_O_TRUNC);
    }
    if (s->want_splice_write && (conn->capable_ext & FUSE_CAP_SPLICE_WRITE))
        fuse_set_feature_flag(conn, FUSE_CAP_SPLICE_WRITE);
    if (s->splice_max_read)
        conn->max_read = s->splice_max_read; /* libfuse checks it against the mount option */
    this_worker->init_handled = 1;
    enter();
    call_void(s, OP_INIT, NULL, 0);
    leave();
}

static void reply_entry_result(fuse_req_t req, Session *s, enum op op, PyObject *r)
{
    struct fuse_entry_param e;
    int err = 0;
    if (r == NULL || entry_from(r, &e) < 0)
        err = take_error(s, op);
    Py_XDECREF(r);
    leave();
    dir_attrs_end(s);
    if (err)
        fuse_reply_err(req, err);
    else if (fuse_reply_entry(req, &e) != 0)
        forget_unanswered(s, &e.ino, 1);
}

/* For requests answered with no data: 0 or an errno. */
static void reply_none_result(fuse_req_t req, Session *s, enum op op, PyObject *r)
{
    int err = r == NULL ? take_error(s, op) : 0;
    Py_XDECREF(r);
    leave();
    dir_attrs_end(s);
    fuse_reply_err(req, err);
}

static void ll_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    Session *s = session_of(req);
    enter();
    PyObject *a[] = {u64(parent), name_of(name)};
    reply_entry_result(req, s, OP_LOOKUP, call(s, OP_LOOKUP, a, 2));
}

/* FORGET and BATCH_FORGET: nobody waits for them, and each would take the GIL in a thread of its
 * own beside the request that follows (an unlink's FORGET comes with the next unlink). They are
 * queued here and handed to ops.forget by the next thread that takes the GIL for a request
 * (enter), or by run()'s own loop within 200 ms. Handing them over late only keeps an inode
 * longer: a later LOOKUP of it adds its reference before the late FORGET takes the old ones. */
static void queue_forgets(Session *s, const struct forget_item *items, size_t n)
{
    pthread_mutex_lock(&s->forget_lock);
    if (s->n_forgets + n > s->cap_forgets) {
        size_t cap = s->cap_forgets ? s->cap_forgets : 64;
        while (cap < s->n_forgets + n)
            cap *= 2;
        struct forget_item *grown = realloc(s->forgets, cap * sizeof(*grown));
        if (grown == NULL) { /* keep the references: the inode stays until the next mount */
            pthread_mutex_unlock(&s->forget_lock);
            return;
        }
        s->forgets = grown;
        s->cap_forgets = cap;
    }
    memcpy(s->forgets + s->n_forgets, items, n * sizeof(*items));
    __atomic_store_n(&s->n_forgets, s->n_forgets + n, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&s->forget_lock);
}

/* A reply that carried entries did not reach the kernel (the request was interrupted, or the
 * connection aborted): the kernel took no reference to them, so the references the handler
 * counted for them are handed back as FORGETs. */
static void forget_unanswered(Session *s, const uint64_t *inos, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct forget_item item = {inos[i], 1};
        if (inos[i] != 0)
            queue_forgets(s, &item, 1);
    }
}

/* With the GIL held: ops.forget(the queued FORGETs). */
static void flush_forgets(Session *s)
{
    pthread_mutex_lock(&s->forget_lock);
    size_t n = s->n_forgets;
    struct forget_item *items = s->forgets;
    s->forgets = NULL;
    s->n_forgets = s->cap_forgets = 0;
    pthread_mutex_unlock(&s->forget_lock);
    if (n == 0) {
        free(items);
        return;
    }
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list != NULL && i < n; i++) {
        PyObject *item = Py_BuildValue("(KK)", (unsigned long long)items[i].ino, (unsigned long long)items[i].nlookup);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    free(items);
    PyObject *a[] = {list};
    call_void(s, OP_FORGET, a, 1);
}

static void ll_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    struct forget_item item = {ino, nlookup};
    queue_forgets(session_of(req), &item, 1);
    fuse_reply_none(req);
}

static void ll_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
    /* struct fuse_forget_data is {uint64_t ino, nlookup}, as forget_item */
    _Static_assert(sizeof(struct fuse_forget_data) == sizeof(struct forget_item), "forget layout");
    queue_forgets(session_of(req), (const struct forget_item *)forgets, count);
    fuse_reply_none(req);
}

static void reply_attr_result(fuse_req_t req, Session *s, enum op op, PyObject *r)
{
    struct fuse_entry_param e;
    int err = 0;
    if (r == NULL || entry_from(r, &e) < 0)
        err = take_error(s, op);
    else if (e.ino == 0) {
        err = EIO;
        PyErr_Clear();
    }
    Py_XDECREF(r);
    leave();
    dir_attrs_end(s);
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_attr(req, &e.attr, e.attr_timeout);
}

static void ll_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    struct stat st;
    double timeout;
    (void)fi;
    if (dir_attrs_get(s, ino, &st, &timeout)) {
        fuse_reply_attr(req, &st, timeout);
        return;
    }
    enter();
    PyObject *a[] = {u64(ino)};
    reply_attr_result(req, s, OP_GETATTR, call(s, OP_GETATTR, a, 1));
}

static void ll_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set, struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    struct timespec now = {0, 0};
    if (to_set & (FUSE_SET_ATTR_ATIME_NOW | FUSE_SET_ATTR_MTIME_NOW))
        clock_gettime(CLOCK_REALTIME, &now);
    int64_t now_ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
#define NS(ts) ((int64_t)(ts).tv_sec * 1000000000 + (ts).tv_nsec)
    dir_attrs_begin(s, ino);
    enter();
    PyObject *none = Py_None;
    PyObject *a[9];
    a[0] = u64(ino);
    a[1] = (to_set & FUSE_SET_ATTR_MODE) ? u64(attr->st_mode) : Py_NewRef(none);
    a[2] = (to_set & FUSE_SET_ATTR_UID) ? u64(attr->st_uid) : Py_NewRef(none);
    a[3] = (to_set & FUSE_SET_ATTR_GID) ? u64(attr->st_gid) : Py_NewRef(none);
    a[4] = (to_set & FUSE_SET_ATTR_SIZE) ? u64((uint64_t)attr->st_size) : Py_NewRef(none);
    a[5] = (to_set & FUSE_SET_ATTR_ATIME) ? i64(NS(attr->st_atim))
         : (to_set & FUSE_SET_ATTR_ATIME_NOW) ? i64(now_ns) : Py_NewRef(none);
    a[6] = (to_set & FUSE_SET_ATTR_MTIME) ? i64(NS(attr->st_mtim))
         : (to_set & FUSE_SET_ATTR_MTIME_NOW) ? i64(now_ns) : Py_NewRef(none);
    a[7] = (to_set & FUSE_SET_ATTR_CTIME) ? i64(NS(attr->st_ctim)) : Py_NewRef(none);
    a[8] = fi != NULL ? u64(fi->fh) : Py_NewRef(none);
#undef NS
    reply_attr_result(req, s, OP_SETATTR, call(s, OP_SETATTR, a, 9));
}

/* A reply of bytes (readlink): NUL-terminated for fuse_reply_readlink. */
static void ll_readlink(fuse_req_t req, fuse_ino_t ino)
{
    Session *s = session_of(req);
    enter();
    PyObject *a[] = {u64(ino)};
    PyObject *r = call(s, OP_READLINK, a, 1);
    char *target = NULL;
    int err = 0;
    if (r == NULL || !PyBytes_Check(r)) {
        if (r != NULL)
            PyErr_SetString(PyExc_TypeError, "readlink must return bytes");
        err = take_error(s, OP_READLINK);
    } else {
        target = strndup(PyBytes_AS_STRING(r), (size_t)PyBytes_GET_SIZE(r));
        if (target == NULL)
            err = ENOMEM;
    }
    Py_XDECREF(r);
    leave();
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_readlink(req, target);
    free(target);
}

static void ll_mknod(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, dev_t rdev)
{
    Session *s = session_of(req);
    dir_attrs_begin(s, parent);
    enter();
    PyObject *a[8] = {u64(parent), name_of(name), u64(mode), u64(rdev)};
    ctx_args(req, a + 4);
    reply_entry_result(req, s, OP_MKNOD, call(s, OP_MKNOD, a, 8));
}

static void ll_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode)
{
    Session *s = session_of(req);
    dir_attrs_begin(s, parent);
    enter();
    PyObject *a[7] = {u64(parent), name_of(name), u64(mode)};
    ctx_args(req, a + 3);
    reply_entry_result(req, s, OP_MKDIR, call(s, OP_MKDIR, a, 7));
}

static void ll_unlink(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    Session *s = session_of(req);
    dir_attrs_begin(s, parent);
    enter();
    PyObject *a[] = {u64(parent), name_of(name)};
    reply_none_result(req, s, OP_UNLINK, call(s, OP_UNLINK, a, 2));
}

static void ll_rmdir(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    Session *s = session_of(req);
    dir_attrs_begin(s, parent);
    enter();
    PyObject *a[] = {u64(parent), name_of(name)};
    PyObject *r = call(s, OP_RMDIR, a, 2);
    dir_attrs_clear(s); /* the directory removed may be kept */
    reply_none_result(req, s, OP_RMDIR, r);
}

static void ll_symlink(fuse_req_t req, const char *link, fuse_ino_t parent, const char *name)
{
    Session *s = session_of(req);
    dir_attrs_begin(s, parent);
    enter();
    PyObject *a[7] = {u64(parent), name_of(name), name_of(link)};
    ctx_args(req, a + 3);
    reply_entry_result(req, s, OP_SYMLINK, call(s, OP_SYMLINK, a, 7));
}

static void ll_rename(fuse_req_t req, fuse_ino_t parent, const char *name, fuse_ino_t newparent,
                      const char *newname, unsigned int flags)
{
    Session *s = session_of(req);
    dir_attrs_begin(s, parent);
    dir_attrs_begin(s, newparent);
    enter();
    PyObject *a[] = {u64(parent), name_of(name), u64(newparent), name_of(newname), u64(flags)};
    reply_none_result(req, s, OP_RENAME, call(s, OP_RENAME, a, 5));
}

static void ll_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t newparent, const char *newname)
{
    Session *s = session_of(req);
    dir_attrs_begin(s, newparent);
    enter();
    PyObject *a[] = {u64(ino), u64(newparent), name_of(newname)};
    reply_entry_result(req, s, OP_LINK, call(s, OP_LINK, a, 3));
}

/* An open whose reply did not reach the kernel (the opener was interrupted, or the connection
 * aborted): nobody will release the handle. */
static void release_unanswered(Session *s, enum op op, uint64_t fh)
{
    enter();
    PyObject *a[] = {u64(fh)};
    call_void(s, op, a, 1);
    leave();
}

static void ll_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    enter();
    PyObject *a[] = {u64(ino), i64(fi->flags)};
    PyObject *r = call(s, OP_OPEN, a, 2);
    int err = 0;
    if (r == NULL || open_from(r, fi) < 0)
        err = take_error(s, OP_OPEN);
    Py_XDECREF(r);
    leave();
    if (err)
        fuse_reply_err(req, err);
    else if (fuse_reply_open(req, fi) != 0)
        release_unanswered(s, OP_RELEASE, fi->fh);
}

static void ll_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode, struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    struct fuse_entry_param e;
    dir_attrs_begin(s, parent);
    enter();
    PyObject *a[8] = {u64(parent), name_of(name), u64(mode), i64(fi->flags)};
    ctx_args(req, a + 4);
    PyObject *r = call(s, OP_CREATE, a, 8);
    int err = 0;
    if (r == NULL || open_from(r, fi) < 0)
        err = take_error(s, OP_CREATE);
    else if (PyTuple_GET_SIZE(r) != 4) {
        PyErr_SetString(PyExc_TypeError, "create must return (fh, backing_id, flags, entry)");
        err = take_error(s, OP_CREATE);
    } else if (entry_from(PyTuple_GET_ITEM(r, 3), &e) < 0)
        err = take_error(s, OP_CREATE);
    Py_XDECREF(r);
    leave();
    dir_attrs_end(s);
    if (err)
        fuse_reply_err(req, err);
    else if (fuse_reply_create(req, &e, fi) != 0) {
        /* neither the handle nor the entry reached the kernel */
        release_unanswered(s, OP_RELEASE, fi->fh);
        forget_unanswered(s, &e.ino, 1);
    }
}

/* Reply with the bytes of a buffer object, the GIL dropped while the kernel copies them. */
static void reply_buffer_result(fuse_req_t req, Session *s, enum op op, PyObject *r)
{
    Py_buffer view;
    if (r == NULL || PyObject_GetBuffer(r, &view, PyBUF_SIMPLE) < 0) {
        int err = take_error(s, op);
        Py_XDECREF(r);
        leave();
        fuse_reply_err(req, err);
        return;
    }
    leave();
    fuse_reply_buf(req, view.buf, (size_t)view.len);
    enter();
    PyBuffer_Release(&view);
    Py_DECREF(r);
    leave();
}

/* READ: ops.read(fh, off, size) returns the bytes, or (fd, offset, length): a range of a file
 * that holds them, which libfuse sends without the GIL and without a copy in user space (it
 * splices the range into /dev/fuse where INIT granted FUSE_CAP_SPLICE_WRITE). The fd must stay
 * open until the reply is sent: a handle's file while the kernel waits for its READ. */
static void ll_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    (void)ino;
    enter();
    PyObject *a[] = {u64(fi->fh), i64(off), u64(size)};
    PyObject *r = call(s, OP_READ, a, 3);
    if (r == NULL || !PyTuple_Check(r)) {
        reply_buffer_result(req, s, OP_READ, r);
        return;
    }
    int64_t fd, pos, len;
    int err = 0;
    if (PyTuple_GET_SIZE(r) != 3 || item_i64(r, 0, &fd) < 0 || item_i64(r, 1, &pos) < 0 || item_i64(r, 2, &len) < 0
        || fd < 0 || pos < 0 || len < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a read reply must be bytes or (fd, offset, length)");
        err = take_error(s, OP_READ);
    }
    Py_DECREF(r);
    leave();
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    struct fuse_bufvec bufv = FUSE_BUFVEC_INIT((size_t)len);
    bufv.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
    bufv.buf[0].fd = (int)fd;
    bufv.buf[0].pos = pos;
    fuse_reply_data(req, &bufv, 0);
}

/* WRITE data reaches Python as a read-only memoryview whose base object is a WriteData: the
 * request's bytes, where the thread serving it read them (no copy) or, where the transport
 * refills that memory itself (a ring entry), a copy in a buffer of the thread's own. Once the
 * handler has returned, if anything still refers to those bytes (the view, a slice of it,
 * memoryview() of it, its .obj), the memory becomes the WriteData's: the thread lets go of it
 * and takes a fresh buffer for its next request. What Python keeps therefore never shows
 * another request's bytes, and is freed with the last reference to it. */
typedef struct {
    PyObject_HEAD
    const char *data;
    Py_ssize_t len;
    Py_ssize_t exports; /* buffers handed out and not yet released */
    void *owned;        /* the memory, once it is this object's (freed with it) */
} WriteData;

static int WriteData_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    WriteData *wd = (WriteData *)self;
    if (PyBuffer_FillInfo(view, self, (void *)wd->data, wd->len, 1, flags) < 0)
        return -1;
    wd->exports++;
    return 0;
}

static void WriteData_releasebuffer(PyObject *self, Py_buffer *view)
{
    (void)view;
    ((WriteData *)self)->exports--;
}

static void WriteData_dealloc(PyObject *self)
{
    free(((WriteData *)self)->owned);
    Py_TYPE(self)->tp_free(self);
}

static PyBufferProcs WriteData_as_buffer = {WriteData_getbuffer, WriteData_releasebuffer};

static PyTypeObject WriteDataType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ckptfs_fuse.WriteData",
    .tp_basicsize = sizeof(WriteData),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The bytes of one WRITE request (read-only; see ll_write).",
    .tp_dealloc = WriteData_dealloc,
    .tp_as_buffer = &WriteData_as_buffer,
};

static void ll_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    struct worker *w = this_worker;
    (void)ino;
    const char *mem = w->buf.mem;
    int in_recv = mem != NULL && buf >= mem && size <= w->buf.size && buf - mem <= (ptrdiff_t)(w->buf.size - size);
    if (!in_recv) {
        if (w->wcopy_cap < size) {
            char *grown = realloc(w->wcopy, size);
            if (grown == NULL) {
                fuse_reply_err(req, ENOMEM);
                return;
            }
            w->wcopy = grown;
            w->wcopy_cap = size;
        }
        memcpy(w->wcopy, buf, size);
        buf = w->wcopy;
    }
    enter();
    WriteData *wd = PyObject_New(WriteData, &WriteDataType);
    PyObject *view = NULL;
    if (wd != NULL) {
        wd->data = buf;
        wd->len = (Py_ssize_t)size;
        wd->exports = 0;
        wd->owned = NULL;
        view = PyMemoryView_FromObject((PyObject *)wd);
    }
    PyObject *a[] = {u64(fi->fh), i64(off), view};
    PyObject *r = call(s, OP_WRITE, a, 3);
    size_t written = 0;
    int err = 0;
    if (r == NULL)
        err = take_error(s, OP_WRITE);
    else {
        written = PyLong_AsSize_t(r);
        if (written == (size_t)-1 && PyErr_Occurred())
            err = take_error(s, OP_WRITE);
    }
    Py_XDECREF(r);
    if (wd != NULL) {
        if (Py_REFCNT(wd) > 1 || wd->exports > 0) { /* kept: the memory is Python's now */
            if (in_recv) {
                wd->owned = w->buf.mem;
                w->give_up_buf = 1; /* (libfuse still holds buf: let go once it returns) */
            } else {
                wd->owned = w->wcopy;
                w->wcopy = NULL;
                w->wcopy_cap = 0;
            }
        }
        Py_DECREF(wd);
    }
    leave();
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_write(req, written);
}

/* Requests on an open handle answered with no data: ops.<op>(fh) or ops.<op>(fh, datasync). */
static void answer_fh(fuse_req_t req, enum op op, uint64_t fh, int datasync)
{
    Session *s = session_of(req);
    enter();
    PyObject *a[] = {u64(fh), datasync < 0 ? NULL : PyBool_FromLong(datasync)};
    reply_none_result(req, s, op, call(s, op, a, datasync < 0 ? 1 : 2));
}

static void ll_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    answer_fh(req, OP_FLUSH, fi->fh, -1);
}

static void ll_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    answer_fh(req, OP_RELEASE, fi->fh, -1);
}

static void ll_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    answer_fh(req, OP_FSYNC, fi->fh, datasync);
}

static void ll_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    enter();
    PyObject *a[] = {u64(ino)};
    PyObject *r = call(s, OP_OPENDIR, a, 1);
    int err = 0;
    if (r == NULL)
        err = take_error(s, OP_OPENDIR);
    else {
        fi->fh = PyLong_AsUnsignedLongLong(r);
        if (fi->fh == (uint64_t)-1 && PyErr_Occurred())
            err = take_error(s, OP_OPENDIR);
    }
    Py_XDECREF(r);
    leave();
    if (err)
        fuse_reply_err(req, err);
    else if (fuse_reply_open(req, fi) != 0)
        release_unanswered(s, OP_RELEASEDIR, fi->fh);
}

/* READDIRPLUS: ops.readdir(fh, off) gives [(name, entry, next_off), ...]; as many as fit go
 * into the reply, and ops.readdir_taken(fh, inos) counts the kernel's new references to them
 * before the reply goes out (so no FORGET of them can come first). */
static void ll_readdirplus(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    Session *s = session_of(req);
    (void)ino;
    char *buf = malloc(size ? size : 1);
    uint64_t *inos = NULL; /* the entries counted by readdir_taken, to forget if the reply fails */
    size_t n_inos = 0;
    size_t used = 0;
    int err = 0;
    if (buf == NULL) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    enter();
    PyObject *a[] = {u64(fi->fh), i64(off)};
    PyObject *r = call(s, OP_READDIR, a, 2);
    PyObject *taken = NULL;
    if (r == NULL || !PyList_Check(r)) {
        if (r != NULL)
            PyErr_SetString(PyExc_TypeError, "readdir must return a list");
        err = take_error(s, OP_READDIR);
        goto done;
    }
    taken = PyList_New(0);
    if (taken == NULL) {
        err = take_error(s, OP_READDIR);
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(r); i++) {
        PyObject *item = PyList_GET_ITEM(r, i);
        struct fuse_entry_param e;
        int64_t next;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 || !PyBytes_Check(PyTuple_GET_ITEM(item, 0))) {
            PyErr_SetString(PyExc_TypeError, "readdir items must be (name, entry, next_offset)");
            err = take_error(s, OP_READDIR);
            goto done;
        }
        if (entry_from(PyTuple_GET_ITEM(item, 1), &e) < 0 || item_i64(item, 2, &next) < 0) {
            err = take_error(s, OP_READDIR);
            goto done;
        }
        size_t need = fuse_add_direntry_plus(req, buf + used, size - used, PyBytes_AS_STRING(PyTuple_GET_ITEM(item, 0)),
                                             &e, next);
        if (need > size - used)
            break;
        used += need;
        if (PyList_Append(taken, PyTuple_GET_ITEM(PyTuple_GET_ITEM(item, 1), 0)) < 0) {
            err = take_error(s, OP_READDIR);
            goto done;
        }
    }
    if (PyList_GET_SIZE(taken) > 0) {
        n_inos = (size_t)PyList_GET_SIZE(taken);
        inos = malloc(n_inos * sizeof(*inos));
        for (size_t i = 0; inos != NULL && i < n_inos; i++)
            inos[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(taken, (Py_ssize_t)i));
        if (inos == NULL) {
            err = ENOMEM; /* (before they are counted: nothing to hand back) */
            goto done;
        }
        PyObject *b[] = {u64(fi->fh), Py_NewRef(taken)};
        err = call_void(s, OP_READDIR_TAKEN, b, 2);
    }
done:
    Py_XDECREF(taken);
    Py_XDECREF(r);
    leave();
    if (err)
        fuse_reply_err(req, err);
    else if (fuse_reply_buf(req, buf, used) != 0)
        forget_unanswered(s, inos, n_inos);
    free(inos);
    free(buf);
}

static void ll_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    answer_fh(req, OP_RELEASEDIR, fi->fh, -1);
}

static void ll_fsyncdir(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    answer_fh(req, OP_FSYNCDIR, fi->fh, datasync);
}

static void ll_statfs(fuse_req_t req, fuse_ino_t ino)
{
    Session *s = session_of(req);
    struct statvfs st;
    uint64_t v[9];
    int err = 0;
    (void)ino;
    memset(&st, 0, sizeof(st));
    enter();
    PyObject *r = call(s, OP_STATFS, NULL, 0);
    if (r == NULL || !PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 9) {
        if (r != NULL)
            PyErr_SetString(PyExc_TypeError, "statfs must return 9 numbers");
        err = take_error(s, OP_STATFS);
    } else {
        for (int i = 0; i < 9 && !err; i++)
            if (item_u64(r, i, &v[i]) < 0)
                err = take_error(s, OP_STATFS);
    }
    Py_XDECREF(r);
    leave();
    if (err) {
        fuse_reply_err(req, err);
        return;
    }
    st.f_bsize = v[0];
    st.f_frsize = v[1];
    st.f_blocks = v[2];
    st.f_bfree = v[3];
    st.f_bavail = v[4];
    st.f_files = v[5];
    st.f_ffree = v[6];
    st.f_favail = v[7];
    st.f_namemax = v[8];
    fuse_reply_statfs(req, &st);
}

static void ll_setxattr(fuse_req_t req, fuse_ino_t ino, const char *name, const char *value, size_t size, int flags)
{
    Session *s = session_of(req);
    dir_attrs_begin(s, ino);
    enter();
    PyObject *a[] = {u64(ino), name_of(name), PyBytes_FromStringAndSize(value, (Py_ssize_t)size), i64(flags)};
    reply_none_result(req, s, OP_SETXATTR, call(s, OP_SETXATTR, a, 4));
}

/* getxattr and listxattr: size 0 asks for the length; a value longer than size is ERANGE. */
static void reply_xattr_result(fuse_req_t req, Session *s, enum op op, PyObject *r, size_t size)
{
    if (r == NULL || !PyBytes_Check(r)) {
        if (r != NULL)
            PyErr_SetString(PyExc_TypeError, "an xattr reply must be bytes");
        int err = take_error(s, op);
        Py_XDECREF(r);
        leave();
        fuse_reply_err(req, err);
        return;
    }
    size_t len = (size_t)PyBytes_GET_SIZE(r);
    char *copy = NULL;
    if (size != 0 && len <= size) {
        copy = malloc(len ? len : 1);
        if (copy != NULL)
            memcpy(copy, PyBytes_AS_STRING(r), len);
    }
    Py_DECREF(r);
    leave();
    if (size == 0)
        fuse_reply_xattr(req, len);
    else if (len > size)
        fuse_reply_err(req, ERANGE);
    else if (copy == NULL)
        fuse_reply_err(req, ENOMEM);
    else
        fuse_reply_buf(req, copy, len);
    free(copy);
}

static void ll_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size)
{
    Session *s = session_of(req);
    if (s->user_xattrs_only && strncmp(name, "user.", 5) != 0) {
        /* FUSE clears SB_NOSEC, so the kernel asks for security.capability before every
         * write(2): answered here, without the GIL. (ENOSYS would stop all getxattr.) */
        fuse_reply_err(req, ENODATA);
        return;
    }
    enter();
    PyObject *a[] = {u64(ino), name_of(name)};
    reply_xattr_result(req, s, OP_GETXATTR, call(s, OP_GETXATTR, a, 2), size);
}

static void ll_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size)
{
    Session *s = session_of(req);
    enter();
    PyObject *a[] = {u64(ino)};
    reply_xattr_result(req, s, OP_LISTXATTR, call(s, OP_LISTXATTR, a, 1), size);
}

static void ll_removexattr(fuse_req_t req, fuse_ino_t ino, const char *name)
{
    Session *s = session_of(req);
    dir_attrs_begin(s, ino);
    enter();
    PyObject *a[] = {u64(ino), name_of(name)};
    reply_none_result(req, s, OP_REMOVEXATTR, call(s, OP_REMOVEXATTR, a, 2));
}

static const struct fuse_lowlevel_ops ll_ops = {
    .init = ll_init,
    .lookup = ll_lookup,
    .forget = ll_forget,
    .forget_multi = ll_forget_multi,
    .getattr = ll_getattr,
    .setattr = ll_setattr,
    .readlink = ll_readlink,
    .mknod = ll_mknod,
    .mkdir = ll_mkdir,
    .unlink = ll_unlink,
    .rmdir = ll_rmdir,
    .symlink = ll_symlink,
    .rename = ll_rename,
    .link = ll_link,
    .open = ll_open,
    .read = ll_read,
    .write = ll_write,
    .flush = ll_flush,
    .release = ll_release,
    .fsync = ll_fsync,
    .opendir = ll_opendir,
    .readdirplus = ll_readdirplus,
    .releasedir = ll_releasedir,
    .fsyncdir = ll_fsyncdir,
    .statfs = ll_statfs,
    .setxattr = ll_setxattr,
    .getxattr = ll_getxattr,
    .listxattr = ll_listxattr,
    .removexattr = ll_removexattr,
    .create = ll_create,
};

/* ---- the worker pool ------------------------------------------------------------------------ */

static void wake_readers(Session *s);
static void wake_rings(Session *s);

/* With s->lock held: every thread is to end (see Session_exit). */
static void session_end_locked(Session *s)
{
    s->exiting = 1;
    fuse_session_exit(s->se);
    wake_readers(s);
    wake_rings(s);
    pthread_cond_broadcast(&s->ended);
}

/* A thread the session cannot do without ended with errno err while serving: the session ends
 * (run() raises OSError(err, ..., what)) rather than leave requests to a thread that is gone.
 * Nothing happens if the session was already ending (exit(), an unmount). */
static void session_failed(Session *s, int err, const char *what)
{
    pthread_mutex_lock(&s->lock);
    if (!s->exiting) {
        if (s->error == 0) {
            s->error = err;
            s->error_what = what;
        }
        session_end_locked(s);
    }
    pthread_mutex_unlock(&s->lock);
}

static void on_wake_signal(int sig) { (void)sig; }

static sigset_t wake_set(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, WAKE_SIGNAL);
    return set;
}

/* The signals a front-end thread starts with blocked: those the Python main thread handles never
 * come to it, and the wake signal only while it waits for a request (see worker_main). */
static sigset_t blocked_in_workers(void)
{
    sigset_t set = wake_set();
    int handled_in_python[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGCHLD, SIGUSR1, SIGUSR2};
    for (size_t i = 0; i < sizeof(handled_in_python) / sizeof(handled_in_python[0]); i++)
        sigaddset(&set, handled_in_python[i]);
    return set;
}

static int start_worker(Session *s);
static void start_rings(Session *s);

static void account(Session *s, uint32_t opcode, uint64_t ns, uint64_t gil_ns)
{
    struct op_stat *st = &s->stats[opcode < N_OPCODES && opcode_names[opcode] ? opcode : 0];
    double seconds = (double)ns / 1e9;
    int b = 0;
    while (b < N_BUCKETS && seconds > bucket_bounds[b])
        b++;
    __atomic_fetch_add(&st->count, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&st->ns, ns, __ATOMIC_RELAXED);
    __atomic_fetch_add(&st->gil_ns, gil_ns, __ATOMIC_RELAXED);
    __atomic_fetch_add(&st->buckets[b], 1, __ATOMIC_RELAXED);
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    Session *s = w->s;
    sigset_t wake = wake_set();
    /* Python thread state for the life of this thread */
    PyGILState_STATE gil = PyGILState_Ensure();
    w->ts = PyThreadState_Get();
    (void)PyEval_SaveThread();
    this_worker = w;

    for (;;) {
        pthread_mutex_lock(&s->lock);
        int exiting = s->exiting;
        if (!exiting)
            w->reading = 1;
        pthread_mutex_unlock(&s->lock);
        if (exiting)
            break;
        /* Only while reading may WAKE_SIGNAL come in (a pending one comes in here). */
        pthread_sigmask(SIG_UNBLOCK, &wake, NULL);
        int res = s->exiting ? -EINTR : fuse_session_receive_buf(s->se, &w->buf);
        pthread_sigmask(SIG_BLOCK, &wake, NULL);
        pthread_mutex_lock(&s->lock);
        w->reading = 0;
        if (res == -EINTR || res == -EAGAIN) {
            pthread_mutex_unlock(&s->lock);
            continue;
        }
        if (res <= 0) {
            /* 0: unmounted (ENODEV) or the session was told to exit; < 0: an error */
            if (res < 0 && s->error == 0)
                s->error = -res;
            s->exiting = 1;
            pthread_mutex_unlock(&s->lock);
            break;
        }
        s->n_idle--;
        int spawn = s->n_idle == 0 && s->n_workers < s->max_threads && !s->exiting;
        pthread_mutex_unlock(&s->lock);
        if (spawn)
            start_worker(s);
        uint32_t opcode = ((const struct { uint32_t len, opcode; } *)w->buf.mem)->opcode;
        uint64_t started = now_ns();
        w->gil_ns = 0;
        fuse_session_process_buf(s->se, &w->buf);
        if (w->give_up_buf) { /* a WriteData owns it now; libfuse allocates the next one */
            w->buf.mem = NULL;
            w->give_up_buf = 0;
        }
        account(s, opcode, now_ns() - started, w->gil_ns);
        if (w->init_handled) {
            /* INIT's reply is in the kernel now: what must follow it (the mount's read-ahead) */
            w->init_handled = 0;
            if (s->want_ring)
                start_rings(s);
            enter();
            call_void(s, OP_INIT_REPLIED, NULL, 0);
            leave();
        }
        pthread_mutex_lock(&s->lock);
        s->n_idle++;
        pthread_mutex_unlock(&s->lock);
    }

    PyEval_RestoreThread(w->ts);
    PyGILState_Release(gil);
    this_worker = NULL;
    pthread_mutex_lock(&s->lock);
    s->n_running--;
    s->n_idle--;
    if (!s->exiting) { /* a worker ending means the loop ends: tell the others */
        s->exiting = 1;
    }
    pthread_cond_broadcast(&s->ended);
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* Start one more worker (with s->lock not held). */
static int start_worker(Session *s)
{
    struct worker *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return -1;
    w->s = s;
    sigset_t block = blocked_in_workers(), old;
    pthread_mutex_lock(&s->lock);
    if (s->n_workers >= s->max_threads || s->exiting) {
        pthread_mutex_unlock(&s->lock);
        free(w);
        return -1;
    }
    s->n_workers++;
    s->n_running++;
    s->n_idle++;
    w->next = s->workers;
    s->workers = w;
    pthread_sigmask(SIG_BLOCK, &block, &old);
    int rc = pthread_create(&w->tid, NULL, worker_main, w);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        s->workers = w->next;
        s->n_workers--;
        s->n_running--;
        s->n_idle--;
        pthread_mutex_unlock(&s->lock);
        free(w);
        return -1;
    }
    pthread_mutex_unlock(&s->lock);
    return 0;
}

/* With s->lock held: signal every worker blocked reading. */
static void wake_readers(Session *s)
{
    for (struct worker *w = s->workers; w != NULL; w = w->next)
        if (w->reading)
            pthread_kill(w->tid, WAKE_SIGNAL);
}

/* libfuse splices a READ reply only if the whole reply fits in its thread's pipe, which it grows
 * with F_SETPIPE_SZ to the reply's size plus three pages; past /proc/sys/fs/pipe-max-size that
 * needs CAP_SYS_RESOURCE, and without it every reply falls back to a pread into a fresh buffer
 * and a writev (two copies instead of one). Where a pipe cannot grow past the 1 MiB of the
 * largest READ, the largest READ is made to fit: the max_read mount option, in whole pages. */
static unsigned splice_max_read(void)
{
    const long page = sysconf(_SC_PAGESIZE);
    const long largest = 1L << 20; /* FUSE_MAX_MAX_PAGES pages: libfuse's largest request */
    const long slack = 4 * page;   /* libfuse's 3 pages and the reply header, rounded up */
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0)
        return 0;
    long grown = fcntl(p[0], F_SETPIPE_SZ, (int)(largest + slack));
    close(p[0]);
    close(p[1]);
    if (grown >= largest + slack)
        return 0;
    long limit = 0;
    FILE *f = fopen("/proc/sys/fs/pipe-max-size", "re");
    if (f != NULL) {
        if (fscanf(f, "%ld", &limit) != 1)
            limit = 0;
        fclose(f);
    }
    if (limit <= slack + 2 * page)
        return 0; /* too small to be worth it: leave READs whole, copied */
    long max_read = (limit - slack) / page * page;
    return (unsigned)(max_read < largest ? max_read : largest);
}

/* ---- FUSE over io_uring ----------------------------------------------------------------------
 *
 * Why (docs/DESIGN.md, "Round 8"): with /dev/fuse, a request wakes whichever worker has waited
 * longest, on whichever CPU it last ran, and its reply wakes the caller back on its own CPU:
 * two cross-CPU wake-ups per request. Where an idle CPU is expensive to wake (a VM whose idle
 * CPUs halt at once), that is most of what a metadata request costs. With FUSE over io_uring
 * (Linux 6.14+, the fuse module's enable_uring parameter), the kernel queues each request on the
 * queue of the caller's CPU; here each queue is served by threads pinned to that CPU, so the
 * caller, which blocks until the answer, hands its CPU to the thread that answers.
 *
 * Each ring thread has an io_uring of its own and one ring entry: a header buffer and a payload
 * buffer registered with FUSE_IO_URING_CMD_REGISTER for its CPU's queue. A request arrives as a
 * completion with the fuse_in_header in the header's in_out, the opcode's fixed argument in
 * op_in and the rest in the payload buffer. The thread lays them out as /dev/fuse would (the
 * payload buffer has room in front for the headers, so the payload is not copied) and hands
 * them to libfuse, whose reply comes back through the session's custom writev (io_writev):
 * the fuse_out_header goes to in_out and the reply's arguments to the payload buffer. Then
 * FUSE_IO_URING_CMD_COMMIT_AND_FETCH sends the reply and waits for the next request.
 * FORGET and INTERRUPT still come through /dev/fuse (the kernel sends them there), as do
 * notifications from the daemon; the /dev/fuse workers above stay for them. The kernel switches
 * a connection to the rings once every CPU's queue has an entry; until then, or if registering
 * fails, every request comes through /dev/fuse as before. */

#include <linux/io_uring.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>

/* From <linux/fuse.h> 7.42, which Debian 12's headers predate. */
struct ck_fuse_in_header { uint32_t len, opcode; uint64_t unique, nodeid; uint32_t uid, gid, pid;
                           uint16_t total_extlen, padding; };
struct ck_fuse_out_header { uint32_t len; int32_t error; uint64_t unique; };
struct ck_uring_ent_in_out { uint64_t flags, commit_id; uint32_t payload_sz, padding; uint64_t reserved; };
struct ck_uring_req_header { char in_out[128]; char op_in[128]; struct ck_uring_ent_in_out ring_ent_in_out; };
struct ck_uring_cmd_req { uint64_t flags, commit_id; uint16_t qid; uint8_t padding[6]; };
#define CK_URING_CMD_REGISTER 1
#define CK_URING_CMD_COMMIT_AND_FETCH 2
#define RING_HEADROOM 256 /* room in front of the payload for the in header and op_in */

struct ring {
    int fd;
    unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    char *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *sqes_map, *cq_map;
    size_t sq_map_len, sqes_map_len, cq_map_len;
    /* the ring entry */
    struct ck_uring_req_header *hdr;
    char *buf;          /* RING_HEADROOM + payload */
    size_t payload_len;
    uint64_t unique;    /* of the request being served */
    int replied;
};

static void ring_close(struct ring *r)
{
    if (r->sqes_map != NULL && r->sqes_map != MAP_FAILED)
        munmap(r->sqes_map, r->sqes_map_len);
    if (r->cq_map != NULL && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_map_len);
    if (r->sq_map != NULL && r->sq_map != MAP_FAILED)
        munmap(r->sq_map, r->sq_map_len);
    if (r->fd >= 0)
        close(r->fd);
    free(r->hdr);
    free(r->buf);
    memset(r, 0, sizeof(*r));
    r->fd = -1;
}

/* An io_uring with 128-byte SQEs, for the calling thread only. 0 or -errno. */
static int ring_open(struct ring *r, size_t payload_len)
{
    memset(r, 0, sizeof(*r));
    r->fd = -1;
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    p.flags = IORING_SETUP_SQE128 | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    int fd = (int)syscall(__NR_io_uring_setup, 4, &p);
    if (fd < 0 && errno == EINVAL) { /* before Linux 6.1 */
        memset(&p, 0, sizeof(p));
        p.flags = IORING_SETUP_SQE128;
        fd = (int)syscall(__NR_io_uring_setup, 4, &p);
    }
    if (fd < 0)
        return -errno;
    r->fd = fd;
    r->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_map_len > r->sq_map_len)
            r->sq_map_len = r->cq_map_len;
    }
    r->sq_map = mmap(NULL, r->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED)
        goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_map = r->sq_map;
    } else {
        r->cq_map = mmap(NULL, r->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (r->cq_map == MAP_FAILED)
            goto fail;
    }
    r->sqes_map_len = p.sq_entries * 128;
    r->sqes_map = mmap(NULL, r->sqes_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (r->sqes_map == MAP_FAILED)
        goto fail;
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    r->sqes = r->sqes_map;
    r->payload_len = payload_len;
    if (posix_memalign((void **)&r->hdr, 64, sizeof(*r->hdr)) != 0)
        r->hdr = NULL;
    if (posix_memalign((void **)&r->buf, 4096, RING_HEADROOM + payload_len) != 0)
        r->buf = NULL;
    if (r->hdr == NULL || r->buf == NULL) {
        ring_close(r);
        return -ENOMEM;
    }
    memset(r->hdr, 0, sizeof(*r->hdr));
    return 0;
fail:;
    int e = errno;
    ring_close(r);
    return -e;
}

/* Submit one FUSE ring command for queue qid. 0 or -errno. */
static int ring_submit(struct ring *r, int fuse_fd, uint32_t cmd_op, uint64_t commit_id, uint16_t qid)
{
    struct iovec iov[2] = {{r->hdr, sizeof(*r->hdr)}, {r->buf + RING_HEADROOM, r->payload_len}};
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = (struct io_uring_sqe *)(r->sqes + (size_t)idx * 128);
    memset(sqe, 0, 128);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = fuse_fd;
    sqe->cmd_op = cmd_op;
    sqe->addr = (uint64_t)(uintptr_t)iov; /* read by the kernel during io_uring_enter only */
    sqe->len = 2;
    struct ck_uring_cmd_req req = {.commit_id = commit_id, .qid = qid};
    memcpy(sqe->cmd, &req, sizeof(req));
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    for (;;) {
        long n = syscall(__NR_io_uring_enter, r->fd, 1, 0, 0, NULL, 0);
        if (n == 1)
            return 0;
        if (n < 0 && errno == EINTR)
            continue;
        return n < 0 ? -errno : -EIO;
    }
}

/* The next completion's result: wait if block, else -EAGAIN when there is none. -EINTR when
 * a signal came in while waiting. */
static int ring_reap(struct ring *r, int block)
{
    for (;;) {
        unsigned head = *r->cq_head;
        if (head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            int res = r->cqes[head & *r->cq_mask].res;
            __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
            return res;
        }
        /* with DEFER_TASKRUN completions are posted only inside io_uring_enter */
        long n = syscall(__NR_io_uring_enter, r->fd, 0, block ? 1 : 0, IORING_ENTER_GETEVENTS, NULL, 0);
        if (n < 0 && errno == EINTR)
            return -EINTR;
        if (n < 0)
            return -errno;
        if (!block && *r->cq_head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE))
            return -EAGAIN;
    }
}

static __thread struct ring *this_ring;

/* The session's writev: a reply to the request this ring thread serves goes into its ring
 * entry; anything else (replies read from /dev/fuse, notifications) to /dev/fuse. */
static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata)
{
    (void)userdata;
    struct ring *r = this_ring;
    const struct ck_fuse_out_header *out = iov[0].iov_base;
    if (r == NULL || count < 1 || iov[0].iov_len != sizeof(*out) || out->unique == 0 || out->unique != r->unique)
        return writev(fd, iov, count);
    memcpy(r->hdr->in_out, out, sizeof(*out));
    char *payload = r->buf + RING_HEADROOM;
    size_t n = 0;
    for (int i = 1; i < count; i++) {
        if (iov[i].iov_len > r->payload_len - n) {
            errno = EINVAL; /* larger than any reply the kernel accepts */
            return -1;
        }
        memmove(payload + n, iov[i].iov_base, iov[i].iov_len);
        n += iov[i].iov_len;
    }
    r->hdr->ring_ent_in_out.payload_sz = (uint32_t)n;
    r->replied = 1;
    return (ssize_t)(sizeof(*out) + n);
}

static ssize_t io_read(int fd, void *buf, size_t len, void *userdata)
{
    (void)userdata;
    return read(fd, buf, len);
}

/* A READ reply libfuse spliced into a pipe (header, then data): into the ring entry, or on to
 * /dev/fuse. */
static ssize_t io_splice_send(int fdin, off_t *offin, int fdout, off_t *offout, size_t len, unsigned flags,
                              void *userdata)
{
    (void)userdata;
    struct ring *r = this_ring;
    if (r == NULL)
        return splice(fdin, offin, fdout, offout, len, flags);
    struct ck_fuse_out_header out;
    size_t got = 0;
    while (got < sizeof(out)) {
        ssize_t n = read(fdin, (char *)&out + got, sizeof(out) - got);
        if (n <= 0)
            return -1;
        got += (size_t)n;
    }
    size_t data = len - sizeof(out);
    if (out.unique != r->unique || data > r->payload_len) {
        errno = EINVAL;
        return -1;
    }
    char *payload = r->buf + RING_HEADROOM;
    got = 0;
    while (got < data) {
        ssize_t n = read(fdin, payload + got, data - got);
        if (n <= 0)
            return -1;
        got += (size_t)n;
    }
    memcpy(r->hdr->in_out, &out, sizeof(out));
    r->hdr->ring_ent_in_out.payload_sz = (uint32_t)data;
    r->replied = 1;
    return (ssize_t)len;
}

static const struct fuse_custom_io ring_io = {
    .writev = io_writev, .read = io_read, .splice_send = io_splice_send,
};

/* A CPU list file of sysfs ("0-3,8,10-11") into set (CPUs < max); the highest CPU + 1, or 0. */
static int read_cpu_list(const char *file, unsigned char *set, int max)
{
    FILE *f = fopen(file, "re");
    int last = -1, a, b, c;
    if (f == NULL)
        return 0;
    while (fscanf(f, "%d", &a) == 1) {
        b = a;
        c = fgetc(f);
        if (c == '-') {
            if (fscanf(f, "%d", &b) != 1)
                break;
            c = fgetc(f);
        }
        for (int i = a; i <= b && i < max; i++)
            if (i >= 0)
                set[i] = 1;
        if (b > last)
            last = b;
        if (c != ',')
            break;
    }
    fclose(f);
    return last + 1;
}

static void *ring_main(void *arg)
{
    struct worker *w = arg;
    Session *s = w->s;
    sigset_t wake = wake_set();
    struct ring r;
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    CPU_SET(w->qid, &cpus);
    /* Outside the CPUs this process may use (a cpuset), the thread runs anywhere: slower, not
     * wrong. */
    (void)pthread_setaffinity_np(pthread_self(), sizeof(cpus), &cpus);
    int first = -EAGAIN; /* what REGISTER completed with, if it did at once */
    int rc = ring_open(&r, s->ring_payload_len);
    if (rc == 0) {
        rc = ring_submit(&r, s->fd, CK_URING_CMD_REGISTER, 0, (uint16_t)w->qid);
        if (rc == 0) {
            /* A refused REGISTER completes at once; an accepted one when a request comes,
             * which may already be the case. */
            first = ring_reap(&r, 0);
            if (first < 0 && first != -EAGAIN && first != -EINTR)
                rc = first;
        }
    }
    pthread_mutex_lock(&s->lock);
    if (rc != 0 && s->ring_error == 0)
        s->ring_error = -rc;
    w->registered = rc == 0;
    s->rings_pending--;
    pthread_cond_broadcast(&s->ended);
    pthread_mutex_unlock(&s->lock);
    if (rc != 0)
        goto out;

    PyGILState_STATE gil = PyGILState_Ensure();
    w->ts = PyThreadState_Get();
    (void)PyEval_SaveThread();
    this_worker = w;
    this_ring = &r;
    int registering = 1; /* the last command was a REGISTER: its failure ends the thread */
    int died = 0;        /* the errno that ended this thread while the session was serving */
    for (;;) {
        pthread_mutex_lock(&s->lock);
        w->reading = !s->exiting;
        pthread_mutex_unlock(&s->lock);
        if (!w->reading)
            break;
        pthread_sigmask(SIG_UNBLOCK, &wake, NULL);
        int res;
        if (first >= 0) {
            res = first;
            first = -EAGAIN;
        } else {
            res = s->exiting ? -EINTR : ring_reap(&r, 1);
        }
        pthread_sigmask(SIG_BLOCK, &wake, NULL);
        pthread_mutex_lock(&s->lock);
        w->reading = 0;
        pthread_mutex_unlock(&s->lock);
        if (res == -EINTR)
            continue;
        if (res >= 0)
            registering = 0;
        else if (!registering && (res == -ENOENT || res == -EIO || res == -EINVAL)) {
            /* The kernel no longer had the request this commit answered: the entry went with
             * it. Register the buffers again as a new entry. */
            if ((died = -ring_submit(&r, s->fd, CK_URING_CMD_REGISTER, 0, (uint16_t)w->qid)) != 0)
                break;
            registering = 1;
            continue;
        }
        if (res < 0) {
            /* ENOTCONN, ECONNABORTED, ENODEV: unmounted or aborted, the /dev/fuse workers end too */
            if (res != -ENOTCONN && res != -ECONNABORTED && res != -ENODEV)
                died = -res;
            break;
        }
        const struct ck_fuse_in_header *in = (const void *)r.hdr->in_out;
        uint32_t payload_sz = r.hdr->ring_ent_in_out.payload_sz;
        uint64_t commit_id = r.hdr->ring_ent_in_out.commit_id;
        size_t fixed = (size_t)in->len - sizeof(*in) - payload_sz; /* op_in's share of len */
        r.unique = in->unique;
        r.replied = 0;
        uint32_t opcode = in->opcode;
        uint64_t started = now_ns();
        w->gil_ns = 0;
        if (in->len >= sizeof(*in) + payload_sz && fixed <= sizeof(r.hdr->op_in) && payload_sz <= r.payload_len) {
            char *start = r.buf + RING_HEADROOM - sizeof(*in) - fixed;
            memcpy(start, in, sizeof(*in));
            memcpy(start + sizeof(*in), r.hdr->op_in, fixed);
            struct fuse_buf b = {.size = in->len, .mem = start};
            fuse_session_process_buf(s->se, &b);
        }
        if (!r.replied) { /* a malformed request, or none of libfuse's replies went out */
            struct ck_fuse_out_header out = {.len = sizeof(out), .error = -EIO, .unique = r.unique};
            memcpy(r.hdr->in_out, &out, sizeof(out));
            r.hdr->ring_ent_in_out.payload_sz = 0;
        }
        account(s, opcode, now_ns() - started, w->gil_ns);
        __atomic_fetch_add(&s->ring_requests, 1, __ATOMIC_RELAXED);
        if ((died = -ring_submit(&r, s->fd, CK_URING_CMD_COMMIT_AND_FETCH, commit_id, (uint16_t)w->qid)) != 0)
            break;
    }
    if (died != 0)
        session_failed(s, died, "an io_uring queue thread ended");
    this_ring = NULL;
    this_worker = NULL;
    PyEval_RestoreThread(w->ts);
    PyGILState_Release(gil);
out:
    ring_close(&r);
    pthread_mutex_lock(&s->lock);
    s->n_rings_running--;
    pthread_cond_broadcast(&s->ended);
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* After INIT's reply: ring_entries ring threads for each online CPU's queue (one for a CPU that
 * is possible but offline: the kernel wants every queue served before it uses any), and wait
 * until each has registered its entry (or failed). Sets s->ring_active: every queue has one. */
#define MAX_CPUS 4096
static void start_rings(Session *s)
{
    unsigned char *possible = calloc(2, MAX_CPUS), *online = possible + MAX_CPUS;
    if (possible == NULL) {
        s->ring_error = ENOMEM;
        return;
    }
    int ncpu = read_cpu_list("/sys/devices/system/cpu/possible", possible, MAX_CPUS);
    read_cpu_list("/sys/devices/system/cpu/online", online, MAX_CPUS);
    if (ncpu <= 0 || ncpu > MAX_CPUS) {
        free(possible);
        s->ring_error = ENOTSUP;
        return;
    }
    /* the kernel's largest payload: max_write, max_pages pages (libfuse asks for up to 1 MiB) */
    s->ring_payload_len = (size_t)(1 << 20) + (size_t)sysconf(_SC_PAGESIZE);
    sigset_t block = blocked_in_workers(), old;
    pthread_mutex_lock(&s->lock);
    for (int q = 0; q < ncpu && s->ring_error == 0; q++) {
        int threads = online[q] ? s->ring_entries : 1;
        for (int k = 0; k < threads; k++) {
            struct worker *w = calloc(1, sizeof(*w));
            if (w == NULL) {
                s->ring_error = ENOMEM;
                break;
            }
            w->s = s;
            w->qid = q;
            pthread_sigmask(SIG_BLOCK, &block, &old);
            int rc = pthread_create(&w->tid, NULL, ring_main, w);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            if (rc != 0) {
                free(w);
                s->ring_error = rc;
                break;
            }
            w->next = s->rings;
            s->rings = w;
            s->rings_pending++;
            s->n_rings_running++;
        }
    }
    while (s->rings_pending > 0)
        pthread_cond_wait(&s->ended, &s->lock);
    /* The kernel switches to the queues once each has an entry, even if some threads failed. */
    int served = 0;
    for (int q = 0; q < ncpu; q++) {
        int has = 0;
        for (struct worker *w = s->rings; w != NULL && !has; w = w->next)
            has = w->qid == q && w->registered;
        served += has;
    }
    s->ring_active = served == ncpu;
    pthread_mutex_unlock(&s->lock);
    free(possible);
}

/* With s->lock held: signal every ring thread waiting for a request. */
static void wake_rings(Session *s)
{
    for (struct worker *w = s->rings; w != NULL; w = w->next)
        if (w->reading)
            pthread_kill(w->tid, WAKE_SIGNAL);
}

/* ---- the Session type ----------------------------------------------------------------------- */

static char *session_kwlist[] = {"ops", "mountpoint", "options", "passthrough", "writeback_cache",
                                 "atomic_o_trunc", "direct_io_mmap", "export_support", "max_threads",
                                 "max_backing_stack_depth", "user_xattrs_only", "splice_write", "io_uring",
                                 "ring_threads_per_cpu", NULL};

static int Session_init(Session *self, PyObject *args, PyObject *kwds)
{
    PyObject *ops, *options;
    const char *mountpoint;
    int passthrough = 0, writeback = 1, atomic = 1, dio_mmap = 0, export_support = 1, max_threads = 64;
    int user_xattrs_only = 0, splice_write = 0, io_uring = 0, ring_entries = 8;
    unsigned int depth = 1;
    if (self->se != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "session already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OsO|$pppppiIpppi", session_kwlist, &ops, &mountpoint, &options,
                                     &passthrough, &writeback, &atomic, &dio_mmap, &export_support,
                                     &max_threads, &depth, &user_xattrs_only, &splice_write, &io_uring,
                                     &ring_entries))
        return -1;
    if (ring_entries < 1 || ring_entries > 64) {
        PyErr_SetString(PyExc_ValueError, "ring_threads_per_cpu must be 1..64");
        return -1;
    }
    if (max_threads < 1) {
        PyErr_SetString(PyExc_ValueError, "max_threads must be at least 1");
        return -1;
    }
    for (int i = 0; i < N_OPS; i++) {
        /* an op the object lacks is answered ENOSYS */
        self->methods[i] = PyObject_GetAttrString(ops, op_names[i]);
        if (self->methods[i] == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
        }
    }
    self->ops = Py_NewRef(ops);
    self->interp = PyThreadState_GetInterpreter(PyThreadState_Get());
    self->want_passthrough = passthrough;
    self->want_writeback = writeback;
    self->want_atomic_o_trunc = atomic;
    self->want_dio_mmap = dio_mmap;
    self->want_export = export_support;
    self->max_threads = max_threads;
    self->max_backing_stack_depth = depth;
    self->user_xattrs_only = user_xattrs_only;
    self->want_splice_write = splice_write;
    self->want_ring = io_uring; /* asked for where the kernel offers it (gateway/mount.py) */
    self->ring_entries = ring_entries;

    PyObject *seq = PySequence_Fast(options, "options must be a sequence of str");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    self->splice_max_read = splice_write ? splice_max_read() : 0;
    char **argv = calloc((size_t)(2 * n + 4), sizeof(char *));
    if (argv == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    int argc = 0;
    argv[argc++] = strdup("ckptfs");
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *opt = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
        if (opt == NULL) {
            for (int j = 0; j < argc; j++)
                free(argv[j]);
            free(argv);
            Py_DECREF(seq);
            return -1;
        }
        argv[argc++] = strdup("-o");
        argv[argc++] = strdup(opt);
    }
    Py_DECREF(seq);
    if (self->splice_max_read) {
        char opt[32];
        snprintf(opt, sizeof(opt), "max_read=%u", self->splice_max_read);
        argv[argc++] = strdup("-o");
        argv[argc++] = strdup(opt);
    }
    struct fuse_args fargs = FUSE_ARGS_INIT(argc, argv);
    struct fuse_session *se = fuse_session_new(&fargs, &ll_ops, sizeof(ll_ops), self);
    fuse_opt_free_args(&fargs);
    for (int j = 0; j < argc; j++)
        free(argv[j]);
    free(argv);
    if (se == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fuse_session_new() failed (see the log for the option it refused)");
        return -1;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fuse_session_mount(se, mountpoint);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        fuse_session_destroy(se);
        PyErr_Format(PyExc_RuntimeError, "fuse_session_mount(%s) failed", mountpoint);
        return -1;
    }
    self->se = se;
    self->mounted = 1;
    self->fd = fuse_session_fd(se);
    /* Replies to requests taken from a ring go back through it (io_writev); INIT, which
     * decides whether splice is used, has not come yet. */
    if (self->want_ring && fuse_session_custom_io(se, &ring_io, sizeof(ring_io), self->fd) != 0)
        self->want_ring = 0;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->ended, NULL);
    pthread_mutex_init(&self->dir_attrs_lock, NULL);
    pthread_mutex_init(&self->forget_lock, NULL);

    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_wake_signal; /* no SA_RESTART: a read(2) it hits returns EINTR */
    sigemptyset(&sa.sa_mask);
    sigaction(WAKE_SIGNAL, &sa, NULL);
    return 0;
}

/* With s->lock held: wait until a thread ends, or ms milliseconds. */
static void wait_ended(Session *s, long ms)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += ms * 1000 * 1000;
    if (until.tv_nsec >= 1000000000) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&s->ended, &s->lock, &until);
}

static PyObject *Session_run(Session *self, PyObject *unused)
{
    (void)unused;
    if (self->se == NULL || self->running) {
        PyErr_SetString(PyExc_RuntimeError, "the session is closed or already running");
        return NULL;
    }
    if (self->exiting) {
        /* exit() came first (a SIGTERM while the mount was being set up): nothing to serve */
        self->exiting = 0;
        fuse_session_reset(self->se);
        Py_RETURN_NONE;
    }
    self->running = 1;
    self->error = 0;
    self->error_what = NULL;
    PyObject *signalled = NULL; /* what a Python signal handler raised (main thread only) */
    int started;
    Py_BEGIN_ALLOW_THREADS
    started = start_worker(self) == 0;
    if (started) {
        pthread_mutex_lock(&self->lock);
        while (self->n_running > 0) {
            /* A wake signal can slip in between a worker's check and its read(2): repeat it
             * while exiting. Otherwise wake up now and then for Python's signal handlers,
             * which only run when the main thread runs Python (run() may be called there). */
            if (self->exiting) {
                wake_readers(self);
                wake_rings(self);
            }
            wait_ended(self, self->exiting ? 50 : 200);
            if (!self->exiting && self->n_running > 0 && signalled == NULL) {
                pthread_mutex_unlock(&self->lock); /* (exit() takes the GIL, then the lock) */
                Py_BLOCK_THREADS
                if (__atomic_load_n(&self->n_forgets, __ATOMIC_RELAXED) != 0)
                    flush_forgets(self);
                if (PyErr_CheckSignals() < 0) {
                    PyObject *type, *tb;
                    PyErr_Fetch(&type, &signalled, &tb);
                    PyErr_NormalizeException(&type, &signalled, &tb);
                    if (signalled != NULL && tb != NULL)
                        PyException_SetTraceback(signalled, tb);
                    Py_XDECREF(type);
                    Py_XDECREF(tb);
                    if (signalled == NULL)
                        signalled = Py_NewRef(PyExc_RuntimeError);
                }
                Py_UNBLOCK_THREADS
                pthread_mutex_lock(&self->lock);
                if (signalled != NULL) { /* e.g. KeyboardInterrupt: end, then raise it */
                    self->exiting = 1;
                    fuse_session_exit(self->se);
                }
            }
        }
        pthread_mutex_unlock(&self->lock);
    } else {
        self->error = EAGAIN;
    }
    for (struct worker *w = self->workers; w != NULL; w = w->next)
        pthread_join(w->tid, NULL);
    /* The ring threads end when the connection does (their commands complete with ENOTCONN),
     * or, after exit(), at the wake signal. */
    pthread_mutex_lock(&self->lock);
    self->exiting = 1;
    while (self->n_rings_running > 0) {
        wake_rings(self);
        wait_ended(self, 50);
    }
    pthread_mutex_unlock(&self->lock);
    while (self->rings != NULL) {
        struct worker *w = self->rings;
        self->rings = w->next;
        pthread_join(w->tid, NULL);
        free(w->wcopy);
        free(w);
    }
    while (self->workers != NULL) {
        struct worker *w = self->workers;
        self->workers = w->next;
        free(w->buf.mem);
        free(w->wcopy);
        free(w);
    }
    self->n_workers = self->n_idle = 0;
    Py_END_ALLOW_THREADS
    flush_forgets(self); /* what came last (the core's release_all and recovery see the rest) */
    self->running = 0;
    int error = self->error;
    self->exiting = 0;
    fuse_session_reset(self->se);
    if (signalled != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(signalled), signalled);
        Py_DECREF(signalled);
        return NULL;
    }
    if (error != 0) {
        errno = error;
        if (self->error_what != NULL)
            return PyErr_SetFromErrnoWithFilename(PyExc_OSError, self->error_what);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *Session_exit(Session *self, PyObject *unused)
{
    (void)unused;
    if (self->se == NULL)
        Py_RETURN_NONE;
    pthread_mutex_lock(&self->lock);
    session_end_locked(self);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *Session_unmount(Session *self, PyObject *unused)
{
    (void)unused;
    if (self->se != NULL && self->mounted) {
        Py_BEGIN_ALLOW_THREADS
        fuse_session_unmount(self->se);
        Py_END_ALLOW_THREADS
        self->mounted = 0;
    }
    Py_RETURN_NONE;
}

static void session_free(Session *self)
{
    if (self->se != NULL && !self->running) {
        if (self->mounted)
            fuse_session_unmount(self->se);
        fuse_session_destroy(self->se);
        self->se = NULL;
        pthread_mutex_destroy(&self->lock);
        pthread_cond_destroy(&self->ended);
        for (int b = 0; b < DIR_ATTRS_BUCKETS; b++)
            while (self->dir_attrs[b] != NULL)
                dir_attrs_drop(self, &self->dir_attrs[b]);
        pthread_mutex_destroy(&self->dir_attrs_lock);
        pthread_mutex_destroy(&self->forget_lock);
        free(self->forgets);
        self->forgets = NULL;
    }
}

static PyObject *Session_destroy(Session *self, PyObject *unused)
{
    (void)unused;
    if (self->se == NULL)
        Py_RETURN_NONE;
    if (self->running) {
        /* run() is still returning in another thread (its caller was cancelled): end it and
         * wait; run() needs the GIL to finish, so wait without it. */
        Session_exit(self, NULL);
        Py_DECREF(Py_None);
        while (self->running) {
            Py_BEGIN_ALLOW_THREADS
            usleep(10000);
            Py_END_ALLOW_THREADS
        }
    }
    Py_BEGIN_ALLOW_THREADS
    session_free(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The ops object usually points back at the session (the gateway's on_init closure): the
 * garbage collector must see these references to free such a cycle. */
static int Session_traverse(Session *self, visitproc visit, void *arg)
{
    for (int i = 0; i < N_OPS; i++)
        Py_VISIT(self->methods[i]);
    Py_VISIT(self->ops);
    return 0;
}

static int Session_clear(Session *self)
{
    for (int i = 0; i < N_OPS; i++)
        Py_CLEAR(self->methods[i]);
    Py_CLEAR(self->ops);
    return 0;
}

static void Session_dealloc(Session *self)
{
    PyObject_GC_UnTrack(self);
    session_free(self);
    Session_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Session_get_fd(Session *self, void *c) { (void)c; return PyLong_FromLong(self->se ? self->fd : -1); }
static PyObject *Session_get_pt(Session *self, void *c) { (void)c; return PyBool_FromLong(self->passthrough_granted); }
static PyObject *Session_get_wb(Session *self, void *c) { (void)c; return PyBool_FromLong(self->writeback_granted); }
static PyObject *Session_get_dm(Session *self, void *c) { (void)c; return PyBool_FromLong(self->dio_mmap_granted); }
static PyObject *Session_get_mr(Session *self, void *c) { (void)c; return PyLong_FromUnsignedLong(self->splice_max_read); }
static PyObject *Session_get_ring(Session *self, void *c) { (void)c; return PyBool_FromLong(self->ring_active); }
static PyObject *Session_get_ring_error(Session *self, void *c) { (void)c; return PyLong_FromLong(self->ring_error); }
static PyObject *Session_get_ring_requests(Session *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&self->ring_requests, __ATOMIC_RELAXED));
}
static PyObject *Session_get_dir_attr_hits(Session *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&self->dir_attrs_hits, __ATOMIC_RELAXED));
}
static PyObject *Session_get_threads(Session *self, void *c)
{
    (void)c;
    pthread_mutex_lock(&self->lock);
    int n = self->n_workers;
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLong(n);
}

/* {op: (count, seconds, (per-bucket counts, the last above every bound), seconds waiting for
 * the GIL)} for the requests served so far; the bounds are BUCKET_BOUNDS. */
static PyObject *Session_request_stats(Session *self, PyObject *unused)
{
    (void)unused;
    struct op_stat sum[N_OPCODES];
    memset(sum, 0, sizeof(sum));
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    for (int op = 0; op < N_OPCODES; op++) {
        struct op_stat *st = &self->stats[op];
        uint64_t count = __atomic_load_n(&st->count, __ATOMIC_RELAXED);
        if (count == 0)
            continue;
        const char *name = opcode_names[op] ? opcode_names[op] : "other";
        /* opcodes that share a name (forget, readdir, rename) are added up */
        int first = op;
        for (int o = 0; o < op; o++)
            if (opcode_names[o] && opcode_names[op] && strcmp(opcode_names[o], name) == 0) {
                first = o;
                break;
            }
        sum[first].count += count;
        sum[first].ns += __atomic_load_n(&st->ns, __ATOMIC_RELAXED);
        sum[first].gil_ns += __atomic_load_n(&st->gil_ns, __ATOMIC_RELAXED);
        for (int b = 0; b <= N_BUCKETS; b++)
            sum[first].buckets[b] += __atomic_load_n(&st->buckets[b], __ATOMIC_RELAXED);
    }
    for (int op = 0; op < N_OPCODES; op++) {
        if (sum[op].count == 0)
            continue;
        PyObject *buckets = PyTuple_New(N_BUCKETS + 1);
        if (buckets == NULL)
            goto fail;
        for (int b = 0; b <= N_BUCKETS; b++)
            PyTuple_SET_ITEM(buckets, b, PyLong_FromUnsignedLongLong(sum[op].buckets[b]));
        PyObject *v = Py_BuildValue("(KdNd)", (unsigned long long)sum[op].count, (double)sum[op].ns / 1e9, buckets,
                                    (double)sum[op].gil_ns / 1e9);
        if (v == NULL || PyDict_SetItemString(out, opcode_names[op] ? opcode_names[op] : "other", v) < 0) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef Session_methods[] = {
    {"request_stats", (PyCFunction)Session_request_stats, METH_NOARGS,
     "{op: (count, seconds, bucket counts)} of the requests served so far."},
    {"run", (PyCFunction)Session_run, METH_NOARGS, "Serve requests until unmounted or exit()."},
    {"exit", (PyCFunction)Session_exit, METH_NOARGS, "Make run() return (from any thread)."},
    {"unmount", (PyCFunction)Session_unmount, METH_NOARGS, "Unmount (lazily, as libfuse does)."},
    {"destroy", (PyCFunction)Session_destroy, METH_NOARGS, "Unmount if mounted and free the session."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Session_getset[] = {
    {"fd", (getter)Session_get_fd, NULL, "the /dev/fuse file descriptor", NULL},
    {"passthrough_granted", (getter)Session_get_pt, NULL, "INIT negotiated FUSE passthrough", NULL},
    {"writeback_cache_granted", (getter)Session_get_wb, NULL, "INIT negotiated the writeback cache", NULL},
    {"direct_io_mmap_granted", (getter)Session_get_dm, NULL, "INIT negotiated FUSE_DIRECT_IO_ALLOW_MMAP", NULL},
    {"splice_max_read", (getter)Session_get_mr, NULL, "0, or the max_read mount option that keeps each READ reply within one pipe (see splice_max_read)", NULL},
    {"threads", (getter)Session_get_threads, NULL, "worker threads started", NULL},
    {"io_uring_active", (getter)Session_get_ring, NULL, "requests come through io_uring rings (set once INIT was replied)", NULL},
    {"io_uring_error", (getter)Session_get_ring_error, NULL, "0, or the errno that kept the rings from being set up", NULL},
    {"io_uring_requests", (getter)Session_get_ring_requests, NULL, "requests served from the io_uring queues", NULL},
    {"dir_attr_hits", (getter)Session_get_dir_attr_hits, NULL, "GETATTRs answered from a directory's attributes kept after a change", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SessionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ckptfs_fuse.Session",
    .tp_basicsize = sizeof(Session),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Session_traverse,
    .tp_clear = (inquiry)Session_clear,
    .tp_doc = "A mounted FUSE session served by a pool of threads calling a Python ops object.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Session_init,
    .tp_dealloc = (destructor)Session_dealloc,
    .tp_methods = Session_methods,
    .tp_getset = Session_getset,
};

static PyMethodDef module_methods[] = {
    {"remember_dir_attrs", (PyCFunction)remember_dir_attrs, METH_O,
     "From within a request that changes a directory: its entry as the change left it, for the "
     "GETATTR that follows (answered without Python). True if kept."},
    {"forget_dir_attrs", (PyCFunction)forget_dir_attrs, METH_NOARGS,
     "From within a request: drop every directory's attributes kept (a directory was moved or removed)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ckptfs_fuse",
    "The ckptfs gateway's FUSE front end over libfuse's low-level API (native/ckptfs_fuse.c).",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_ckptfs_fuse(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyType_Ready(&SessionType) < 0 || PyType_Ready(&WriteDataType) < 0)
        return NULL;
    PyModule_AddObjectRef(m, "Session", (PyObject *)&SessionType);
    /* class FuseError(Exception) with an ``errno`` attribute, defined in Python for brevity */
    PyObject *ns = PyDict_New();
    if (ns == NULL)
        return NULL;
    PyDict_SetItemString(ns, "__builtins__", PyEval_GetBuiltins());
    PyObject *modname = PyUnicode_FromString("ckptfs_fuse");
    PyDict_SetItemString(ns, "__name__", modname);
    Py_XDECREF(modname);
    PyObject *res = PyRun_String(
        "import os as _os\n"
        "class FuseError(Exception):\n"
        "    \"\"\"Answer a FUSE request with an errno: raise FuseError(errno.ENOENT).\"\"\"\n"
        "    def __init__(self, errno):\n"
        "        super().__init__(errno)\n"
        "        self.errno = errno\n"
        "    def __str__(self):\n"
        "        return f'[Errno {self.errno}] {_os.strerror(self.errno)}'\n",
        Py_file_input, ns, ns);
    if (res == NULL) {
        Py_DECREF(ns);
        return NULL;
    }
    Py_DECREF(res);
    FuseError = PyDict_GetItemString(ns, "FuseError");
    Py_XINCREF(FuseError);
    Py_DECREF(ns);
    if (FuseError == NULL)
        return NULL;
    PyModule_AddObjectRef(m, "FuseError", FuseError);
    PyModule_AddStringConstant(m, "LIBFUSE_VERSION", fuse_pkgversion());
    PyModule_AddIntConstant(m, "HAVE_PASSTHROUGH", 1);
    PyModule_AddIntConstant(m, "ROOT_INODE", FUSE_ROOT_ID);
    PyModule_AddIntConstant(m, "OPEN_KEEP_CACHE", OPEN_KEEP_CACHE);
    PyModule_AddIntConstant(m, "OPEN_DIRECT_IO", OPEN_DIRECT_IO);
    PyModule_AddIntConstant(m, "OPEN_NOFLUSH", OPEN_NOFLUSH);
    PyObject *bounds = PyTuple_New(N_BUCKETS);
    for (int b = 0; bounds != NULL && b < N_BUCKETS; b++)
        PyTuple_SET_ITEM(bounds, b, PyFloat_FromDouble(bucket_bounds[b]));
    if (bounds == NULL || PyModule_AddObject(m, "BUCKET_BOUNDS", bounds) < 0)
        return NULL;
    return m;
}
