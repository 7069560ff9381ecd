/*
 * Computations that give MLX's own CPU results bit for bit, shared by the primitives of
 * _ops.cpp (one op each) and the whole decode layer of _quantized.cpp (_layer.h): attention as
 * MLX's composed fallback computes it (the same BLAS calls, MLX's softmax), RoPE's rotation from
 * its tables, and RMSNorm. Everything here is internal to the module including it (an anonymous
 * namespace); the build key of mlxspec/cpu/build.py covers the files a source includes.
 */
#pragma once

#include <dlfcn.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/types/limits.h"

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                            const float *a, int lda, const float *b, int ldb, float beta, float *c,
                            int ldc);

namespace mx = mlx::core;

namespace {

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum MaskKind { NO_MASK = 0, CAUSAL = 1, BOOL_MASK = 2, ADDITIVE_MASK = 3 };

/* How MLX's matmul hands a (rows, cols) operand to BLAS (check_transpose in its
 * backend/cpu/matmul.cpp): row-major as is, column-major as a transpose, else a row-major copy. */
struct Operand {
  bool transposed;
  bool copy;
  int64_t ld;
};

Operand blas_operand(int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  if (row_stride == cols && col_stride == 1) return {false, false, row_stride};
  if (row_stride == 1 && col_stride == rows) return {true, false, col_stride};
  return {false, true, cols};
}

/* MLX's softmax (backend/cpu/softmax.cpp, float32, precise) over each of `rows` rows of `n`. */
void softmax_rows(float *x, int rows, int n) {
  namespace simd = mx::simd;
  static_assert(simd::max_size<float> == 1, "MLX's softmax order is written here for 1 lane");
  for (int r = 0; r < rows; ++r, x += n) {
    simd::Simd<float, 1> vmaximum(-mx::numeric_limits<float>::infinity());
    for (int i = 0; i < n; ++i) vmaximum = simd::maximum(simd::Simd<float, 1>(x[i]), vmaximum);
    float maximum = simd::max(vmaximum);
    for (int i = 0; i < n; ++i) x[i] = simd::exp(simd::Simd<float, 1>(x[i]) - maximum).value;
    simd::Simd<float, 1> vnormalizer(0.0);
    for (int i = 0; i < n; ++i) vnormalizer = vnormalizer + simd::Simd<float, 1>(x[i]);
    float normalizer = simd::sum(vnormalizer);
    normalizer = 1 / normalizer;
    for (int i = 0; i < n; ++i) x[i] = simd::Simd<float, 1>(x[i] * normalizer).value;
  }
}

/* dst (rows, cols) row-major from src's element (i, j) at i * row_stride + j * col_stride. */
void gather(float *dst, const float *src, int rows, int cols, int64_t row_stride,
            int64_t col_stride) {
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) dst[(size_t)i * cols + j] = src[i * row_stride + j * col_stride];
}

struct Problem {
  int batch, heads, kv_heads, q_len, kv_len, dim;
  int mask_kind;
  const float *q, *k, *v;
  const void *mask;
  mx::Strides q_strides, k_strides, v_strides, mask_strides;
  float *out;
};

/* The BLAS shim's thread pool, where it is loaded (else null): fn(context, i) for i < count, each
 * call computed whole by one thread, the calling thread taking part. */
using ParallelFor = void (*)(int, void (*)(void *, int), void *);
ParallelFor parallel_for() {
  static auto fn = reinterpret_cast<ParallelFor>(dlsym(RTLD_DEFAULT, "mlxspec_blas_parallel_for"));
  return fn;
}

/* mlxspec's BLAS shim, where it is loaded: whether a product of this shape goes to a kernel
 * whose outputs do not depend on how many rows share the call (then a KV head's query heads go
 * in one call, the same bits as one call per head). */
using RowsIndependent = int (*)(int, int, int, int);
RowsIndependent rows_independent() {
  static auto fn = reinterpret_cast<RowsIndependent>(dlsym(RTLD_DEFAULT, "mlxspec_blas_rows_independent"));
  return fn;
}

