/*
 * One MLX primitive for scaled dot-product attention on the CPU back-end: the numbers of MLX's own
 * CPU path (the composed fallback of mx.fast.scaled_dot_product_attention), from one op instead
 * of a dozen; mlxspec.serving.rows.greedy_candidates as one op; and RoPE's rotation from its
 * tables (CpuRope), RMSNorm (CpuRmsNorm), exp and last-axis logsumexp (CpuRows) as one op each.
 * mlxspec/cpu/ops.py builds and loads them.
 *
 * Where MLX has no attention kernel (every CPU build) it composes the attention from ops: q scaled,
 * one BLAS product per (row, query head) for q k^T, the mask, a softmax, one product per
 * (row, query head) for p v. A decode step over 8 rows of SmolLM2 (30 layers, 9 heads) schedules
 * ~10 ops a layer and ~4,300 BLAS calls, and its softmax runs MLX's exp one scalar at a time
 * through libm's fmaf (the Linux wheel targets baseline x86-64).
 *
 * This primitive makes the same BLAS calls (cblas_sgemm, resolved as MLX resolves it: through
 * mlxspec's BLAS shim where it is loaded) with the same shapes, transposes and operands, applies
 * the mask as MLX does, and computes the softmax with MLX's own exp (its header, inlined, so GCC
 * can vectorize it: -mfma computes the same correctly rounded fma as libm's fmaf) in MLX's order:
 * the row maximum, exp(x - max), their sum left to right (MLX's Linux build has one-lane SIMD),
 * one reciprocal, one product per value. The output is bitwise MLX's (tests/cpu/test_cpu_ops.py
 * and a check when the module loads). One difference, invisible in the numbers: where the
 * products go to the shim's kernels, a row's leading keys that its mask hides from every query
 * (a batch's left padding) are not read at all (hidden_prefix; the same bits while keys and
 * values are finite). In-process, SmolLM2, 8 streams sending 64-token requests back to back
 * (rows of different lengths), alternating builds: 184.4-190.3 against 177.7-188.6 tok/s.
 */
#include <dlfcn.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "mlx/types/limits.h"

namespace mx = mlx::core;
namespace nb = nanobind;

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                            const float *a, int lda, const float *b, int ldb, float beta, float *c,
                            int ldc);

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
constexpr double PARALLEL_MIN_WORK = 1 << 18;

void attend(const Problem &p) {
  using ParallelFor = void (*)(int, void (*)(void *, int), void *);
  static auto parallel_for =
      reinterpret_cast<ParallelFor>(dlsym(RTLD_DEFAULT, "mlxspec_blas_parallel_for"));
  const Plan plan = plan_for(p);
  const int pairs = p.batch * p.kv_heads;
  const double work = 2.0 * p.batch * p.heads * p.q_len * p.kv_len * p.dim;
  if (parallel_for && pairs > 1 && work >= PARALLEL_MIN_WORK) {
    parallel_for(pairs, [](void *context, int i) {
      const Plan &plan = *static_cast<const Plan *>(context);
      attend_pair(plan, i / plan.p->kv_heads, i % plan.p->kv_heads);
    }, const_cast<Plan *>(&plan));
  } else {
    for (int i = 0; i < pairs; ++i) attend_pair(plan, i / p.kv_heads, i % p.kv_heads);
  }
}

/* What the single-output primitives here share: they run on the CPU stream only, allocate their
 * output and register their arrays with the stream's encoder (begin), and take their gradients,
 * forward derivatives and vmap through an MLX composition computing the same function
 * (composed): mx.logsumexp is replaced process-wide, so every transform MLX's own has must work. */
