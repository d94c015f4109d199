/* The paged attention of runtime/backends/paged_attention.py: FP32 softmax(q k^T * scale + mask) v over one layer's
 * pool of cached keys and values, read in place at the cells each group's key window names (no gathered copy).
 *
 * q [G, H, M, D] (strided; d contiguous), a layer's pools [cells, H, D] (contiguous), cells [G * W] (group g's key j at
 * g * W + j), mask [G or 1, 1, M, W] (strided, additive FP32), out [G, H, M, D] contiguous. Row (g, h, m):
 *   s_j = dot(q, k_j) * scale + mask_j;  p_j = exp(s_j - max_j s_j);  out = (sum_j p_j v_j) / (sum_j p_j)
 * Every row is computed on its own in one fixed order, whatever the rows beside it, the window's extent W or the
 * threads: a dot product is eight FP32 FMA chains over d = l mod 8 summed as ((0+4)+(2+6))+((1+5)+(3+7)); the sum of
 * p is eight chains over j mod 8 summed the same way; the mix is one FMA chain over j per output. A key masked at
 * the FP32 minimum (or -inf) in a row that has a key open (mask above half the FP32 minimum) has p_j = 0 exactly, so
 * it is skipped: adding it would leave every sum's bits as they are (keys past a row's position cost nothing, and
 * a longer window of masked keys changes no bit). A row with no open key takes every key.
 * exp is Cephes' single-precision polynomial on a rounded exponent (within 2 ulp of expf), 0 below -87.3.
 *
 * paged_attention_bf16 is transformers' eager attention for BF16 in the same order: q, the pools and out BF16, the
 * mask boolean (nonzero: hidden); s_j = bf16(bf16(dot(q, k_j)) * scale), a hidden key at the BF16 minimum; the softmax
 * in FP32 as above, each p_j = bf16(e_j / sum e); out = bf16(sum_j p_j v_j), one FP32 FMA chain over j.
 * Built by paged_attention.py with -O3 -march=native -fopenmp: the threads are the process's OpenMP threads. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHAINS 8
#define ROWS 8 /* rows of one (group, head) taken together: each key row read once for them */
#define INLINE static inline __attribute__((always_inline))

typedef float v8 __attribute__((vector_size(CHAINS * sizeof(float))));
typedef int32_t v8i __attribute__((vector_size(CHAINS * sizeof(int32_t))));

extern int omp_get_thread_num(void);

