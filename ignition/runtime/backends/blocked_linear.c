/* The blocked linear of runtime/backends/blocked_linear.py: y [M, N] = x [M, K] @ W.T (+ bias), on W packed once as
 * [ceil(N / 16), K, 16] (16 output features a block, their K weights interleaved; rows past N zero), in FP32 or BF16.
 *
 * Every output is one FP32 FMA chain over k = 0 .. K-1 from zero, then the bias: the same order at every row count,
 * so a row's result does not depend on the rows beside it. A BF16 weight and input are widened to FP32 exactly (a
 * 16-bit shift) and the FP32 sum plus the bias is rounded to BF16 once, to nearest even, as torch rounds.
 * One row (a decode lane) reads ONE_ROW_BLOCKS blocks at once, far apart in each thread's share (that many sequential
 * reads in flight); more rows are taken CHUNK at a time (FEW_CHUNK where that makes one chunk of a decode batch, so
 * each block is read once), transposed into FP32 scratch (x^T [K, chunk]), against BLOCKS blocks at once (chunk x
 * BLOCKS vector accumulators), the rows in tiles of TILE so a tile's transposed rows stay in cache while every block
 * of the thread's share passes. The sums live in the ISA's own vectors (WIDTH floats: a block's 16 features in one
 * AVX-512 register or two AVX2 ones) and the tiles are sized to its register file (AVX2's eight-row chunk spills a
 * few sums, cheaper than reading each block twice); the tiles change which products are computed together, never an
 * output's order.
 * With leaves > 1 the K inputs are that many equal slices (a row-parallel projection's reduction leaves,
 * recipes/layers.py row_linear): y is [leaves, M, N], leaf l one FMA chain over its slice from zero, the bias (if
 * any) in leaf 0 only; each block is still read once, its leaves one after another. With tree (leaves a power of
 * two, at most MAX_TREE_LEAVES), y is [M, N]: the leaves (the bias added to leaf 0) summed as row_linear sums them,
 * each level adding leaf 2i + 1 to leaf 2i.
 * Where the compiler targets AVX512-BF16 (-march=native on such a CPU: AMD Zen 4, Intel Cooper Lake and later),
 * a BF16 weight is packed as [ceil(N / 16), K / 2, 16, 2] instead (k in pairs, K even) and multiplied with
 * VDPBF16PS: each k pair's two exact products are added to the FP32 sum one after the other, k + 1 first, with
 * denormals flushed (blocked_bf16_pairs says which form this build uses; one form for every row count).
 * Built by blocked_linear.py with -O3 -march=native -fopenmp: the threads are the process's OpenMP threads (torch's). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAIRS 1
#else
#define PAIRS 0
#endif

#define LANES 16
#if defined(__AVX512F__) /* 32 vector registers of 16 floats: a block's k-vector in one */
#define WIDTH 16
#define ONE_ROW_BLOCKS 8
#define BLOCKS 2
#define CHUNK 8
#define FEW_CHUNK 8
#else /* AVX2 and narrower (16 registers of 8 floats): a k-vector in two, tiles that fit the register file */
#define WIDTH 8
#define ONE_ROW_BLOCKS 6
#define BLOCKS 1
#define CHUNK 4
#define FEW_CHUNK 8 /* up to 8 rows (a decode batch) in one chunk: each block read once, a few sums spilled */
#endif
#define MAX_CHUNK (CHUNK > FEW_CHUNK ? CHUNK : FEW_CHUNK)
#define HALVES (LANES / WIDTH) /* native vectors a block's k-vector */
#define TILE 256
#define MAX_TREE_LEAVES 16
/* a leaf's vectors, one group */
#define PER_LEAF (MAX_CHUNK * BLOCKS > ONE_ROW_BLOCKS ? MAX_CHUNK * BLOCKS : ONE_ROW_BLOCKS)
#define PREFETCH_BYTES 2048 /* how far ahead in a block's stream (32 cache lines) */
#define INLINE static inline __attribute__((always_inline))

typedef float lanes __attribute__((vector_size(LANES * sizeof(float)), aligned(LANES * sizeof(float))));
/* the native vector the sums are kept in (a 64-byte lanes on an AVX2 build lives on the stack) */
typedef float vec __attribute__((vector_size(WIDTH * sizeof(float)), aligned(WIDTH * sizeof(float))));
typedef uint16_t vec_halves __attribute__((vector_size(WIDTH * sizeof(uint16_t)), aligned(WIDTH * sizeof(uint16_t))));
typedef uint32_t vec_words __attribute__((vector_size(WIDTH * sizeof(uint32_t))));

