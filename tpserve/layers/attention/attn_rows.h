/* One work item of paged_attention.c: its rows' online softmax over a page-aligned key walk, and
 * the merge of an item's key-split parts. Included by paged_attention.c after the problem and
 * item types and the vector layer (attn_simd.h), only when LANES > 0. */

typedef struct attn_scratch {
    float q[ATTN_MAX_ROWS * ATTN_MAX_HEAD_DIM]; /* scaled, in the cache's lane order */
    float acc[ATTN_MAX_ROWS * ATTN_MAX_HEAD_DIM];
    float p[ATTN_MAX_ROWS * LANES]; /* the chunk's probabilities per row */
    float m[ATTN_MAX_ROWS], l[ATTN_MAX_ROWS];
    int64_t lo[ATTN_MAX_ROWS], hi[ATTN_MAX_ROWS]; /* visible key range per row */
    int64_t tail[ATTN_MAX_ROWS]; /* keys from here on are walked by tree_tail (INT64_MAX: none) */
    int32_t j[ATTN_MAX_ROWS], h[ATTN_MAX_ROWS], g[ATTN_MAX_ROWS];
    uint32_t bits[ATTN_MAX_ROWS];
    /* A tree row's chunk gathered in sequential order (see tree_tail): one kv head. */
    char kbuf[LANES * ATTN_MAX_HEAD_DIM * 4], vbuf[LANES * ATTN_MAX_HEAD_DIM * 4];
} attn_scratch;

/* Position of element d inside the kernel's lane order (see load_pair). */
static inline int64_t lane_pos(int dtype, int64_t d) {
    if (dtype != ATTN_BF16) return d;
    const int64_t block = d / (2 * LANES), e = d % (2 * LANES);
    return block * 2 * LANES + (e % 2) * LANES + e / 2;
}

/* Rows kv-head-major: rows of one kv head are consecutive and share its keys. */
static int map_rows(const attn_item *it, attn_scratch *s) {
    int r = 0;
    for (int h = it->h0; h < it->h1; h++)
        for (int j = it->j0; j < it->j1; j++)
            for (int g = it->g0; g < it->g1; g++, r++) {
                s->j[r] = j;
                s->h[r] = h;
                s->g[r] = g;
            }
    return r;
}

/* Query j of masked request b: which keys of its tree block it sees (mask_width bytes). */
static inline const uint8_t *mask_row(const attn_problem *p, int64_t b, int64_t j) {
    return p->custom_mask + (b * p->mask_rows + j) * p->mask_width;
}

/* The logical index sequential decoding gives query j of masked request b: mask_start plus
 * the keys of the tree block it sees, itself included, minus one. */
static int64_t tree_position(const attn_problem *p, int64_t b, int64_t j, int64_t mask_end) {
    const int64_t start = p->mask_start[b];
    const uint8_t *row = mask_row(p, b, j);
    int64_t seen = 0;
    for (int64_t t = start; t < mask_end; t++) seen += row[t - start] != 0;
    return start + seen - 1;
}

/* Start of the page-aligned chunk of LANES keys that holds logical key t. */
static inline int64_t chunk_start(int64_t t, int64_t ps) { return t - (t % ps) % LANES; }

/* Whether query j of masked request b sees a run of its tree block from the block's first
 * key (a chain, or a tree's first branch): its keys then sit where sequential decoding puts
 * them, and the shared walk already gives plain decoding's bits. */
static int in_sequence(const attn_problem *p, int64_t b, int64_t j, int64_t mask_end) {
    const int64_t start = p->mask_start[b];
    const uint8_t *row = mask_row(p, b, j);
    int64_t t = start;
    while (t < mask_end && row[t - start]) t++;
    while (t < mask_end && !row[t - start]) t++;
    return t == mask_end;
}

