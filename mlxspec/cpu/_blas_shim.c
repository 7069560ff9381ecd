/*
 * Forwarding shim: gives MLX's CPU backend (libmlx.so) an optimized BLAS/LAPACK on Linux.
 *
 * libmlx.so from the `mlx-cpu` wheel leaves these symbols undefined and finds them in the netlib
 * reference libraries it bundles. mlxspec.cpu.blas compiles this file once, loads it with RTLD_GLOBAL
 * before `import mlx.core`, and the dynamic linker then binds MLX's calls here (the global scope
 * is searched before a library's own dependencies).
 *
 * Each function forwards to `<prefix><name>` in a library that mlxspec_blas_load() opens with
 * RTLD_LOCAL. For scipy-openblas32 the prefix is "scipy_"; keeping OpenBLAS out of the global scope
 * matters because it also exports unprefixed LAPACK 3.12 helpers (slaqz0_, ...) that would
 * otherwise interpose on the ones inside MLX's bundled LAPACK 3.10.
 *
 * The list is exactly what `nm -D --undefined-only libmlx.so` shows for mlx 0.32: MLX calls
 * cblas_?gemm for every float32/float64/complex64 matmul (matrix-vector too; it never calls gemv),
 * and the LAPACK routines behind mx.linalg. float16/bfloat16 matmuls and quantized_matmul do not
 * use BLAS. Integers are 32-bit (LP64), as in the reference BLAS and scipy-openblas32. LAPACK
 * routines with character arguments take the hidden Fortran string lengths at the end (MLX passes
 * them: it calls the LAPACK_xxx macros of lapack.h >= 3.9.1).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int blas_int;
typedef int cblas_enum; /* CBLAS_ORDER / CBLAS_TRANSPOSE */

/* Number of forwarded calls, so a test can prove that MLX's calls really arrive here. */
unsigned long long mlxspec_blas_calls = 0;

/* X(name, parameter list, argument list) for every forwarded routine. */
#define MLXSPEC_FORWARDED(X)                                                                      \
  X(cblas_dgemm,                                                                                  \
    (cblas_enum order, cblas_enum ta, cblas_enum tb, blas_int m, blas_int n, blas_int k,         \
     double alpha, const double *a, blas_int lda, const double *b, blas_int ldb, double beta,    \
     double *c, blas_int ldc),                                                                   \
    (order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))                                \
  /* complex64: alpha, beta and the matrices are pointers to interleaved (re, im) floats */     \
  X(cblas_cgemm,                                                                                  \
    (cblas_enum order, cblas_enum ta, cblas_enum tb, blas_int m, blas_int n, blas_int k,         \
     const void *alpha, const void *a, blas_int lda, const void *b, blas_int ldb,                \
     const void *beta, void *c, blas_int ldc),                                                   \
    (order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))                                \
  /* QR */                                                                                        \
  X(sgeqrf_, (blas_int *m, blas_int *n, float *a, blas_int *lda, float *tau, float *work,        \
              blas_int *lwork, blas_int *info), (m, n, a, lda, tau, work, lwork, info))           \
  X(dgeqrf_, (blas_int *m, blas_int *n, double *a, blas_int *lda, double *tau, double *work,     \
              blas_int *lwork, blas_int *info), (m, n, a, lda, tau, work, lwork, info))           \
  X(sorgqr_, (blas_int *m, blas_int *n, blas_int *k, float *a, blas_int *lda, float *tau,        \
              float *work, blas_int *lwork, blas_int *info),                                      \
    (m, n, k, a, lda, tau, work, lwork, info))                                                    \
  X(dorgqr_, (blas_int *m, blas_int *n, blas_int *k, double *a, blas_int *lda, double *tau,      \
              double *work, blas_int *lwork, blas_int *info),                                     \
    (m, n, k, a, lda, tau, work, lwork, info))                                                    \
  /* symmetric / Hermitian eigen-decomposition */                                                 \
  X(ssyevd_, (char *jobz, char *uplo, blas_int *n, float *a, blas_int *lda, float *w,            \
              float *work, blas_int *lwork, blas_int *iwork, blas_int *liwork, blas_int *info,    \
              size_t jobz_len, size_t uplo_len),                                                  \
    (jobz, uplo, n, a, lda, w, work, lwork, iwork, liwork, info, jobz_len, uplo_len))             \
  X(dsyevd_, (char *jobz, char *uplo, blas_int *n, double *a, blas_int *lda, double *w,          \
              double *work, blas_int *lwork, blas_int *iwork, blas_int *liwork, blas_int *info,   \
              size_t jobz_len, size_t uplo_len),                                                  \
    (jobz, uplo, n, a, lda, w, work, lwork, iwork, liwork, info, jobz_len, uplo_len))             \
  X(cheevd_, (char *jobz, char *uplo, blas_int *n, void *a, blas_int *lda, float *w, void *work, \
              blas_int *lwork, float *rwork, blas_int *lrwork, blas_int *iwork, blas_int *liwork, \
              blas_int *info, size_t jobz_len, size_t uplo_len),                                  \
    (jobz, uplo, n, a, lda, w, work, lwork, rwork, lrwork, iwork, liwork, info, jobz_len,         \
     uplo_len))                                                                                   \
  /* Cholesky, LU, inverse */                                                                     \
  X(spotrf_, (char *uplo, blas_int *n, float *a, blas_int *lda, blas_int *info, size_t uplo_len), \
    (uplo, n, a, lda, info, uplo_len))                                                            \
  X(dpotrf_, (char *uplo, blas_int *n, double *a, blas_int *lda, blas_int *info,                 \
              size_t uplo_len), (uplo, n, a, lda, info, uplo_len))                                \
  X(sgetrf_, (blas_int *m, blas_int *n, float *a, blas_int *lda, blas_int *ipiv, blas_int *info), \
    (m, n, a, lda, ipiv, info))                                                                   \
  X(dgetrf_, (blas_int *m, blas_int *n, double *a, blas_int *lda, blas_int *ipiv,                \
              blas_int *info), (m, n, a, lda, ipiv, info))                                        \
  X(sgetri_, (blas_int *n, float *a, blas_int *lda, blas_int *ipiv, float *work, blas_int *lwork, \
              blas_int *info), (n, a, lda, ipiv, work, lwork, info))                              \
  X(dgetri_, (blas_int *n, double *a, blas_int *lda, blas_int *ipiv, double *work,               \
              blas_int *lwork, blas_int *info), (n, a, lda, ipiv, work, lwork, info))             \
  X(strtri_, (char *uplo, char *diag, blas_int *n, float *a, blas_int *lda, blas_int *info,      \
              size_t uplo_len, size_t diag_len), (uplo, diag, n, a, lda, info, uplo_len, diag_len)) \
  X(dtrtri_, (char *uplo, char *diag, blas_int *n, double *a, blas_int *lda, blas_int *info,     \
              size_t uplo_len, size_t diag_len), (uplo, diag, n, a, lda, info, uplo_len, diag_len)) \
  /* general eigen-decomposition */                                                               \
  X(sgeev_, (char *jobvl, char *jobvr, blas_int *n, float *a, blas_int *lda, float *wr,          \
             float *wi, float *vl, blas_int *ldvl, float *vr, blas_int *ldvr, float *work,        \
             blas_int *lwork, blas_int *info, size_t jobvl_len, size_t jobvr_len),                \
    (jobvl, jobvr, n, a, lda, wr, wi, vl, ldvl, vr, ldvr, work, lwork, info, jobvl_len,           \
     jobvr_len))                                                                                  \
  X(dgeev_, (char *jobvl, char *jobvr, blas_int *n, double *a, blas_int *lda, double *wr,        \
             double *wi, double *vl, blas_int *ldvl, double *vr, blas_int *ldvr, double *work,    \
             blas_int *lwork, blas_int *info, size_t jobvl_len, size_t jobvr_len),                \
    (jobvl, jobvr, n, a, lda, wr, wi, vl, ldvl, vr, ldvr, work, lwork, info, jobvl_len,           \
     jobvr_len))                                                                                  \
  X(cgeev_, (char *jobvl, char *jobvr, blas_int *n, void *a, blas_int *lda, void *w, void *vl,   \
             blas_int *ldvl, void *vr, blas_int *ldvr, void *work, blas_int *lwork, float *rwork, \
             blas_int *info, size_t jobvl_len, size_t jobvr_len),                                 \
    (jobvl, jobvr, n, a, lda, w, vl, ldvl, vr, ldvr, work, lwork, rwork, info, jobvl_len,         \
     jobvr_len))                                                                                  \
  /* singular value decomposition */                                                              \
  X(sgesdd_, (char *jobz, blas_int *m, blas_int *n, float *a, blas_int *lda, float *s, float *u, \
              blas_int *ldu, float *vt, blas_int *ldvt, float *work, blas_int *lwork,             \
              blas_int *iwork, blas_int *info, size_t jobz_len),                                  \
    (jobz, m, n, a, lda, s, u, ldu, vt, ldvt, work, lwork, iwork, info, jobz_len))                \
  X(dgesdd_, (char *jobz, blas_int *m, blas_int *n, double *a, blas_int *lda, double *s,         \
              double *u, blas_int *ldu, double *vt, blas_int *ldvt, double *work,                 \
              blas_int *lwork, blas_int *iwork, blas_int *info, size_t jobz_len),                 \
    (jobz, m, n, a, lda, s, u, ldu, vt, ldvt, work, lwork, iwork, info, jobz_len))                \
  X(cgesdd_, (char *jobz, blas_int *m, blas_int *n, void *a, blas_int *lda, float *s, void *u,   \
              blas_int *ldu, void *vt, blas_int *ldvt, void *work, blas_int *lwork,               \
              float *rwork, blas_int *iwork, blas_int *info, size_t jobz_len),                    \
    (jobz, m, n, a, lda, s, u, ldu, vt, ldvt, work, lwork, rwork, iwork, info, jobz_len))

