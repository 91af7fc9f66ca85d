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
 *
 * pageio_engine_*: a pool that lives across calls, for a reader kept busy by many callers (below).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The engine's unit: the file store's pages (embbench/disk/layout.py's PAGE). */
#define PAGEIO_PAGE 4096

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

/* ---- The engine: a pool of threads that lives across calls (the file store's reads ahead).
 *
 * pageio_engine_submit queues requests (each a page of a file and the address of its buffer:
 * reads go straight to where the caller wants them, no staging copy) and returns a ticket at
 * once; the pool's threads take requests in queue order, so requests of successive submissions
 * stay in flight together. An urgent submission goes to the queue's front (a read the caller
 * waits for now). pageio_ticket_wait blocks until a ticket's requests are all done and returns
 * 0, an errno or -1 (short transfer) with the lowest failed request's index; pageio_ticket_free
 * frees it (once done). pageio_engine_stats gives the time the pool had a request in flight
 * and the pages read and written, so that reads a second *while reading* can be told apart from
 * reads a second of the whole run. */

struct ticket {
    int64_t remaining;
    int code;
    int64_t index;
    int64_t done;
};

struct request {
    int fd;
    int is_write;
    int64_t offset;
    uint8_t *buf;
    struct ticket *ticket;
    int64_t index;
};

struct engine {
    pthread_mutex_t lock;
    pthread_cond_t work, finished;
    struct request *queue;
    int64_t cap, head, count;
    int stopping, threads;
    pthread_t *workers;
    int64_t in_flight, busy_ns, busy_since, reads, writes;
};

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void *engine_worker(void *arg)
{
    struct engine *e = arg;
    pthread_mutex_lock(&e->lock);
    for (;;) {
        while (e->count == 0 && !e->stopping)
            pthread_cond_wait(&e->work, &e->lock);
        if (e->count == 0)
            break;
        struct request r = e->queue[e->head];
        e->head = (e->head + 1) % e->cap;
        e->count--;
        if (e->in_flight++ == 0)
            e->busy_since = now_ns();
        pthread_mutex_unlock(&e->lock);
        int code = 0;
        int64_t done = 0;
        while (done < PAGEIO_PAGE) {
            ssize_t n = r.is_write ? pwrite(r.fd, r.buf + done, PAGEIO_PAGE - done, r.offset + done)
                                   : pread(r.fd, r.buf + done, PAGEIO_PAGE - done, r.offset + done);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0) {
                code = n < 0 ? errno : -1;
                break;
            }
            done += n;
        }
        pthread_mutex_lock(&e->lock);
        if (--e->in_flight == 0)
            e->busy_ns += now_ns() - e->busy_since;
        if (r.is_write)
            e->writes++;
        else
            e->reads++;
        struct ticket *t = r.ticket;
        if (code != 0 && (t->code == 0 || r.index < t->index)) {
            t->code = code;
            t->index = r.index;
            t->done = done;
        }
        if (--t->remaining == 0)
            pthread_cond_broadcast(&e->finished);
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

void *pageio_engine_open(int threads)
{
    struct engine *e = calloc(1, sizeof *e);
    if (e == NULL)
        return NULL;
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->finished, NULL);
    e->cap = 1024;
    e->queue = calloc(e->cap, sizeof *e->queue);
    e->workers = calloc(threads > 0 ? threads : 1, sizeof(pthread_t));
    if (e->queue == NULL || e->workers == NULL) {
        free(e->queue);
        free(e->workers);
        free(e);
        return NULL;
    }
    for (; e->threads < threads; e->threads++)
        if (pthread_create(&e->workers[e->threads], NULL, engine_worker, e) != 0)
            break;
    if (e->threads == 0) {
        free(e->queue);
        free(e->workers);
        free(e);
        return NULL;
    }
    return e;
}

int pageio_engine_threads(void *handle) { return ((struct engine *)handle)->threads; }

/* Queues `count` requests: page pages[i] of fd to or from the page at bufs[i]. NULL if out of memory. */
void *pageio_engine_submit(void *handle, int fd, int is_write, const int64_t *pages, const uint64_t *bufs,
                           int64_t count, int urgent)
{
    struct engine *e = handle;
    struct ticket *t = calloc(1, sizeof *t);
    if (t == NULL)
        return NULL;
    t->remaining = count;
    t->index = -1;
    pthread_mutex_lock(&e->lock);
    if (e->count + count > e->cap) {
        int64_t cap = e->cap;
        while (cap < e->count + count)
            cap *= 2;
        struct request *q = malloc(cap * sizeof *q);
        if (q == NULL) {
            pthread_mutex_unlock(&e->lock);
            free(t);
            return NULL;
        }
        for (int64_t i = 0; i < e->count; i++)
            q[i] = e->queue[(e->head + i) % e->cap];
        free(e->queue);
        e->queue = q;
        e->cap = cap;
        e->head = 0;
    }
    for (int64_t k = 0; k < count; k++) {
        int64_t i = urgent ? count - 1 - k : k; /* urgent: pushed to the front, last first, so in order */
        struct request r = {fd, is_write, pages[i] * PAGEIO_PAGE, (uint8_t *)(uintptr_t)bufs[i], t, i};
        if (urgent) {
            e->head = (e->head + e->cap - 1) % e->cap;
            e->queue[e->head] = r;
        } else {
            e->queue[(e->head + e->count) % e->cap] = r;
        }
        e->count++;
    }
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->lock);
    return t;
}

int pageio_ticket_done(void *handle, void *ticket)
{
    struct engine *e = handle;
    pthread_mutex_lock(&e->lock);
    int done = ((struct ticket *)ticket)->remaining == 0;
    pthread_mutex_unlock(&e->lock);
    return done;
}

int pageio_ticket_wait(void *handle, void *ticket, int64_t *fail_index, int64_t *fail_done)
{
    struct engine *e = handle;
    struct ticket *t = ticket;
    pthread_mutex_lock(&e->lock);
    while (t->remaining > 0)
        pthread_cond_wait(&e->finished, &e->lock);
    int code = t->code;
    *fail_index = t->index;
    *fail_done = t->done;
    pthread_mutex_unlock(&e->lock);
    return code;
}

/* A finished ticket's outcome, without the engine (after pageio_engine_close, which finishes all). */
int pageio_ticket_result(void *ticket, int64_t *fail_index, int64_t *fail_done)
{
    struct ticket *t = ticket;
    *fail_index = t->index;
    *fail_done = t->done;
    return t->code;
}

void pageio_ticket_free(void *ticket) { free(ticket); }

/* out[0]: nanoseconds with a request in flight (the current stretch included), out[1]: pages
 * read, out[2]: pages written, out[3]: requests queued or in flight now. */
void pageio_engine_stats(void *handle, int64_t *out)
{
    struct engine *e = handle;
    pthread_mutex_lock(&e->lock);
    out[0] = e->busy_ns + (e->in_flight ? now_ns() - e->busy_since : 0);
    out[1] = e->reads;
    out[2] = e->writes;
    out[3] = e->count + e->in_flight;
    pthread_mutex_unlock(&e->lock);
}

/* Ends the threads once every queued request is done, and frees the engine. */
void pageio_engine_close(void *handle)
{
    struct engine *e = handle;
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->lock);
    for (int i = 0; i < e->threads; i++)
        pthread_join(e->workers[i], NULL);
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->finished);
    free(e->queue);
    free(e->workers);
    free(e);
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