class CpuPrimitive : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;

  void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
    throw std::runtime_error("[mlxspec cpu_ops] runs on the CPU stream only");
  }

 protected:
  mx::cpu::CommandEncoder &begin(const std::vector<mx::array> &inputs, mx::array &out) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream());
    for (const auto &input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    return encoder;
  }

  using Composed = std::function<std::vector<mx::array>(const std::vector<mx::array> &)>;
  /* The same function from MLX ops. */
  virtual Composed composed() const = 0;

 public:
  std::vector<mx::array> vjp(const std::vector<mx::array> &primals,
                             const std::vector<mx::array> &cotangents,
                             const std::vector<int> &argnums,
                             const std::vector<mx::array> &) override {
    auto grads = mx::vjp(composed(), primals, cotangents).second;
    std::vector<mx::array> result;
    for (int i : argnums) result.push_back(grads[i]);
    return result;
  }

  std::vector<mx::array> jvp(const std::vector<mx::array> &primals,
                             const std::vector<mx::array> &tangents,
                             const std::vector<int> &argnums) override {
    std::vector<mx::array> all;  // zero for the inputs not differentiated
    for (const auto &primal : primals) all.push_back(mx::zeros_like(primal));
    for (size_t i = 0; i < argnums.size(); ++i) all[argnums[i]] = tangents[i];
    return mx::jvp(composed(), primals, all).second;
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array> &inputs,
                                                          const std::vector<int> &axes) override {
    return {mx::vmap(composed(), axes, {0})(inputs), {0}};  // axes: -1 where not mapped
  }
};

class CpuAttention : public CpuPrimitive {
 public:
  CpuAttention(mx::Stream stream, int mask_kind) : CpuPrimitive(stream), mask_kind_(mask_kind) {}

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2];
    auto &encoder = begin(inputs, out);
    Problem p{(int)q.shape(0), (int)q.shape(1), (int)k.shape(1), (int)q.shape(2), (int)k.shape(2),
              (int)q.shape(3), mask_kind_, q.data<float>(), k.data<float>(),
              v.data<float>(), nullptr, q.strides(), k.strides(), v.strides(), {}, out.data<float>()};
    if (inputs.size() > 3) {
      p.mask = inputs[3].data<void>();
      p.mask_strides = inputs[3].strides();
    }
    encoder.dispatch([p = std::move(p)]() { attend(p); });
  }

  /* Gradients through MLX's own composition (q already scaled: scale 1 multiplies exactly). */
  Composed composed() const override {
    const int kind = mask_kind_;
    auto composed = [kind](const std::vector<mx::array> &in) {
      std::optional<mx::array> mask;
      if (in.size() > 3) mask = in[3];
      const char *mode = in.size() > 3 ? "array" : kind == CAUSAL ? "causal" : "";
      return std::vector<mx::array>{
          mx::fast::scaled_dot_product_attention(in[0], in[1], in[2], 1.0f, mode, mask)};
    };
    return composed;
  }

  const char *name() const override { return "MlxspecCpuAttention"; }

  bool is_equivalent(const mx::Primitive &other) const override {
    auto &o = static_cast<const CpuAttention &>(other);
    return mask_kind_ == o.mask_kind_;
  }

 private:
  int mask_kind_;
};

/* q (B, H, Lq, D), k and v (B, KV, L, D), float32; mask None, or bool/float32 broadcastable to
 * (B, H, Lq, L); causal: MLX's "causal" mask. Returns (B, H, Lq, D) float32. */
mx::array attention(const mx::array &q, const mx::array &k, const mx::array &v, float scale,
                    const std::optional<mx::array> &mask, bool causal) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || q.dtype() != mx::float32 ||
      k.dtype() != mx::float32 || v.dtype() != mx::float32 || k.shape() != v.shape() ||
      q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3) || q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument("[mlxspec cpu_ops] unsupported shapes or dtypes");
  auto stream = mx::to_stream({});
  // q scaled by MLX's own multiply, as its fallback does: the product's layout is MLX's too
  std::vector<mx::array> inputs = {mx::multiply(mx::array(scale, mx::float32), q, stream), k, v};
  int kind = causal ? CAUSAL : NO_MASK;
  if (mask) {
    if (causal) throw std::invalid_argument("[mlxspec cpu_ops] a mask array or causal");
    kind = mask->dtype() == mx::bool_ ? BOOL_MASK : ADDITIVE_MASK;
    if (kind == ADDITIVE_MASK && mask->dtype() != mx::float32)
      throw std::invalid_argument("[mlxspec cpu_ops] masks are bool or float32");
    mx::Shape shape = q.shape();
    shape.back() = k.shape(2);
    inputs.push_back(mx::broadcast_to(*mask, shape, stream));
  }
  return mx::array(q.shape(), mx::float32, std::make_shared<CpuAttention>(stream, kind),
                   std::move(inputs));
}