/* For each routine: a pointer to the target and the exported forwarder. */
#define DEFINE_FORWARDER(name, params, args)                   \
  static void(*name##_target) params;                          \
  void name params {                                           \
    __atomic_add_fetch(&mlxspec_blas_calls, 1, __ATOMIC_RELAXED); \
    name##_target args;                                        \
  }
MLXSPEC_FORWARDED(DEFINE_FORWARDER)

/*
 * Skinny products: decoding multiplies a few rows of activations by each weight matrix,
 * x (m, k) @ W.T with W (n, k) and m = 1 (one stream) to 16 (a batch, a speculative
 * verification, a short prefill). OpenBLAS's sgemm packs the whole of W into its blocked layout
 * before using it, even for one row: it reads and writes the weights twice to use them once. This
 * kernel streams each row of W once and applies it to all m rows of x (held in cache), so a
 * product over 8 rows costs little more than one over one. Each output is the same sum in the
 * same order whatever m is, so a row's result does not depend on what it is batched with.
 *
 * Memory: the hardware prefetcher alone keeps a product over 8 rows at about half the bandwidth
 * of a product over one row (the FMAs between the weights' loads leave few cache misses in
 * flight), so the kernel prefetches the next block of W's rows while it works on this one.
 * SmolLM2's 211 float32 products per token, from memory, 2 vCPUs of an Intel Sapphire Rapids
 * (bench/results/blas.json, "kernel_alone_ms"): the AVX-512 kernel 18-20 ms at 1 row and 39-40
 * ms at 8 without the prefetch, 17 / 23 / 26 ms at 1 / 8 / 16 rows with it; the AVX2 kernel
 * 20-25 and 35-41 ms without it, 19-20 and 24 ms with it. A whole float32 forward over 1 / 8
 * tokens: 30.0 / 49.1 ms, against 60.9 / 78.7 with every product sent to sgemm (same file).
 * x86-64 with AVX-512F: 12 rows at once, with AVX2 and FMA: 8, and up to SKINNY_GROUPED_ROWS in
 * groups of those; elsewhere m = 1 goes to sgemv, which also streams W once, and larger m to sgemm.
 * The AVX-512 blocks of 5-8 rows take 4 or 3 columns of W at once and keep each row of x in a
 * register for all of them: on a 2-vCPU Xeon (AVX-512, 480 MB L3) SmolLM2's 211 products from
 * memory, 8 rows 29.8 ms against 33.7 with 2 columns and x re-read per FMA, 12 rows 33.6 / 35.6,
 * 16 rows 47.0 / 48.4, 21 rows 52.5 / 57.0, 24 rows 59.5 / 69.1; 1 row 23.5 / 24.0
 * (bench/skinny.py --base d1704f5~1; that result file is in git at commit bb49351).
 */
#define SKINNY_MAX_ROWS 12
/* Products of more rows than a kernel instance takes, up to this many, run the kernel over groups
 * of rows (skinny_grouped); more go to sgemm. SmolLM2's 211 products on an AMD EPYC (AVX2, 2
 * vCPUs), grouped against sgemm: 9 rows 47 against 80 ms, 12 rows 47 / 87, 16 rows 56 / 72,
 * 24 rows 85-90 / 95-99, 32 rows 119 / 107 (the groups are compute-bound, sgemm packs once;
 * bench/blas.py, that result file in git at commit 32eede4). */
#define SKINNY_GROUPED_ROWS 24
/* Products smaller than this (multiply-adds) run on one thread: waking another costs more. */
#define SKINNY_PARALLEL_MIN (1 << 16)

static int skinny_threads = 1;  /* mlxspec_blas_set_threads(): as many as OpenBLAS's */
static int skinny_rows = 0;     /* rows the kernel takes: 12 (AVX-512F), 8 (AVX2+FMA), 0 (none) */
static int skinny_routing = 1;  /* mlxspec_blas_set_routing(0): every product to sgemm */
static int skinny_max_rows = SKINNY_GROUPED_ROWS; /* mlxspec_blas_set_max_rows (benchmarks) */

void mlxspec_blas_set_threads(int threads) { skinny_threads = threads > 0 ? threads : 1; }
int mlxspec_blas_threads(void) { return skinny_threads; }
void mlxspec_blas_set_routing(int on) { skinny_routing = on; }
void mlxspec_blas_set_max_rows(int rows) { skinny_max_rows = rows; }
int mlxspec_blas_max_rows(void) { return skinny_max_rows; }

/* What this build does with skinny products: bit 0 routing on, bit 1 a kernel (AVX2 and FMA),
 * bit 2 the AVX-512 kernel. */
int mlxspec_blas_skinny_mode(void) {
  return skinny_routing | (skinny_rows > 0) << 1 | (skinny_rows > 8) << 2;
}

#if defined(__x86_64__)
#include <immintrin.h>
#define SKINNY_TARGET __attribute__((target("avx2,fma")))

SKINNY_TARGET static inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* c[i, j] = alpha * sum_p a[i, p] * b[j, p] (+ beta * c[i, j]) for i < ROWS, n0 <= j < n1.
 * ROWS is a constant in each instance, so the accumulators stay in registers. */
#define SKINNY_KERNEL(ROWS)                                                                     \
  SKINNY_TARGET static void skinny_##ROWS(int n0, int n1, int k, float alpha, const float *a,  \
                                          int lda, const float *b, int ldb, float beta,        \
                                          float *c, int ldc) {                                 \
    for (int j = n0; j < n1; ++j) {                                                             \
      const float *bj = b + (size_t)j * ldb;                                                    \
      const float *next = j + 1 < n1 ? bj + ldb : bj; /* the row of W after this one */         \
      __m256 acc[ROWS];                                                                         \
      _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; ++i) acc[i] = _mm256_setzero_ps();      \
      int p = 0;                                                                                \
      for (; p + 8 <= k; p += 8) {                                                              \
        if (!(p & 15)) _mm_prefetch((const char *)(next + p), _MM_HINT_T0); /* once a line */ \
        __m256 w = _mm256_loadu_ps(bj + p);                                                     \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; ++i) acc[i] =                         \
            _mm256_fmadd_ps(_mm256_loadu_ps(a + (size_t)i * lda + p), w, acc[i]);              \
      }                                                                                         \
      for (int i = 0; i < ROWS; ++i) {                                                          \
        float sum = sum8(acc[i]);                                                               \
        for (int q = p; q < k; ++q) sum += a[(size_t)i * lda + q] * bj[q];                      \
        float *out = c + (size_t)i * ldc + j;                                                   \
        *out = beta == 0.0f ? alpha * sum : alpha * sum + beta * *out; /* BLAS: beta 0 never reads c */ \
      }                                                                                         \
    }                                                                                           \
  }
