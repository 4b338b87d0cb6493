/* bf16 Y = X W^T by AMX tiles (Intel's matrix unit: Sapphire Rapids and later), for gemm.c.
 *
 * Why: above a few x rows the DPBF16 tiles are bound by arithmetic, and ATen's oneDNN gemm,
 * which does use AMX, rounds a row differently depending on how many rows share its call (on a
 * 2-vCPU Xeon, a 512 x 1536 projection's rows at 4-36 rows differ from the same rows at 300),
 * so a prompt's bits depended on how it was chunked: a prefix hit's recomputed tail changed the
 * bench model's greedy output. Here every output of a weight row is the same fixed sum at any
 * x row count, thread count or chunk, as in gemm_tiles.c, so AMX can take every row count.
 *
 * Arithmetic: weight rows in blocks of 16 (the A tile: 16 rows x 32 columns), x rows in blocks
 * of up to 16 (the B tile: 16 column pairs x the block's x rows, VNNI order); each output
 * accumulates in fp32 over the columns 32 at a time, in order, by TDPBF16PS (inside it, each
 * pair's two products, as the instruction defines them: bf16 subnormal inputs count as zero,
 * as in the DPBF16 tiles), then is rounded once to bf16 (nearest-even). An output's sum uses
 * only its weight row and its x row, so neither the block widths nor the loop order (both
 * chosen by the x row count below) change its bits. Needs k a multiple of 32 and at least one
 * whole 16-row block; the rows past the last whole block go through the DPBF16 tiles, at every
 * x row count alike.
 *
 * Measured on a 2-vCPU Xeon with AMX (the bench model's projections + lm_head on 2 threads, a
 * ctypes harness alternating builds, medians of 7-9 rounds): at one x row the narrow B tile
 * (one x row, not 16 zero-padded) took the stream from 1.30-1.45x to 1.06-1.08x of the
 * DPBF16 tiles' time; prefetching 256 columns ahead 1.15-1.27x -> that (128: 1.10-1.19x, 512
 * and more: slower); one 16-row weight block per pass beat 2 (1.22x) and 4 (1.30x), whose 32
 * and 64 rows read side by side outrun the prefetchers. At 64 and 256 x rows the 2 x 2 squares
 * took 0.83x and 0.80x of the time of 4 weight blocks against one x block, and transposing the
 * sum tiles in registers instead of storing outputs one by one took 256 rows from 18.3 to
 * 13.7-15.4 ms (`launch.bench_gemm --threads 2`); at one x row, storing each sum tile's
 * column contiguously (no transpose) took 1.055x of the DPBF16 tiles' time to 1.029x.
 *
 * Linux lends the tile registers to a process only on request (arch_prctl); amx_ready() asks
 * once. TPSERVE_AMX=0 keeps the DPBF16 tiles (decided once per process).
 */
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16             /* weight rows per A tile, x rows per B tile */
#define AMX_COLS 32             /* bf16 columns per A tile row */
#ifndef AMX_GROUP
#define AMX_GROUP 4             /* A tiles (64 weight rows) per pass over an x block */
#endif
#if AMX_GROUP < 1 || AMX_GROUP > 4
#error "AMX_GROUP: 1 to 4 sum tiles"
#endif
#ifndef AMX_STREAM
#define AMX_STREAM 1            /* A tiles per pass when one x block streams the weights */
#endif
#if AMX_STREAM < 1 || AMX_STREAM > AMX_GROUP
#error "AMX_STREAM: 1 to AMX_GROUP sum tiles"
#endif
#ifndef AMX_AHEAD
#define AMX_AHEAD 256           /* columns ahead of the tiles' loads to prefetch (streaming) */
#endif
#ifndef AMX_SQUARE
#define AMX_SQUARE 1
#endif
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 1: tiles usable, -1: not (pthread_once sets it) */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void) {
    const char *env = getenv("TPSERVE_AMX");
    if (env && env[0] == '0') {
        amx_state = -1;
        return;
    }
    amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
}

static int amx_ready(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_state == 1;
}

/* Whether a k-column bf16 projection with `rows` weight rows takes the AMX tiles: decided by
 * the weight's shape only, never by the x row count. */
static int amx_fits(int64_t rows, int64_t k) {
    return k % AMX_COLS == 0 && rows >= AMX_ROWS && amx_ready();
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* x rows per B tile: all of them up to 16 (a narrower tile moves less for decode's one row),
 * else 16 (the last block zero-padded). Each output's sum is the same at any width. */
static int amx_width(int64_t m) { return (int)(m < AMX_ROWS ? m : AMX_ROWS); }

/* Tiles 0-3 the sums (16 weight rows x `nb` x rows, fp32), 4-5 x blocks (16 column pairs x
 * `nb` x rows), 6-7 weights (16 rows x 32 columns). Loaded at every chunk: oneDNN configures
 * the tiles its own way on threads it may share with us. */
static void amx_configure(int nb) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = (uint16_t)(t < 6 ? 4 * nb : 2 * AMX_COLS);
        cfg.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&cfg);
}

