/*
 * handlers.c: one libfuse low-level handler per FUSE request.
 *
 * Owns: decoding each request's arguments into a call of one ops method (pycall.c), turning
 * its result into the reply (entries, attributes, bytes, a file range to splice, handles), what
 * a reply that does not reach the kernel leaves behind (handles released, lookup references
 * handed back), the two requests answered without Python (GETATTR of a directory kept by
 * dir_attrs.c, getxattr outside user.* with user_xattrs_only), and the memory of WRITE data
 * while Python may hold it (WriteData).
 * Must never: hold the GIL while a reply is sent or while waiting on a lock other than the
 * GIL, give Python a view of memory that can be reused while the view lives, or decide what
 * a request means: every answer except those two comes from Python.
 */
#include "frontend.h"

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

PyTypeObject WriteDataType = {
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

const struct fuse_lowlevel_ops ll_ops = {
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

