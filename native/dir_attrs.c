/*
 * dir_attrs.c: a directory's attributes as the request that changed it left them, answered to
 * the GETATTR that follows without Python (filesystem semantics in C: the one place they are).
 *
 * Owns: the table of kept attributes and its coherence rules (below); the interface is
 * dir_attrs_begin/end around each request that changes a directory, dir_attrs_get for GETATTR,
 * dir_attrs_clear, and remember_dir_attrs/forget_dir_attrs for Python.
 * Must never: make up attributes (it only repeats what Python said), answer for longer than
 * the attribute timeout Python gave, or answer while a request may be changing the directory.
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
#include "frontend.h"

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
#define DIR_ATTRS_MAX 4096

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
void dir_attrs_begin(Session *s, uint64_t ino)
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
void dir_attrs_end(Session *s)
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
int dir_attrs_get(Session *s, uint64_t ino, struct stat *st, double *timeout)
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
PyObject *remember_dir_attrs(PyObject *module, PyObject *entry)
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
void dir_attrs_clear(Session *s)
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
PyObject *forget_dir_attrs(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    if (this_worker != NULL)
        dir_attrs_clear(this_worker->s);
    Py_RETURN_NONE;
}


/* Free everything kept (the session is being freed: no request runs). */
void dir_attrs_free(Session *s)
{
    for (int b = 0; b < DIR_ATTRS_BUCKETS; b++)
        while (s->dir_attrs[b] != NULL)
            dir_attrs_drop(s, &s->dir_attrs[b]);
}
