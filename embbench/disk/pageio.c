/* Many page reads (or writes) in one call, kept in flight together (embbench/disk/reader.py).
 *
 * pageio_threads: a pool of `threads` POSIX threads, each taking the next page from a shared
 * counter and doing one pread/pwrite, so up to `threads` requests are in the drive's queue.
 * pageio_uring: one thread keeping up to `depth` requests in an io_uring (raw system calls, no
 * liburing), built only where the kernel headers have io_uring (pageio_uring_check says
 * whether this process may use one).
 *
 * Both return 0, an errno, or -1 for a short transfer (end of file); `*fail_index` is then the
 * lowest failed index in `pages` and `*fail_done` the bytes that page did get. They keep no
 * state between calls, so several threads may call them at once.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct failure {
    pthread_mutex_t lock;
    int code;
    int64_t index;
    int64_t done;
};

static void fail(struct failure *f, int code, int64_t index, int64_t done)
{
    pthread_mutex_lock(&f->lock);
    if (f->code == 0 || index < f->index) {
        f->code = code;
        f->index = index;
        f->done = done;
    }
    pthread_mutex_unlock(&f->lock);
}

struct job {
    int fd;
    int is_write;
    const int64_t *pages;
    int64_t count;
    uint8_t *buf;
    int64_t page_size;
    int64_t next; /* the next index to take (atomic) */
    struct failure failure;
};

/* One whole page, resuming after partial transfers and signals. */
static void transfer_one(struct job *job, int64_t i)
{
    uint8_t *buf = job->buf + i * job->page_size;
    off_t offset = (off_t)job->pages[i] * job->page_size;
    int64_t done = 0;
    while (done < job->page_size) {
        ssize_t n = job->is_write ? pwrite(job->fd, buf + done, job->page_size - done, offset + done)
                                  : pread(job->fd, buf + done, job->page_size - done, offset + done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            fail(&job->failure, n < 0 ? errno : -1, i, done);
            return;
        }
        done += n;
    }
}

static void *worker(void *arg)
{
    struct job *job = arg;
    for (;;) {
        int64_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->count || __atomic_load_n(&job->failure.code, __ATOMIC_RELAXED) != 0)
            return NULL;
        transfer_one(job, i);
    }
}

static int finish(struct failure *f, int64_t *fail_index, int64_t *fail_done)
{
    pthread_mutex_destroy(&f->lock);
    *fail_index = f->index;
    *fail_done = f->done;
    return f->code;
}

int pageio_threads(int fd, int is_write, const int64_t *pages, int64_t count, uint8_t *buf,
                   int64_t page_size, int threads, int64_t *fail_index, int64_t *fail_done)
{
    struct job job = {fd, is_write, pages, count, buf, page_size, 0, {PTHREAD_MUTEX_INITIALIZER, 0, -1, 0}};
    if (threads > count)
        threads = (int)count;
    if (threads < 1)
        threads = 1;
    pthread_t *helpers = calloc(threads, sizeof(pthread_t));
    if (helpers == NULL)
        return ENOMEM;
    /* The calling thread is one of the workers: no thread is started for one request in flight. */
    int started = 0;
    for (; started < threads - 1; started++)
        if (pthread_create(&helpers[started], NULL, worker, &job) != 0)
            break; /* fewer threads in flight, same result */
    worker(&job);
    for (int t = 0; t < started; t++)
        pthread_join(helpers[t], NULL);
    free(helpers);
    return finish(&job.failure, fail_index, fail_done);
}

#if defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#define PAGEIO_HAS_URING 1
#endif
#endif

#ifdef PAGEIO_HAS_URING
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>

struct ring {
    int fd;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len;
    struct io_uring_sqe *sqes;
    size_t sqes_len;
    unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
};

static void ring_close(struct ring *r)
{
    if (r->sqes != NULL && r->sqes != MAP_FAILED)
        munmap(r->sqes, r->sqes_len);
    if (r->cq_map != NULL && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_len);
    if (r->sq_map != NULL && r->sq_map != MAP_FAILED)
        munmap(r->sq_map, r->sq_len);
    if (r->fd >= 0)
        close(r->fd);
}

static int ring_open(struct ring *r, unsigned depth)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    memset(r, 0, sizeof *r);
    r->fd = (int)syscall(__NR_io_uring_setup, depth, &p);
    if (r->fd < 0)
        return errno;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP)
        r->sq_len = r->cq_len = r->sq_len > r->cq_len ? r->sq_len : r->cq_len;
    r->sq_map = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED)
        return errno;
    r->cq_map = (p.features & IORING_FEAT_SINGLE_MMAP)
                    ? r->sq_map
                    : mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
    if (r->cq_map == MAP_FAILED)
        return errno;
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED)
        return errno;
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
}