/* How MLX hands one attention's operands to BLAS, and how this one calls it (see attend). */
struct Plan {
  const Problem *p;
  Operand qo, kt, vo;
  int kt_trans, v_trans, repeats, per_call, rows;
  bool q_direct;
  bool skip_hidden;  // the products' sums do not depend on where they start (see hidden_prefix)
  int64_t q_step;
};

Plan plan_for(const Problem &p) {
  Plan plan{&p};
  const int64_t *qst = p.q_strides.data(), *kst = p.k_strides.data(), *vst = p.v_strides.data();
  const int lq = p.q_len, l = p.kv_len, d = p.dim;
  plan.repeats = p.heads / p.kv_heads;
  // MLX's operands: q (lq, d) per head; k^T (d, l) with k's strides swapped; v (l, d).
  plan.qo = blas_operand(lq, d, qst[2], qst[3]);
  plan.kt = blas_operand(d, l, kst[3], kst[2]);
  plan.vo = blas_operand(l, d, vst[2], vst[3]);
  plan.kt_trans = plan.kt.transposed ? TRANS : NO_TRANS;
  plan.v_trans = plan.vo.transposed ? TRANS : NO_TRANS;
  RowsIndependent independent = rows_independent();
  const bool grouped = plan.repeats > 1 && !plan.qo.transposed && independent &&
                       independent(NO_TRANS, plan.kt_trans, plan.repeats * lq, l) &&
                       independent(NO_TRANS, plan.v_trans, plan.repeats * lq, d);
  plan.per_call = grouped ? plan.repeats : 1;
  plan.rows = plan.per_call * lq;
  // The shim's kernels: q k^T one sum per key, p v one FMA chain per output from its first key
  // (BLAS proper may block a sum over keys differently once it starts elsewhere)
  plan.skip_hidden = !plan.qo.transposed && independent &&
                     independent(NO_TRANS, plan.kt_trans, plan.rows, l) &&
                     independent(NO_TRANS, plan.v_trans, plan.rows, d);
  // A call's q rows (head r, query i at r * lq + i) in place when they are evenly spaced.
  plan.q_step = plan.per_call > 1 && lq == 1 ? qst[1] : plan.qo.ld;
  plan.q_direct = !plan.qo.copy && !plan.qo.transposed && qst[3] == 1 && plan.q_step >= d &&
                  (plan.per_call == 1 || lq == 1 || qst[1] == lq * qst[2]);
  return plan;
}

/* How many leading key positions the mask hides from every query of row b's heads
 * [h_begin, h_end) (bool false, or an additive -inf), 0 if it hides all of them. A batch's rows
 * are left-padded to its longest: a row that joined late attends over padding it cannot see.
 * Those positions get a probability of exactly 0 (MLX's exp is 0 below -88), so they add exact
 * zeros at the start of the softmax's sum and of every p v chain (keys and values are finite):
 * starting at the first visible position gives the same bits for less work (the keys and values
 * of the padding are not read). */
int hidden_prefix(const Problem &p, int b, int h_begin, int h_end) {
  if (p.mask_kind != BOOL_MASK && p.mask_kind != ADDITIVE_MASK) return 0;
  const int64_t *ms = p.mask_strides.data();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  int start = p.kv_len;
  if (ms[1] == 0) h_end = h_begin + 1;  // the same mask for every head
  for (int h = h_begin; h < h_end && start > 0; ++h)
    for (int i = 0; i < p.q_len && start > 0; ++i) {
      const int64_t base = b * ms[0] + h * ms[1] + i * ms[2];
      int j = 0;
      if (p.mask_kind == BOOL_MASK) {
        const bool *mask = static_cast<const bool *>(p.mask);
        while (j < start && !mask[base + j * ms[3]]) ++j;
      } else {
        const float *mask = static_cast<const float *>(p.mask);
        while (j < start && mask[base + j * ms[3]] == minus_inf) ++j;
      }
      start = j;
    }
  return start == p.kv_len ? 0 : start;
}