/* x [m, k] bf16 (rows ldx apart) into B tiles of width nb = amx_width(m): block b of nb x rows,
 * column block c holds pack[((b * (k / 32) + c) * 16 + p) * 2 nb + 2 i + h]
 * = x[nb b + i, 32 c + 2 p + h]; so block b starts at b * nb * k and column c (a multiple of
 * 32) of it at c * nb. */
static uint16_t *amx_pack_x(const uint16_t *x, int64_t ldx, int64_t m, int64_t k) {
    const int nb = amx_width(m);
    const int64_t blocks = (m + nb - 1) / nb, cblocks = k / AMX_COLS;
    const size_t bytes = (size_t)(blocks * nb * k) * 2;
    uint16_t *pack = (uint16_t *)aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!pack) return NULL;
    if (m % nb) memset(pack + (blocks - 1) * nb * k, 0, (size_t)(nb * k) * 2);
    for (int64_t i = 0; i < m; i++) {
        const int64_t b = i / nb, col = i % nb;
        for (int64_t c = 0; c < cblocks; c++) {
            uint16_t *tile = pack + (b * cblocks + c) * AMX_ROWS * 2 * nb + 2 * col;
            const uint16_t *src = x + i * ldx + c * AMX_COLS;
            for (int p = 0; p < AMX_COLS / 2; p++) /* a column pair */
                memcpy(tile + p * 2 * nb, src + 2 * p, 2 * sizeof(uint16_t));
        }
    }
    return pack;
}

/* One step of the sums: weight tile W (rows T * 16 on) times the x block in tile 4. The tile
 * numbers are immediates, hence a macro. */
#define AMX_DOT(T, W)                                                                         \
    do {                                                                                      \
        _tile_loadd(W, wp + (T) * AMX_ROWS * ldw, ldw * 2);                                   \
        _tile_dpbf16ps(T, W, 4);                                                              \
    } while (0)

/* `n` (1..AMX_GROUP) blocks of 16 weight rows from `w` against one x block `xb`, summed over
 * all k columns into sums[0..n-1]. With `ahead` set, the weights AMX_AHEAD columns on are
 * prefetched, running on into `next` (`next_rows` rows) past the last column: the tiles read
 * 16 rows side by side, 64 bytes of each a step, which the hardware prefetchers do not
 * follow. */
static void amx_group(const uint16_t *w, int64_t ldw, const uint16_t *xb, int nb, int64_t k,
                      int n, int ahead, const uint16_t *next, int next_rows,
                      float sums[4][AMX_ROWS][AMX_ROWS]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < k; c += AMX_COLS) {
        const uint16_t *wp = w + c;
        if (ahead) {
            const int64_t pc = c + AMX_AHEAD;
            const uint16_t *base = pc < k ? w + pc : next + (pc - k);
            const int rows = pc < k ? n * AMX_ROWS : next_rows;
            for (int q = 0; q < rows; q++) _mm_prefetch((const char *)(base + q * ldw), _MM_HINT_T0);
        }
        _tile_loadd(4, xb + c * nb, 4 * nb);
        AMX_DOT(0, 6);
        if (n > 1) AMX_DOT(1, 7);
        if (n > 2) AMX_DOT(2, 6);
        if (n > 3) AMX_DOT(3, 7);
    }
    /* One x row: each sum tile's 16 outputs land side by side (stored by store_bf16). */
    const int stride = nb == 1 ? 4 : 64;
    _tile_stored(0, sums[0], stride);
    if (n > 1) _tile_stored(1, sums[1], stride);
    if (n > 2) _tile_stored(2, sums[2], stride);
    if (n > 3) _tile_stored(3, sums[3], stride);
}

/* Two blocks of 16 weight rows (the second when `two`), copied by amx_pack_w, against two x
 * blocks (`xa`, `xb`), into sums[a * 2 + b] for weight block a and x block b: each tile load
 * serves two sums. */
static void amx_square(const uint16_t *wp, int two, const uint16_t *xa, const uint16_t *xb,
                       int nb, int64_t k, float sums[4][AMX_ROWS][AMX_ROWS]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < k; c += AMX_COLS, wp += 2 * AMX_ROWS * AMX_COLS) {
        _tile_loadd(4, xa + c * nb, 4 * nb);
        _tile_loadd(5, xb + c * nb, 4 * nb);
        _tile_loadd(6, wp, 2 * AMX_COLS);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
        if (two) {
            _tile_loadd(7, wp + AMX_ROWS * AMX_COLS, 2 * AMX_COLS);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(3, 7, 5);
        }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if (two) {
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
    }
}

/* `blocks` (1 or 2) blocks of 16 weight rows into tile order, each tile's 16 rows of 64 bytes
 * contiguous: read from the weights in place, 16 rows k apart land in few L1 sets (one set
 * for k = 2048), so every x block after the first read them from L2 again. */
static void amx_pack_w(const uint16_t *w, int64_t ldw, int blocks, int64_t k, uint16_t *dst) {
    for (int64_t c = 0; c < k; c += AMX_COLS, dst += 2 * AMX_ROWS * AMX_COLS)
        for (int q = 0; q < blocks * AMX_ROWS; q++)
            memcpy(dst + q * AMX_COLS, w + q * ldw + c, 2 * AMX_COLS);
}

