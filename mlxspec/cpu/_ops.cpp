/*
 * One MLX primitive for scaled dot-product attention on the CPU back-end: the numbers of MLX's own
 * CPU path (the composed fallback of mx.fast.scaled_dot_product_attention), from one op instead
 * of a dozen; mlxspec.serving.rows.greedy_candidates as one op; and RoPE's rotation from its
 * tables (CpuRope), RMSNorm (CpuRmsNorm), exp and last-axis logsumexp (CpuRows) as one op each.
 * mlxspec/cpu/build.py builds them and mlxspec/cpu/ops.py loads them.
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

#include "_mlx_bits.h"

namespace {

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