SKINNY_KERNEL(1)
SKINNY_KERNEL(2)
SKINNY_KERNEL(3)
SKINNY_KERNEL(4)
SKINNY_KERNEL(5)
SKINNY_KERNEL(6)
SKINNY_KERNEL(7)
SKINNY_KERNEL(8)

/* AVX-512: each output is one 16-lane accumulator over p ascending (the last k % 16 values
 * through a masked load), reduced by _mm512_reduce_add_ps. A block computes C columns of c at
 * once (up to 24 accumulators of the 32 registers), so x's loads serve C rows of W; the block
 * width changes nothing in any output's sum. */
#define SKINNY512_TARGET __attribute__((target("avx512f,avx2,fma")))

#define SKINNY512_BLOCK(ROWS, C)                                                                \
  SKINNY512_TARGET static inline void block512_##ROWS##_##C(                                   \
      int j, int n1, int k, float alpha, const float *a, int lda, const float *b, int ldb,     \
      float beta, float *c, int ldc) {                                                          \
    const float *bj = b + (size_t)j * ldb, *ahead[C];                                           \
    for (int q = 0; q < C; ++q) /* the next block's rows, else these again (never past n1) */  \
      ahead[q] = bj + (size_t)(j + C + q < n1 ? C + q : q) * ldb;                               \
    __m512 acc[C][ROWS], w[C];                                                                  \
    _Pragma("GCC unroll 16") for (int q = 0; q < C; ++q)                                        \
      _Pragma("GCC unroll 16") for (int i = 0; i < ROWS; ++i) acc[q][i] = _mm512_setzero_ps();  \
    int p = 0;                                                                                  \
    for (; p + 16 <= k; p += 16) {                                                              \
      _Pragma("GCC unroll 16") for (int q = 0; q < C; ++q) {                                    \
        _mm_prefetch((const char *)(ahead[q] + p), _MM_HINT_T0);                                \
        w[q] = _mm512_loadu_ps(bj + (size_t)q * ldb + p);                                       \
      }                                                                                         \
      _Pragma("GCC unroll 16") for (int i = 0; i < ROWS; ++i) {                                 \
        __m512 x = _mm512_loadu_ps(a + (size_t)i * lda + p);                                    \
        __asm__("" : "+v"(x)); /* one load for all C columns: GCC would fold one into each FMA */ \
        _Pragma("GCC unroll 16") for (int q = 0; q < C; ++q)                                    \
          acc[q][i] = _mm512_fmadd_ps(x, w[q], acc[q][i]);                                      \
      }                                                                                         \
    }                                                                                           \
    if (p < k) {                                                                                \
      __mmask16 tail = (__mmask16)((1u << (k - p)) - 1);                                        \
      for (int q = 0; q < C; ++q) w[q] = _mm512_maskz_loadu_ps(tail, bj + (size_t)q * ldb + p); \
      for (int i = 0; i < ROWS; ++i) {                                                          \
        __m512 x = _mm512_maskz_loadu_ps(tail, a + (size_t)i * lda + p);                        \
        for (int q = 0; q < C; ++q) acc[q][i] = _mm512_fmadd_ps(x, w[q], acc[q][i]);            \
      }                                                                                         \
    }                                                                                           \
    for (int q = 0; q < C; ++q)                                                                 \
      for (int i = 0; i < ROWS; ++i) {                                                          \
        float sum = _mm512_reduce_add_ps(acc[q][i]), *out = c + (size_t)i * ldc + j + q;        \
        *out = beta == 0.0f ? alpha * sum : alpha * sum + beta * *out;                          \
      }                                                                                         \
  }

