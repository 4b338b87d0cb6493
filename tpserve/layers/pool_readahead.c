/* Reading ahead on gemm_pool.c's first helper while the caller does work that reads no weights.
 *
 * Why: at batch 1 a step streams every weight once, and between the projections the caller
 * does work that reads no weights (attention, norms, sampling, the next step's Python: ~0.8 of
 * a ~2.5 ms step of the bench model) while its helper spins and DRAM idles. Helper 0 instead
 * prefetches the part of the coming projections it will compute itself into its own caches: it
 * claims chunks from the end of a job (the others from the start), so those are the last
 * chunks. Only its own caches: on the 2-vCPU EPYC a buffer one vCPU had read streamed to the
 * other at 15 GB/s against 26 GB/s from DRAM (each vCPU sees its own L3), so reading ahead for
 * the caller would cost. It reads only after the current job is over: while the caller still
 * streams its share DRAM is busy anyway.
 *
 * What comes next is learnt, not told: the caller records which spanned job followed which
 * (keyed by the buffer's address: a decode step runs the same projections in the same order
 * every step), and the helper follows that chain from the job it saw last. It uses prefetch
 * instructions, which never fault: an entry may name a buffer freed since, or be read while the
 * caller rewrites it, and the worst either can do is waste bandwidth.
 *
 * Measured on the 2-vCPU AVX-512 EPYC, bench model, TP = 1, 2 threads. Offline batch-1 decode,
 * one process alternating this on and off per 256-token request (tpserve::set_matmul_readahead),
 * 30 rounds: paired median 1.095x (28 of 30 rounds faster); in the VM's slow stretches (decode
 * at ~350-380 tok/s instead of ~430) 0.98-1.05x over 10-20 rounds: level there. In an earlier
 * build with the lead a variable, 8 rounds: claims from both ends alone 1.067-1.072x, with
 * 2 / 4 / 8 MB read ahead 1.094 / 1.089 / 1.080x (16 MB, in a first version, ran slower than
 * none). Served (two servers, this against the parent commit, streamed clients, both start
 * orders): batch 1 1.10-1.27x, batch 16 0.99-1.10x.
 * Included by gemm_pool.c; gemm.c's jobs carry spans. */

/* The buffer a job streams: chunk c is bytes [c * chunk_bytes, min((c + 1) * chunk_bytes,
 * bytes)) of base (a gemm's weight rows). */
typedef struct {
    const char *base;
    int64_t chunk_bytes, bytes, chunks;
} pool_span;

#define RA_SLOTS 1024 /* successor table entries (a power of two) */
#define RA_RING 64    /* spans read ahead whose jobs have not started */
#define RA_SLICE 8192 /* bytes per burst between two looks at the job word */
/* Bytes read ahead and not yet claimed, at most: 2-8 MB measured alike (above); more would
 * push the first of them out of the helper's caches before its job comes. */
#define RA_LEAD_BYTES (4 << 20)

#define RELAXED_LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define RELAXED_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

/* A span shared between threads without a lock, field by field: a copy torn by a concurrent
 * write only misdirects prefetches (gemm_pool.c's current job, the successor table). */
static inline void span_store(pool_span *dst, const pool_span *src) {
    RELAXED_STORE(&dst->base, src->base);
    RELAXED_STORE(&dst->chunk_bytes, src->chunk_bytes);
    RELAXED_STORE(&dst->bytes, src->bytes);
    RELAXED_STORE(&dst->chunks, src->chunks);
}

static inline pool_span span_load(const pool_span *src) {
    const pool_span out = {RELAXED_LOAD(&src->base), RELAXED_LOAD(&src->chunk_bytes),
                           RELAXED_LOAD(&src->bytes), RELAXED_LOAD(&src->chunks)};
    return out;
}

typedef struct {
    const char *key;
    pool_span next;
} ra_successor;

/* Which spanned job followed which: written by callers (under gemm_pool.c's `run`), read by
 * helper 0 without a lock (field by field: a torn entry only misdirects prefetches). */
static ra_successor ra_table[RA_SLOTS];

static inline uint64_t ra_slot(const char *key) {
    return (((uint64_t)(uintptr_t)key >> 6) * 0x9E3779B97F4A7C15ull >> 32) & (RA_SLOTS - 1);
}