/* mlxspec.serving.rows.greedy_candidates over logits (rows, vocabulary), float32: each row's
 * argmax as MLX's ArgMax finds it (the first NaN if there is one, else the first index of the
 * largest value), and how many values are >= that value minus `tie` (0 when it is not finite).
 * MLX's three ops scan the row with scalar loops, ~0.9 ms for 8 rows of 49,152; here the maximum
 * is taken 16 lanes at a time (the largest value does not depend on the order; the first index
 * holding it is then found by a scan). */
void greedy_row(const float *r, int64_t vocab, int64_t stride, float tie, uint32_t *top,
                int32_t *near) {
  float best = r[0];
  int nan_seen = std::isnan(best);
  int64_t j = 1;
#if defined(__AVX2__)
  if (stride == 1) {  // (a > m) ? a : m per lane is what _mm256_max_ps(a, m) computes
    __m256 m0 = _mm256_set1_ps(best), m1 = m0, unordered = _mm256_setzero_ps();
    for (; j + 16 <= vocab; j += 16) {
      const __m256 a = _mm256_loadu_ps(r + j), b = _mm256_loadu_ps(r + j + 8);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
      m0 = _mm256_max_ps(a, m0);
      m1 = _mm256_max_ps(b, m1);
    }
    float lanes[16];
    _mm256_storeu_ps(lanes, m0);
    _mm256_storeu_ps(lanes + 8, m1);
    for (float v : lanes) best = v > best ? v : best;
    nan_seen |= _mm256_movemask_ps(unordered) != 0;
  }
#endif
  for (; j < vocab; ++j) {
    const float v = r[j * stride];
    nan_seen |= v != v;
    best = v > best ? v : best;
  }
  uint32_t at = 0;
  if (nan_seen) {
    while (!std::isnan(r[at * stride])) ++at;
    *top = at, *near = 0;
    return;
  }
#if defined(__AVX2__)
  if (stride == 1) {
    const __m256 target = _mm256_set1_ps(best);
    for (; at + 8 <= vocab; at += 8)
      if (int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + at), target, _CMP_EQ_OQ))) {
        at += __builtin_ctz(hit);
        break;
      }
  }
#endif
  while (!(r[at * stride] == best)) ++at;
  int32_t count = 0;
  if (std::isfinite(best)) {
    const float threshold = best - tie;
    for (int64_t i = 0; i < vocab; ++i) count += r[i * stride] >= threshold;
  }
  *top = at, *near = count;
}

class GreedyCandidates : public mx::Primitive {
 public:
  GreedyCandidates(mx::Stream stream, float tie) : mx::Primitive(stream), tie_(tie) {}

  void eval_cpu(const std::vector<mx::array> &inputs, std::vector<mx::array> &outputs) override {
    const mx::array &logits = inputs[0];
    for (auto &out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(logits);
    for (auto &out : outputs) encoder.set_output_array(out);
    encoder.dispatch([x = logits.data<float>(), rows = logits.shape(0), vocab = logits.shape(1),
                      row_stride = logits.strides(0), col_stride = logits.strides(1), tie = tie_,
                      top = outputs[0].data<uint32_t>(), near = outputs[1].data<int32_t>()]() {
      for (int64_t i = 0; i < rows; ++i)
        greedy_row(x + i * row_stride, vocab, col_stride, tie, top + i, near + i);
    });
  }

  void eval_gpu(const std::vector<mx::array> &, std::vector<mx::array> &) override {
    throw std::runtime_error("[mlxspec cpu_ops] runs on the CPU stream only");
  }

  /* mx.vmap (mlxspec.cpu.argmax is a sampler, which MLX's argmax lets one map): the mapped axis
   * moved first and merged with the rows, the outputs split again. */
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array> &inputs,
                                                          const std::vector<int> &axes) override {
    mx::array x = mx::moveaxis(inputs[0], axes[0], 0);  // (mapped, rows, vocabulary)
    const int mapped = x.shape(0), rows = x.shape(1);
    x = mx::reshape(x, {mapped * rows, x.shape(2)});
    mx::Shape flat = {mapped * rows};
    auto outs = mx::array::make_arrays({flat, flat}, {mx::uint32, mx::int32},
                                       std::make_shared<GreedyCandidates>(stream(), tie_), {x});
    for (auto &out : outs) out = mx::reshape(out, {mapped, rows});
    return {outs, {0, 0}};
  }

