/*
 * io_uring.c: FUSE over io_uring, the requests of each CPU taken from a queue of its own.
 *
 * Owns: the ring threads (pinned, one io_uring and one ring entry each), laying a request out
 * as /dev/fuse would for libfuse, the session's custom I/O that puts a reply to the request
 * being served into the ring entry, and ending the session when a ring thread fails.
 * Must never: serve a request other than through libfuse's dispatch (handlers.c), let a
 * handler see the entry's payload buffer past its request (the kernel refills it: handlers.c
 * copies WRITE data), or end silently while the session serves: the kernel would keep queuing
 * requests to an entry nobody answers.
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
 * notifications from the daemon; the /dev/fuse workers (session.c) stay for them. The kernel switches
 * a connection to the rings once every CPU's queue has an entry; until then, or if registering
 * fails, every request comes through /dev/fuse as before. */
#include "frontend.h"

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
void start_rings(Session *s)
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
void wake_rings(Session *s)
{
    for (struct worker *w = s->rings; w != NULL; w = w->next)
        if (w->reading)
            pthread_kill(w->tid, WAKE_SIGNAL);
}


/* Replies to requests taken from a ring go back through it (io_writev): the session's custom
 * I/O, set before INIT comes. 0 or -errno. */
int rings_take_replies(Session *s)
{
    return fuse_session_custom_io(s->se, &ring_io, sizeof(ring_io), s->fd);
}