/* Row b's KV head kvh: its query heads' outputs, whole (one thread computes them). */
void attend_pair(const Plan &plan, int b, int kvh) {
  const Problem &p = *plan.p;
  const Operand &qo = plan.qo, &kt = plan.kt, &vo = plan.vo;
  const int lq = p.q_len, d = p.dim, per_call = plan.per_call, rows = plan.rows;
  const int64_t *qst = p.q_strides.data(), *kst = p.k_strides.data(), *vst = p.v_strides.data();
  // keys [skip, kv_len) only: the mask hides the others from every query here
  const int skip =
      plan.skip_hidden ? hidden_prefix(p, b, kvh * plan.repeats, (kvh + 1) * plan.repeats) : 0;
  const int l = p.kv_len - skip;
  std::vector<float> scores((size_t)rows * l), q_copy, kt_copy, v_copy;
  const float *kb = p.k + b * kst[0] + kvh * kst[1] + skip * kst[2];
  const float *vb = p.v + b * vst[0] + kvh * vst[1] + skip * vst[2];
  if (kt.copy) {
    kt_copy.resize((size_t)d * l);
    gather(kt_copy.data(), kb, d, l, kst[3], kst[2]);
  }
  if (vo.copy) {
    v_copy.resize((size_t)l * d);
    gather(v_copy.data(), vb, l, d, vst[2], vst[3]);
  }
  if (!plan.q_direct && !qo.transposed) q_copy.resize((size_t)rows * d);
  const float *kt_ptr = kt.copy ? kt_copy.data() : kb, *v_ptr = vo.copy ? v_copy.data() : vb;
  const int kt_ld = kt.copy ? l : (int)kt.ld;  // a copy's rows are l long (the plan's: kv_len)
  const float lowest = mx::numeric_limits<float>::lowest();
  for (int h0 = kvh * plan.repeats; h0 < (kvh + 1) * plan.repeats; h0 += per_call) {
    const float *qb = p.q + b * qst[0] + h0 * qst[1];
    if (qo.transposed) {  // MLX's q operand column-major: one head a call (per_call 1)
      cblas_sgemm(ROW_MAJOR, TRANS, plan.kt_trans, lq, l, d, 1.0f, qb, (int)qo.ld, kt_ptr,
                  kt_ld, 0.0f, scores.data(), l);
    } else {
      if (!plan.q_direct)
        for (int r = 0; r < per_call; ++r)
          gather(q_copy.data() + (size_t)r * lq * d, qb + r * qst[1], lq, d, qst[2], qst[3]);
      cblas_sgemm(ROW_MAJOR, NO_TRANS, plan.kt_trans, rows, l, d, 1.0f,
                  plan.q_direct ? qb : q_copy.data(), (int)(plan.q_direct ? plan.q_step : d),
                  kt_ptr, kt_ld, 0.0f, scores.data(), l);
    }
    for (int r = 0; r < per_call; ++r) {
      float *head_scores = scores.data() + (size_t)r * lq * l;
      if (p.mask_kind == CAUSAL) {  // skip is 0
        for (int i = 0; i < lq; ++i)
          for (int j = 0; j < l; ++j)
            if (!(i + (l - lq) >= j)) head_scores[(size_t)i * l + j] = lowest;
      } else if (p.mask_kind != NO_MASK) {
        const int64_t *ms = p.mask_strides.data();
        const int64_t base = b * ms[0] + (h0 + r) * ms[1];
        for (int i = 0; i < lq; ++i)
          for (int j = 0; j < l; ++j) {
            float &s = head_scores[(size_t)i * l + j];
            const int64_t at = base + i * ms[2] + (j + skip) * ms[3];
            if (p.mask_kind == BOOL_MASK)
              s = static_cast<const bool *>(p.mask)[at] ? s : lowest;
            else
              s = s + static_cast<const float *>(p.mask)[at];
          }
      }
    }
    softmax_rows(scores.data(), rows, l);
    cblas_sgemm(ROW_MAJOR, NO_TRANS, plan.v_trans, rows, d, l, 1.0f, scores.data(), l, v_ptr,
                (int)vo.ld, 0.0f, p.out + ((size_t)b * p.heads + h0) * lq * d, d);
  }
}

/* Multiply-adds (q k^T and p v) from which the (row, KV head) pairs run on the BLAS shim's
 * threads: below, waking a thread costs more than it saves. */
constexpr double ATTENTION_PARALLEL_MIN_WORK = 1 << 18;