  const char *name() const override { return "MlxspecGreedyCandidates"; }

  bool is_equivalent(const mx::Primitive &other) const override {
    return tie_ == static_cast<const GreedyCandidates &>(other).tie_;
  }

 private:
  float tie_;
};

/* logits (rows, vocabulary) float32, rows >= 1 and vocabulary >= 1: (top uint32, near int32). */
std::vector<mx::array> greedy_candidates(const mx::array &logits, float tie) {
  if (logits.ndim() != 2 || logits.dtype() != mx::float32 || logits.shape(0) < 1 ||
      logits.shape(1) < 1)
    throw std::invalid_argument("[mlxspec cpu_ops] greedy_candidates takes (rows, vocab) float32");
  auto stream = mx::to_stream({});
  mx::Shape rows = {logits.shape(0)};
  return mx::array::make_arrays({rows, rows}, {mx::uint32, mx::int32},
                                std::make_shared<GreedyCandidates>(stream, tie), {logits});
}

/* RoPE's rotation from its cosine and sine tables, as one op: mlxspec/cpu/fused_ops.py builds
 * the tables once per position with MLX's own function and calls this for each RoPE of a step.
 * x (B, N, T, D) float32, any strides; cos, sin (T, dims / 2) float32, any strides. The result is
 * MLX's fallback's, [x1 c - x2 s, x1 s + x2 c, x[dims:]] with x1, x2 the two halves of the first
 * dims (traditional: their even and odd elements, the results interleaved), every product and
 * sum rounded on its own as MLX's compiled kernels round them (this file is built without fma
 * contraction). Gradients go through the same rotation composed of MLX ops. */
mx::array rotation_ops(const mx::array &x, const mx::array &c, const mx::array &s, int dims,
                       bool traditional) {
  const int B = x.shape(0), N = x.shape(1), T = x.shape(2), D = x.shape(3), half = dims / 2;
  mx::array x1 = traditional ? mx::slice(x, {0, 0, 0, 0}, {B, N, T, dims}, {1, 1, 1, 2})
                             : mx::slice(x, {0, 0, 0, 0}, {B, N, T, half});
  mx::array x2 = traditional ? mx::slice(x, {0, 0, 0, 1}, {B, N, T, dims}, {1, 1, 1, 2})
                             : mx::slice(x, {0, 0, 0, half}, {B, N, T, dims});
  std::vector<mx::array> outs = {mx::subtract(mx::multiply(x1, c), mx::multiply(x2, s)),
                                 mx::add(mx::multiply(x1, s), mx::multiply(x2, c))};
  mx::array out = traditional ? mx::reshape(mx::concatenate({mx::expand_dims(outs[0], -1),
                                                             mx::expand_dims(outs[1], -1)}, -1),
                                            {B, N, T, dims})
                              : mx::concatenate(outs, -1);
  if (dims < D) out = mx::concatenate({out, mx::slice(x, {0, 0, 0, dims}, {B, N, T, D})}, -1);
  return out;
}

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

class CpuRope : public CpuPrimitive {
 public:
  CpuRope(mx::Stream stream, int dims, bool traditional)
      : CpuPrimitive(stream), dims_(dims), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    const mx::array &x = inputs[0], &c = inputs[1], &s = inputs[2];
    auto &encoder = begin(inputs, out);
    Rotation r{(int)x.shape(0), (int)x.shape(1), (int)x.shape(2), (int)x.shape(3), dims_,
               traditional_, x.data<float>(), c.data<float>(), s.data<float>(), x.strides(),
               c.strides(), s.strides(), out.data<float>()};
    encoder.dispatch([r = std::move(r)]() { rotate(r); });
  }

  Composed composed() const override {
    const int dims = dims_;
    const bool traditional = traditional_;
    auto composed = [dims, traditional](const std::vector<mx::array> &in) {
      return std::vector<mx::array>{rotation_ops(in[0], in[1], in[2], dims, traditional)};
    };
    return composed;
  }

  const char *name() const override { return "MlxspecCpuRope"; }

  bool is_equivalent(const mx::Primitive &other) const override {
    auto &o = static_cast<const CpuRope &>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_;
  }

 private:
  int dims_;
  bool traditional_;
};