/* `next` ran right after the spanned job at `prev`. */
static void ra_record(const char *prev, const pool_span *next) {
    ra_successor *e = &ra_table[ra_slot(prev)];
    if (RELAXED_LOAD(&e->key) == prev) {
        const pool_span known = span_load(&e->next);
        if (known.base == next->base && known.bytes == next->bytes &&
            known.chunk_bytes == next->chunk_bytes)
            return;
    }
    RELAXED_STORE(&e->key, (const char *)NULL);
    span_store(&e->next, next);
    RELAXED_STORE(&e->key, prev);
}

/* The job recorded after the spanned job at `key`; 0 when none (or a torn entry). */
static int ra_lookup(const char *key, pool_span *out) {
    if (!key) return 0;
    const ra_successor *e = &ra_table[ra_slot(key)];
    if (RELAXED_LOAD(&e->key) != key) return 0;
    *out = span_load(&e->next);
    return out->base && out->chunk_bytes > 0 && out->chunks > 0 && out->bytes > 0 &&
           out->bytes <= out->chunk_bytes * out->chunks;
}

/* Helper 0's state: the predicted jobs' spans, oldest first; of each, the chunks it expects to
 * claim (its share, the last ones), read from the last down, each from its start. */
typedef struct {
    pool_span span[RA_RING];
    int64_t chunk[RA_RING]; /* chunk being read */
    int64_t off[RA_RING];   /* bytes of it read */
    int64_t lead;           /* bytes read ahead in the ring */
    int head, count;
    int threads;            /* the pool's, caller included: the helper's share is 1 / threads */
    const char *last;       /* the spanned job seen last: the chain starts after it */
} ra_state;

static inline int64_t ra_share(const ra_state *ra, const pool_span *s) {
    return s->chunks / (ra->threads > 1 ? ra->threads : 2);
}

static inline int64_t ra_chunk_len(const pool_span *s, int64_t c) {
    const int64_t start = c * s->chunk_bytes;
    return s->bytes - start < s->chunk_bytes ? s->bytes - start : s->chunk_bytes;
}

/* A job with `span` started: forget what was read ahead for it and the jobs before it. */
static void ra_arrive(ra_state *ra, const pool_span *span) {
    if (!span->base) return; /* not a spanned job (attention, norms): the chain goes on */
    int found = -1;
    for (int i = 0; i < ra->count && found < 0; i++)
        if (ra->span[(ra->head + i) % RA_RING].base == span->base) found = i;
    if (found < 0) {
        ra->count = 0;
    } else {
        ra->head = (ra->head + found + 1) % RA_RING;
        ra->count -= found + 1;
    }
    ra->lead = 0;
    for (int i = 0; i < ra->count; i++) {
        const int r = (ra->head + i) % RA_RING;
        ra->lead += ra->off[r];
        for (int64_t c = ra->chunk[r] + 1; c < ra->span[r].chunks; c++)
            ra->lead += ra_chunk_len(&ra->span[r], c);
    }
    ra->last = span->base;
}

/* One burst of reading ahead; 0 when there is nothing (more) to read. */
static int ra_step(ra_state *ra) {
    if (ra->lead >= RA_LEAD_BYTES) return 0;
    int r = (ra->head + ra->count - 1) % RA_RING;
    if (!ra->count || ra->chunk[r] < ra->span[r].chunks - ra_share(ra, &ra->span[r])) {
        /* the newest span's share is read (or there is none): the next one in the chain */
        pool_span next;
        if (ra->count == RA_RING || !ra_lookup(ra->count ? ra->span[r].base : ra->last, &next))
            return 0;
        for (int i = 0; i < ra->count; i++) /* the chain came round within the lead */
            if (ra->span[(ra->head + i) % RA_RING].base == next.base) return 0;
        if (next.base == ra->last) return 0;
        r = (ra->head + ra->count++) % RA_RING;
        ra->span[r] = next;
        ra->chunk[r] = next.chunks - 1;
        ra->off[r] = 0;
        if (ra_share(ra, &next) < 1) return 1; /* nothing of it is ours: on to the next */
    }
    const pool_span *s = &ra->span[r];
    const int64_t len = ra_chunk_len(s, ra->chunk[r]);
    const int64_t n = len - ra->off[r] < RA_SLICE ? len - ra->off[r] : RA_SLICE;
    const char *p = s->base + ra->chunk[r] * s->chunk_bytes + ra->off[r];
    /* prefetcht0 on x86 (prefetcht1 measured no better); a hint that never faults anywhere */
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i, 0, 3);
    ra->lead += n;
    ra->off[r] += n;
    if (ra->off[r] >= len) {
        ra->chunk[r]--;
        ra->off[r] = 0;
    }
    return 1;
}
