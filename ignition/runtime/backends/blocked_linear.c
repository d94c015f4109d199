/* The blocked FP32 linear of runtime/backends/blocked_linear.py: y [M, N] = x [M, K] @ W.T (+ bias), on W packed
 * once as [ceil(N / 16), K, 16] (16 output features a block, their K weights interleaved; rows past N zero).
 *
 * Every output is one FMA chain over k = 0 .. K-1 from zero, then the bias: the same order at every row count, so a
 * row's result does not depend on the rows beside it. One row (a decode lane) reads ONE_ROW_BLOCKS blocks at once,
 * far apart in each thread's share (that many sequential reads in flight); more rows are taken CHUNK at a time,
 * transposed into scratch (x^T [K, CHUNK]), against BLOCKS blocks at once (CHUNK x BLOCKS vector accumulators), the
 * rows in tiles of TILE so a tile's transposed rows stay in cache while every block of the thread's share passes.
 * Built by blocked_linear.py with -O3 -march=native -fopenmp: the threads are the process's OpenMP threads (torch's). */
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define ONE_ROW_BLOCKS 8
#define BLOCKS 2
#define CHUNK 8
#define TILE 256
#define PREFETCH 32 /* k steps (cache lines of a block) ahead */

typedef float lanes __attribute__((vector_size(LANES * sizeof(float)), aligned(LANES * sizeof(float))));

extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);

void blocked_pack_f32(const float *w, float *packed, long n_out, long k_in) {
  long blocks = (n_out + LANES - 1) / LANES;
#pragma omp parallel for
  for (long block = 0; block < blocks; block++)
    for (long j = 0; j < LANES; j++) {
      long n = block * LANES + j;
      float *to = packed + block * k_in * LANES + j;
      for (long k = 0; k < k_in; k++) to[k * LANES] = n < n_out ? w[n * k_in + k] : 0.0f;
    }
}

static void one_row(const float *x, const float *packed, long k_in, const long *block, lanes *out) {
  const lanes *w[ONE_ROW_BLOCKS];
  lanes sum[ONE_ROW_BLOCKS];
  for (int b = 0; b < ONE_ROW_BLOCKS; b++) {
    w[b] = (const lanes *)(packed + block[b] * k_in * LANES);
    sum[b] = (lanes){0};
  }
  for (long k = 0; k < k_in; k++) {
    float xk = x[k];
#pragma GCC unroll 16
    for (int b = 0; b < ONE_ROW_BLOCKS; b++) {
      __builtin_prefetch(w[b] + k + PREFETCH, 0, 0);
      sum[b] += xk * w[b][k];
    }
  }
  for (int b = 0; b < ONE_ROW_BLOCKS; b++) out[b] = sum[b];
}

/* xt [K, CHUNK]: CHUNK rows of x, transposed; out [CHUNK][BLOCKS] */
static void chunk_rows(const float *xt, const float *packed, long k_in, const long *block, lanes *out, int prefetch) {
  const lanes *w[BLOCKS];
  lanes sum[CHUNK][BLOCKS];
  for (int b = 0; b < BLOCKS; b++) w[b] = (const lanes *)(packed + block[b] * k_in * LANES);
  for (int i = 0; i < CHUNK; i++)
    for (int b = 0; b < BLOCKS; b++) sum[i][b] = (lanes){0};
  for (long k = 0; k < k_in; k++) {
    lanes wk[BLOCKS];
    for (int b = 0; b < BLOCKS; b++) {
      if (prefetch) __builtin_prefetch(w[b] + k + PREFETCH, 0, 0);
      wk[b] = w[b][k];
    }
    const float *xk = xt + k * CHUNK;
#pragma GCC unroll 16
    for (int i = 0; i < CHUNK; i++) {
      float xi = xk[i];
      for (int b = 0; b < BLOCKS; b++) sum[i][b] += xi * wk[b];
    }
  }
  for (int i = 0; i < CHUNK; i++)
    for (int b = 0; b < BLOCKS; b++) out[i * BLOCKS + b] = sum[i][b];
}

static void store(float *y, const float *bias, long n_out, long row, long block, lanes v) {
  for (int j = 0; j < LANES; j++) {
    long n = block * LANES + j;
    if (n < n_out) y[row * n_out + n] = bias ? v[j] + bias[n] : v[j];
  }
}

/* 0, or 1 where the scratch for the transposed rows could not be allocated (nothing written) */
int blocked_linear_f32(const float *x, const float *packed, const float *bias, float *y, long rows, long n_out,
                       long k_in, int threads) {
  long blocks = (n_out + LANES - 1) / LANES, chunks = (rows + CHUNK - 1) / CHUNK;
  float *xt = NULL;
  if (rows > 1) {
    xt = aligned_alloc(64, ((size_t)chunks * k_in * CHUNK * sizeof(float) + 63) / 64 * 64);
    if (!xt) return 1;
    for (long c = 0; c < chunks; c++)
      for (long k = 0; k < k_in; k++)
        for (int i = 0; i < CHUNK; i++) {
          long row = c * CHUNK + i;
          xt[(c * k_in + k) * CHUNK + i] = row < rows ? x[row * k_in + k] : 0.0f;
        }
  }
  int at_once = rows == 1 ? ONE_ROW_BLOCKS : BLOCKS;
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), count = omp_get_num_threads();
    long first = blocks * t / count, end = blocks * (t + 1) / count;
    long stride = (end - first + at_once - 1) / at_once; /* run b of the share starts at first + b * stride */
    lanes out[CHUNK * BLOCKS > ONE_ROW_BLOCKS ? CHUNK * BLOCKS : ONE_ROW_BLOCKS];
    for (long tile = 0; tile < chunks; tile += TILE / CHUNK) {
      long tile_end = tile + TILE / CHUNK < chunks ? tile + TILE / CHUNK : chunks;
      for (long i = 0; i < stride; i++) {
        long block[ONE_ROW_BLOCKS];
        int live[ONE_ROW_BLOCKS];
        for (int b = 0; b < at_once; b++) {
          long at = first + b * stride + i;
          live[b] = at < end;
          block[b] = live[b] ? at : first + i; /* a spent run reads a live block again, its sums dropped */
        }
        if (rows == 1) {
          one_row(x, packed, k_in, block, out);
          for (int b = 0; b < at_once; b++)
            if (live[b]) store(y, bias, n_out, 0, block[b], out[b]);
          continue;
        }
        for (long c = tile; c < tile_end; c++) {
          chunk_rows(xt + c * k_in * CHUNK, packed, k_in, block, out, c == tile);
          for (int r = 0; r < CHUNK && c * CHUNK + r < rows; r++)
            for (int b = 0; b < at_once; b++)
              if (live[b]) store(y, bias, n_out, c * CHUNK + r, block[b], out[r * BLOCKS + b]);
        }
      }
    }
  }
  free(xt);
  return 0;
}
