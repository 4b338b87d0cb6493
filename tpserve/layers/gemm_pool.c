/* A small persistent thread pool for gemm.c: the caller and `threads - 1` helper threads share
 * the chunks of one job at a time.
 *
 * Why its own and not torch's intra-op pool: a decode projection lasts 5-100 us, and handing
 * work to a sleeping thread costs about as much, so helpers spin for SPIN_NS after each job
 * (the next projection, or the next decode step's first, usually arrives within that) and
 * only then sleep on a condition variable. at::parallel_for would need this library built
 * against torch's OpenMP runtime, whose spin policy we do not control. The thread count is
 * process state set by gemm_set_threads (the server sets it beside torch.set_num_threads).
 *
 * Chunks are claimed one at a time from a single atomic word (the caller and most helpers from
 * the start, helper 0 from the end: pool_readahead.c says why), and the caller waits only for
 * chunks some thread has claimed, never for a helper to show up: on a machine with more
 * runnable threads than cores a helper may not be scheduled for milliseconds, and waiting for
 * it (a fork-join barrier, as torch's OpenMP pool does) made each projection that slow. A
 * helper that wakes after the job is over finds nothing to claim.
 *
 * One job at a time: a second concurrent caller (another Python thread) runs its job alone on
 * its own thread rather than wait. After fork() the child has no helpers; they are started
 * again at its first job. Atomics are GCC builtins so the file also compiles as C++ (the torch
 * op includes it).
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define POOL_MAX_THREADS 256
/* How long an idle helper spins before it sleeps, and how often it looks at the clock.
 * Long enough to outlast the host work between two decode steps (sampling, streaming, the
 * next plan: ~1-2 ms of Python on the 2-vCPU Zen 3), so the helper is awake for the next
 * step's first projection: a sleeping helper's wake-up (a futex wake reaching an idle vCPU)
 * cost more than the spin saves. Batch-1 decode of the 80 MB bench model, TP = 1, one
 * process alternating the setting per request (12 rounds, median tok/s ratio to 200 us):
 * 20 us 0.88x, 1 ms 1.08x, 3 ms 1.10x; served with streaming clients, 3 ms against 200 us:
 * 1.12x at 1 stream (20 rounds), 1.08x at 16 (6 rounds); 10 ms against 3 ms 0.96x. The
 * helper yields its core every SPINS_PER_CLOCK spins, so the HTTP thread still runs. */
#define SPIN_NS 3000000
#define SPINS_PER_CLOCK 64

typedef void (*pool_chunk_fn)(void *ctx, int64_t chunk);

#include "pool_readahead.c"

/* The claim word: job tag (the low bits of its generation), end (one past the last chunk not
 * claimed from the end), next (the first not claimed from the start). One
 * compare-and-swap claims a chunk of exactly that job, so a late helper can never take a chunk
 * of the next job with the last one's parameters. */
#define CHUNK_BITS 20
#define POOL_MAX_CHUNKS ((int64_t)1 << CHUNK_BITS)
#define CHUNK_MASK ((uint64_t)POOL_MAX_CHUNKS - 1)
static inline uint64_t claim_word(uint64_t generation, int64_t chunks) {
    return (generation << (2 * CHUNK_BITS)) | ((uint64_t)chunks << CHUNK_BITS);
}

typedef struct {
    pthread_mutex_t run;   /* held by the caller of the current job, and by pool_set_threads */
    pthread_mutex_t sleep; /* with `wake`: helpers that have spun long enough wait here */
    pthread_cond_t wake;
    pthread_t helpers[POOL_MAX_THREADS];
    int started;             /* helpers running (under `run`) */
    int threads;             /* the requested count, caller included (written under `run`) */
    uint64_t start_generation; /* what helpers started by the last start have seen */
    /* Shared with the helpers through atomics: */
    uint64_t generation; /* bumped once per job */
    int sleeping;        /* helpers waiting on `wake` */
    int stop;
    uint64_t claim; /* claim_word(...) + chunks claimed so far */
    int64_t done;   /* chunks finished */
    int64_t chunks; /* of the current job (done == chunks: the caller is past it) */
    pool_chunk_fn fn; /* the job: written before `claim` is, read after a chunk is claimed */
    void *ctx;
    pool_span span;         /* the job's bytes, when it streams a buffer (zero otherwise) */
    const char *last_base;  /* the caller's previous spanned job (under `run`) */
    int ends;               /* helper 0 claims from the end and reads ahead (pool_readahead.c) */
} pool_state;

