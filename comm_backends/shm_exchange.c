/* One whole `shm` allreduce exchange in one call: copy in, publish, wait, reduce (and, for
 * two-shot, publish, wait, gather), for the common case where every peer is already there.
 *
 * Why: the same steps driven from Python cost ~15 us of interpreter and dispatch overhead per
 * call (3 torch copies, flag reads and writes through a memoryview, a ctypes call for the
 * reduction), which at 2 ranks was most of a 4-64 KB allreduce.
 *
 * The Python side (comm_backends/shm.py, shm_flags.py) stays the authority on the protocol:
 * this file follows the same flag layout (passed in `board`, never hard-coded) and the same
 * publish rules, and it only ever *spins*. When a wait would need more than a short spin (a
 * peer is late, has stopped, or last ran on our CPU so spinning would starve it) it returns
 * the stage to resume at; Python then does the real wait (yield, futex sleep, liveness and
 * deadline checks, error reporting) and calls back in with that stage.
 *
 * Ordering: the flags are int64 words written by their owning rank only. A release store of
 * the sequence counter after the data, acquire loads before reading peers' data (plain moves
 * on x86-64, which `shm` requires), and a full fence between publishing and looking for
 * sleepers, the Dekker pair with FlagBoard._sleep.
 */
#define _GNU_SOURCE /* sched_getcpu */
#include "shm_reduce.c"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_RANKS 64

typedef struct {
    int64_t *words;   /* the segment's header: one line of line_words int64 per rank */
    int64_t spin_ns;  /* longest busy-poll before handing a wait back to Python */
    int32_t rank, world, line_words;
    int32_t seq_word, status_word, cpu_word, sleep_word; /* word indices within a line */
} board_t;

typedef struct {
    void *shm;        /* where the bytes live in the segment */
    int64_t offset;   /* byte offset into the caller's tensor */
    int64_t nbytes;
} span_t;

typedef struct {
    const board_t *board;
    /* One-shot: every rank's half, rank order. Two-shot: my segment in every rank's in-half;
     * entry `rank` is replaced by my segment of the caller's tensor. */
    const void *const *rows;
    const span_t *publish;   /* copied tensor -> segment before the first publish */
    const span_t *gather;    /* two-shot: copied segment -> tensor after the second wait;
                              * a gather (n = 0, one round): peers' rows after the first */
    void *out2;              /* two-shot: my segment of my out-half (peers gather it); else NULL */
    int64_t n;               /* elements reduced (0: a gather, nothing summed) */
    int64_t offset;          /* byte offset of the reduced elements in the tensor */
    int32_t dtype;           /* 0 fp32, 1 bf16, 2 fp16 */
    int32_t rounds;          /* 1 one-shot, 2 two-shot */
    int32_t n_publish, n_gather;
} plan_t;