void attend(const Problem &p) {
  ParallelFor pf = parallel_for();
  const Plan plan = plan_for(p);
  const int pairs = p.batch * p.kv_heads;
  const double work = 2.0 * p.batch * p.heads * p.q_len * p.kv_len * p.dim;
  if (pf && pairs > 1 && work >= ATTENTION_PARALLEL_MIN_WORK) {
    pf(pairs, [](void *context, int i) {
      const Plan &plan = *static_cast<const Plan *>(context);
      attend_pair(plan, i / plan.p->kv_heads, i % plan.p->kv_heads);
    }, const_cast<Plan *>(&plan));
  } else {
    for (int i = 0; i < pairs; ++i) attend_pair(plan, i / p.kv_heads, i % p.kv_heads);
  }
}

/* Offset of row r (the last axis being the row) of an array of this shape and strides. */
int64_t row_offset(const mx::Shape &shape, const mx::Strides &strides, int64_t r) {
  int64_t at = 0;
  for (int d = (int)shape.size() - 2; d >= 0; --d) {
    at += (r % shape[d]) * strides[d];
    r /= shape[d];
  }
  return at;
}

/* How many rows (the last axis being the row) an array of this shape has. */
int64_t row_count(const mx::Shape &shape) {
  return std::accumulate(shape.begin(), shape.end() - 1, (int64_t)1, std::multiplies<int64_t>());
}

/* RoPE's rotation from its tables, MLX's fallback's numbers (see rotation_ops in _ops.cpp). */
struct Rotation {
  int B, N, T, D, dims;
  bool traditional;
  const float *x, *c, *s;
  mx::Strides xs, cs, ss;
  float *out;
};

void rotate(const Rotation &r) {
  const int half = r.dims / 2;
  const int64_t x3 = r.xs[3], c1 = r.cs[1], s1 = r.ss[1];
  const int64_t first = r.traditional ? 2 * x3 : x3, second = r.traditional ? x3 : half * x3;
  for (int b = 0; b < r.B; ++b)
    for (int n = 0; n < r.N; ++n)
      for (int t = 0; t < r.T; ++t) {
        const float *x = r.x + b * r.xs[0] + n * r.xs[1] + t * r.xs[2];
        const float *c = r.c + t * r.cs[0], *s = r.s + t * r.ss[0];
        float *o = r.out + (((int64_t)b * r.N + n) * r.T + t) * r.D;
        for (int i = 0; i < half; ++i) {
          const float x1 = x[i * first], x2 = x[i * first + second], ci = c[i * c1], si = s[i * s1];
          const float a = x1 * ci - x2 * si, z = x1 * si + x2 * ci;
          if (r.traditional)
            o[2 * i] = a, o[2 * i + 1] = z;
          else
            o[i] = a, o[i + half] = z;
        }
        for (int i = r.dims; i < r.D; ++i) o[i] = x[i * x3];
      }
}

/* MLX's RMSNorm fallback (fast.cpp; float32 input and weight) as one op where it is three
 * (square, sum, and the compiled rest): per row, the squares summed left to right (its reduce
 * runs one lane here), times float(1 / n), plus eps, 1 / sqrt, times x, times the weight; every
 * operation rounded on its own, in MLX's order. Gradients through MLX's own function. */
struct NormJob {
  const float *x, *w;
  float *out;
  mx::Shape shape;
  mx::Strides strides;
  int64_t w_stride;
  float eps, inverse_n;
};

void rms_norm_rows(const NormJob &j) {
  const int n = j.shape.back();
  const int64_t rows = row_count(j.shape);
  const int64_t step = j.strides.back();
  for (int64_t r = 0; r < rows; ++r) {
    const float *x = j.x + row_offset(j.shape, j.strides, r);
    float *o = j.out + r * n;
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += x[i * step] * x[i * step];
    const float scale = 1.0f / std::sqrt(sum * j.inverse_n + j.eps);
    if (step == 1 && j.w_stride == 1)  // the common case, vectorized
      for (int i = 0; i < n; ++i) o[i] = (x[i] * scale) * j.w[i];
    else
      for (int i = 0; i < n; ++i) o[i] = (x[i * step] * scale) * j.w[i * j.w_stride];
  }
}

}  // namespace
