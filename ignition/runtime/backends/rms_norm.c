/* The RMSNorm of runtime/backends/rms_norm.py: y = w * (x * rsqrt(eps + sum(x * x) / n)) over each row of n FP32
 * values, as the recipes write it out in ATen ops (recipes/layers.py), in one pass; and its BF16 form (the _bf16
 * functions), transformers' own: the row widened to FP32, normed in FP32, rounded to BF16, then times the BF16 weight
 * and rounded again (as the ATen ops round: float products, round to nearest even).
 *
 * Compiled with -ffp-contract=off (rms_norm.py FLAGS): every product and sum is rounded on its own.
 * x [rows, n] contiguous, w [weight_rows, n] contiguous (row r takes weight row r mod weight_rows: a per-head weight
 * of a [tokens, heads, head_dim] input), y [rows, n]. The sum of squares is eight FP32 chains (a product, then a
 * sum) over i mod 8, summed as ((0+4)+(2+6))+((1+5)+(3+7)): one fixed order whatever the rows beside it or the
 * threads. The rest is ATen's arithmetic, each step rounded as its op rounds: t = s / n, v = eps + t,
 * r = 1 / sqrt(v), x * r, then w *.
 * Optionally followed by the rotary embedding (rms_norm_rope_f32). Built by rms_norm.py with -O3 -march=native
 * -fopenmp (native_build), without FMA contraction. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHAINS 8
extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);
typedef float v8 __attribute__((vector_size(CHAINS * sizeof(float))));

static inline float reduce(v8 a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

static inline void row(const float *x, const float *w, float *y, long n, float eps, float count) {
  v8 acc = {0};
  long i = 0;
  for (; i + CHAINS <= n; i += CHAINS) {
    v8 v;
    memcpy(&v, x + i, sizeof v);
    acc += v * v;
  }
  for (long l = 0; i < n; i++, l++) acc[l] += x[i] * x[i];
  float t = reduce(acc) / count;
  float r = 1.0f / sqrtf(eps + t);
  for (i = 0; i < n; i++) {
    float scaled = x[i] * r;
    y[i] = w[i] * scaled;
  }
}

/* rotary embedding on a normed row (recipes' rotate-half form): y[i] = v[i] * cos[i] + v[(i - shift) mod n] * sin[i],
 * each product and the sum rounded on its own, as ATen's mul, roll, mul and add round them (no FMA: the file is
 * compiled with -ffp-contract=off) */
static void rotate(const float *v, const float *c, const float *s, float *y, long n, long shift) {
  long sh = (shift % n + n) % n; /* v[(i - sh) mod n]: the last sh values first */
  for (long i = 0; i < sh; i++) {
    float first = v[i] * c[i], second = v[i - sh + n] * s[i];
    y[i] = first + second;
  }
  for (long i = sh; i < n; i++) {
    float first = v[i] * c[i], second = v[i - sh] * s[i];
    y[i] = first + second;
  }
}

/* rms_norm_f32, then row r rotated by trig row r / per_trig_row of cos and sin [*, n] */
static void norm_rope_rows(const float *x, const float *w, float *y, long r0, long r1, long n, long weight_rows,
                           float eps, float count, const float *c, const float *s, long per_trig_row, long shift) {
  float scratch[n];
  for (long r = r0; r < r1; r++) {
    row(x + r * n, w + r % weight_rows * n, scratch, n, eps, count);
    long t = r / per_trig_row;
    rotate(scratch, c + t * n, s + t * n, y + r * n, n, shift);
  }
}

void rms_norm_rope_f32(const float *x, const float *w, float *y, long rows, long n, long weight_rows, float eps,
                       float count, const float *c, const float *s, long per_trig_row, long shift, int threads) {
  if (rows * n < 65536 || threads < 2) { /* small inputs on the calling thread */
    norm_rope_rows(x, w, y, 0, rows, n, weight_rows, eps, count, c, s, per_trig_row, shift);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), count_threads = omp_get_num_threads();
    norm_rope_rows(x, w, y, rows * t / count_threads, rows * (t + 1) / count_threads, n, weight_rows, eps, count, c,
                   s, per_trig_row, shift);
  }
}

void rms_norm_f32(const float *x, const float *w, float *y, long rows, long n, long weight_rows, float eps,
                  float count, int threads) {
  long per_thread = rows * n < 65536 ? rows : 1; /* small inputs on the calling thread */
  if (per_thread == rows || threads < 2) {
    for (long r = 0; r < rows; r++) row(x + r * n, w + r % weight_rows * n, y + r * n, n, eps, count);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long r = 0; r < rows; r++) row(x + r * n, w + r % weight_rows * n, y + r * n, n, eps, count);
}


/* BF16: the bits of a bfloat16 widened, and a float rounded to nearest even as c10::BFloat16 rounds (NaN stays NaN) */
static inline float widen(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t narrow(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* y = bf16(w * bf16(float(x) * r)), r from the FP32 sum of float(x)^2 in row()'s order */
static inline void row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long n, float eps, float count) {
  v8 acc = {0};
  long i = 0;
  for (; i + CHAINS <= n; i += CHAINS) {
    v8 v;
    for (int l = 0; l < CHAINS; l++) v[l] = widen(x[i + l]);
    acc += v * v;
  }
  for (long l = 0; i < n; i++, l++) acc[l] += widen(x[i]) * widen(x[i]);
  float t = reduce(acc) / count;
  float r = 1.0f / sqrtf(eps + t);
  for (i = 0; i < n; i++) y[i] = narrow(widen(w[i]) * widen(narrow(widen(x[i]) * r)));
}

/* rotate() in BF16: each product and the sum rounded to BF16, as ATen's BF16 mul and add round them */
static void rotate_bf16(const uint16_t *v, const uint16_t *c, const uint16_t *s, uint16_t *y, long n, long shift) {
  long sh = (shift % n + n) % n;
  for (long i = 0; i < n; i++) {
    float first = widen(narrow(widen(v[i]) * widen(c[i])));
    float second = widen(narrow(widen(v[i < sh ? i - sh + n : i - sh]) * widen(s[i])));
    y[i] = narrow(first + second);
  }
}

static void norm_rope_rows_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long r0, long r1, long n,
                                long weight_rows, float eps, float count, const uint16_t *c, const uint16_t *s,
                                long per_trig_row, long shift) {
  uint16_t scratch[n];
  for (long r = r0; r < r1; r++) {
    row_bf16(x + r * n, w + r % weight_rows * n, scratch, n, eps, count);
    long t = r / per_trig_row;
    rotate_bf16(scratch, c + t * n, s + t * n, y + r * n, n, shift);
  }
}

void rms_norm_rope_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long n, long weight_rows,
                        float eps, float count, const uint16_t *c, const uint16_t *s, long per_trig_row, long shift,
                        int threads) {
  if (rows * n < 65536 || threads < 2) {
    norm_rope_rows_bf16(x, w, y, 0, rows, n, weight_rows, eps, count, c, s, per_trig_row, shift);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), count_threads = omp_get_num_threads();
    norm_rope_rows_bf16(x, w, y, rows * t / count_threads, rows * (t + 1) / count_threads, n, weight_rows, eps,
                        count, c, s, per_trig_row, shift);
  }
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long n, long weight_rows, float eps,
                   float count, int threads) {
  if (rows * n < 65536 || threads < 2) {
    for (long r = 0; r < rows; r++) row_bf16(x + r * n, w + r % weight_rows * n, y + r * n, n, eps, count);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long r = 0; r < rows; r++) row_bf16(x + r * n, w + r % weight_rows * n, y + r * n, n, eps, count);
}