/* Blocks of COLS columns, then the last n % COLS one at a time. */
#define SKINNY512_KERNEL(ROWS, COLS)                                                            \
  SKINNY512_TARGET static void skinny512_##ROWS(int n0, int n1, int k, float alpha,            \
                                                const float *a, int lda, const float *b,        \
                                                int ldb, float beta, float *c, int ldc) {       \
    int j = n0;                                                                                 \
    for (; j + COLS <= n1; j += COLS)                                                           \
      block512_##ROWS##_##COLS(j, n1, k, alpha, a, lda, b, ldb, beta, c, ldc);                  \
    for (; j < n1; ++j) block512_##ROWS##_1(j, n1, k, alpha, a, lda, b, ldb, beta, c, ldc);     \
  }
/* COLS: as many columns as keep the accumulators (ROWS x COLS) in registers. */
#define SKINNY512_WIDE(ROWS, COLS) \
  SKINNY512_BLOCK(ROWS, 1) SKINNY512_BLOCK(ROWS, COLS) SKINNY512_KERNEL(ROWS, COLS)
SKINNY512_WIDE(1, 4)
SKINNY512_WIDE(2, 4)
SKINNY512_WIDE(3, 4)
SKINNY512_WIDE(4, 4)
SKINNY512_WIDE(5, 4)
SKINNY512_WIDE(6, 4)
SKINNY512_WIDE(7, 3)
SKINNY512_WIDE(8, 3)
SKINNY512_WIDE(9, 2)
SKINNY512_WIDE(10, 2)
SKINNY512_WIDE(11, 2)
SKINNY512_WIDE(12, 2)

typedef void (*skinny_kernel)(int, int, int, float, const float *, int, const float *, int, float,
                              float *, int);
static const skinny_kernel skinny_avx2[9] = {NULL,     skinny_1, skinny_2, skinny_3, skinny_4,
                                             skinny_5, skinny_6, skinny_7, skinny_8};
static const skinny_kernel skinny_avx512[SKINNY_MAX_ROWS + 1] = {
    NULL,         skinny512_1, skinny512_2, skinny512_3,  skinny512_4,  skinny512_5, skinny512_6,
    skinny512_7,  skinny512_8, skinny512_9, skinny512_10, skinny512_11, skinny512_12};
static const skinny_kernel *skinny_kernels = skinny_avx2;

/* More rows than one kernel instance takes (a prefill chunk, a batch of 9-64 streams): the rows
 * in groups of at most `skinny_rows`, as even as can be (AVX-512: 16 rows as 8 + 8, 21 as 11 + 10;
 * 16 rows in one instance would leave one column per block: its x loads outnumber its FMAs), every
 * group over one block of W's rows before the next block, so
 * W comes from memory once and from cache for the other groups (sgemm would pack it first).
 * SKINNY_BLOCK_BYTES of W a block: with the rows of x it stays in a 512 KB L2. Each output is
 * still the one kernel's sum, so a row's result does not depend on how many rows it is with. */
#define SKINNY_BLOCK_BYTES (128 * 1024)
static void skinny_grouped(int m, int n0, int n1, int k, float alpha, const float *a, int lda,
                           const float *b, int ldb, float beta, float *c, int ldc) {
  if (m <= skinny_rows) {
    skinny_kernels[m](n0, n1, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  int groups = (m + skinny_rows - 1) / skinny_rows, per = (m + groups - 1) / groups;
  int block = SKINNY_BLOCK_BYTES / (int)(k * sizeof(float));
  block = block < 4 ? 4 : block;
  for (int j = n0; j < n1; j += block) {
    int j1 = j + block < n1 ? j + block : n1;
    for (int i = 0; i < m; i += per) {
      int rows = m - i < per ? m - i : per;
      skinny_kernels[rows](j, j1, k, alpha, a + (size_t)i * lda, lda, b, ldb, beta,
                           c + (size_t)i * ldc, ldc);
    }
  }
}

/* Products with b not transposed and few columns (attention's p v: rows of probabilities times
 * V, n = the head dimension): c[i, j] = alpha * sum_p a[i, p] * b[p, j] as one FMA chain per
 * output, p ascending, the vector lanes holding columns. An output's sum depends on nothing else:
 * not on m, not on the rows it shares a call with, not on the vector width (AVX-512 and AVX2 give
 * the same bits), so mlxspec/cpu/_ops.cpp computes a KV head's query heads in one call.
 * Replaces sgemv (one row) and sgemm (more): SmolLM2's attention over 8 rows, ~100 positions,
 * 2,160 such products a step, each ~0.5 us in OpenBLAS's sgemv, which wakes its threads past
 * 9,216 multiply-adds. */
#define NN_MAX_COLS 256
#define NN_STORE(ACC, OUT, MUL, ADD, LOAD, STORE, SET1, MASK)                                    \
  do {                                                                                         \
    if (beta == 0.0f) {                                                                        \
      STORE(OUT, MASK, MUL(SET1(alpha), ACC));                                                 \
    } else {                                                                                   \
      STORE(OUT, MASK, ADD(MUL(SET1(alpha), ACC), MUL(SET1(beta), LOAD(MASK, OUT))));          \
    }                                                                                          \
  } while (0)

#define NN512_LOAD(MASK, P) _mm512_maskz_loadu_ps(MASK, P)
#define NN512_STORE(P, MASK, V) _mm512_mask_storeu_ps(P, MASK, V)
/* ROWS rows of a against up to 64 columns of b (four 16-lane blocks, the last ones masked). */
#define NN512_KERNEL(ROWS)                                                                      \
  SKINNY512_TARGET static void nn512_##ROWS(int n, int k, float alpha, const float *a, int lda, \
                                            const float *b, int ldb, float beta, float *c,      \
                                            int ldc) {                                         \
    for (int j0 = 0; j0 < n; j0 += 64) {                                                        \
      __mmask16 mask[4];                                                                        \
      for (int q = 0; q < 4; ++q) {                                                             \
        int left = n - j0 - 16 * q;                                                             \
        mask[q] = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;          \
      }                                                                                         \
      __m512 acc[ROWS][4];                                                                      \
      _Pragma("GCC unroll 4") for (int i = 0; i < ROWS; ++i)                                    \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();    \
      for (int p = 0; p < k; ++p) {                                                             \
        __m512 w[4];                                                                            \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q)                                     \
          w[q] = _mm512_maskz_loadu_ps(mask[q], b + (size_t)p * ldb + j0 + 16 * q);             \
        _Pragma("GCC unroll 4") for (int i = 0; i < ROWS; ++i) {                                \
          __m512 x = _mm512_set1_ps(a[(size_t)i * lda + p]);                                    \
          _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q)                                   \
            acc[i][q] = _mm512_fmadd_ps(x, w[q], acc[i][q]);                                    \
        }                                                                                       \
      }                                                                                         \
      for (int i = 0; i < ROWS; ++i)                                                            \
        for (int q = 0; q < 4; ++q)                                                             \
          if (mask[q])                                                                          \
            NN_STORE(acc[i][q], c + (size_t)i * ldc + j0 + 16 * q, _mm512_mul_ps,               \
                     _mm512_add_ps, NN512_LOAD, NN512_STORE, _mm512_set1_ps, mask[q]);          \
    }                                                                                           \
  }
