/* Y = X W^T for 16-bit weights W [rows, k] and X [m, k], on gemm_pool.c's threads.
 *
 * CPU decode reads every weight once per step; at batch 1 a step is as fast as the weights
 * stream, and at batch 16-64 ATen's bf16 matmul (oneDNN) is not much faster than at batch 1 on
 * these shapes. Here the weight rows are cut into chunks that threads claim in turn
 * (gemm_pool.c), so each thread streams a disjoint slice of W; inside a chunk, each block of x
 * rows passes over the chunk's weights (still in L1/L2 after the first block) with the
 * gemm_tiles.c tiles, which load every weight vector once for several x rows.
 *
 * Bits: each output is one gemm_tiles.c sum (fixed order, one rounding), whatever the chunk,
 * tile or thread that computes it: eager and compiled decode, any batch and any thread count
 * agree.
 *
 * cpu_ops.cpp includes this file (the torch op tpserve::matmul); the tests also build it alone
 * with ctypes (e.g. -mno-avx512f for the AVX2 path).
 */
#include "gemm_tiles.c"
#include "gemm_pool.c"

/* AMX tiles for bf16 where the compiler targets them (-march=native on a CPU that has them):
 * gemm_amx.c, included below. -DAMX_TILES=0 builds without them (the tests compare both). */
#ifndef AMX_TILES
#if DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define AMX_TILES 1
#else
#define AMX_TILES 0
#endif
#endif

/* Bytes of weights per chunk, and at least CHUNKS_PER_THREAD chunks a thread, so a thread that
 * starts late (or shares its core) leaves the rest to the others.
 *
 * Large: each chunk a thread claims starts a new weight stream, and the streams' ramp-up cost
 * more than the x blocks after the first lose by reading the chunk from L2 instead of L1. The
 * bench model's 33 projections + lm_head (ctypes harness, 2 threads, median of 9 alternating
 * rounds, ms), a 2-vCPU AVX-512 EPYC (Zen 4 class), 32 KB against 256 KB chunks: x rows 2
 * 4.26 / 3.25, 4 4.55 / 3.26, 8 6.02 / 4.37, 16 8.72 / 7.03, 32 13.41 / 11.41; one thread, 16
 * rows 13.56 / 11.79, 64 rows 39.9 / 37.9; the FMA tiles 4 rows 5.38 / 4.34, 16 rows 12.6 /
 * 12.2; the AVX2 build 4 rows 5.20 / 4.67, 16 rows 12.1 / 11.0. One x row (each weight read
 * once, nothing to keep cached), 2 threads, a 2-vCPU Zen 3: 4.98 ms with 32 KB chunks, 4.64
 * with 128 KB, 4.52 with 256 KB (a plain read of the same bytes through the same pool:
 * ~3.6-4.0). Fewer claims of the shared word, too (each a cache line moving between cores). */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES 262144
#endif
#define CHUNKS_PER_THREAD 4
/* Most x rows per pass over a chunk: blocks of up to PAIR_XS use the 2-row tiles. AVX-512, one
 * thread, hot weights, 16 rows (tools-only C loop, GFLOP/s): k = 512: 2 x 4 tiles 78, 1 x 8 86;
 * k = 2048 (a 4-row fp32 x block is 32 KB, 8 rows overflow L1): 2 x 4 46, 1 x 8 32. AVX2 (one
 * weight row per tile, 2 accumulators per x row): a 2-vCPU Zen 3, one thread, k = 512, hot,
 * GMAC/s by x rows 1..8: 9, 15, 20, 22, 24, 24-25, 23, 20 (8 rows spill the 16 registers); the
 * bench model's projections + lm_head, 2 threads, five alternating runs, median ms: blocks
 * of up to 6 against blocks of 4, 22.5 vs 27.5 at 16 rows, 72.7 vs 83.4 at 64, 13.6 vs 13.2
 * at 8 (noise). */
#ifndef XBLOCK
#if LANES == 16
#define XBLOCK XPAIR
#else
#define XBLOCK 6
#endif
#endif

/* Rows in the next x block: XBLOCK while that many are left, then the rest. Only which rows
 * share a pass changes, never an output's arithmetic.
 *
 * Blocks of near-equal size (5 rows as 3 + 2, 9 as 3 + 3 + 3) used to be the rule, so no
 * block ran the narrow tiles alone; on the AVX-512 EPYC the full block is worth more (4 rows then):
 * ctypes harness, median of 9 alternating rounds, the bench model's projections + lm_head
 * on 2 threads, greedy / even: 5 rows 1.02x, 6 0.97x, 9 0.92x, 10 0.88x, 13 0.84x, 17
 * 0.86x; the demo target's TP = 2 shapes on one thread (a verify of a 4-deep chain is 5
 * rows): 5 rows 0.84x, 6 0.91x, 9 0.87x (a C loop: 5 rows 163 -> 119 us, 6 195 -> 150).
 * The AVX2 build (-mno-avx512f, same machine, XBLOCK 6): 0.94-1.05x, within the noise. */
static inline int x_block(int64_t left) { return (int)(left < XBLOCK ? left : XBLOCK); }