/* x (B, N, T, D) float32, cos and sin (T, dims / 2) float32, 0 < dims <= D even. */
mx::array rope(const mx::array &x, const mx::array &c, const mx::array &s, int dims,
               bool traditional) {
  if (x.ndim() != 4 || x.dtype() != mx::float32 || c.dtype() != mx::float32 ||
      s.dtype() != mx::float32 || dims <= 0 || dims % 2 || dims > x.shape(3) ||
      c.shape() != mx::Shape{x.shape(2), dims / 2} || s.shape() != c.shape())
    throw std::invalid_argument("[mlxspec cpu_ops] unsupported shapes or dtypes for rope");
  auto stream = mx::to_stream({});
  return mx::array(x.shape(), mx::float32, std::make_shared<CpuRope>(stream, dims, traditional),
                   {x, c, s});
}

/* MLX's exp and logsumexp over float32 on its Linux build, whose CPU kernels run one lane at a
 * time and call libm's fmaf (software on baseline x86-64) inside every exp: ~13 ns an element,
 * 0.65 ms for one row of a 49,152-token vocabulary, paid by every log-softmax of decoding and
 * every probability of sampled speculation. Here MLX's own exp (its header, inlined; -mfma gives
 * the same correctly rounded fma) runs vectorized. LogSumExp is backend/cpu/logsumexp.cpp's
 * order: the maximum, exp(x - maximum) summed left to right, log(sum) + maximum. Bitwise MLX's
 * (tests/cpu/test_cpu_exp.py; checked at load). Gradients through MLX's own ops. */
struct RowsJob {
  const float *x;
  float *out;
  mx::Shape shape;
  mx::Strides strides;
};

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

void exp_rows(const RowsJob &j) {
  namespace simd = mx::simd;
  const int n = j.shape.back();
  const int64_t rows = n ? row_count(j.shape) : 0;
  const int64_t step = j.strides.back();
  for (int64_t r = 0; r < rows; ++r) {
    const float *x = j.x + row_offset(j.shape, j.strides, r);
    float *o = j.out + r * n;
    if (step == 1)  // the common case, vectorized
      for (int i = 0; i < n; ++i) o[i] = simd::exp(simd::Simd<float, 1>(x[i])).value;
    else
      for (int i = 0; i < n; ++i) o[i] = simd::exp(simd::Simd<float, 1>(x[i * step])).value;
  }
}

void logsumexp_rows(const RowsJob &j) {
  namespace simd = mx::simd;
  static_assert(simd::max_size<float> == 1, "MLX's logsumexp order is written here for 1 lane");
  const int n = j.shape.back();
  const int64_t rows = row_count(j.shape);
  const int64_t step = j.strides.back();
  std::vector<float> e(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float *x = j.x + row_offset(j.shape, j.strides, r);
    simd::Simd<float, 1> vmaximum(-mx::numeric_limits<float>::infinity());
    for (int i = 0; i < n; ++i) vmaximum = simd::maximum(simd::Simd<float, 1>(x[i * step]), vmaximum);
    const float maximum = simd::max(vmaximum);
    if (step == 1)  // the common case, vectorized
      for (int i = 0; i < n; ++i) e[i] = simd::exp(simd::Simd<float, 1>(x[i]) - maximum).value;
    else
      for (int i = 0; i < n; ++i)
        e[i] = simd::exp(simd::Simd<float, 1>(x[i * step]) - maximum).value;
    simd::Simd<float, 1> vnormalizer(0.0);
    for (int i = 0; i < n; ++i) vnormalizer = vnormalizer + simd::Simd<float, 1>(e[i]);
    const float normalizer = simd::sum(vnormalizer);
    j.out[r] = std::isinf(maximum) ? maximum : std::log(normalizer) + maximum;
  }
}