static inline int64_t *line_of(const board_t *b, int32_t rank) {
    return b->words + (int64_t)rank * b->line_words;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void publish(const board_t *b, int64_t seq) {
    int64_t *mine = line_of(b, b->rank);
    __atomic_store_n(mine + b->cpu_word, (int64_t)sched_getcpu() + 1, __ATOMIC_RELAXED);
    __atomic_store_n(mine + b->seq_word, seq, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int32_t k = 0; k < b->world; k++) {
        if (k != b->rank && __atomic_load_n(line_of(b, k) + b->sleep_word, __ATOMIC_ACQUIRE) == b->rank + 1) {
            syscall(SYS_futex, mine + b->seq_word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
            return;
        }
    }
}

/* 1 once every peer has published `seq`; 0 to hand the wait to Python. */
static int spin_wait(const board_t *b, int64_t seq) {
    const int64_t cpu = (int64_t)sched_getcpu() + 1;
    int64_t deadline = 0;
    for (int32_t k = 0; k < b->world; k++) {
        const int64_t *peer = line_of(b, k);
        if (k == b->rank) continue;
        for (uint32_t i = 0; __atomic_load_n(peer + b->seq_word, __ATOMIC_ACQUIRE) < seq; i++) {
            if ((i & 31) == 0) {
                if (__atomic_load_n(peer + b->status_word, __ATOMIC_RELAXED) != 0) return 0;
                /* It last ran on this CPU: it may be queued behind us, so do not spin. */
                if (__atomic_load_n(peer + b->cpu_word, __ATOMIC_RELAXED) == cpu) return 0;
                int64_t t = now_ns();
                if (deadline == 0) deadline = t + b->spin_ns;
                else if (t > deadline) return 0;
            }
#if LANES
            _mm_pause();
#endif
        }
    }
    return 1;
}

/* memcpy for lines shared with a peer core. Publishing overwrites lines the peer read last round
 * (each store would otherwise wait to take them back); gathering reads lines the peer just
 * wrote. Prefetching both streams ahead: 1 MB two-shot at 2 ranks, 230-260 -> 170-190 us with
 * the reduction's write prefetch (publish 45 -> 40 us, gather 54 -> 46-52 us). */
static void copy_shared(char *dst, const char *src, int64_t n) {
    int64_t i = 0;
#if LANES
    for (; i + 64 <= n; i += 64) {
        PREFETCH(src + i);
        PREFETCH_WRITE(dst + i);
        memcpy(dst + i, src + i, 64); /* one or two vector moves at -O3 */
    }
#endif
    memcpy(dst + i, src + i, (size_t)(n - i));
}

static void reduce(int32_t dtype, const void *const *rows, int32_t nrows, void *out, void *out2,
                   int64_t n) {
    if (dtype == 1) reduce_bf16(rows, nrows, out, out2, n);
    else if (dtype == 2) reduce_f16(rows, nrows, out, out2, n);
    else reduce_f32(rows, nrows, out, out2, n);
}

/* Run the plan on tensor `x` from `stage` (0 at the start). Returns 0 when done, else the
 * stage to call again with once every peer has published `seq + stage - 1`. */
int32_t exchange(const plan_t *p, char *x, int64_t seq, int32_t stage) {
    const board_t *b = p->board;
    if (stage == 0) {
        for (int32_t s = 0; s < p->n_publish; s++)
            copy_shared(p->publish[s].shm, x + p->publish[s].offset, p->publish[s].nbytes);
        publish(b, seq);
        stage = 1;
        if (!spin_wait(b, seq)) return stage;
    }
    if (stage == 1 && p->n > 0) { /* n = 0: a gather (one round, no sum) */
        const void *rows[MAX_RANKS];
        for (int32_t k = 0; k < b->world; k++) rows[k] = p->rows[k];
        if (p->rounds == 2) rows[b->rank] = x + p->offset;
        reduce(p->dtype, rows, b->world, x + p->offset, p->out2, p->n);
    }
    if (stage == 1 && p->rounds == 2) {
        publish(b, seq + 1);
        stage = 2;
        if (!spin_wait(b, seq + 1)) return stage;
    }
    for (int32_t s = 0; s < p->n_gather; s++)
        copy_shared(x + p->gather[s].offset, p->gather[s].shm, p->gather[s].nbytes);
    return 0;
}

/* Wait until every peer has published `seq`, never handing the wait back: spin briefly, then
 * yield the CPU. Returns 0, or -1 when a peer is no longer running (it aborted or closed),
 * -2 past `timeout_ns`, -3 when a peer's process is gone (`pids`, checked every 50 ms). */
static int32_t wait_peers(const board_t *b, int64_t seq, int64_t timeout_ns, const int32_t *pids) {
    const int64_t start = now_ns();
    int64_t next_check = start + 50000000;
    for (uint32_t i = 0;; i++) {
        int ready = 1;
        for (int32_t k = 0; k < b->world; k++) {
            const int64_t *peer = line_of(b, k);
            if (k == b->rank || __atomic_load_n(peer + b->seq_word, __ATOMIC_ACQUIRE) >= seq) continue;
            if (__atomic_load_n(peer + b->status_word, __ATOMIC_RELAXED) != 0) return -1;
            ready = 0;
        }
        if (ready) return 0;
        if (i < 256) {
#if LANES
            _mm_pause();
#endif
            continue;
        }
        sched_yield();
        if ((i & 63) != 0) continue;
        const int64_t t = now_ns();
        if (t - start > timeout_ns) return -2;
        if (t > next_check) {
            next_check = t + 50000000;
            for (int32_t k = 0; k < b->world; k++)
                if (k != b->rank && kill(pids[k], 0) != 0 && errno == ESRCH) return -3;
        }
    }
}

/* `exchange` run to completion in C, for callers that cannot return to Python mid-way (the
 * native decoder stack reduces between its layer halves): the waits it would hand back are
 * done by wait_peers. The caller owns the sequence numbers (shm.py's `stack_exchange`). */
int32_t exchange_blocking(const plan_t *p, char *x, int64_t seq, int64_t timeout_ns,
                          const int32_t *pids) {
    int32_t stage = exchange(p, x, seq, 0);
    while (stage) {
        const int32_t waited = wait_peers(p->board, seq + stage - 1, timeout_ns, pids);
        if (waited != 0) return waited;
        stage = exchange(p, x, seq, stage);
    }
    return 0;
}

int32_t exchange_max_ranks(void) { return MAX_RANKS; }
