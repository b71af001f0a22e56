/*
 * pycall.c: calling Python from a request's thread.
 *
 * Owns: the call of one ops method with the GIL held (a method the object lacks is ENOSYS),
 * the mapping of what it raised to an errno (FuseError, or ops.unexpected and EIO), the
 * conversion of its replies' tuples (entries, open replies) into libfuse's structures, and the
 * queue of FORGETs handed to ops.forget late.
 * Must never: decide what a reply means (that is Python's), keep a reference to a Python
 * object past the call that made it, or be called without the thread's Python thread state.
 */
#include "frontend.h"

PyObject *FuseError; /* ckptfs_fuse.FuseError, created at import */

const char *const op_names[N_OPS] = {
    "init", "init_replied", "lookup", "forget", "getattr", "setattr", "readlink",
    "mknod", "mkdir", "unlink", "rmdir", "symlink", "rename", "link", "open", "read",
    "write", "flush", "release", "fsync", "opendir", "readdir", "readdir_taken",
    "releasedir", "fsyncdir", "statfs", "setxattr", "getxattr", "listxattr",
    "removexattr", "create", "unexpected",
};

/* Report the pending exception: FuseError gives its errno; anything else goes to
 * ops.unexpected(opname, exc) and is EIO. Called with the GIL held; clears the exception. */
int take_error(Session *s, enum op op)
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
PyObject *call(Session *s, enum op op, PyObject **args, size_t nargs)
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
int call_void(Session *s, enum op op, PyObject **args, size_t nargs)
{
    PyObject *r = call(s, op, args, nargs);
    if (r == NULL)
        return take_error(s, op);
    Py_DECREF(r);
    return 0;
}

int item_u64(PyObject *t, Py_ssize_t i, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, i));
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

int item_i64(PyObject *t, Py_ssize_t i, int64_t *out)
{
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

int item_double(PyObject *t, Py_ssize_t i, double *out)
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
int entry_from(PyObject *t, struct fuse_entry_param *e)
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

/* (fh, backing_id, flags) into a fuse_file_info */
int open_from(PyObject *t, struct fuse_file_info *fi)
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

PyObject *ctx_args(fuse_req_t req, PyObject **args)
{
    const struct fuse_ctx *ctx = fuse_req_ctx(req);
    args[0] = u64(ctx->uid);
    args[1] = u64(ctx->gid);
    args[2] = u64(ctx->umask);
    args[3] = i64(ctx->pid);
    return args[0];
}


/* FORGET and BATCH_FORGET: nobody waits for them, and each would take the GIL in a thread of its
 * own beside the request that follows (an unlink's FORGET comes with the next unlink). They are
 * queued here and handed to ops.forget by the next thread that takes the GIL for a request
 * (enter), or by run()'s own loop within 200 ms. Handing them over late only keeps an inode
 * longer: a later LOOKUP of it adds its reference before the late FORGET takes the old ones. */
void queue_forgets(Session *s, const struct forget_item *items, size_t n)
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
void forget_unanswered(Session *s, const uint64_t *inos, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct forget_item item = {inos[i], 1};
        if (inos[i] != 0)
            queue_forgets(s, &item, 1);
    }
}

/* With the GIL held: ops.forget(the queued FORGETs). */
void flush_forgets(Session *s)
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