/* Queues one request for slot `slot` (its page index and the bytes it already has). */
static void ring_queue(struct ring *r, struct job *job, unsigned slot, int64_t i, int64_t done)
{
    unsigned tail = *r->sq_tail; /* only this thread writes the tail */
    unsigned at = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[at];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = job->is_write ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = job->fd;
    sqe->off = (uint64_t)job->pages[i] * job->page_size + done;
    sqe->addr = (uint64_t)(uintptr_t)(job->buf + i * job->page_size + done);
    sqe->len = (unsigned)(job->page_size - done);
    sqe->user_data = slot;
    r->sq_array[at] = at;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* 0 when this process may make an io_uring (a kernel may lack it, disable it by sysctl, or
 * a container's seccomp filter refuse it), else the errno. */
int pageio_uring_check(void)
{
    struct ring r;
    int code = ring_open(&r, 1);
    ring_close(&r);
    return code;
}

int pageio_uring(int fd, int is_write, const int64_t *pages, int64_t count, uint8_t *buf,
                 int64_t page_size, int depth, int64_t *fail_index, int64_t *fail_done)
{
    struct job job = {fd, is_write, pages, count, buf, page_size, 0, {PTHREAD_MUTEX_INITIALIZER, 0, -1, 0}};
    if (count == 0)
        return finish(&job.failure, fail_index, fail_done);
    if (depth > count)
        depth = (int)count;
    if (depth < 1)
        depth = 1;
    struct ring r;
    int code = ring_open(&r, (unsigned)depth);
    int64_t *slot_index = calloc(depth, sizeof(int64_t));
    int64_t *slot_done = calloc(depth, sizeof(int64_t));
    if (code == 0 && (slot_index == NULL || slot_done == NULL))
        code = ENOMEM;
    if (code != 0) {
        free(slot_index);
        free(slot_done);
        ring_close(&r);
        pthread_mutex_destroy(&job.failure.lock);
        return code;
    }
    int64_t next = 0;
    unsigned queued = 0, in_flight = 0;
    for (unsigned slot = 0; slot < (unsigned)depth && next < count; slot++, next++, queued++) {
        slot_index[slot] = next;
        slot_done[slot] = 0;
        ring_queue(&r, &job, slot, next, 0);
    }
    while (queued + in_flight > 0) {
        /* Submit what is queued and wait for at least one completion. */
        int n = (int)syscall(__NR_io_uring_enter, r.fd, queued, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            /* The ring cannot be driven any more; closing it below cancels what is in flight. */
            fail(&job.failure, errno, -1, 0);
            break;
        }
        in_flight += (unsigned)n;
        queued -= (unsigned)n;
        unsigned head = *r.cq_head;
        unsigned tail = __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            struct io_uring_cqe *cqe = &r.cqes[head & *r.cq_mask];
            unsigned slot = (unsigned)cqe->user_data;
            int res = cqe->res;
            in_flight--;
            if (res == -EINTR || res == -EAGAIN) {
                ring_queue(&r, &job, slot, slot_index[slot], slot_done[slot]);
                queued++;
                continue;
            }
            if (res <= 0) {
                fail(&job.failure, res < 0 ? -res : -1, slot_index[slot], slot_done[slot]);
                continue;
            }
            slot_done[slot] += res;
            if (slot_done[slot] < page_size) { /* partial: ask for the rest */
                ring_queue(&r, &job, slot, slot_index[slot], slot_done[slot]);
                queued++;
            } else if (next < count && job.failure.code == 0) { /* after a failure, only drain */
                slot_index[slot] = next;
                slot_done[slot] = 0;
                ring_queue(&r, &job, slot, next++, 0);
                queued++;
            }
        }
        __atomic_store_n(r.cq_head, head, __ATOMIC_RELEASE);
    }
    free(slot_index);
    free(slot_done);
    ring_close(&r);
    return finish(&job.failure, fail_index, fail_done);
}
#else
int pageio_uring_check(void) { return ENOSYS; }

int pageio_uring(int fd, int is_write, const int64_t *pages, int64_t count, uint8_t *buf,
                 int64_t page_size, int depth, int64_t *fail_index, int64_t *fail_done)
{
    (void)fd, (void)is_write, (void)pages, (void)count, (void)buf, (void)page_size, (void)depth;
    *fail_index = -1;
    *fail_done = 0;
    return ENOSYS;
}
#endif