extern int omp_get_thread_num(void);
extern int omp_get_num_threads(void);

INLINE float from_bf16(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

INLINE uint16_t to_bf16(float f) { /* round to nearest even; a NaN stays a (quiet) NaN */
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* part h (of HALVES) of the k-th vector of 16 weights of a block; bf16: the element size is 2 */
INLINE vec load(const void *block, long k, int h, const int bf16) {
  if (!bf16) return ((const vec *)block)[k * HALVES + h];
  const vec_halves *from = (const vec_halves *)block + k * HALVES + h;
#if defined(__AVX512F__) /* one VPMOVZXWD and a shift (the generic conversion takes four instructions on AVX2) */
  return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i *)from)), 16);
#elif defined(__AVX2__)
  return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_load_si128((const __m128i *)from)), 16);
#else
  return (vec)(__builtin_convertvector(*from, vec_words) << 16);
#endif
}

INLINE lanes join(const vec *parts) {
  lanes whole;
  memcpy(&whole, parts, sizeof whole);
  return whole;
}

int blocked_bf16_pairs(void) { return PAIRS; }

INLINE void pack(const void *w, void *packed, long n_out, long k_in, const int bf16) {
  long blocks = (n_out + LANES - 1) / LANES;
#pragma omp parallel for
  for (long block = 0; block < blocks; block++)
    for (long j = 0; j < LANES; j++) {
      long n = block * LANES + j;
      for (long k = 0; k < k_in; k++) {
        long to = (block * k_in + k) * LANES + j, from = n * k_in + k;
        if (bf16 && PAIRS) to = (block * k_in + k / 2 * 2) * LANES + j * 2 + k % 2; /* [.., K / 2, 16, 2] */
        if (bf16) ((uint16_t *)packed)[to] = n < n_out ? ((const uint16_t *)w)[from] : 0;
        else ((float *)packed)[to] = n < n_out ? ((const float *)w)[from] : 0.0f;
      }
    }
}

void blocked_pack_f32(const float *w, float *packed, long n_out, long k_in) { pack(w, packed, n_out, k_in, 0); }
void blocked_pack_bf16(const uint16_t *w, uint16_t *packed, long n_out, long k_in) { pack(w, packed, n_out, k_in, 1); }

/* x: K floats; k over [k0, k1) */
INLINE void one_row(const float *x, const char *packed, long k_in, long k0, long k1, const long *block, lanes *out,
                    const int bf16) {
  const long element = bf16 ? 2 : 4;
  const char *w[ONE_ROW_BLOCKS];
  vec sum[ONE_ROW_BLOCKS][HALVES];
  for (int b = 0; b < ONE_ROW_BLOCKS; b++) {
    w[b] = packed + block[b] * k_in * LANES * element;
    for (int h = 0; h < HALVES; h++) sum[b][h] = (vec){0};
  }
  for (long k = k0; k < k1; k++) {
    float xk = x[k];
#pragma GCC unroll 16
    for (int b = 0; b < ONE_ROW_BLOCKS; b++) {
      __builtin_prefetch(w[b] + k * LANES * element + PREFETCH_BYTES, 0, 0);
      for (int h = 0; h < HALVES; h++) sum[b][h] += xk * load(w[b], k, h, bf16);
    }
  }
  for (int b = 0; b < ONE_ROW_BLOCKS; b++) out[b] = join(sum[b]);
}

/* xt [K, chunk]: chunk rows of x, transposed, in FP32; out [chunk][BLOCKS]; k over [k0, k1) */
INLINE void chunk_rows(const float *xt, const char *packed, long k_in, long k0, long k1, const long *block,
                       lanes *out, int prefetch, const int bf16, const int chunk) {
  const long element = bf16 ? 2 : 4;
  const char *w[BLOCKS];
  vec sum[MAX_CHUNK][BLOCKS][HALVES];
  for (int b = 0; b < BLOCKS; b++) w[b] = packed + block[b] * k_in * LANES * element;
  for (int i = 0; i < chunk; i++)
    for (int b = 0; b < BLOCKS; b++)
      for (int h = 0; h < HALVES; h++) sum[i][b][h] = (vec){0};
  for (long k = k0; k < k1; k++) {
    vec wk[BLOCKS][HALVES];
    for (int b = 0; b < BLOCKS; b++) {
      if (prefetch) __builtin_prefetch(w[b] + k * LANES * element + PREFETCH_BYTES, 0, 0);
      for (int h = 0; h < HALVES; h++) wk[b][h] = load(w[b], k, h, bf16);
    }
    const float *xk = xt + k * chunk;
#pragma GCC unroll 16
    for (int i = 0; i < chunk; i++) {
      float xi = xk[i];
      for (int b = 0; b < BLOCKS; b++)
        for (int h = 0; h < HALVES; h++) sum[i][b][h] += xi * wk[b][h];
    }
  }
  for (int i = 0; i < chunk; i++)
    for (int b = 0; b < BLOCKS; b++) out[i * BLOCKS + b] = join(sum[i][b]);
}

