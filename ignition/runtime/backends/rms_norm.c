/* The RMSNorm of runtime/backends/rms_norm.py: y = w * (x * rsqrt(eps + sum(x * x) / n)) over each row of n FP32
 * values, as the recipes write it out in ATen ops (recipes/layers.py), in one pass.
 *
 * x [rows, n] contiguous, w [weight_rows, n] contiguous (row r takes weight row r mod weight_rows: a per-head weight
 * of a [tokens, heads, head_dim] input), y [rows, n]. The sum of squares is eight FP32 FMA chains over i mod 8,
 * summed as ((0+4)+(2+6))+((1+5)+(3+7)): one fixed order whatever the rows beside it or the threads. The rest is
 * ATen's arithmetic, each step rounded as its op rounds: t = s / n, v = eps + t, r = 1 / sqrt(v), x * r, then w *.
 * Built by rms_norm.py with -O3 -march=native -fopenmp (native_build). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHAINS 8
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