#if LANES
typedef struct {
    const uint16_t *w;
    int64_t ldw;
    const float *x; /* m rows of the fp32 layout, k apart (NULL where AMX takes every row) */
    int64_t m, rows, k;
    uint16_t *y;
    int64_t ldy;
    int64_t chunk; /* weight rows per chunk (a multiple of ROWS; of AMX_GROUP x 16 with pack) */
    int bf16;
    const uint16_t *pack; /* x in AMX B tiles (gemm_amx.c), or NULL: gemm_tiles.c's tiles */
} gemm_job;

/* Several x rows: outputs are summed into an fp32 block of up to SUB_ROWS weight rows per x
 * row, then rounded to 16 bits a vector at a time: rounding one output at a time cost about
 * as much as its sums at k = 128 (8 rows of a 704 x 128 projection: 43 -> 31 us). One x row
 * keeps rounding each output as its tile ends, hidden behind the weight stream (the block
 * pass measured 8-12% slower on the bench model's batch-1 projections). */
#define SUB_ROWS 256

static void store_bf16(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
#if LANES == 16
    for (; i + 16 <= n; i += 16) /* f32_to_bf16, 16 at a time: nearest-even, NaN quiet */
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtepi32_epi16(f32x16_to_bf16_bits(_mm512_loadu_ps(src + i))));
#endif
    for (; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

static void store_f16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_f16(src[i]);
}

#if AMX_TILES
#include "gemm_amx.c" /* after store_bf16, which it uses */
#endif

/* Rows [r0, r1) of W against every row of x, XBLOCK x rows at a time (4 weight rows per tile
 * for a lone x row). */
#define DEFINE_CHUNK(FMT)                                                                     \
    static void chunk_##FMT(const gemm_job *job, int64_t r0, int64_t r1) {                     \
        const int64_t k = job->k, ldw = job->ldw, ldy = job->ldy;                              \
        float sums[ROWS], out[XMAX * SUB_ROWS];                                               \
        for (int64_t i0 = 0; i0 < job->m;) {                                                  \
            const int64_t left = job->m - i0;                                                 \
            const int xs = x_block(left);                                                     \
            const float *xb = job->x + i0 * k;                                                \
            uint16_t *yb = job->y + i0 * ldy;                                                 \
            if (xs == 1) { /* streaming-bound: each output rounded as its tile ends */         \
                int64_t r = r0;                                                               \
                for (; r + ROWS <= r1; r += ROWS) {                                           \
                    STREAM_TILE(FMT)(job->w + r * ldw, ldw, xb, k, k, sums, ROWS);            \
                    for (int q = 0; q < ROWS; q++) yb[r + q] = f32_to_##FMT(sums[q]);         \
                }                                                                             \
                for (; r < r1; r++) {                                                         \
                    one_row_tiles_##FMT[1](job->w + r * ldw, ldw, xb, k, k, sums, 1);         \
                    yb[r] = f32_to_##FMT(sums[0]);                                            \
                }                                                                             \
                i0 += 1;                                                                      \
                continue;                                                                     \
            }                                                                                 \
            for (int64_t rb = r0; rb < r1; rb += SUB_ROWS) {                                  \
                const int64_t re = rb + SUB_ROWS < r1 ? rb + SUB_ROWS : r1;                   \
                int64_t r = rb;                                                               \
                if (xs <= PAIR_XS && (COLD_PAIRS || i0 > 0))                                  \
                    for (; r + 2 <= re; r += 2)                                               \
                        two_row_tiles_##FMT[xs](job->w + r * ldw, ldw, xb, k, k,              \
                                                out + (r - rb), SUB_ROWS);                    \
                for (; r < re; r++)                                                           \
                    one_row_tiles_##FMT[xs](job->w + r * ldw, ldw, xb, k, k, out + (r - rb),  \
                                            SUB_ROWS);                                        \
                for (int j = 0; j < xs; j++)                                                  \
                    store_##FMT(yb + j * ldy + rb, out + j * SUB_ROWS, re - rb);              \
            }                                                                                 \
            i0 += xs;                                                                         \
        }                                                                                     \
    }
DEFINE_CHUNK(bf16)
DEFINE_CHUNK(f16)

static void gemm_chunk(void *ctx, int64_t c) {
    const gemm_job *job = (const gemm_job *)ctx;
    const int64_t r0 = c * job->chunk;
    const int64_t r1 = r0 + job->chunk < job->rows ? r0 + job->chunk : job->rows;
#if AMX_TILES
    if (job->pack) { /* whole 16-row blocks by AMX, the rows past the last one by the tiles */
        const int64_t whole = job->rows / AMX_ROWS * AMX_ROWS;
        const int64_t mid = r1 < whole ? r1 : whole;
        if (mid > r0) amx_rows(job->w, job->ldw, job->pack, job->m, job->k, job->y, job->ldy, r0, mid);
        if (r1 > mid) chunk_bf16(job, mid > r0 ? mid : r0, r1);
        return;
    }
#endif
    if (job->bf16) chunk_bf16(job, r0, r1);
    else chunk_f16(job, r0, r1);
}