/* A sum tile (16 weight rows x 16 x rows, fp32) transposed and rounded to bf16: x row i < xs
 * into out + i * ldy, 16 outputs each. The transpose only moves elements: pairs of rows
 * interleaved (ps, then pd), after which register 4b + j holds, in 128-bit lane L, rows
 * 4b..4b+3 of column 4L + j; then a 4 x 4 transpose of lanes per j. */
static inline void amx_store(const float tile[AMX_ROWS][AMX_ROWS], int64_t xs, uint16_t *out,
                             int64_t ldy) {
    __m512 r[16], t[16], col[16];
    for (int q = 0; q < 16; q++) r[q] = _mm512_load_ps(tile[q]);
    for (int q = 0; q < 16; q += 2) {
        t[q] = _mm512_unpacklo_ps(r[q], r[q + 1]);
        t[q + 1] = _mm512_unpackhi_ps(r[q], r[q + 1]);
    }
#define PD(v) _mm512_castps_pd(v)
    for (int q = 0; q < 16; q += 4) {
        r[q] = _mm512_castpd_ps(_mm512_unpacklo_pd(PD(t[q]), PD(t[q + 2])));
        r[q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(PD(t[q]), PD(t[q + 2])));
        r[q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(PD(t[q + 1]), PD(t[q + 3])));
        r[q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(PD(t[q + 1]), PD(t[q + 3])));
    }
#undef PD
    for (int j = 0; j < 4; j++) {
        const __m512 u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        const __m512 u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
        col[j] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        col[4 + j] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        col[8 + j] = _mm512_shuffle_f32x4(u0, u2, 0xdd);
        col[12 + j] = _mm512_shuffle_f32x4(u1, u3, 0xdd);
    }
    for (int64_t i = 0; i < xs; i++)
        _mm256_storeu_si256((__m256i *)(out + i * ldy),
                            _mm512_cvtepi32_epi16(f32x16_to_bf16_bits(col[i])));
}

/* Weight rows [r0, r1) (both multiples of 16) against every x row. One x block streams the
 * weights: AMX_STREAM blocks of weight rows at a time with prefetch; more x blocks reuse each
 * weight tile across AMX_GROUP sums (the chunk's weights stay in L2 between x blocks). */
static void amx_rows(const uint16_t *w, int64_t ldw, const uint16_t *pack, int64_t m,
                     int64_t k, uint16_t *y, int64_t ldy, int64_t r0, int64_t r1) {
    float sums[4][AMX_ROWS][AMX_ROWS] __attribute__((aligned(64)));
    const int nb = amx_width(m);
    const int stream = m <= nb;
    const int group = stream ? AMX_STREAM : AMX_GROUP;
    amx_configure(nb);
#if AMX_SQUARE
    /* Several x blocks: 2 x 2 squares over a copy of the weight rows (without the memory for
     * it, the streaming loop below gives the same sums). */
    uint16_t *wpack = m > nb ? (uint16_t *)aligned_alloc(64, (size_t)(2 * AMX_ROWS * k) * 2)
                             : NULL;
    if (wpack) {
        for (int64_t r = r0; r < r1; r += 2 * AMX_ROWS) {
            const int two = r1 - r >= 2 * AMX_ROWS;
            amx_pack_w(w + r * ldw, ldw, 1 + two, k, wpack);
            for (int64_t i0 = 0; i0 < m; i0 += 2 * nb) {
                const int pair = m - i0 > nb;
                amx_square(wpack, two, pack + i0 * k, pack + (pair ? i0 + nb : i0) * k, nb,
                           k, sums);
                for (int b = 0; b < 1 + pair; b++) {
                    const int64_t xi = i0 + b * nb, xs = m - xi < nb ? m - xi : nb;
                    for (int a = 0; a < 1 + two; a++)
                        amx_store(sums[a * 2 + b], xs, y + xi * ldy + r + a * AMX_ROWS, ldy);
                }
            }
        }
        free(wpack);
        _tile_release();
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r += group * AMX_ROWS) {
        const int64_t left = (r1 - r) / AMX_ROWS;
        const int n = (int)(left < group ? left : group);
        const int64_t after = r + n * AMX_ROWS, rest = r1 - after;
        const int next_rows = (int)(rest < group * AMX_ROWS ? rest : group * AMX_ROWS);
        for (int64_t i0 = 0; i0 < m; i0 += nb) {
            amx_group(w + r * ldw, ldw, pack + i0 * k, nb, k, n, stream && AMX_AHEAD,
                      w + after * ldw, next_rows, sums);
            const int64_t xs = m - i0 < nb ? m - i0 : nb;
            for (int t = 0; t < n; t++) {
                uint16_t *out = y + i0 * ldy + r + t * AMX_ROWS;
                if (nb == 1)
                    store_bf16(out, &sums[t][0][0], AMX_ROWS);
                else
                    amx_store(sums[t], xs, out, ldy);
            }
        }
    }
    _tile_release(); /* the tile state back to the OS: cheaper context switches */
}