INLINE float reduce(v8 a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

INLINE v8 load(const float *p) {
  v8 v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* four dot products side by side (independent FMA chains, so the core overlaps them), each in dot order: eight
 * FP32 FMA chains over d = l mod 8, then reduce() */
INLINE void dot4(const float *const *q, const float *const *k, long d_len, float *out) {
  v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
  long d = 0;
  for (; d + CHAINS <= d_len; d += CHAINS) {
    a0 += load(q[0] + d) * load(k[0] + d);
    a1 += load(q[1] + d) * load(k[1] + d);
    a2 += load(q[2] + d) * load(k[2] + d);
    a3 += load(q[3] + d) * load(k[3] + d);
  }
  for (long l = 0; d < d_len; d++, l++) {
    a0[l] += q[0][d] * k[0][d];
    a1[l] += q[1][d] * k[1][d];
    a2[l] += q[2][d] * k[2][d];
    a3[l] += q[3][d] * k[3][d];
  }
  out[0] = reduce(a0);
  out[1] = reduce(a1);
  out[2] = reduce(a2);
  out[3] = reduce(a3);
}

/* out[i] = dot(q[i], k[i]) for i < n, four at a time (the last four padded with the last pair): every dot the same
 * code, so its bits do not depend on its neighbours */
static void dots(long n, const float **q, const float **k, long d_len, float *out) {
  float pad[4];
  long i = 0;
  for (; i + 4 <= n; i += 4) dot4(q + i, k + i, d_len, out + i);
  if (i < n) {
    const float *qs[4], *ks[4];
    for (int l = 0; l < 4; l++) {
      qs[l] = q[i + l < n ? i + l : n - 1];
      ks[l] = k[i + l < n ? i + l : n - 1];
    }
    dot4(qs, ks, d_len, pad);
    for (long l = 0; i + l < n; l++) out[i + l] = pad[l];
  }
}

INLINE float widen(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

INLINE uint16_t narrow(float f) { /* to nearest even, as c10::BFloat16 rounds; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

INLINE float round_bf16(float f) { return widen(narrow(f)); }

INLINE v8 load_bf16(const uint16_t *p) { /* eight BF16 values widened */
  v8i bits;
  for (int l = 0; l < CHAINS; l++) bits[l] = (int32_t)((uint32_t)p[l] << 16);
  v8 f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* value i of a row of FP32 values, or of BF16 ones (bf16) widened; inlined with a constant bf16 */
INLINE v8 load_at(const void *row, long i, int bf16) {
  return bf16 ? load_bf16((const uint16_t *)row + i) : load((const float *)row + i);
}

INLINE float value_at(const void *row, long i, int bf16) {
  return bf16 ? widen(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* o[d] = sum_j p[j] * v_j[d] with v_j the row at element window[j] * stride of base (FP32, or BF16 widened): for
 * each output one FMA chain over j ascending from 0, a zero weight skipped (it adds nothing); the sums held in
 * registers across the window, 64 outputs a pass */
INLINE void mix_rows(const float *p, const void *base, int bf16, const int64_t *window, long stride, long w_len,
                     long d_len, float *o) {
  long size = bf16 ? 2 : 4, d = 0;
  for (; d + 8 * CHAINS <= d_len; d += 8 * CHAINS) {
    v8 a[8] = {{0}};
    for (long j = 0; j < w_len; j++) {
      if (p[j] == 0.0f) continue;
      const char *v = (const char *)base + (window[j] * stride + d) * size;
      v8 weight = (v8){0} + p[j];
      for (int c = 0; c < 8; c++) a[c] += weight * load_at(v, c * CHAINS, bf16);
    }
    memcpy(o + d, a, sizeof a);
  }
  for (; d + CHAINS <= d_len; d += CHAINS) {
    v8 a = {0};
    for (long j = 0; j < w_len; j++)
      if (p[j] != 0.0f) a += ((v8){0} + p[j]) * load_at((const char *)base + (window[j] * stride + d) * size, 0, bf16);
    memcpy(o + d, &a, sizeof a);
  }
  for (; d < d_len; d++) {
    float a = 0.0f;
    for (long j = 0; j < w_len; j++)
      if (p[j] != 0.0f) a += p[j] * value_at(base, window[j] * stride + d, bf16);
    o[d] = a;
  }
}

static void mix(const float *p, const float *base, const int64_t *window, long stride, long w_len, long d_len,
                float *o) {
  mix_rows(p, base, 0, window, stride, w_len, d_len, o);
}

static void mix_bf16(const float *p, const uint16_t *base, const int64_t *window, long stride, long w_len,
                     long d_len, float *o) {
  mix_rows(p, base, 1, window, stride, w_len, d_len, o);
}

INLINE v8 pick(v8i where, v8 a, v8 b) { /* a where set, else b */
  v8i ai, bi;
  memcpy(&ai, &a, sizeof ai);
  memcpy(&bi, &b, sizeof bi);
  ai = (ai & where) | (bi & ~where);
  memcpy(&a, &ai, sizeof a);
  return a;
}

INLINE v8 exp8(v8 x) { /* Cephes expf: x = n ln2 + r, |r| <= ln2 / 2; 0 below -87.3 */
  const v8 lo = (v8){0} - 87.3f, hi = (v8){0} + 88.3f;
  v8i open = ~(x < lo); /* a NaN stays NaN */
  x = pick(x < lo, lo, x);
  x = pick(x > hi, hi, x);
  const v8 magic = (v8){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  v8 t = x * 1.44269504088896341f + magic;
  v8i n;
  memcpy(&n, &t, sizeof n);
  n -= 0x4B400000;
  v8 fn = t - magic;
  v8 r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  v8 y = 1.9875691500E-4f * r + 1.3981999507E-3f;
  y = y * r + 8.3334519073E-3f;
  y = y * r + 4.1665795894E-2f;
  y = y * r + 1.6666665459E-1f;
  y = y * r + 5.0000001201E-1f;
  y = y * (r * r) + r + 1.0f;
  v8i bits = (n + 127) << 23;
  v8 pow2;
  memcpy(&pow2, &bits, sizeof pow2);
  y = y * pow2;
  return pick(open, y, (v8){0});
}

/* s[j] = exp(s[j] - max s) in place over a row of W scores; returns their sum (eight chains over j mod 8, reduce()) */
static float exponentials(float *s, long w_len) {
  float top = -INFINITY;
  for (long j = 0; j < w_len; j++)
    if (s[j] > top) top = s[j];
  v8 sum = {0}, shift = (v8){0} + top;
  long j = 0;
  for (; j + CHAINS <= w_len; j += CHAINS) {
    v8 p = exp8(load(s + j) - shift);
    memcpy(s + j, &p, sizeof p);
    sum += p;
  }
  if (j < w_len) {
    v8 tail = (v8){0} - INFINITY;
    memcpy(&tail, s + j, (w_len - j) * sizeof(float));
    v8 p = exp8(tail - shift); /* the lanes past W are -inf: 0 */
    memcpy(s + j, &p, (w_len - j) * sizeof(float));
    sum += p;
  }
  return reduce(sum);
}

INLINE int closed(float mask) { return mask <= -FLT_MAX; }

/* rows [m0, m0 + rows) of group g, heads [h0, h1); scores: (h1 - h0) x ROWS x W scratch. Each key's cell is read
 * once for all the heads (one contiguous run of the pool) */
static void block(const float *q, long q_sg, long q_sh, long q_sm, const float *k_pool, const float *v_pool,
                  const int64_t *cells, const float *mask, long m_sg, long m_sm, long m_sw, float *out, long g,
                  long h0, long h1, long m0, int rows, long heads, long m_len, long w_len, long d_len, float scale,
                  float *scores) {
  const float *mr[ROWS];
  int any_open[ROWS];
  for (int r = 0; r < rows; r++) {
    mr[r] = mask + g * m_sg + (m0 + r) * m_sm;
    any_open[r] = 0;
    for (long j = 0; j < w_len && !any_open[r]; j++) any_open[r] = mr[r][j * m_sw] > -FLT_MAX / 2;
  }
  const int64_t *window = cells + g * w_len;
  const float *qs[64 * ROWS], *ks[64 * ROWS];
  long at[64 * ROWS];
  float found[64 * ROWS], masks[64 * ROWS];
  for (long j = 0; j < w_len; j++) {
    const float *key = k_pool + window[j] * heads * d_len;
    long n = 0;
    for (int r = 0; r < rows; r++) {
      float m = mr[r][j * m_sw];
      int skip = any_open[r] && closed(m);
      for (long h = h0; h < h1; h++) {
        long i = ((h - h0) * ROWS + r) * w_len + j;
        if (skip) {
          scores[i] = -INFINITY;
          continue;
        }
        qs[n] = q + g * q_sg + h * q_sh + (m0 + r) * q_sm;
        ks[n] = key + h * d_len;
        masks[n] = m;
        at[n++] = i;
      }
    }
    dots(n, qs, ks, d_len, found);
    for (long i = 0; i < n; i++) scores[at[i]] = found[i] * scale + masks[i];
  }
  float total[ROWS * 64]; /* heads a task: at most 64 (the caller's split) */
  for (long h = h0; h < h1; h++)
    for (int r = 0; r < rows; r++)
      total[(h - h0) * ROWS + r] = exponentials(scores + ((h - h0) * ROWS + r) * w_len, w_len);
  for (long h = h0; h < h1; h++)
    for (int r = 0; r < rows; r++) {
      float *o = out + ((g * heads + h) * m_len + m0 + r) * d_len, t = total[(h - h0) * ROWS + r];
      mix(scores + ((h - h0) * ROWS + r) * w_len, v_pool + h * d_len, window, heads * d_len, w_len, d_len, o);
      for (long d = 0; d < d_len; d++) o[d] /= t;
    }
}

/* BF16 (paged_attention_bf16) */
static void widen_row(const uint16_t *in, float *out, long n) {
  for (long i = 0; i < n; i++) out[i] = widen(in[i]);
}

#define BF16_LOWEST -3.38953138925153547590470800371487866880e+38f /* the BF16 minimum, a hidden key's score */

/* block() for BF16; scratch: (h1 - h0) x ROWS x W scores, then (h1 - h0) x ROWS x D queries, then heads x D for a
 * widened key or value cell */
static void block_bf16(const uint16_t *q, long q_sg, long q_sh, long q_sm, const uint16_t *k_pool,
                       const uint16_t *v_pool, const int64_t *cells, const uint8_t *mask, long m_sg, long m_sm,
                       long m_sw, uint16_t *out, long g, long h0, long h1, long m0, int rows, long heads, long m_len,
                       long w_len, long d_len, float scale, float *scores) {
  float *queries = scores + (h1 - h0) * ROWS * w_len, *cell = queries + (h1 - h0) * ROWS * d_len;
  const uint8_t *mr[ROWS];
  int any_open[ROWS];
  for (int r = 0; r < rows; r++) {
    mr[r] = mask + g * m_sg + (m0 + r) * m_sm;
    any_open[r] = 0;
    for (long j = 0; j < w_len && !any_open[r]; j++) any_open[r] = !mr[r][j * m_sw];
    for (long h = h0; h < h1; h++)
      widen_row(q + g * q_sg + h * q_sh + (m0 + r) * q_sm, queries + ((h - h0) * ROWS + r) * d_len, d_len);
  }
  const int64_t *window = cells + g * w_len;
  const float *qs[64 * ROWS], *ks[64 * ROWS];
  long at[64 * ROWS];
  float found[64 * ROWS];
  for (long j = 0; j < w_len; j++) {
    int needed = 0;
    for (int r = 0; r < rows; r++) needed |= !any_open[r] || !mr[r][j * m_sw];
    if (needed) widen_row(k_pool + window[j] * heads * d_len + h0 * d_len, cell, (h1 - h0) * d_len);
    long n = 0;
    for (int r = 0; r < rows; r++) {
      int hidden = mr[r][j * m_sw] != 0, skip = any_open[r] && hidden;
      for (long h = h0; h < h1; h++) {
        long i = ((h - h0) * ROWS + r) * w_len + j;
        if (skip || hidden) {
          scores[i] = skip ? -INFINITY : BF16_LOWEST;
          continue;
        }
        qs[n] = queries + ((h - h0) * ROWS + r) * d_len;
        ks[n] = cell + (h - h0) * d_len;
        at[n++] = i;
      }
    }
    dots(n, qs, ks, d_len, found);
    for (long i = 0; i < n; i++) scores[at[i]] = round_bf16(round_bf16(found[i]) * scale);
  }
  float *mix = queries; /* the queries are read; their scratch holds the FP32 sums now */
  for (long h = h0; h < h1; h++)
    for (int r = 0; r < rows; r++) {
      float *s = scores + ((h - h0) * ROWS + r) * w_len, total = exponentials(s, w_len);
      for (long j = 0; j < w_len; j++) s[j] = round_bf16(s[j] / total);
    }
  for (long h = h0; h < h1; h++)
    for (int r = 0; r < rows; r++) {
      uint16_t *o = out + ((g * heads + h) * m_len + m0 + r) * d_len;
      float *m = mix + ((h - h0) * ROWS + r) * d_len;
      mix_bf16(scores + ((h - h0) * ROWS + r) * w_len, v_pool + h * d_len, window, heads * d_len, w_len, d_len, m);
      for (long d = 0; d < d_len; d++) o[d] = narrow(m[d]);
    }
}

static void block_bf16(const uint16_t *q, long q_sg, long q_sh, long q_sm, const uint16_t *k_pool,
                       const uint16_t *v_pool, const int64_t *cells, const uint8_t *mask, long m_sg, long m_sm,
                       long m_sw, uint16_t *out, long g, long h0, long h1, long m0, int rows, long heads, long m_len,
                       long w_len, long d_len, float scale, float *scores);

/* Rows split into tasks of (group, ROWS rows, a part of the heads) over the threads, each with its scratch: block()
 * (FP32) or block_bf16(). 0, or 1: a cell outside [0, pool_cells) (nothing written), 2: no scratch */
static int launch(int bf16, const void *q, long q_sg, long q_sh, long q_sm, const void *k_pool, const void *v_pool,
                  long pool_cells, const int64_t *cells, const void *mask, long m_sg, long m_sm, long m_sw, void *out,
                  long groups, long heads, long m_len, long w_len, long d_len, float scale, int threads) {
  for (long i = 0; i < groups * w_len; i++)
    if (cells[i] < 0 || cells[i] >= pool_cells) return 1;
  long row_blocks = (m_len + ROWS - 1) / ROWS, slices = (long)groups * row_blocks;
  /* heads split into parts so that every thread has a task, at most 64 heads a part */
  long parts = slices >= threads ? 1 : (threads + slices - 1) / slices;
  if (parts > heads) parts = heads;
  if ((heads + parts - 1) / parts > 64) parts = (heads + 63) / 64;
  long tasks = slices * parts, per_part = (heads + parts - 1) / parts;
  /* scores; BF16 also the widened queries (then the sums) and a widened key cell */
  size_t scratch = (size_t)per_part * ROWS * (w_len ? w_len : 1) + (bf16 ? (size_t)per_part * (ROWS + 1) * d_len : 0);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float *scores = malloc(scratch * sizeof(float));
    if (!scores) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (long task = 0; task < tasks; task++) {
      if (!scores) continue;
      long slice = task / parts, part = task % parts, g = slice / row_blocks, m0 = slice % row_blocks * ROWS;
      long h0 = part * per_part, h1 = h0 + per_part < heads ? h0 + per_part : heads;
      int rows = m_len - m0 < ROWS ? (int)(m_len - m0) : ROWS;
      if (h0 >= h1) continue;
      if (bf16)
        block_bf16(q, q_sg, q_sh, q_sm, k_pool, v_pool, cells, mask, m_sg, m_sm, m_sw, out, g, h0, h1, m0, rows, heads,
                   m_len, w_len, d_len, scale, scores);
      else
        block(q, q_sg, q_sh, q_sm, k_pool, v_pool, cells, mask, m_sg, m_sm, m_sw, out, g, h0, h1, m0, rows, heads,
              m_len, w_len, d_len, scale, scores);
    }
    free(scores);
  }
  return failed ? 2 : 0;
}

int paged_attention_f32(const float *q, long q_sg, long q_sh, long q_sm, const float *k_pool, const float *v_pool,
                        long pool_cells, const int64_t *cells, const float *mask, long m_sg, long m_sm, long m_sw,
                        float *out, long groups, long heads, long m_len, long w_len, long d_len, float scale,
                        int threads) {
  return launch(0, q, q_sg, q_sh, q_sm, k_pool, v_pool, pool_cells, cells, mask, m_sg, m_sm, m_sw, out, groups, heads,
                m_len, w_len, d_len, scale, threads);
}

int paged_attention_bf16(const uint16_t *q, long q_sg, long q_sh, long q_sm, const uint16_t *k_pool,
                         const uint16_t *v_pool, long pool_cells, const int64_t *cells, const uint8_t *mask, long m_sg,
                         long m_sm, long m_sw, uint16_t *out, long groups, long heads, long m_len, long w_len,
                         long d_len, float scale, int threads) {
  return launch(1, q, q_sg, q_sh, q_sm, k_pool, v_pool, pool_cells, cells, mask, m_sg, m_sm, m_sw, out, groups, heads,
                m_len, w_len, d_len, scale, threads);
}

/* The cache write of a layer (paged_attention.py write_cells): for i < n where valid[i], pool row cells[i] takes
 * source row order[i] (row_bytes bytes at source + order[i] * source_stride), copied as bytes; rows not valid are
 * left as they are. 0, or 1: a valid row's cell or order out of range (nothing written). */
int write_cells(char *pool, long pool_rows, long row_bytes, const int64_t *cells, const char *source, long source_rows,
                long source_stride, const int64_t *order, const uint8_t *valid, long n) {
  for (long i = 0; i < n; i++)
    if (valid[i] && (cells[i] < 0 || cells[i] >= pool_rows || order[i] < 0 || order[i] >= source_rows)) return 1;
  for (long i = 0; i < n; i++)
    if (valid[i]) memcpy(pool + cells[i] * row_bytes, source + order[i] * source_stride, row_bytes);
  return 0;
}