static pool_state pool = {.run = PTHREAD_MUTEX_INITIALIZER, .sleep = PTHREAD_MUTEX_INITIALIZER,
                          .wake = PTHREAD_COND_INITIALIZER, .ends = 1};
static pthread_once_t pool_fork_once = PTHREAD_ONCE_INIT;

#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Waits until the generation moves past `seen` (or stop); returns the new generation. With
 * `ra` (helper 0), reads ahead while it waits. */
static uint64_t pool_wait(uint64_t seen, ra_state *ra) {
    int64_t deadline = 0;
    for (int spins = 0;; spins++) {
        uint64_t g = LOAD(&pool.generation);
        if (g != seen || LOAD(&pool.stop)) return g;
        if (!ra || LOAD(&pool.done) < LOAD(&pool.chunks) || !ra_step(ra)) cpu_relax();
        if (spins % SPINS_PER_CLOCK) continue;
        /* Now and then give the core away: torch's intra-op workers (attention, norms between
         * projections) may be waiting for it, and on a machine with as many threads as cores
         * a helper that only spins would halve their share. */
        sched_yield();
        int64_t t = now_ns();
        if (!deadline) deadline = t + SPIN_NS;
        else if (t > deadline) break;
    }
    /* The caller bumps the generation, then signals if `sleeping` is set; a helper counts
     * itself in `sleeping` before it looks at the generation again, both under `sleep`, so one
     * of the two always sees the other (seq_cst atomics). */
    pthread_mutex_lock(&pool.sleep);
    __atomic_add_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
    while (LOAD(&pool.generation) == seen && !LOAD(&pool.stop))
        pthread_cond_wait(&pool.wake, &pool.sleep);
    __atomic_sub_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&pool.sleep);
    return LOAD(&pool.generation);
}

/* Claims and runs chunks of job `generation` until none are left: from the start, or with
 * `tail` from the end (helper 0, whose read-ahead is the last chunks). A claimed chunk holds the
 * job open (its caller waits for `done`), so fn and ctx read after the claim are that job's. */
static void pool_drain(uint64_t generation, int tail) {
    const uint64_t tag = generation & (UINT64_MAX >> (2 * CHUNK_BITS));
    uint64_t v = LOAD(&pool.claim);
    for (;;) {
        const int64_t end = (int64_t)((v >> CHUNK_BITS) & CHUNK_MASK);
        const int64_t next = (int64_t)(v & CHUNK_MASK);
        if ((v >> (2 * CHUNK_BITS)) != tag || next >= end) return;
        const uint64_t claimed = tail ? v - ((uint64_t)1 << CHUNK_BITS) : v + 1;
        if (!__atomic_compare_exchange_n(&pool.claim, &v, claimed, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST))
            continue; /* v now holds the current word */
        pool.fn(pool.ctx, tail ? end - 1 : next);
        __atomic_add_fetch(&pool.done, 1, __ATOMIC_SEQ_CST);
        v = LOAD(&pool.claim);
    }
}

static void *pool_helper(void *arg) {
    const int ends = (int)(intptr_t)arg == 0 && LOAD(&pool.ends);
    uint64_t seen = pool.start_generation; /* written before this thread was created */
    ra_state ra = {.threads = LOAD(&pool.threads)};
    for (;;) {
        uint64_t g = pool_wait(seen, ends ? &ra : NULL);
        if (LOAD(&pool.stop)) return NULL;
        seen = g;
        if (ends) {
            /* the job's span, read before any claim (stale if the job is over already, which
             * only misleads the read-ahead) */
            const pool_span span = span_load(&pool.span);
            ra_arrive(&ra, &span);
        }
        pool_drain(g, ends);
    }
}