static void load_rows(const attn_problem *p, const attn_item *it, attn_scratch *s, int rows, int dtype) {
    const int64_t d_all = p->head_dim, group = p->q_heads / p->kv_heads;
    const int64_t q0 = p->q_indptr[it->b], q_len = p->q_indptr[it->b + 1] - q0;
    const int64_t kv = p->kv_lens[it->b];
    const int64_t mask_end = p->custom_mask ? mask_end_of(p, it->b) : 0;
    for (int r = 0; r < rows; r++) {
        const int64_t at = kv - q_len + s->j[r]; /* the query's logical index */
        const char *src = (const char *)p->q + ((q0 + s->j[r]) * p->q_stride +
                                                (s->h[r] * group + s->g[r]) * d_all) * elem_size(p->q_dtype);
        float *q = s->q + r * d_all;
        if (p->q_dtype == dtype) { /* the common case: one load_pair per block */
            for (int64_t c = 0; c < d_all; c += 2 * LANES) {
                vf lo, hi;
                load_pair(src + c * elem_size(dtype), dtype, &lo, &hi);
                v_store(q + c, v_mul(lo, v_set1(p->scale)));
                v_store(q + c + LANES, v_mul(hi, v_set1(p->scale)));
            }
        } else {
            for (int64_t d = 0; d < d_all; d++) q[lane_pos(dtype, d)] = load_elem(src, p->q_dtype, d) * p->scale;
        }
        memset(s->acc + r * d_all, 0, (size_t)d_all * sizeof(float));
        s->m[r] = -INFINITY;
        s->l[r] = 0.0f;
        s->lo[r] = p->window > 0 ? max64(0, at - p->window + 1) : 0;
        s->hi[r] = p->custom_mask ? mask_end : at + 1;
        s->tail[r] = p->custom_mask && !in_sequence(p, it->b, s->j[r], mask_end)
                         ? chunk_start(p->mask_start[it->b], p->page_size) : INT64_MAX;
    }
}

static inline uint32_t lane_range(int64_t a, int64_t e) { /* bits a..e-1, 0 <= a <= e <= LANES */
    return (uint32_t)(((1ull << e) - 1ull) & ~((1ull << a) - 1ull));
}

/* Which of the keys [t0, t0 + n) inside [k0, k1) row r sees. */
static inline uint32_t row_bits(const attn_problem *p, const attn_scratch *s, int r, int64_t b,
                                int64_t t0, int64_t n, int64_t k0, int64_t k1) {
    const int64_t a = max64(max64(s->lo[r], t0), k0);
    const int64_t e = min64(min64(min64(s->hi[r], t0 + n), k1), s->tail[r]);
    if (a >= e) return 0;
    uint32_t bits = lane_range(a - t0, e - t0);
    if (p->custom_mask) {
        const int64_t start = p->mask_start[b];
        const uint8_t *row = mask_row(p, b, s->j[r]);
        for (int64_t t = max64(a, start); t < e; t++)
            if (!row[t - start]) bits &= ~(1u << (t - t0));
    }
    return bits;
}

/* Online-softmax step of one row with the chunk's scores `sc`. */
static inline void softmax_step(attn_scratch *s, int r, vf sc, int64_t head_dim) {
    const uint32_t bits = s->bits[r];
    sc = v_select(bits, sc, v_set1(-INFINITY));
    const float top = v_hmax(sc);
    if (top > s->m[r]) {
        const float shrink = expf(s->m[r] - top); /* 0 on the row's first visible chunk */
        if (s->l[r] != 0.0f) {
            s->l[r] *= shrink;
            float *acc = s->acc + r * head_dim;
            for (int64_t c = 0; c < head_dim; c += LANES) v_store(acc + c, v_mul(v_load(acc + c), v_set1(shrink)));
        }
        s->m[r] = top;
    }
    const vf e = v_select(bits, v_exp(v_sub(sc, v_set1(s->m[r]))), v_zero());
    s->l[r] += v_hsum(e);
    v_store(s->p + r * LANES, e);
}

