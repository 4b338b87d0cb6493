/* Attention that reads tpserve's paged KV cache in place, on CPU.
 *
 * The cache of a layer is a flat slot array [slots, kv_heads, head_dim] (slot = page * page_size
 * + offset). A batch is ragged: request b owns query rows q_indptr[b]..q_indptr[b+1] and
 * kv_lens[b] keys (its new keys included, written by attn_write first); query j of b sits at
 * logical index kv_lens[b] - q_len + j. A key is visible when
 *   - causal (no custom mask): key <= query, or
 *   - custom mask: key < mask_start[b], or key - mask_start[b] < mask_width and the mask says so;
 *   - and, with a window, key > query - window.
 *
 * Work items. A row is (query, q head). An item holds up to ATTN_MAX_ROWS rows of one request
 * that share every key they load: decode and small verify steps take all heads of a request
 * (each page is then read once, front to back, rather than once per kv head with a stride),
 * longer query blocks take one kv head and as many queries as fit. An item's keys are split at
 * multiples of ATTN_SPLIT_KEYS into separate items whose partial softmax states are merged
 * afterwards (long decodes then spread over threads). Keys are walked in chunks of LANES slots
 * aligned to the page, so a row's result depends only on its own visible keys: not on the batch,
 * the other rows of its item, or the thread count. A tree (custom mask) query's keys from the
 * chunk of its block's first key on are walked at the positions sequential decoding gives
 * them (attn_rows.h, tree_tail), so a verified token's attention has plain decoding's bits.
 *
 * Per chunk: scores (one fp32 vector accumulator per row and key over head_dim, the chunk's
 * accumulators summed by one transpose-and-add tree), online softmax in fp32 (running max,
 * rescale on a new max, vector exp), then acc[row] += p * v. bf16 keys/values are widened with
 * the shift/and trick of gemm_tiles.c (even and odd elements of 2*LANES in two vectors); q and the
 * accumulators use the same order inside each 2*LANES block, so head_dim must be a multiple of
 * 2*LANES. Written as C that is also C++ (cpu_attention.cpp includes it); the tests also build
 * it alone (ctypes), with -mno-avx512f for the AVX2 path.
 *
 * Where the time goes (Zen 4, one thread, bf16, 8 q / 4 kv heads, head_dim 64): with the KV in
 * L2, ~56 ns per key (8 rows): scores ~30, values ~11, softmax ~9; from DRAM the page jumps
 * add latency that the software prefetch (attn_rows.h) hides only in part: 16K keys read at
 * ~10 GB/s where a plain 1-thread read streams 16 GB/s (33 GB/s with transparent huge pages).
 */
#include <stdlib.h>

#include "attn_simd.h"

#define ATTN_MAX_ROWS 32
#define ATTN_MAX_HEAD_DIM 256
#define ATTN_SPLIT_KEYS 1024
#ifndef ATTN_PREFETCH_KEYS
#define ATTN_PREFETCH_KEYS 32
#endif

typedef struct attn_problem {
    int64_t batch, max_pages, page_size;
    int64_t q_heads, kv_heads, head_dim;
    int64_t window; /* 0: no window */
    float scale;
    const int32_t *page_table;  /* [batch, max_pages] */
    const int32_t *q_indptr;    /* [batch + 1] */
    const int32_t *kv_lens;     /* [batch] */
    const int32_t *mask_start;  /* [batch], or NULL: causal */
    const uint8_t *custom_mask; /* [batch, mask_rows, mask_width] bytes 0/1, or NULL */
    int64_t mask_rows, mask_width;
    const void *q; /* token t, head g at q + t * q_stride + g * head_dim (elements) */
    int64_t q_stride;
    int32_t q_dtype, cache_dtype;
    const void *k_cache, *v_cache; /* [slots, kv_heads, head_dim] */
    void *out;                     /* [tokens, q_heads * head_dim], q_dtype */
    float *partials;               /* attn_partial_floats() per part (see attn_plan) */
} attn_problem;

typedef struct attn_item {
    int32_t b, j0, j1, h0, h1, g0, g1; /* request, queries, kv heads, heads inside a group */
    int32_t k0, k1;                    /* keys walked */
    int32_t part, split, splits;       /* part -1: write the output; else a partial state */
} attn_item;

/* Copy `tokens` rows of `heads * head_dim` elements (heads contiguous inside a token, tokens
 * `src_stride` elements apart) into the cache rows `slots`, converting the element type. */
void attn_write(const void *src, int64_t src_stride, int32_t src_dtype, void *cache,
                int32_t cache_dtype, const int64_t *slots, int64_t tokens, int64_t heads,
                int64_t head_dim) {
    const int64_t row = heads * head_dim;
    for (int64_t t = 0; t < tokens; t++) {
        const char *s = (const char *)src + t * src_stride * elem_size(src_dtype);
        char *d = (char *)cache + slots[t] * row * elem_size(cache_dtype);
        if (src_dtype == cache_dtype) {
            memcpy(d, s, (size_t)(row * elem_size(cache_dtype)));
        } else {
            for (int64_t i = 0; i < row; i++) store_elem(d, cache_dtype, i, load_elem(s, src_dtype, i));
        }
    }
}

/* Lanes per vector in this build: 0 means no vector path (the caller uses another backend). */
int32_t attn_lanes(void) { return LANES; }

/* head_dim must be a multiple of this (one load_pair). */
int32_t attn_head_dim_multiple(void) { return 2 * LANES; }