static void pool_after_fork_in_child(void) {
    /* The helpers did not survive fork; the locks may have been held by them or by another
     * thread of the parent. Start clean: helpers are created again at the next job. */
    pthread_mutex_init(&pool.run, NULL);
    pthread_mutex_init(&pool.sleep, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
    pool.sleeping = pool.stop = 0;
}

static void pool_register_fork_handler(void) {
    pthread_atfork(NULL, NULL, pool_after_fork_in_child);
}

/* Under `run`: stop and join every helper. */
static void pool_stop_helpers(void) {
    if (!pool.started) return;
    pthread_mutex_lock(&pool.sleep);
    STORE(&pool.stop, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep);
    for (int i = 0; i < pool.started; i++) pthread_join(pool.helpers[i], NULL);
    pool.started = 0;
    STORE(&pool.stop, 0);
}

/* Under `run`: start helpers up to the requested count (fewer if the system refuses). */
static void pool_start_helpers(void) {
    pthread_once(&pool_fork_once, pool_register_fork_handler);
    pool.start_generation = LOAD(&pool.generation);
    while (pool.started < pool.threads - 1) {
        if (pthread_create(&pool.helpers[pool.started], NULL, pool_helper,
                           (void *)(intptr_t)pool.started) != 0)
            break;
        pool.started++;
    }
    if (pool.started < pool.threads - 1) STORE(&pool.threads, pool.started + 1);
}

/* Threads (caller included) for later jobs; clamped to [1, POOL_MAX_THREADS]. Returns it. */
static int32_t pool_set_threads(int32_t threads) {
    if (threads < 1) threads = 1;
    if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
    pthread_mutex_lock(&pool.run);
    pool_stop_helpers();
    STORE(&pool.threads, threads); /* helpers start lazily, at the first job */
    pthread_mutex_unlock(&pool.run);
    return threads;
}

/* 1: helper 0 claims from the end of each job and reads ahead (the default); 0: every thread
 * claims from the start, nothing is read ahead (the A/B baseline; outputs are the same bits).
 * Returns the setting. */
static int32_t pool_set_ends(int32_t on) {
    pthread_mutex_lock(&pool.run);
    pool_stop_helpers();
    STORE(&pool.ends, on ? 1 : 0);
    pthread_mutex_unlock(&pool.run);
    return on ? 1 : 0;
}

static int32_t pool_threads(void) {
    int32_t threads = LOAD(&pool.threads);
    return threads > 0 ? threads : 1;
}

/* fn(ctx, c) for every chunk c < chunks (at most POOL_MAX_CHUNKS), on the caller and whichever
 * helpers come; returns when all have returned. `span` (or NULL) is the buffer the chunks
 * stream, for the read-ahead. */
static void pool_run_span(pool_chunk_fn fn, void *ctx, int64_t chunks, const pool_span *span) {
    if (chunks <= 1 || pthread_mutex_trylock(&pool.run) != 0) {
        /* one chunk, or another job is running: go alone */
        for (int64_t c = 0; c < chunks; c++) fn(ctx, c);
        return;
    }
    if (pool.threads > 1 && pool.started < pool.threads - 1) pool_start_helpers();
    if (pool.threads <= 1 || !pool.started) {
        pthread_mutex_unlock(&pool.run);
        for (int64_t c = 0; c < chunks; c++) fn(ctx, c);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    const pool_span none = {0};
    span_store(&pool.span, span ? span : &none);
    if (span) {
        if (pool.last_base) ra_record(pool.last_base, span);
        pool.last_base = span->base;
    }
    STORE(&pool.done, 0);
    STORE(&pool.chunks, chunks);
    const uint64_t generation = LOAD(&pool.generation) + 1;
    STORE(&pool.claim, claim_word(generation, chunks));
    STORE(&pool.generation, generation);
    if (LOAD(&pool.sleeping)) {
        pthread_mutex_lock(&pool.sleep);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep);
    }
    pool_drain(generation, 0);
    /* Every chunk is claimed; wait for those still running on helpers (yielding the core to
     * them after a while, in case they share it with this thread). */
    for (int spins = 0; LOAD(&pool.done) < chunks; spins++) {
        if (spins < 4096) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool.run);
}

static void pool_run(pool_chunk_fn fn, void *ctx, int64_t chunks) {
    pool_run_span(fn, ctx, chunks, NULL);
}