/* Scores of rows [r0, r0 + RG) against n keys (`key_bytes` apart), then their softmax steps. */
#define DEFINE_SCORES(RG)                                                                     \
    static inline __attribute__((always_inline)) void scores_##RG(                           \
        attn_scratch *s, int r0, const char *keys, int64_t key_bytes, int64_t n,             \
        int64_t head_dim, int dtype) {                                                        \
        vf tmp[RG][LANES];                                                                    \
        for (int64_t i = 0; i < n; i++) {                                                     \
            const char *k = keys + i * key_bytes;                                             \
            vf a[RG], b[RG]; /* two chains per row: half the FMA latency per key */           \
            for (int rr = 0; rr < RG; rr++) a[rr] = b[rr] = v_zero();                         \
            for (int64_t c = 0; c < head_dim; c += 2 * LANES) {                               \
                vf lo, hi;                                                                    \
                load_pair(k + c * elem_size(dtype), dtype, &lo, &hi);                         \
                for (int rr = 0; rr < RG; rr++) {                                             \
                    const float *q = s->q + (r0 + rr) * head_dim + c;                         \
                    a[rr] = v_fma(v_load(q), lo, a[rr]);                                      \
                    b[rr] = v_fma(v_load(q + LANES), hi, b[rr]);                              \
                }                                                                             \
            }                                                                                 \
            for (int rr = 0; rr < RG; rr++) tmp[rr][i] = v_add(a[rr], b[rr]);                 \
        }                                                                                     \
        for (int64_t i = n; i < LANES; i++)                                                   \
            for (int rr = 0; rr < RG; rr++) tmp[rr][i] = v_zero();                            \
        for (int rr = 0; rr < RG; rr++) {                                                     \
            if (s->bits[r0 + rr]) softmax_step(s, r0 + rr, v_transpose_sum(tmp[rr]), head_dim); \
            else v_store(s->p + (r0 + rr) * LANES, v_zero()); /* values_* read every row */     \
        }                                                                                     \
    }
DEFINE_SCORES(1)
DEFINE_SCORES(2)
DEFINE_SCORES(4)

/* acc[r] += sum_i p[r][i] * v_i for RG rows, NB blocks of 2*LANES elements from element c: the
 * accumulators stay in registers across the chunk's keys (a load/store per key made the
 * store-to-load latency the bound). Hidden keys have p = 0 (0 * v as SDPA's masked matmul). */
#define DEFINE_VALUES(RG, NB)                                                                 \
    static inline __attribute__((always_inline)) void values_##RG##_##NB(                    \
        attn_scratch *s, int r0, int64_t c, const char *values, int64_t key_bytes, int64_t n, \
        int64_t head_dim, uint32_t any, int dtype) {                                          \
        vf a[RG][2 * NB];                                                                     \
        for (int rr = 0; rr < RG; rr++)                                                       \
            for (int x = 0; x < 2 * NB; x++) a[rr][x] = v_load(s->acc + (r0 + rr) * head_dim + c + x * LANES); \
        for (int64_t i = 0; i < n; i++) {                                                     \
            if (!((any >> i) & 1u)) continue;                                                 \
            const char *v = values + i * key_bytes + c * elem_size(dtype);                    \
            vf w[2 * NB];                                                                     \
            for (int x = 0; x < NB; x++)                                                      \
                load_pair(v + x * 2 * LANES * elem_size(dtype), dtype, &w[2 * x], &w[2 * x + 1]); \
            for (int rr = 0; rr < RG; rr++) {                                                 \
                const vf pr = v_set1(s->p[(r0 + rr) * LANES + i]);                            \
                for (int x = 0; x < 2 * NB; x++) a[rr][x] = v_fma(pr, w[x], a[rr][x]);        \
            }                                                                                 \
        }                                                                                     \
        for (int rr = 0; rr < RG; rr++)                                                       \
            for (int x = 0; x < 2 * NB; x++) v_store(s->acc + (r0 + rr) * head_dim + c + x * LANES, a[rr][x]); \
    }
DEFINE_VALUES(1, 1)
DEFINE_VALUES(1, 2)
DEFINE_VALUES(2, 1)
DEFINE_VALUES(2, 2)
#if LANES == 16 /* 32 vector registers: 4 rows x 4 accumulators fit */
DEFINE_VALUES(4, 1)
DEFINE_VALUES(4, 2)
#define VALUE_ROWS 4
#else
#define VALUE_ROWS 2
#endif