NN512_KERNEL(1)
NN512_KERNEL(2)
NN512_KERNEL(3)
NN512_KERNEL(4)

#define NN256_LOAD(MASK, P) _mm256_maskload_ps(P, MASK)
#define NN256_STORE(P, MASK, V) _mm256_maskstore_ps(P, MASK, V)
/* The same with 8 lanes: ROWS rows against up to 32 columns (four 8-lane blocks). */
#define NN256_KERNEL(ROWS)                                                                      \
  SKINNY_TARGET static void nn256_##ROWS(int n, int k, float alpha, const float *a, int lda,    \
                                         const float *b, int ldb, float beta, float *c,         \
                                         int ldc) {                                            \
    for (int j0 = 0; j0 < n; j0 += 32) {                                                        \
      __m256i mask[4];                                                                          \
      for (int q = 0; q < 4; ++q) {                                                             \
        int left = n - j0 - 8 * q;                                                              \
        mask[q] = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 0 ? 0 : left),                    \
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));                \
      }                                                                                         \
      __m256 acc[ROWS][4];                                                                      \
      _Pragma("GCC unroll 4") for (int i = 0; i < ROWS; ++i)                                    \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_setzero_ps();    \
      for (int p = 0; p < k; ++p) {                                                             \
        __m256 w[4];                                                                            \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q)                                     \
          w[q] = _mm256_maskload_ps(b + (size_t)p * ldb + j0 + 8 * q, mask[q]);                 \
        _Pragma("GCC unroll 4") for (int i = 0; i < ROWS; ++i) {                                \
          __m256 x = _mm256_set1_ps(a[(size_t)i * lda + p]);                                    \
          _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q)                                   \
            acc[i][q] = _mm256_fmadd_ps(x, w[q], acc[i][q]);                                    \
        }                                                                                       \
      }                                                                                         \
      for (int i = 0; i < ROWS; ++i)                                                            \
        for (int q = 0; q < 4; ++q)                                                             \
          if (n - j0 - 8 * q > 0)                                                               \
            NN_STORE(acc[i][q], c + (size_t)i * ldc + j0 + 8 * q, _mm256_mul_ps, _mm256_add_ps, \
                     NN256_LOAD, NN256_STORE, _mm256_set1_ps, mask[q]);                         \
    }                                                                                           \
  }
NN256_KERNEL(1)
NN256_KERNEL(2)

typedef void (*nn_kernel)(int, int, float, const float *, int, const float *, int, float, float *,
                          int);
static const nn_kernel nn_avx512[] = {NULL, nn512_1, nn512_2, nn512_3, nn512_4};
static const nn_kernel nn_avx2[] = {NULL, nn256_1, nn256_2};
static const nn_kernel *nn_kernels = nn_avx2;
static int nn_rows = 2; /* rows per kernel call: 4 (AVX-512), 2 (AVX2) */

static void nn_product(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                       int ldb, float beta, float *c, int ldc) {
  for (int i = 0; i < m; i += nn_rows) {
    int rows = m - i < nn_rows ? m - i : nn_rows;
    nn_kernels[rows](n, k, alpha, a + (size_t)i * lda, lda, b, ldb, beta, c + (size_t)i * ldc, ldc);
  }
}

/* The widest kernel the CPU runs, unless `isa` asks for AVX2 ("avx2": tests and benchmarks). */
void mlxspec_blas_set_isa(const char *isa) {
  __builtin_cpu_init();
  int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  int avx512 = avx2 && __builtin_cpu_supports("avx512f") && !(isa && !strcmp(isa, "avx2"));
  skinny_kernels = avx512 ? skinny_avx512 : skinny_avx2;
  skinny_rows = avx512 ? 12 : avx2 ? 8 : 0;
  nn_kernels = avx512 ? nn_avx512 : nn_avx2;
  nn_rows = avx512 ? 4 : 2;
}

/*
 * The kernel's threads: a pool of its own rather than OpenMP's. libgomp gives every thread that
 * starts a parallel region a team of its own, and MLX multiplies on two threads (the default
 * stream's and mlx-lm's generation stream's): once both have teams, libgomp counts more threads
 * than cores and stops spinning, and every product pays for waking its team (decode at sgemm's
 * speed). One pool serves every caller here, one product at a time (a caller finding it
 * busy computes alone). Its workers spin for the next product up to 50 us
 * (MLXSPEC_POOL_SPIN_US), then sleep on a condition variable. With a layer's products in a few
 * fused ops a step, the gaps between one step's products (attention, norms, cache writes) are
 * tens of microseconds; after 10 us of spinning a worker was asleep for most of them, and waking
 * it (a futex call) took 6 % of a decode's CPU samples (perf). Intel Xeon (family 6, model 207),
 * 2 vCPUs, processes alternating (no result file): `mlxspec generate`, 200 tokens, 10 us 62.9 and
 * 50 us 67.1 tok/s (means of 6 rounds; faster in 10 of 11), `mlxspec batch` of 8 streams 110.9 /
 * 113.9, bench/decode.py's 4-bit row (no output printed while decoding) 67.6 / 66.4. Much longer
 * spinning holds a core that MLX's evaluation thread and Python need (2 cores, 3 busy threads):
 * with the layers unfused (AMD EPYC, 2 vCPUs) spinning up to 1 ms gave 8 streams 88.6 tok/s and
 * one 18.4, against 105.5 and 21.6 at 10 us.
 *
 * A product is cut into chunks of columns that the caller and the workers claim one at a time
 * (one atomic ticket), so nobody waits for a part assigned to a thread that is not running: a
 * woken worker often finds both cores taken (MLX's thread, Python building the next graph), and
 * a fixed half per thread leaves the caller spinning for it, ~16 ms of a 70 ms step of 8 rows
 * (perf, SmolLM2). Decode steps, claimed chunks against fixed halves in alternating processes
 * (7 rounds, Xeon, 2 vCPUs; no result file): 1 row 42.1 against 43.7 ms, 8 rows 63.5 against
 * 65.0. Products timed alone (bench/skinny.py, the worker always spinning when a product starts)
 * lose 3-10% instead. Each output is computed whole by whichever thread claims its chunk: the
 * numbers do not change (tests/cpu/test_blas.py).
 */