/* Floats of one partial state: per row the running max, the sum and head_dim accumulators. */
int64_t attn_partial_floats(const attn_problem *p) { return ATTN_MAX_ROWS * (p->head_dim + 2); }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Queries, kv heads and group heads per item for a request with q_len queries. */
static void item_shape(const attn_problem *p, int64_t q_len, int64_t *qb, int64_t *hb, int64_t *gb) {
    const int64_t group = p->q_heads / p->kv_heads;
    if (group * q_len <= ATTN_MAX_ROWS) {
        *qb = q_len;
        *hb = min64(p->kv_heads, ATTN_MAX_ROWS / (group * q_len));
        *gb = group;
    } else {
        *qb = group <= ATTN_MAX_ROWS ? ATTN_MAX_ROWS / group : 1;
        *hb = 1;
        *gb = min64(group, ATTN_MAX_ROWS);
    }
}

/* End of masked request b's tree block: the keys a custom mask covers end here. */
static inline int64_t mask_end_of(const attn_problem *p, int64_t b) {
    return min64(p->kv_lens[b], (int64_t)p->mask_start[b] + p->mask_width);
}

/* Keys any of queries [j0, j1) of request b may see: [*lo, *hi). */
static void key_range(const attn_problem *p, int64_t b, int64_t j0, int64_t j1, int64_t *lo,
                      int64_t *hi) {
    const int64_t kv = p->kv_lens[b], first = kv - (p->q_indptr[b + 1] - p->q_indptr[b]);
    *lo = p->window > 0 ? max64(0, first + j0 - p->window + 1) : 0;
    *hi = p->custom_mask ? mask_end_of(p, b) : first + j1;
    *hi = max64(*hi, *lo);
}

static int64_t plan_block(const attn_problem *p, attn_item base, attn_item *items, int64_t n,
                          int64_t *parts) {
    int64_t lo, hi;
    key_range(p, base.b, base.j0, base.j1, &lo, &hi);
    const int64_t first = lo / ATTN_SPLIT_KEYS;
    const int64_t splits = hi > lo ? (hi - 1) / ATTN_SPLIT_KEYS - first + 1 : 1;
    for (int64_t s = 0; s < splits; s++, n++) {
        if (!items) continue;
        attn_item it = base;
        it.k0 = (int32_t)max64(lo, (first + s) * ATTN_SPLIT_KEYS);
        it.k1 = (int32_t)min64(hi, (first + s + 1) * ATTN_SPLIT_KEYS);
        it.part = splits > 1 ? (int32_t)(*parts + s) : -1;
        it.split = (int32_t)s;
        it.splits = (int32_t)splits;
        items[n] = it;
    }
    if (splits > 1) *parts += splits;
    return n;
}

/* The work items of a call, request-major; returns their number and sets *parts (partial states
 * needed), filling `items` when given. */
int64_t attn_plan(const attn_problem *p, attn_item *items, int64_t *parts) {
    const int64_t group = p->q_heads / p->kv_heads;
    int64_t n = 0;
    *parts = 0;
    for (int64_t b = 0; b < p->batch; b++) {
        const int64_t q_len = p->q_indptr[b + 1] - p->q_indptr[b];
        int64_t qb, hb, gb;
        if (q_len <= 0) continue;
        item_shape(p, q_len, &qb, &hb, &gb);
        for (int64_t h = 0; h < p->kv_heads; h += hb)
            for (int64_t j = 0; j < q_len; j += qb)
                for (int64_t g = 0; g < group; g += gb) {
                    attn_item base = {(int32_t)b, (int32_t)j, (int32_t)min64(j + qb, q_len),
                                      (int32_t)h, (int32_t)min64(h + hb, p->kv_heads), (int32_t)g,
                                      (int32_t)min64(g + gb, group), 0, 0, -1, 0, 1};
                    n = plan_block(p, base, items, n, parts);
                }
    }
    return n;
}

#if LANES
#include "attn_rows.h"

size_t attn_scratch_bytes(void) { return sizeof(attn_scratch); }

/* One work item; `scratch`: attn_scratch_bytes() bytes owned by the calling thread. */
void attn_run_item(const attn_problem *p, const attn_item *it, void *scratch) {
    attn_scratch *s = (attn_scratch *)scratch;
    switch (p->cache_dtype) {
    case ATTN_BF16: run_item(p, it, s, ATTN_BF16); break;
    case ATTN_F16: run_item(p, it, s, ATTN_F16); break;
    default: run_item(p, it, s, ATTN_F32); break;
    }
}

/* For an item with split == 0 and splits > 1, after every part ran: the merged output. */
void attn_merge(const attn_problem *p, const attn_item *it, void *scratch) {
    merge_parts(p, it, (attn_scratch *)scratch);
}

/* Every item on the calling thread, then the merges (the tests' entry point); returns 0, or -1
 * when out of memory. The caller has validated the problem (cpu_attention.cpp does). */
int32_t attn_forward(const attn_problem *problem) {
    attn_problem p = *problem;
    int64_t parts;
    const int64_t n = attn_plan(&p, NULL, &parts);
    attn_item *items = (attn_item *)malloc((size_t)(n > 0 ? n : 1) * sizeof(attn_item));
    void *scratch = malloc(sizeof(attn_scratch));
    p.partials = (float *)malloc((size_t)(parts > 0 ? parts * attn_partial_floats(&p) : 1) * sizeof(float));
    int32_t status = -1;
    if (items && scratch && p.partials) {
        attn_plan(&p, items, &parts);
        for (int64_t i = 0; i < n; i++) attn_run_item(&p, items + i, scratch);
        for (int64_t i = 0; i < n; i++)
            if (items[i].splits > 1 && items[i].split == 0) attn_merge(&p, items + i, scratch);
        status = 0;
    }
    free(items);
    free(scratch);
    free(p.partials);
    return status;
}
#endif