static inline __attribute__((always_inline)) void accumulate_values(
    attn_scratch *s, int r0, int r1, const char *values, int64_t key_bytes, int64_t n,
    int64_t head_dim, uint32_t any, int dtype) {
    for (int64_t c = 0; c < head_dim; c += 4 * LANES) {
        const int two = head_dim - c >= 4 * LANES;
        int r = r0;
#if VALUE_ROWS == 4
        for (; r + 4 <= r1; r += 4) {
            if (two) values_4_2(s, r, c, values, key_bytes, n, head_dim, any, dtype);
            else values_4_1(s, r, c, values, key_bytes, n, head_dim, any, dtype);
        }
#endif
        for (; r + 2 <= r1; r += 2) {
            if (two) values_2_2(s, r, c, values, key_bytes, n, head_dim, any, dtype);
            else values_2_1(s, r, c, values, key_bytes, n, head_dim, any, dtype);
        }
        for (; r < r1; r++) {
            if (two) values_1_2(s, r, c, values, key_bytes, n, head_dim, any, dtype);
            else values_1_1(s, r, c, values, key_bytes, n, head_dim, any, dtype);
        }
    }
}

/* Software prefetch of n rows of head_bytes, key_bytes apart: the keys (or values) of one kv
 * head for a chunk ATTN_PREFETCH_KEYS ahead. The next page is anywhere in memory, so the
 * hardware prefetcher cannot run ahead of a page jump. Measured at 16K keys from DRAM (paired
 * runs, GB/s of KV read): none 4.3; whole chunk at once into L1 4.9, into L2 6.4; per head and
 * tensor (bursts of 32 lines for 16 keys of 128 B) into L2 10.1. Prefetching an item's first
 * chunks before its q rows were loaded was slower (paired: 0.20 vs 0.12 ms, batch 16 x 128). */
static inline __attribute__((always_inline)) void prefetch_rows(const char *first, int64_t n,
                                                                int64_t head_bytes, int64_t key_bytes) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t at = 0; at < head_bytes; at += 64) prefetch(first + i * key_bytes + at);
}

/* Rows [r0, r1) (one kv head) against one chunk. */
static inline __attribute__((always_inline)) void head_chunk(
    attn_scratch *s, int r0, int r1, const char *keys, const char *values, int64_t key_bytes,
    int64_t n, int64_t head_dim, int dtype, int64_t ahead, int64_t n_ahead) {
    uint32_t any = 0;
    for (int r = r0; r < r1; r++) any |= s->bits[r];
    if (!any) return;
    const int64_t head_bytes = head_dim * elem_size(dtype);
    prefetch_rows(keys + ahead, n_ahead, head_bytes, key_bytes);
    int r = r0;
    for (; r + 4 <= r1; r += 4) scores_4(s, r, keys, key_bytes, n, head_dim, dtype);
    for (; r + 2 <= r1; r += 2) scores_2(s, r, keys, key_bytes, n, head_dim, dtype);
    for (; r < r1; r++) scores_1(s, r, keys, key_bytes, n, head_dim, dtype);
    prefetch_rows(values + ahead, n_ahead, head_bytes, key_bytes);
    accumulate_values(s, r0, r1, values, key_bytes, n, head_dim, any, dtype);
}

static void store_rows(const attn_problem *p, const attn_item *it, const attn_scratch *s, int rows) {
    const int64_t d_all = p->head_dim, group = p->q_heads / p->kv_heads;
    for (int r = 0; r < rows; r++) {
        const int64_t token = p->q_indptr[it->b] + s->j[r], head = s->h[r] * group + s->g[r];
        void *dst = (char *)p->out + (token * p->q_heads + head) * d_all * elem_size(p->q_dtype);
        const float inv = s->l[r] > 0.0f ? 1.0f / s->l[r] : 0.0f;
        const float *acc = s->acc + r * d_all;
        if (p->q_dtype == p->cache_dtype) {
            for (int64_t c = 0; c < d_all; c += 2 * LANES)
                store_pair((char *)dst + c * elem_size(p->q_dtype), p->q_dtype,
                           v_mul(v_load(acc + c), v_set1(inv)), v_mul(v_load(acc + c + LANES), v_set1(inv)));
        } else {
            for (int64_t d = 0; d < d_all; d++)
                store_elem(dst, p->q_dtype, d, acc[lane_pos(p->cache_dtype, d)] * inv);
        }
    }
}