#define POOL_MAX_THREADS 64
#define POOL_SPIN_US 50 /* default spinning of a worker before it sleeps (MLXSPEC_POOL_SPIN_US) */
#define TSC_CYCLES_PER_US 2000ULL /* a 2 GHz time-stamp counter; a faster one spins less */
#define POOL_CHUNKS_PER_THREAD 8  /* claims per thread and product, for balance */
#define POOL_MIN_CHUNK 64         /* columns: smaller chunks cost the kernel its blocking */

/* The ticket: bits 0-19 the first chunk not claimed, 20-39 the chunk after the last one not
 * claimed, 40-63 the product's generation (a new product never repeats the value of the one
 * before). The caller claims from the front, workers from the back. */
#define TICKET_FRONT(t) ((unsigned)((t) & 0xFFFFF))
#define TICKET_BACK(t) ((unsigned)(((t) >> 20) & 0xFFFFF))
#define TICKET_GENERATION(t) ((t) >> 40)

static struct {
  pthread_mutex_t busy;   /* held by the caller whose product the pool is computing */
  pthread_mutex_t sleep;  /* with `wake`: where idle workers sleep */
  pthread_cond_t wake;
  unsigned long long ticket; /* atomic; published after the product below is set */
  unsigned done;             /* chunks of the current product computed (atomic) */
  int workers;               /* workers started so far */
  /* the current job: task(context, i) for each chunk i, or without a task a product in chunks
   * of `chunk` columns of c */
  void (*task)(void *, int);
  void *context;
  int chunk, m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *a, *b;
  float *c;
  unsigned long long spin_cycles; /* set before the first worker starts */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER,
            .sleep = PTHREAD_MUTEX_INITIALIZER,
            .wake = PTHREAD_COND_INITIALIZER};

/* Claim and compute chunks of the current product (from the front or the back) until none is
 * left. The product's fields are read only after a claim succeeds: its caller waits for every
 * claimed chunk before it returns, so they stay valid while a claim is held. */
static void pool_claim_chunks(int from_back) {
  unsigned long long t = __atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE);
  while (TICKET_FRONT(t) < TICKET_BACK(t)) {
    unsigned long long claimed = from_back ? t - (1ULL << 20) : t + 1;
    if (!__atomic_compare_exchange_n(&pool.ticket, &t, claimed, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
      continue; /* t now holds the current ticket */
    int index = (int)(from_back ? TICKET_BACK(claimed) : TICKET_FRONT(t));
    if (pool.task) {
      pool.task(pool.context, index);
    } else {
      int n0 = index * pool.chunk, n1 = n0 + pool.chunk < pool.n ? n0 + pool.chunk : pool.n;
      skinny_grouped(pool.m, n0, n1, pool.k, pool.alpha, pool.a, pool.lda, pool.b, pool.ldb,
                     pool.beta, pool.c, pool.ldc);
    }
    __atomic_add_fetch(&pool.done, 1, __ATOMIC_RELEASE);
    t = __atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE);
  }
}

static void *pool_worker(void *arg) {
  unsigned long long seen = (unsigned long long)(size_t)arg; /* the generation at its start */
  for (;;) {
    unsigned long long start = __rdtsc();
    while (TICKET_GENERATION(__atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE)) == seen) {
      if (__rdtsc() - start < pool.spin_cycles) {
        _mm_pause();
        continue;
      }
      pthread_mutex_lock(&pool.sleep);
      while (TICKET_GENERATION(__atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE)) == seen)
        pthread_cond_wait(&pool.wake, &pool.sleep);
      pthread_mutex_unlock(&pool.sleep);
    }
    seen = TICKET_GENERATION(__atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE));
    pool_claim_chunks(1);
  }
  return NULL;
}

static int pool_threads(void) {
  return skinny_threads < POOL_MAX_THREADS ? skinny_threads : POOL_MAX_THREADS;
}

/* With pool.busy held and the job set: the workers started (once), `chunks` chunks published and
 * computed by the caller and the workers; returns when all are done, the pool released. */
static void pool_run(int threads, unsigned long long chunks) {
  unsigned long long generation = TICKET_GENERATION(pool.ticket) + 1;
  if (pool.workers == 0 && pool.spin_cycles == 0) {
    const char *value = getenv("MLXSPEC_POOL_SPIN_US");
    char *end = NULL;
    long us = value ? strtol(value, &end, 10) : POOL_SPIN_US;
    if (!value || end == value) us = POOL_SPIN_US; /* unset or not a number: the default */
    us = us < 0 ? 0 : us > 1000000 ? 1000000 : us;  /* at most a second */
    pool.spin_cycles = (unsigned long long)us * TSC_CYCLES_PER_US + 1;
  }
  while (pool.workers < threads - 1) { /* started on first use, kept for the process */
    pthread_t thread;
    if (pthread_create(&thread, NULL, pool_worker, (void *)(size_t)(generation - 1)) != 0)
      break;
    pthread_detach(thread);
    ++pool.workers;
  }
  __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
  pthread_mutex_lock(&pool.sleep); /* a worker between its last check and its wait sees this */
  __atomic_store_n(&pool.ticket, (generation & 0xFFFFFF) << 40 | chunks << 20, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&pool.wake);
  pthread_mutex_unlock(&pool.sleep);
  pool_claim_chunks(0);
  while (__atomic_load_n(&pool.done, __ATOMIC_ACQUIRE) < chunks) _mm_pause();
  pthread_mutex_unlock(&pool.busy);
}