#if PAIRS
#if FEW_CHUNK != CHUNK
#error "the pair kernels take CHUNK rows at every row count"
#endif
/* BF16 in pairs: x as K / 2 words (x[2p] low, x[2p + 1] high); k over [k0, k1), both even */
static void one_row_pairs(const float *x, const char *packed, long k_in, long k0, long k1, const long *block,
                          lanes *out) {
  const uint32_t *pairs = (const uint32_t *)x;
  const __m512i *w[ONE_ROW_BLOCKS];
  __m512 sum[ONE_ROW_BLOCKS];
  for (int b = 0; b < ONE_ROW_BLOCKS; b++) {
    w[b] = (const __m512i *)(packed + block[b] * k_in * LANES * 2);
    sum[b] = _mm512_setzero_ps();
  }
  for (long p = k0 / 2; p < k1 / 2; p++) {
    __m512bh xp = (__m512bh)_mm512_set1_epi32((int)pairs[p]);
#pragma GCC unroll 16
    for (int b = 0; b < ONE_ROW_BLOCKS; b++) {
      __builtin_prefetch((const char *)(w[b] + p) + PREFETCH_BYTES, 0, 0);
      sum[b] = _mm512_dpbf16_ps(sum[b], (__m512bh)_mm512_load_si512(w[b] + p), xp);
    }
  }
  for (int b = 0; b < ONE_ROW_BLOCKS; b++) out[b] = (lanes)sum[b];
}

/* xt [K / 2, CHUNK] words: CHUNK rows' k pairs, transposed; out [CHUNK][BLOCKS]; k over [k0, k1), both even */
static void chunk_rows_pairs(const float *xt, const char *packed, long k_in, long k0, long k1, const long *block,
                             lanes *out, int prefetch) {
  const uint32_t *pairs = (const uint32_t *)xt;
  const __m512i *w[BLOCKS];
  __m512 sum[CHUNK][BLOCKS];
  for (int b = 0; b < BLOCKS; b++) w[b] = (const __m512i *)(packed + block[b] * k_in * LANES * 2);
  for (int i = 0; i < CHUNK; i++)
    for (int b = 0; b < BLOCKS; b++) sum[i][b] = _mm512_setzero_ps();
  for (long p = k0 / 2; p < k1 / 2; p++) {
    __m512bh wp[BLOCKS];
    for (int b = 0; b < BLOCKS; b++) {
      if (prefetch) __builtin_prefetch((const char *)(w[b] + p) + PREFETCH_BYTES, 0, 0);
      wp[b] = (__m512bh)_mm512_load_si512(w[b] + p);
    }
#pragma GCC unroll 16
    for (int i = 0; i < CHUNK; i++) {
      __m512bh xp = (__m512bh)_mm512_set1_epi32((int)pairs[p * CHUNK + i]);
      for (int b = 0; b < BLOCKS; b++) sum[i][b] = _mm512_dpbf16_ps(sum[i][b], wp[b], xp);
    }
  }
  for (int i = 0; i < CHUNK; i++)
    for (int b = 0; b < BLOCKS; b++) out[i * BLOCKS + b] = (lanes)sum[i][b];
}
#endif

/* y [.., n_out] row `row`, the 16 features of `block` (those below n_out): v + bias, rounded to BF16 where bf16 */
INLINE void store(void *y, const void *bias, long n_out, long row, long block, lanes v, const int bf16) {
  for (int j = 0; j < LANES; j++) {
    long n = block * LANES + j;
    if (n >= n_out) break;
    if (bf16) {
      float b = bias ? from_bf16(((const uint16_t *)bias)[n]) : 0.0f;
      ((uint16_t *)y)[row * n_out + n] = to_bf16(bias ? v[j] + b : v[j]);
    } else {
      ((float *)y)[row * n_out + n] = bias ? v[j] + ((const float *)bias)[n] : v[j];
    }
  }
}