/* A part's state: m[ATTN_MAX_ROWS], l[ATTN_MAX_ROWS], then acc rows of head_dim. */
static void save_part(const attn_problem *p, const attn_item *it, const attn_scratch *s, int rows) {
    float *part = p->partials + it->part * attn_partial_floats(p);
    memcpy(part, s->m, (size_t)rows * sizeof(float));
    memcpy(part + ATTN_MAX_ROWS, s->l, (size_t)rows * sizeof(float));
    memcpy(part + 2 * ATTN_MAX_ROWS, s->acc, (size_t)(rows * p->head_dim) * sizeof(float));
}

/* Byte offset of logical key t's slot row in a cache. */
static inline int64_t slot_offset(const attn_problem *p, const int32_t *pages, int64_t t,
                                  int64_t key_bytes) {
    const int64_t page = t / p->page_size;
    return ((int64_t)pages[page] * p->page_size + (t - page * p->page_size)) * key_bytes;
}

/* The first visible slot of a query's tree block at or after t (mask_end when none). */
static inline int64_t next_visible(const uint8_t *mask, int64_t t, int64_t start, int64_t mask_end) {
    while (t < mask_end && !mask[t - start]) t++;
    return t;
}

/* The keys from the chunk of the tree block's first key on, for tree (custom mask) queries
 * off the first branch, laid out as sequential decoding lays them out: prefix key t at
 * position t, the i-th visible key of the block at mask_start + i. Lanes follow positions,
 * and a chunk's exp sum pairs lanes by a fixed tree, so such a node (at a later slot than its
 * token gets when decoded one by one) would otherwise get other bits than plain decoding,
 * and greedy output could change at a near-tie (bf16 demo pair, 4/2/8: 1 of 16 held-out
 * prompts). The chunks are gathered per query (its rows across the group share them). */
static inline __attribute__((always_inline)) void tree_tail(
    const attn_problem *p, const attn_item *it, attn_scratch *s, int per_head,
    int64_t head_bytes, int64_t key_bytes, const int32_t *pages, int dtype) {
    const int64_t ps = p->page_size, b = it->b, start = p->mask_start[b];
    const int64_t mask_end = mask_end_of(p, b);
    const int groups = it->g1 - it->g0, queries = it->j1 - it->j0;
    for (int64_t jj = 0; jj < queries; jj++) {
        if (s->tail[(int)jj * groups] == INT64_MAX) continue; /* walked with the others */
        const int64_t from = max64(s->tail[(int)jj * groups], chunk_start(it->k0, ps));
        const int64_t j = it->j0 + jj;
        const uint8_t *mask = mask_row(p, b, j);
        const int64_t end = min64(it->k1, tree_position(p, b, j, mask_end) + 1);
        const int64_t lo = s->lo[(int)jj * groups]; /* the same for every head */
        int64_t cursor = next_visible(mask, start, start, mask_end); /* slot of position start */
        for (int64_t v = start; v < from; v++) cursor = next_visible(mask, cursor + 1, start, mask_end);
        for (int64_t v0 = from, v1; v0 < end; v0 = v1) {
            v1 = min64(min64(v0 + LANES, (v0 / ps + 1) * ps), end);
            int64_t slot[LANES];
            uint32_t bits = 0;
            for (int64_t v = v0; v < v1; v++) {
                const int64_t t = v < start ? v : cursor;
                if (v >= start) cursor = next_visible(mask, cursor + 1, start, mask_end);
                slot[v - v0] = slot_offset(p, pages, t, key_bytes);
                if (v >= it->k0 && t >= lo) bits |= 1u << (v - v0); /* the window: by slot */
            }
            if (!bits) continue;
            for (int hh = 0; hh < it->h1 - it->h0; hh++) {
                const int r0 = hh * per_head + (int)jj * groups;
                for (int64_t v = v0; v < v1; v++) {
                    const int64_t at = slot[v - v0] + (it->h0 + hh) * head_bytes;
                    memcpy(s->kbuf + (v - v0) * head_bytes, (const char *)p->k_cache + at, (size_t)head_bytes);
                    memcpy(s->vbuf + (v - v0) * head_bytes, (const char *)p->v_cache + at, (size_t)head_bytes);
                }
                for (int r = r0; r < r0 + groups; r++) s->bits[r] = bits;
                /* Lanes past v1 - v0 hold no key: zero scores, hidden (as past a page end). */
                head_chunk(s, r0, r0 + groups, s->kbuf, s->vbuf, head_bytes, v1 - v0, p->head_dim,
                           dtype, 0, 0);
            }
        }
    }
}