static int64_t chunk_rows(int64_t rows, int64_t k, int threads, int64_t multiple) {
    int64_t by_cache = CHUNK_BYTES / (2 * (k > 0 ? k : 1));
    int64_t by_balance = (rows + (int64_t)threads * CHUNKS_PER_THREAD - 1) /
                         ((int64_t)threads * CHUNKS_PER_THREAD);
    int64_t chunk = by_cache < by_balance ? by_cache : by_balance;
    if (chunk < (rows + POOL_MAX_CHUNKS - 1) / POOL_MAX_CHUNKS)
        chunk = (rows + POOL_MAX_CHUNKS - 1) / POOL_MAX_CHUNKS;
    chunk = (chunk + multiple - 1) / multiple * multiple; /* whole tiles */
    return chunk > 0 ? chunk : multiple;
}

static int32_t gemm_run(int bf16, const uint16_t *w, int64_t ldw, const uint16_t *xh,
                        int64_t ldx, int64_t m, int64_t rows, int64_t k, uint16_t *y,
                        int64_t ldy) {
    if (m <= 0 || rows <= 0) return 0;
    uint16_t *pack = NULL;
    int64_t multiple = ROWS;
#if AMX_TILES
    if (bf16 && amx_fits(rows, k)) {
        pack = amx_pack_x(xh, ldx, m, k);
        if (!pack) return -1;
        multiple = AMX_GROUP * AMX_ROWS;
    }
#endif
    /* x in gemm_tiles.c's layout, for the rows the tiles compute: none where AMX takes them
     * all (its own copy of x is `pack`). */
    float *x = NULL;
#if AMX_TILES
    const int tiles = !pack || rows % AMX_ROWS != 0;
#else
    const int tiles = 1;
#endif
    if (tiles) {
        x = (float *)malloc((size_t)(m * k > 0 ? m * k : 1) * sizeof(float));
        if (!x) {
            free(pack);
            return -1;
        }
        for (int64_t i = 0; i < m; i++) {
            if (bf16) bf16_layout(xh + i * ldx, k, x + i * k);
            else f16_layout(xh + i * ldx, k, x + i * k);
        }
    }
    gemm_job job = {w, ldw, x, m, rows, k, y, ldy, chunk_rows(rows, k, pool_threads(), multiple),
                    bf16, pack};
    const int64_t chunks = (rows + job.chunk - 1) / job.chunk;
    /* the weight rows as one buffer, for the pool's read-ahead (packed rows only) */
    const int64_t row_bytes = k * (int64_t)sizeof(*w);
    const pool_span span = {(const char *)w, job.chunk * row_bytes, rows * row_bytes, chunks};
    pool_run_span(gemm_chunk, &job, chunks, ldw == k ? &span : NULL);
    free(pack);
    free(x);
    return 0;
}
#endif

/* Y[i, r] = sum_c W[r, c] * X[i, c] for i < m, r < rows: W rows `ldw` elements apart, X rows
 * `ldx`, Y rows `ldy`. Returns 0, or -1 when a copy of X cannot be allocated (or, with
 * no vector path in this build, always -1: the caller keeps ATen). */
int32_t gemm_bf16(const uint16_t *w, int64_t ldw, const uint16_t *x, int64_t ldx, int64_t m,
                  int64_t rows, int64_t k, uint16_t *y, int64_t ldy) {
#if LANES
    return gemm_run(1, w, ldw, x, ldx, m, rows, k, y, ldy);
#else
    (void)w, (void)ldw, (void)x, (void)ldx, (void)m, (void)rows, (void)k, (void)y, (void)ldy;
    return -1;
#endif
}

int32_t gemm_f16(const uint16_t *w, int64_t ldw, const uint16_t *x, int64_t ldx, int64_t m,
                 int64_t rows, int64_t k, uint16_t *y, int64_t ldy) {
#if LANES
    return gemm_run(0, w, ldw, x, ldx, m, rows, k, y, ldy);
#else
    (void)w, (void)ldw, (void)x, (void)ldx, (void)m, (void)rows, (void)k, (void)y, (void)ldy;
    return -1;
#endif
}

/* Threads for every later call in this process (caller included); returns the count set. */
int32_t gemm_set_threads(int32_t threads) { return pool_set_threads(threads); }

int32_t gemm_threads(void) { return pool_threads(); }

/* Whether the pool's first helper claims from the end and reads ahead (gemm_pool.c), for every
 * later call; returns the setting. */
int32_t gemm_set_ends(int32_t on) { return pool_set_ends(on); }

/* Lanes per vector step in this build: 0 means no vector path (the caller keeps ATen). */
int32_t gemm_lanes(void) { return LANES; }

/* 1 when bf16 tiles use AVX512-BF16's dot product (bf16 subnormal inputs count as zero). */
int32_t gemm_bf16_dot(void) { return DPBF16; }

/* 1 when bf16 projections with k a multiple of 32 and 16+ weight rows use AMX tiles. */
int32_t gemm_amx(void) {
#if AMX_TILES
    return amx_ready();
#else
    return 0;
#endif
}
