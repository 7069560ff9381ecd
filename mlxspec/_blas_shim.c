/*
 * Forwarding shim: gives MLX's CPU backend (libmlx.so) an optimized BLAS/LAPACK on Linux.
 *
 * libmlx.so from the `mlx-cpu` wheel leaves these symbols undefined and finds them in the netlib
 * reference libraries it bundles. mlxspec.blas compiles this file once, loads it with RTLD_GLOBAL
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
#include <stddef.h>
#include <stdio.h>

typedef int blas_int;
typedef int cblas_enum; /* CBLAS_ORDER / CBLAS_TRANSPOSE */

/* Number of forwarded calls, so a test can prove that MLX's calls really arrive here. */
unsigned long long mlxspec_blas_calls = 0;

/* X(name, parameter list, argument list) for every forwarded routine. */
#define MLXSPEC_FORWARDED(X)                                                                      \
  X(cblas_sgemm,                                                                                  \
    (cblas_enum order, cblas_enum ta, cblas_enum tb, blas_int m, blas_int n, blas_int k,         \
     float alpha, const float *a, blas_int lda, const float *b, blas_int ldb, float beta,        \
     float *c, blas_int ldc),                                                                    \
    (order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))                                \
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

#define TABLE_ENTRY(name, params, args) {#name, (void **)&name##_target},
static const struct {
  const char *name;
  void **target;
} forwarded[] = {MLXSPEC_FORWARDED(TABLE_ENTRY)};
#define N_FORWARDED (sizeof(forwarded) / sizeof(forwarded[0]))

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
  void *found[N_FORWARDED];
  for (size_t i = 0; i < N_FORWARDED; ++i) {
    char symbol[128];
    snprintf(symbol, sizeof(symbol), "%s%s", prefix, forwarded[i].name);
    found[i] = dlsym(handle, symbol);
    if (!found[i]) {
      snprintf(error, sizeof(error), "%s does not define %s", library, symbol);
      dlclose(handle);
      return error;
    }
  }
  for (size_t i = 0; i < N_FORWARDED; ++i) *forwarded[i].target = found[i];
  return NULL;
}

/* Number of forwarded routines and their names (for reports and tests). */
size_t mlxspec_blas_count(void) { return N_FORWARDED; }
const char *mlxspec_blas_name(size_t i) { return i < N_FORWARDED ? forwarded[i].name : NULL; }