static inline __attribute__((always_inline)) void run_item(const attn_problem *p, const attn_item *it,
                                                           attn_scratch *s, const int dtype) {
    const int64_t d_all = p->head_dim, ps = p->page_size, b = it->b;
    const int rows = map_rows(it, s), per_head = rows / (it->h1 - it->h0);
    const int64_t head_bytes = d_all * elem_size(dtype), key_bytes = p->kv_heads * head_bytes;
    const int32_t *pages = p->page_table + b * p->max_pages;
    load_rows(p, it, s, rows, dtype);
    for (int64_t t0 = chunk_start(it->k0, ps), t1; t0 < it->k1; t0 = t1) {
        const int64_t page = t0 / ps;
        t1 = min64(t0 + LANES, (page + 1) * ps);
        uint32_t any = 0;
        for (int r = 0; r < rows; r++) any |= s->bits[r] = row_bits(p, s, r, b, t0, t1 - t0, it->k0, it->k1);
        if (!any) continue;
        const int64_t first = slot_offset(p, pages, t0, key_bytes);
        const int64_t t2 = t0 + ATTN_PREFETCH_KEYS, page2 = t2 / ps;
        const int64_t n2 = t2 < it->k1 ? min64(min64(LANES, (page2 + 1) * ps - t2), it->k1 - t2) : 0;
        const int64_t ahead = n2 ? slot_offset(p, pages, t2, key_bytes) - first : 0;
        for (int hh = 0; hh < it->h1 - it->h0; hh++) {
            const int64_t at = first + (it->h0 + hh) * head_bytes;
            head_chunk(s, hh * per_head, (hh + 1) * per_head, (const char *)p->k_cache + at,
                       (const char *)p->v_cache + at, key_bytes, t1 - t0, d_all, dtype, ahead, n2);
        }
    }
    if (p->custom_mask) tree_tail(p, it, s, per_head, head_bytes, key_bytes, pages, dtype);
    if (it->part < 0) store_rows(p, it, s, rows);
    else save_part(p, it, s, rows);
}

/* Softmax states of parts it->part .. + splits - 1 combined, then the output rows. */
static void merge_parts(const attn_problem *p, const attn_item *it, attn_scratch *s) {
    const int rows = map_rows(it, s);
    const int64_t d_all = p->head_dim, stride = attn_partial_floats(p);
    const float *first = p->partials + it->part * stride;
    for (int r = 0; r < rows; r++) {
        float top = -INFINITY, sum = 0.0f;
        for (int k = 0; k < it->splits; k++) top = fmaxf(top, first[k * stride + r]);
        float *acc = s->acc + r * d_all;
        memset(acc, 0, (size_t)d_all * sizeof(float));
        for (int k = 0; top > -INFINITY && k < it->splits; k++) {
            const float *part = first + k * stride;
            const float w = part[r] > -INFINITY ? expf(part[r] - top) : 0.0f;
            sum += w * part[ATTN_MAX_ROWS + r];
            const float *src = part + 2 * ATTN_MAX_ROWS + r * d_all;
            for (int64_t c = 0; c < d_all; c += LANES)
                v_store(acc + c, v_fma(v_set1(w), v_load(src + c), v_load(acc + c)));
        }
        s->l[r] = sum;
    }
    store_rows(p, it, s, rows);
}