typedef void (*rows_kernel)(const float *, const char *, long, long, long, const long *, lanes *, int);
typedef struct {
  void (*one_row)(const float *, const char *, long, long, long, const long *, lanes *);
  rows_kernel chunk_rows; /* CHUNK rows */
  rows_kernel few_rows;   /* FEW_CHUNK rows */
  void (*store)(void *, const void *, long, long, long, lanes);
  long element;
} kernels;

static void one_row_f32(const float *x, const char *p, long k_in, long k0, long k1, const long *b, lanes *out) {
  one_row(x, p, k_in, k0, k1, b, out, 0);
}
/* a rows_kernel: chunk_rows for one dtype and chunk width, both constants */
#define ROWS_KERNEL(name, bf16, chunk)                                                                                \
  static void name(const float *xt, const char *p, long k_in, long k0, long k1, const long *b, lanes *out,         \
                   int prefetch) {                                                                                  \
    chunk_rows(xt, p, k_in, k0, k1, b, out, prefetch, bf16, chunk);                                                 \
  }
ROWS_KERNEL(chunk_rows_f32, 0, CHUNK)
ROWS_KERNEL(few_rows_f32, 0, FEW_CHUNK)
static void store_f32(void *y, const void *bias, long n_out, long row, long block, lanes v) {
  store(y, bias, n_out, row, block, v, 0);
}
static void store_bf16(void *y, const void *bias, long n_out, long row, long block, lanes v) {
  store(y, bias, n_out, row, block, v, 1);
}
static const kernels F32 = {one_row_f32, chunk_rows_f32, few_rows_f32, store_f32, 4};
#if PAIRS
static const kernels BF16 = {one_row_pairs, chunk_rows_pairs, chunk_rows_pairs, store_bf16, 2};
#else
static void one_row_bf16(const float *x, const char *p, long k_in, long k0, long k1, const long *b, lanes *out) {
  one_row(x, p, k_in, k0, k1, b, out, 1);
}
ROWS_KERNEL(chunk_rows_bf16, 1, CHUNK)
ROWS_KERNEL(few_rows_bf16, 1, FEW_CHUNK)
static const kernels BF16 = {one_row_bf16, chunk_rows_bf16, few_rows_bf16, store_bf16, 2};
#endif

/* the leaves' sums of `count` vectors each, summed pairwise in place into sums[0] (row_linear's tree) */
static void tree_sum(lanes sums[][PER_LEAF], long leaves, int count) {
  for (long width = leaves; width > 1; width /= 2)
    for (long i = 0; i < width / 2; i++)
      for (int v = 0; v < count; v++) sums[i][v] = sums[2 * i][v] + sums[2 * i + 1][v];
}

/* bias (FP32 or BF16) for the features of `block`, as a vector (zeros past n_out) */
static lanes bias_lanes(const void *bias, long n_out, long block, int bf16) {
  lanes v = {0};
  for (int j = 0; j < LANES && block * LANES + j < n_out; j++)
    v[j] = bf16 ? from_bf16(((const uint16_t *)bias)[block * LANES + j]) : ((const float *)bias)[block * LANES + j];
  return v;
}

/* 0; 1 where the FP32 scratch for the rows could not be allocated; 2 where tree and leaves is not a power of two of
 * at most MAX_TREE_LEAVES; 3 where BF16 pairs and a leaf's k is odd (nothing written in any case); leaves divides
 * k_in */