class CpuRows : public CpuPrimitive {
 public:
  CpuRows(mx::Stream stream, bool reduce) : CpuPrimitive(stream), reduce_(reduce) {}

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    const mx::array &x = inputs[0];
    auto &encoder = begin(inputs, out);
    RowsJob j{x.data<float>(), out.data<float>(), x.shape(), x.strides()};
    if (reduce_)
      encoder.dispatch([j = std::move(j)]() { logsumexp_rows(j); });
    else
      encoder.dispatch([j = std::move(j)]() { exp_rows(j); });
  }

  Composed composed() const override {
    const bool reduce = reduce_;
    auto composed = [reduce](const std::vector<mx::array> &in) {
      return std::vector<mx::array>{reduce ? mx::logsumexp(in[0], -1, true) : mx::exp(in[0])};
    };
    return composed;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
    mx::Shape shape = inputs[0].shape();
    if (reduce_) shape.back() = 1;
    return {shape};
  }

  const char *name() const override { return reduce_ ? "MlxspecCpuLogSumExp" : "MlxspecCpuExp"; }

  bool is_equivalent(const mx::Primitive &other) const override {
    return reduce_ == static_cast<const CpuRows &>(other).reduce_;
  }

 private:
  bool reduce_;
};

/* exp(x) for x float32 (any shape, any strides): a row-contiguous array of x's shape. */
mx::array exp_op(const mx::array &x) {
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("[mlxspec cpu_ops] exp takes float32 arrays of 1+ dimensions");
  return mx::array(x.shape(), mx::float32, std::make_shared<CpuRows>(mx::to_stream({}), false),
                   {x});
}

/* logsumexp over the last axis of x float32 (..., n >= 1), keeping it: (..., 1). */
mx::array logsumexp_op(const mx::array &x) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.size() == 0)
    throw std::invalid_argument("[mlxspec cpu_ops] logsumexp takes non-empty float32 arrays");
  mx::Shape shape = x.shape();
  shape.back() = 1;
  return mx::array(shape, mx::float32, std::make_shared<CpuRows>(mx::to_stream({}), true), {x});
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

class CpuRmsNorm : public CpuPrimitive {
 public:
  CpuRmsNorm(mx::Stream stream, float eps) : CpuPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    const mx::array &x = inputs[0], &w = inputs[1];
    auto &encoder = begin(inputs, out);
    NormJob j{x.data<float>(), w.data<float>(), out.data<float>(), x.shape(), x.strides(),
              w.strides()[0], eps_, (float)(1.0 / x.shape(-1))};
    encoder.dispatch([j = std::move(j)]() { rms_norm_rows(j); });
  }

  Composed composed() const override {
    const float eps = eps_;
    auto composed = [eps](const std::vector<mx::array> &in) {
      return std::vector<mx::array>{mx::fast::rms_norm(in[0], in[1], eps)};
    };
    return composed;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array> &inputs) override {
    return {inputs[0].shape()};
  }

  const char *name() const override { return "MlxspecCpuRmsNorm"; }

  bool is_equivalent(const mx::Primitive &other) const override {
    return eps_ == static_cast<const CpuRmsNorm &>(other).eps_;
  }

 private:
  float eps_;
};

/* x (..., n) float32 (any strides), weight (n,) float32: (..., n) row-contiguous. */
mx::array rms_norm_op(const mx::array &x, const mx::array &weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 ||
      weight.ndim() != 1 || weight.shape(0) != x.shape(-1) || x.size() == 0)
    throw std::invalid_argument("[mlxspec cpu_ops] rms_norm takes float32 (..., n) and (n,)");
  return mx::array(x.shape(), mx::float32, std::make_shared<CpuRmsNorm>(mx::to_stream({}), eps),
                   {x, weight});
}

}  // namespace

NB_MODULE(_mlxspec_cpu_ops, m) {
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
        nb::arg("mask").none() = nb::none(), nb::arg("causal") = false);
  m.def("greedy_candidates", &greedy_candidates, nb::arg("logits"), nb::arg("tie"));
  m.def("exp", &exp_op, nb::arg("x"));
  m.def("logsumexp", &logsumexp_op, nb::arg("x"));
  m.def("rms_norm", &rms_norm_op, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("rope", &rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("dims"),
        nb::arg("traditional"));
}
