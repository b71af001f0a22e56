/*
 * session.c: the ckptfs_fuse module, its Session type and the /dev/fuse thread pool.
 *
 * Python side:
 *   Session(ops, mountpoint, options, *, passthrough, writeback_cache, atomic_o_trunc,
 *           direct_io_mmap, export_support, max_threads, max_backing_stack_depth,
 *           user_xattrs_only, splice_write, io_uring, ring_threads_per_cpu)
 *       fuse_session_new + fuse_session_mount. ``options`` are "-o" strings.
 *   .run()     serve requests until the file system is unmounted or .exit() is called; the
 *              calling thread waits without the GIL. Returns after every thread has ended;
 *              raises OSError if a thread the session needs failed.
 *   .exit()    ask run() to return (wakes the workers blocked reading /dev/fuse); before
 *              run(), run() then returns at once.
 *   .unmount(), .destroy(), .fd, .request_stats(), and the attributes INIT set.
 *   FuseError(errno): what an ops method raises to answer an errno.
 *   remember_dir_attrs(entry), forget_dir_attrs(): see dir_attrs.c.
 *
 * Threads: a worker blocks in read(2) on /dev/fuse; when it takes a request and no other worker
 * is idle, it starts another, up to max_threads (requests may block for long: a fetch, room in
 * the cache). Each worker keeps one Python thread state for its life. To end, .exit() sets a
 * flag and signals the idle workers with WAKE_SIGNAL, which they block except while reading,
 * so a signal never interrupts a request's work.
 *
 * Owns: the Session's life (mount, serve, unmount, free; the garbage collector sees its
 * references to ops), the workers, and ending: a thread that fails ends the session visibly.
 * Must never: serve a request itself (handlers.c does), call Python from a worker outside a
 * request, or keep state of a session anywhere but in the Session.
 */
#include "frontend.h"

__thread struct worker *this_worker;

/* ---- the worker pool ------------------------------------------------------------------------ */

static void wake_readers(Session *s);

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
void session_failed(Session *s, int err, const char *what)
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

sigset_t wake_set(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, WAKE_SIGNAL);
    return set;
}

/* The signals a front-end thread starts with blocked: those the Python main thread handles never
 * come to it, and the wake signal only while it waits for a request (see worker_main). */
sigset_t blocked_in_workers(void)
{
    sigset_t set = wake_set();
    int handled_in_python[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGCHLD, SIGUSR1, SIGUSR2};
    for (size_t i = 0; i < sizeof(handled_in_python) / sizeof(handled_in_python[0]); i++)
        sigaddset(&set, handled_in_python[i]);
    return set;
}

static int start_worker(Session *s);

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
    if (self->want_ring && rings_take_replies(self) != 0)
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
        dir_attrs_free(self);
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
    "The ckptfs gateway's FUSE front end over libfuse's low-level API (native/).",
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