/* x (a) in 64-byte-aligned rows for products of more rows than one kernel instance takes. MLX's
 * CPU allocator puts an array's data 8 bytes past malloc's pointer (24 bytes past a 64-byte line
 * for a weight, 40 or 56 for an activation), so every 16-lane load of x spans two cache lines;
 * grouped rows load x once per block of W's rows and are compute-bound. SmolLM2's 211 products
 * from memory, placed as in MLX, with the copy against without it (bench/skinny.py,
 * bench/results/skinny.json): 21 rows 58.1 against 61.6 ms, 24 rows 61.1 / 65.6, 16 rows no
 * change; up to 12 rows (one instance, x loaded once per 2-4 columns) no gain measured, so no
 * copy; W aligned makes no difference from memory. The copy is m x k floats; the values and
 * their order in every sum are the same. The buffer is the calling thread's (MLX's streams and
 * the pool's workers each have one), grown to the largest x seen: at most SKINNY_GROUPED_ROWS
 * rows of the longest k, freed when the thread ends. */
static __thread float *aligned_x;
static __thread size_t aligned_x_floats;
/* The buffer is also the value of a thread-specific key whose destructor frees it: a thread that
 * ends (a short-lived one calling MLX, a stream torn down) gives its buffer back. */
static pthread_key_t aligned_x_key;
static int aligned_x_keyed; /* the key exists (pthread_key_create succeeded) */
static pthread_once_t aligned_x_once = PTHREAD_ONCE_INIT;
static void aligned_x_release(void *buffer) {
  free(buffer);
  aligned_x = NULL, aligned_x_floats = 0; /* a later destructor calling BLAS starts afresh */
}
static void aligned_x_key_create(void) {
  aligned_x_keyed = pthread_key_create(&aligned_x_key, aligned_x_release) == 0;
}

static const float *aligned_rows(int m, int k, const float *a, int *lda) {
  if (m <= skinny_rows || (((uintptr_t)a & 63) == 0 && (*lda & 15) == 0)) return a;
  int stride = (k + 15) & ~15;
  size_t need = (size_t)m * stride;
  if (need > aligned_x_floats) {
    float *grown = NULL;
    if (posix_memalign((void **)&grown, 64, need * sizeof(float)) != 0) return a;
    free(aligned_x);
    aligned_x = grown, aligned_x_floats = need;
    pthread_once(&aligned_x_once, aligned_x_key_create);
    if (aligned_x_keyed) pthread_setspecific(aligned_x_key, aligned_x);
  }
  for (int i = 0; i < m; ++i)
    memcpy(aligned_x + (size_t)i * stride, a + (size_t)i * *lda, (size_t)k * sizeof(float));
  *lda = stride;
  return aligned_x;
}