static int run(const kernels *kernel, const void *x, const char *packed, const void *bias, char *y, long rows,
               long n_out, long k_in, long leaves, int tree, int threads) {
  const int chunk = rows > CHUNK && rows <= FEW_CHUNK ? FEW_CHUNK : CHUNK; /* a decode batch in one chunk */
  rows_kernel chunk_kernel = chunk == CHUNK ? kernel->chunk_rows : kernel->few_rows;
  long blocks = (n_out + LANES - 1) / LANES, chunks = (rows + chunk - 1) / chunk, step = k_in / leaves;
  int bf16 = kernel->element == 2, pairs = bf16 && PAIRS;
  if (tree && (leaves > MAX_TREE_LEAVES || (leaves & (leaves - 1)))) return 2;
  if (pairs && step % 2) return 3;
  const float *x32 = x; /* one FP32 row (pairs: its BF16 words) */
  float *xt = NULL;
  if (rows > 1 || (bf16 && !pairs)) {
    long width = rows > 1 ? chunk : 1;
    xt = aligned_alloc(64, ((size_t)chunks * k_in * width * sizeof(float) + 63) / 64 * 64);
    if (!xt) return 1;
    for (long c = 0; c < chunks; c++)
      for (long k = 0; k < k_in; k++)
        for (int i = 0; i < width; i++) {
          long row = c * chunk + i, at = row * k_in + k;
          if (pairs) { /* [K / 2, chunk] words of two BF16, the even k low */
            uint16_t *words = (uint16_t *)xt;
            words[((c * k_in / 2 + k / 2) * width + i) * 2 + k % 2] = row < rows ? ((const uint16_t *)x)[at] : 0;
            continue;
          }
          float v = row >= rows ? 0.0f : bf16 ? from_bf16(((const uint16_t *)x)[at]) : ((const float *)x)[at];
          xt[(c * k_in + k) * width + i] = v;
        }
    if (rows == 1) x32 = xt;
  }
  int at_once = rows == 1 ? ONE_ROW_BLOCKS : BLOCKS;
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), count = omp_get_num_threads();
    long first = blocks * t / count, end = blocks * (t + 1) / count;
    long stride = (end - first + at_once - 1) / at_once; /* run b of the share starts at first + b * stride */
    lanes out[PER_LEAF], sums[MAX_TREE_LEAVES][PER_LEAF];
    for (long tile = 0; tile < chunks; tile += TILE / chunk) {
      long tile_end = tile + TILE / chunk < chunks ? tile + TILE / chunk : chunks;
      for (long i = 0; i < stride; i++) {
        long block[ONE_ROW_BLOCKS];
        int live[ONE_ROW_BLOCKS];
        for (int b = 0; b < at_once; b++) {
          long at = first + b * stride + i;
          live[b] = at < end;
          block[b] = live[b] ? at : first + i; /* a spent run reads a live block again, its sums dropped */
        }
        if (rows == 1) {
          for (long leaf = 0; leaf < leaves; leaf++) {
            kernel->one_row(x32, packed, k_in, leaf * step, (leaf + 1) * step, block, tree ? sums[leaf] : out);
            if (!tree)
              for (int b = 0; b < at_once; b++)
                if (live[b])
                  kernel->store(y + leaf * n_out * kernel->element, leaf ? NULL : bias, n_out, 0, block[b], out[b]);
          }
          if (tree) {
            if (bias)
              for (int b = 0; b < at_once; b++) sums[0][b] += bias_lanes(bias, n_out, block[b], bf16);
            tree_sum(sums, leaves, at_once);
            for (int b = 0; b < at_once; b++)
              if (live[b]) kernel->store(y, NULL, n_out, 0, block[b], sums[0][b]);
          }
          continue;
        }
        for (long c = tile; c < tile_end; c++) {
          for (long leaf = 0; leaf < leaves; leaf++) {
            chunk_kernel(xt + c * k_in * chunk / (pairs ? 2 : 1), packed, k_in, leaf * step, (leaf + 1) * step,
                               block, tree ? sums[leaf] : out, c == tile);
            if (!tree)
              for (int r = 0; r < chunk && c * chunk + r < rows; r++)
                for (int b = 0; b < at_once; b++)
                  if (live[b])
                    kernel->store(y + leaf * rows * n_out * kernel->element, leaf ? NULL : bias, n_out,
                                  c * chunk + r, block[b], out[r * BLOCKS + b]);
          }
          if (tree) {
            if (bias)
              for (int r = 0; r < chunk; r++)
                for (int b = 0; b < at_once; b++) sums[0][r * BLOCKS + b] += bias_lanes(bias, n_out, block[b], bf16);
            tree_sum(sums, leaves, chunk * BLOCKS);
            for (int r = 0; r < chunk && c * chunk + r < rows; r++)
              for (int b = 0; b < at_once; b++)
                if (live[b]) kernel->store(y, NULL, n_out, c * chunk + r, block[b], sums[0][r * BLOCKS + b]);
          }
        }
      }
    }
  }
  free(xt);
  return 0;
}

int blocked_linear_f32(const float *x, const float *packed, const float *bias, float *y, long rows, long n_out,
                       long k_in, long leaves, int tree, int threads) {
  return run(&F32, x, (const char *)packed, bias, (char *)y, rows, n_out, k_in, leaves, tree, threads);
}

int blocked_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, long rows,
                        long n_out, long k_in, long leaves, int tree, int threads) {
  return run(&BF16, x, (const char *)packed, bias, (char *)y, rows, n_out, k_in, leaves, tree, threads);
}
