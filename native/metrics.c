/*
 * metrics.c: every request counted and timed by opcode, from the moment a thread read it until
 * its reply was sent, with the time spent waiting for the GIL apart (gateway/metrics.py exports
 * them as ckptfs_fuse_requests_total, ckptfs_fuse_request_duration_seconds and
 * ckptfs_fuse_interpreter_wait_seconds_total).
 *
 * Owns: the opcode names (the Prometheus label), the histogram's bounds, the counters' reading.
 * Must never: take a lock or the GIL on a request's path (the counters are atomics).
 */
#include "frontend.h"

/* Names as the Prometheus label; opcodes without a name count as "other". */
const char *const opcode_names[N_OPCODES] = {
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

const double bucket_bounds[N_BUCKETS] = {0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5,
                                                1, 5, 30, 300};

void account(Session *s, uint32_t opcode, uint64_t ns, uint64_t gil_ns)
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

/* {op: (count, seconds, (per-bucket counts, the last above every bound), seconds waiting for
 * the GIL)} for the requests served so far; the bounds are BUCKET_BOUNDS. */
PyObject *Session_request_stats(Session *self, PyObject *unused)
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