static void skinny_nt(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                      int ldb, float beta, float *c, int ldc) {
  a = aligned_rows(m, k, a, &lda);
  int threads = pool_threads();
  if (threads < 2 || (size_t)m * n * k < SKINNY_PARALLEL_MIN ||
      pthread_mutex_trylock(&pool.busy) != 0) {
    skinny_grouped(m, 0, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  int chunk = (n + POOL_CHUNKS_PER_THREAD * threads - 1) / (POOL_CHUNKS_PER_THREAD * threads);
  chunk = chunk < POOL_MIN_CHUNK ? POOL_MIN_CHUNK : (chunk + 7) & ~7;
  pool.task = NULL;
  pool.chunk = chunk;
  pool.m = m, pool.n = n, pool.k = k, pool.alpha = alpha, pool.beta = beta;
  pool.a = a, pool.lda = lda, pool.b = b, pool.ldb = ldb, pool.c = c, pool.ldc = ldc;
  pool_run(threads, (unsigned long long)((n + chunk - 1) / chunk));
}

/* task(context, i) for every i < count, on the pool's threads and the caller; returns when all
 * have run. All run on the caller when there is one thread or the pool is busy (a task's own
 * products then run alone: the pool is never waited for). mlxspec/cpu/_ops.cpp runs an
 * attention's (row, KV head) pairs this way: each is computed whole by one thread, so the
 * numbers do not depend on the threads. */
void mlxspec_blas_parallel_for(int count, void (*task)(void *, int), void *context) {
  int threads = pool_threads();
  if (threads < 2 || count < 2 || count >= (1 << 20) || pthread_mutex_trylock(&pool.busy) != 0) {
    for (int i = 0; i < count; ++i) task(context, i);
    return;
  }
  pool.task = task, pool.context = context;
  pool_run(threads, (unsigned long long)count);
}
#else
void mlxspec_blas_set_isa(const char *isa) { (void)isa; }
void mlxspec_blas_parallel_for(int count, void (*task)(void *, int), void *context) {
  for (int i = 0; i < count; ++i) task(context, i);
}
static void nn_product(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                       int ldb, float beta, float *c, int ldc) {
  (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb, (void)beta,
      (void)c, (void)ldc;
}
static void skinny_nt(int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                      int ldb, float beta, float *c, int ldc) {
  (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb, (void)beta,
      (void)c, (void)ldc;
}
#endif

static void (*cblas_sgemm_target)(cblas_enum, cblas_enum, cblas_enum, blas_int, blas_int,
                                  blas_int, float, const float *, blas_int, const float *,
                                  blas_int, float, float *, blas_int);
static void (*cblas_sgemv_target)(cblas_enum, cblas_enum, blas_int, blas_int, float,
                                  const float *, blas_int, const float *, blas_int, float,
                                  float *, blas_int);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* Products the shim computed itself or sent to sgemv (statistics for tests and reports). */
unsigned long long mlxspec_blas_skinny_calls = 0;
unsigned long long mlxspec_blas_gemv_calls = 0;
unsigned long long mlxspec_blas_nn_calls = 0;

static int skinny_applies(int ta, int tb, int m) {
  return m <= (skinny_rows ? skinny_max_rows : 0) && ta == NO_TRANS && tb == TRANS;
}
static int nn_applies(int ta, int tb, int m, int n) {
  return skinny_rows && m <= skinny_max_rows && n <= NN_MAX_COLS && ta == NO_TRANS &&
         tb == NO_TRANS;
}

/* Whether a row-major product of this shape goes to one of the kernels above, whose outputs do
 * not depend on m: rows computed in one call or one at a time give the same bits. */
int mlxspec_blas_rows_independent(int ta, int tb, int m, int n) {
  return skinny_routing && m > 0 && n > 0 && (skinny_applies(ta, tb, m) || nn_applies(ta, tb, m, n));
}

/* cblas_sgemm, the call behind every float32 matmul: skinny products as above, the rest to sgemm. */
void cblas_sgemm(cblas_enum order, cblas_enum ta, cblas_enum tb, blas_int m, blas_int n,
                 blas_int k, float alpha, const float *a, blas_int lda, const float *b,
                 blas_int ldb, float beta, float *c, blas_int ldc) {
  __atomic_add_fetch(&mlxspec_blas_calls, 1, __ATOMIC_RELAXED);
  int valid = skinny_routing && order == ROW_MAJOR && m > 0 && n > 0 && k > 0;
  if (valid && skinny_applies(ta, tb, m)) {
    __atomic_add_fetch(&mlxspec_blas_skinny_calls, 1, __ATOMIC_RELAXED);
    skinny_nt(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (valid && nn_applies(ta, tb, m, n)) {
    __atomic_add_fetch(&mlxspec_blas_nn_calls, 1, __ATOMIC_RELAXED);
    nn_product(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (valid && m == 1) {
    /* c (1, n) = a (1, k) @ op(b): c.T = op(b).T @ a.T. b is (k, n) untransposed (sgemv of its
     * transpose) or (n, k) transposed (plain sgemv); a's k values are a column (stride lda)
     * when a is transposed. */
    __atomic_add_fetch(&mlxspec_blas_gemv_calls, 1, __ATOMIC_RELAXED);
    int b_plain = tb == NO_TRANS;
    cblas_sgemv_target(ROW_MAJOR, b_plain ? TRANS : NO_TRANS, b_plain ? k : n, b_plain ? n : k,
                       alpha, b, ldb, a, ta == NO_TRANS ? 1 : lda, beta, c, 1);
  } else if (valid && n == 1) {
    /* c (m, 1) = op(a) (m, k) @ b (k, 1): the same with a as the matrix; c is a column. */
    __atomic_add_fetch(&mlxspec_blas_gemv_calls, 1, __ATOMIC_RELAXED);
    int a_plain = ta == NO_TRANS;
    cblas_sgemv_target(ROW_MAJOR, a_plain ? NO_TRANS : TRANS, a_plain ? m : k, a_plain ? k : m,
                       alpha, a, lda, b, tb == NO_TRANS ? ldb : 1, beta, c, ldc);
  } else {
    cblas_sgemm_target(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

#define TABLE_ENTRY(name, params, args) {#name, (void **)&name##_target},
/* Everything loaded from the library: the routines MLX imports, then the one helper the
 * forwarders call that MLX does not import (sgemv). */
static const struct {
  const char *name;
  void **target;
} loaded[] = {{"cblas_sgemm", (void **)&cblas_sgemm_target},
              MLXSPEC_FORWARDED(TABLE_ENTRY){"cblas_sgemv", (void **)&cblas_sgemv_target}};
#define N_LOADED (sizeof(loaded) / sizeof(loaded[0]))
#define N_FORWARDED (N_LOADED - 1)

static char error[512];

/*
 * Opens `library` privately and points every forwarder at `<prefix><name>` in it.
 * Returns NULL on success, else a message naming what is missing (no forwarder is changed then).
 * Call once, before the shim is promoted to the global scope.
 */
const char *mlxspec_blas_load(const char *library, const char *prefix) {
  void *handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    snprintf(error, sizeof(error), "%s", dlerror());
    return error;
  }
  void *found[N_LOADED];
  for (size_t i = 0; i < N_LOADED; ++i) {
    char symbol[128];
    snprintf(symbol, sizeof(symbol), "%s%s", prefix, loaded[i].name);
    found[i] = dlsym(handle, symbol);
    if (!found[i]) {
      snprintf(error, sizeof(error), "%s does not define %s", library, symbol);
      dlclose(handle);
      return error;
    }
  }
  for (size_t i = 0; i < N_LOADED; ++i) *loaded[i].target = found[i];
  mlxspec_blas_set_isa(NULL); /* the widest kernel this CPU runs */
  return NULL;
}

/* Number of forwarded routines and their names (for reports and tests). */
size_t mlxspec_blas_count(void) { return N_FORWARDED; }
const char *mlxspec_blas_name(size_t i) { return i < N_FORWARDED ? loaded[i].name : NULL; }

/* A deadline at which the process ends (one line on stderr, exit status 2) unless it is pushed
 * back first: a sharded run pushes it back at every forward pass (mlxspec.distributed.group's
 * Watchdog, through mlxspec.cpu.deadline). It runs on a thread of its own without Python, so it
 * also ends a process whose Python thread is stuck in a call that holds the GIL (a collective
 * whose peer died), which the watchdog's Python thread cannot. */
static struct {
  pthread_mutex_t lock;
  int armed, started;
  struct timespec at; /* CLOCK_MONOTONIC */
  char message[512];
} deadline = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void *deadline_main(void *arg) {
  (void)arg;
  for (;;) { /* once a second: the deadline is seconds long */
    pthread_mutex_lock(&deadline.lock);
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (deadline.armed && (now.tv_sec > deadline.at.tv_sec ||
                           (now.tv_sec == deadline.at.tv_sec && now.tv_nsec >= deadline.at.tv_nsec))) {
      ssize_t written = write(2, deadline.message, strlen(deadline.message));
      (void)written;
      _exit(2);
    }
    pthread_mutex_unlock(&deadline.lock);
    struct timespec second = {1, 0};
    nanosleep(&second, NULL);
  }
  return NULL;
}

/* End the process `seconds` from now with `message` (kept when NULL) on stderr; seconds <= 0
 * disarms it. */
void mlxspec_deadline(double seconds, const char *message) {
  pthread_mutex_lock(&deadline.lock);
  if (!deadline.started) {
    pthread_t thread;
    if (pthread_create(&thread, NULL, deadline_main, NULL) == 0) {
      pthread_detach(thread);
      deadline.started = 1;
    }
  }
  if (message) snprintf(deadline.message, sizeof deadline.message, "%s", message);
  deadline.armed = seconds > 0;
  clock_gettime(CLOCK_MONOTONIC, &deadline.at);
  if (seconds > 0) {
    double whole = (double)(long long)seconds;
    deadline.at.tv_sec += (time_t)whole;
    deadline.at.tv_nsec += (long)((seconds - whole) * 1e9);
    if (deadline.at.tv_nsec >= 1000000000L) deadline.at.tv_sec += 1, deadline.at.tv_nsec -= 1000000000L;
  }
  pthread_mutex_unlock(&deadline.lock);
}
