/*
 * A whole Llama-family decoder layer for 1 .. MAX_KERNEL_ROWS new tokens as four MLX ops:
 * LayerQkv (RMSNorm, the q/k/v products, RoPE, q scaled), two CacheRows (the new keys and the new
 * values written into the KV cache's buffers) and LayerRest (attention over the cache, the o
 * product and residual, RMSNorm, gate/up, SiLU, down and residual); mlxspec/cpu/layers.py calls
 * decode_layer for each layer of a decode step or a speculative pass.
 *
 * Why: MLX's CPU back-end pays ~8 us to schedule each op whatever its size, and a one-token step
 * of SmolLM2-135M is ~30 ops a layer beside its 7 weight products (docs/linux-cpu.md). Inside
 * these ops only the products and the attention go to the BLAS shim's threads.
 *
 * The numbers are the unfused layer's, bit for bit: the products are QuantizedMatmul's tasks on
 * the same x, RMSNorm, the rotation and the attention are _mlx_bits.h (what the single ops of
 * _ops.cpp compute), q is scaled by one product per element as MLX's fallback scales it, SiLU is
 * MLX's x * sigmoid(x) with MLX's sigmoid and exp, and the residual sums are single additions.
 *
 * The cache writes are ops of their own because MLX hands an input's buffer over to an output
 * (donation) only when nothing else holds the input, and each output of a multi-output op holds
 * all of the op's inputs: a single op returning the layer and the cache could never take the
 * cache's buffer over. A CacheRows takes it over whenever MLX's own slice update would (the
 * usual case), else copies it first (counted: layer_cache_copies).
 */
#pragma once

#include <atomic>
#include <initializer_list>
#include <string>

namespace {

constexpr int LAYER_PROJECTIONS = 7;
enum Projection { PROJ_Q, PROJ_K, PROJ_V, PROJ_O, PROJ_GATE, PROJ_UP, PROJ_DOWN };

std::atomic<int64_t> layer_cache_copies{0};

/* MLX's Sigmoid (backend/cpu/unary_ops.h) on one lane: 1 / (1 + exp(|x|)), mirrored for x >= 0. */
inline float mlx_sigmoid(float x) {
  namespace simd = mx::simd;
  const float y = 1.0f / (1.0f + simd::exp(simd::Simd<float, 1>(std::fabs(x))).value);
  return x < 0.0f ? y : 1.0f - y;
}

struct LayerConfig {
  int heads, kv_heads, rope_dims, offset;
  bool traditional, causal, int8;  // int8: activations rounded to int8 (VNNI), as the product's
  float scale, eps1, eps2;
  std::vector<int> bits, groups;  // per projection: q, k, v, o, gate, up, down

  bool operator==(const LayerConfig &) const = default;
};

/* What a layer's two halves read: shapes, the config, and the projections' weights. */
struct LayerJob {
  LayerConfig c;
  int M, D, head_dim, capacity, hidden;
  bool x_strided;
  const float *x, *norm, *cos, *sin, *keys, *values, *qkv;
  mx::Strides x_strides, cos_strides, sin_strides;  // x's used where x_strided
  float *out;
  Job proj[LAYER_PROJECTIONS];  // w, scales, biases, N, K, bits, group; xp and out set per call
  int64_t q_width() const { return (int64_t)c.heads * head_dim; }
  int64_t kv_width() const { return (int64_t)c.kv_heads * head_dim; }
};

/* Products of one x through several projections in one pass over the pool's threads: the tasks
 * of every product (QuantizedMatmul's, each computing its rows whole) handed out together, so a
 * product too small to split (k and v: one task each) runs beside the others. */
struct Products {
  Job jobs[3];
  int first_task[4];  // task index where each job's tasks start; first_task[count] = total
  int count;
  bool int8;
};

void products_task(void *context, int i) {
  const Products &P = *static_cast<const Products *>(context);
  int at = 0;
  while (i >= P.first_task[at + 1]) ++at;
  (P.int8 ? task_q8 : task)(const_cast<Job *>(&P.jobs[at]), i - P.first_task[at]);
}

/* A buffer of at least n floats of this thread's (grown, never shrunk): slot 0 a layer half's
 * activations, slot 1 x prepared for the products. The kernel's tasks, which may run on this
 * thread too, use scratch(). */
float *layer_buffer(size_t n, int slot) {
  static thread_local std::vector<float> buffers[2];
  if (buffers[slot].size() < n) buffers[slot].resize(n);
  return buffers[slot].data();
}

/* x (M, K) row-major through projections ps[0 .. count) into outs[...] (M, N each), x as
 * QuantizedMatmul prepares it: in each product's chunk order, or rounded to int8 per block
 * (int8 activations). */
void project(const LayerJob &L, std::initializer_list<int> ps, const float *x,
             std::initializer_list<float *> outs) {
  Products P{};
  P.count = (int)ps.size(), P.int8 = L.c.int8;
  std::vector<int64_t> rows(L.M);
  size_t need = 0;
  for (int i = 0; i < P.count; ++i) {
    Job &j = P.jobs[i];
    j = L.proj[ps.begin()[i]];
    j.blocks = (int)((j.row_bytes + 63) / 64);
    need += P.int8 ? (size_t)L.M * (j.blocks * 64 * 8 / j.bits / 4 + j.blocks * 16 + j.groups) + 16
                   : (size_t)L.M * j.K;
  }
  float *buffer = layer_buffer(need, 1);
  double work = 0;
  for (int i = 0; i < P.count; ++i) {
    Job &j = P.jobs[i];
    for (int m = 0; m < L.M; ++m) rows[m] = (int64_t)m * j.K;
    j.out = outs.begin()[i];
    if (P.int8) {  // as QuantizedMatmul's dispatch: xq, then each lane's dx, then x's group sums
      const size_t per_row = (size_t)j.blocks * 64 * 8 / j.bits;
      auto *xq = reinterpret_cast<int8_t *>(buffer);
      float *f = buffer + L.M * per_row / 4 + 16;
      prepare_xq(x, rows.data(), 1, j, xq, f, f + (size_t)L.M * j.blocks * 16);
      j.xq = xq, j.dxv = f, j.xs = f + (size_t)L.M * j.blocks * 16;
      buffer = f + (size_t)L.M * (j.blocks * 16 + j.groups);
    } else {
      prepare_x(x, rows.data(), 1, j.M, j.K, j.bits, buffer);
      j.xp = buffer;
      buffer += (size_t)L.M * j.K;
    }
    P.first_task[i + 1] = P.first_task[i] + split_rows(j, P.int8 ? NR8 : NR);
    work += (double)j.M * j.N * j.K;
  }
  ParallelFor pf = parallel_for();
  const int total = P.first_task[P.count];
  if (pf && work >= PARALLEL_MIN_WORK)
    pf(total, products_task, &P);
  else
    for (int i = 0; i < total; ++i) products_task(&P, i);
}

void rms_norm(const LayerJob &L, const float *x, float eps, float *out) {
  NormJob n{x, L.norm, out, mx::Shape{L.M, L.D}, mx::Strides{L.D, 1}, 1, eps, (float)(1.0 / L.D)};
  rms_norm_rows(n);
}

/* x (M, heads * head_dim) row-major -> out (1, heads, M, head_dim), rotated at the offset. */
void rope_heads(const LayerJob &L, const float *x, int heads, float *out) {
  const int64_t width = (int64_t)heads * L.head_dim;
  Rotation r{1, heads, L.M, L.head_dim, L.c.rope_dims, L.c.traditional, x, L.cos, L.sin,
             mx::Strides{L.M * width, L.head_dim, width, 1}, L.cos_strides, L.sin_strides, out};
  rotate(r);
}

/* x (1, M, D) of any strides as a row-major (M, D) (into dst where it is strided). */
const float *rows_of_x(const LayerJob &L, float *dst) {
  if (!L.x_strided) return L.x;
  for (int m = 0; m < L.M; ++m)
    for (int i = 0; i < L.D; ++i)
      dst[(int64_t)m * L.D + i] = L.x[m * L.x_strides[1] + i * L.x_strides[2]];
  return dst;
}

/* First half -> L.out, (M * (q_width + 2 * kv_width)): q rotated and scaled (1, heads, M, hd),
 * k rotated (1, KV, M, hd), v (1, KV, M, hd). */
void run_qkv(const LayerJob &L) {
  const int M = L.M;
  const int64_t QD = L.q_width(), KD = L.kv_width(), hd = L.head_dim;
  float *h = layer_buffer((size_t)M * (2 * L.D + 2 * QD + 2 * KD), 0);
  float *xc = h + M * L.D, *q = xc + M * L.D, *qr = q + M * QD, *k = qr + M * QD;
  float *v = k + M * KD;
  float *qs = L.out, *kr = qs + M * QD, *vh = kr + M * KD;
  rms_norm(L, rows_of_x(L, xc), L.c.eps1, h);
  project(L, {PROJ_Q, PROJ_K, PROJ_V}, h, {q, k, v});
  rope_heads(L, q, L.c.heads, qr);
  rope_heads(L, k, L.c.kv_heads, kr);
  for (int64_t i = 0; i < M * QD; ++i) qs[i] = L.c.scale * qr[i];
  for (int kvh = 0; kvh < L.c.kv_heads; ++kvh)
    for (int m = 0; m < M; ++m)
      std::memcpy(vh + ((int64_t)kvh * M + m) * hd, v + m * KD + kvh * hd, sizeof(float) * hd);
}

/* Second half -> L.out (M, D): attention over the cache (the new rows already in it), o and the
 * residual, RMSNorm, gate/up, SiLU, down and the residual. */
void run_rest(const LayerJob &L) {
  const int M = L.M, D = L.D, F = L.hidden, hd = L.head_dim;
  const int64_t QD = L.q_width(), plane = (int64_t)L.capacity * hd;
  float *att = layer_buffer((size_t)M * (2 * QD + 4 * D + 3 * F), 0);
  float *o_in = att + M * QD, *xc = o_in + M * QD, *o = xc + M * D, *x1 = o + M * D;
  float *h = x1 + M * D, *g = h + M * D, *u = g + M * F, *a = u + M * F;
  const mx::Strides cache_strides{L.c.kv_heads * plane, plane, hd, 1};
  Problem p{1, L.c.heads, L.c.kv_heads, M, L.c.offset + M, hd, L.c.causal ? CAUSAL : NO_MASK,
            L.qkv, L.keys, L.values, nullptr, mx::Strides{M * QD, M * hd, hd, 1}, cache_strides,
            cache_strides, {}, att};
  attend(p);
  for (int m = 0; m < M; ++m)  // (1, heads, M, hd) -> (M, heads * hd)
    for (int hh = 0; hh < L.c.heads; ++hh)
      std::memcpy(o_in + m * QD + (int64_t)hh * hd, att + ((int64_t)hh * M + m) * hd,
                  sizeof(float) * hd);
  project(L, {PROJ_O}, o_in, {o});
  const float *x = rows_of_x(L, xc);
  for (int64_t i = 0; i < (int64_t)M * D; ++i) x1[i] = x[i] + o[i];
  rms_norm(L, x1, L.c.eps2, h);
  project(L, {PROJ_GATE, PROJ_UP}, h, {g, u});
  for (int64_t i = 0; i < (int64_t)M * F; ++i) {
    const float silu = g[i] * mlx_sigmoid(g[i]);
    a[i] = silu * u[i];
  }
  project(L, {PROJ_DOWN}, a, {o});
  for (int64_t i = 0; i < (int64_t)M * D; ++i) L.out[i] = x1[i] + o[i];
}

/* Projection p's weights (w, scales, biases at inputs[at ..]) into L.proj[p]. */
void set_projection(LayerJob &L, int p, const std::vector<mx::array> &inputs, size_t at) {
  const mx::array &w = inputs[at], &s = inputs[at + 1], &b = inputs[at + 2];
  Job &j = L.proj[p];
  j.M = L.M, j.N = (int)w.shape(0), j.bits = L.c.bits[p], j.group = L.c.groups[p];
  j.K = (int)(w.shape(1) * 32 / j.bits), j.groups = j.K / j.group;
  j.row_bytes = (size_t)j.K * j.bits / 8;
  j.w = reinterpret_cast<const uint8_t *>(w.data<uint32_t>());
  j.scales = s.data<void>(), j.biases = b.data<void>();
  j.scale_type = scale_type(s.dtype()), j.bias_type = scale_type(b.dtype());
}

class LayerPrimitive : public mx::UnaryPrimitive {
 public:
  LayerPrimitive(mx::Stream stream, LayerConfig config)
      : mx::UnaryPrimitive(stream), c_(std::move(config)) {}

  void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
    throw std::runtime_error("[mlxspec layer] runs on the CPU stream only");
  }

 protected:
  /* The output allocated, the arrays registered with the encoder, the job's common part. */
  LayerJob begin(const std::vector<mx::array> &inputs, mx::array &out, int head_dim) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream());
    for (const auto &input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    const mx::array &x = inputs[0];
    LayerJob L{c_};
    L.M = (int)x.shape(1), L.D = (int)x.shape(2), L.head_dim = head_dim;
    L.x = x.data<float>(), L.x_strided = !x.flags().row_contiguous, L.x_strides = x.strides();
    L.out = out.data<float>();
    return L;
  }

  LayerConfig c_;
};

/* inputs: x, norm1, cos, sin, then q, k, v as (w, scales, biases). */
class LayerQkv : public LayerPrimitive {
 public:
  using LayerPrimitive::LayerPrimitive;

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    const int head_dim = (int)(inputs[4].shape(0) / c_.heads);
    LayerJob L = begin(inputs, out, head_dim);
    L.norm = inputs[1].data<float>(), L.cos = inputs[2].data<float>();
    L.sin = inputs[3].data<float>();
    L.cos_strides = inputs[2].strides(), L.sin_strides = inputs[3].strides();
    for (int p = PROJ_Q; p <= PROJ_V; ++p) set_projection(L, p, inputs, 4 + 3 * p);
    mx::cpu::get_command_encoder(stream()).dispatch([L]() { run_qkv(L); });
  }

  const char *name() const override { return "MlxspecCpuLayerQkv"; }
  bool is_equivalent(const mx::Primitive &other) const override {
    return c_ == static_cast<const LayerQkv &>(other).c_;
  }
};

/* inputs: x, qkv, keys, values (with the new rows), norm2, then o, gate, up, down. */
class LayerRest : public LayerPrimitive {
 public:
  using LayerPrimitive::LayerPrimitive;

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    LayerJob L = begin(inputs, out, (int)inputs[2].shape(3));
    L.qkv = inputs[1].data<float>(), L.keys = inputs[2].data<float>();
    L.values = inputs[3].data<float>(), L.norm = inputs[4].data<float>();
    L.capacity = (int)inputs[2].shape(2);
    for (int p = PROJ_O; p <= PROJ_DOWN; ++p) set_projection(L, p, inputs, 5 + 3 * (p - PROJ_O));
    L.hidden = L.proj[PROJ_GATE].N;
    mx::cpu::get_command_encoder(stream()).dispatch([L]() { run_rest(L); });
  }

  const char *name() const override { return "MlxspecCpuLayerRest"; }
  bool is_equivalent(const mx::Primitive &other) const override {
    return c_ == static_cast<const LayerRest &>(other).c_;
  }
};

/* A cache buffer (1, KV, capacity, hd) with rows offset .. offset + M - 1 of each KV head taken
 * from (KV, M, hd) floats starting at element `from` of a LayerQkv output. The buffer is taken
 * over when MLX can donate it (nothing else holds it: the usual case, as for MLX's own slice
 * update of mlx-lm's KVCache), else copied first (counted: layer_cache_copies). */
class CacheRows : public mx::UnaryPrimitive {
 public:
  CacheRows(mx::Stream stream, int offset, int rows, int64_t from)
      : mx::UnaryPrimitive(stream), offset_(offset), rows_(rows), from_(from) {}

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    const mx::array &buffer = inputs[0], &qkv = inputs[1];
    if (!buffer.flags().row_contiguous)
      throw std::runtime_error("[mlxspec layer] the KV cache's buffer is not row-contiguous");
    const bool copy = !(buffer.is_donatable() && buffer.nbytes() == out.nbytes());
    if (copy) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      layer_cache_copies.fetch_add(1, std::memory_order_relaxed);
    } else {
      out.copy_shared_buffer(buffer);
    }
    auto &encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(buffer);
    encoder.set_input_array(qkv);
    encoder.set_output_array(out);
    encoder.dispatch([copy, in = buffer.data<float>(), dst = out.data<float>(),
                      src = qkv.data<float>() + from_, bytes = out.nbytes(), heads = out.shape(1),
                      cap = (int64_t)out.shape(2), hd = (int64_t)out.shape(3), offset = offset_,
                      rows = rows_]() {
      if (copy) std::memcpy(dst, in, bytes);
      for (int kvh = 0; kvh < heads; ++kvh)
        std::memcpy(dst + ((int64_t)kvh * cap + offset) * hd, src + (int64_t)kvh * rows * hd,
                    sizeof(float) * rows * hd);
    });
  }

  void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
    throw std::runtime_error("[mlxspec layer] runs on the CPU stream only");
  }

  const char *name() const override { return "MlxspecCpuCacheRows"; }
  bool is_equivalent(const mx::Primitive &other) const override {
    auto &o = static_cast<const CacheRows &>(other);
    return offset_ == o.offset_ && rows_ == o.rows_ && from_ == o.from_;
  }

 private:
  int offset_, rows_;
  int64_t from_;
};

/* x (1, M, D) float32 with 1 <= M <= MAX_KERNEL_ROWS; norms (D,) float32; cos, sin (M, rope_dims
 * / 2) float32 (mlxspec.cpu.fused_ops' tables at `offset`); keys, values (1, KV, capacity,
 * head_dim) float32 row-contiguous with offset + M <= capacity; weights: 7 x (w, scales, biases)
 * of q, k, v, o, gate, up, down in MLX's affine layout with bits[i], groups[i]; int8: the
 * products' activations rounded to int8 (where the CPU has VNNI). Returns the layer's output
 * (1, M, D) and the cache's keys and values with the new rows. */
std::vector<mx::array> decode_layer(const mx::array &x, const mx::array &norm1,
                                    const mx::array &norm2, const mx::array &cos,
                                    const mx::array &sin, const mx::array &keys,
                                    const mx::array &values, const std::vector<mx::array> &weights,
                                    int heads, int kv_heads, int rope_dims, int offset,
                                    bool traditional, bool causal, float scale, float eps1,
                                    float eps2, std::vector<int> bits, std::vector<int> groups,
                                    bool int8) {
  LayerConfig config{heads, kv_heads, rope_dims, offset, traditional, causal, int8 && HAS_VNNI,
                     scale, eps1, eps2, std::move(bits), std::move(groups)};
  auto fail = [](const char *what) {
    throw std::invalid_argument(std::string("[mlxspec layer] ") + what);
  };
  if (x.ndim() != 3 || x.shape(0) != 1 || x.shape(1) < 1 || x.shape(1) > MAX_KERNEL_ROWS)
    fail("x is (1, M, D) with 1 <= M <= 24");
  const int M = (int)x.shape(1), D = (int)x.shape(2);
  if (keys.ndim() != 4 || keys.shape() != values.shape() || keys.shape(0) != 1 ||
      keys.shape(1) != config.kv_heads || config.offset + M > keys.shape(2) || config.offset < 0)
    fail("keys and values are (1, KV, capacity, head_dim) with room for the new rows");
  const int hd = (int)keys.shape(3);
  for (const mx::array *a : {&x, &norm1, &norm2, &cos, &sin, &keys, &values})
    if (a->dtype() != mx::float32) fail("activations, norms, tables and the cache are float32");
  if (norm1.shape() != mx::Shape{D} || norm2.shape() != mx::Shape{D} ||
      cos.shape() != mx::Shape{M, config.rope_dims / 2} || sin.shape() != cos.shape() ||
      config.rope_dims <= 0 || config.rope_dims % 2 || config.rope_dims > hd ||
      config.heads % config.kv_heads != 0)
    fail("norm, table or head shapes do not match");
  if ((int)weights.size() != 3 * LAYER_PROJECTIONS || (int)config.bits.size() != LAYER_PROJECTIONS ||
      (int)config.groups.size() != LAYER_PROJECTIONS)
    fail("7 projections of (w, scales, biases), bits and group sizes");
  const int64_t QD = (int64_t)config.heads * hd, KD = (int64_t)config.kv_heads * hd;
  for (int p = 0; p < LAYER_PROJECTIONS; ++p) {
    const mx::array &w = weights[3 * p], &s = weights[3 * p + 1], &b = weights[3 * p + 2];
    const int bits = config.bits[p], group = config.groups[p];
    if ((bits != 4 && bits != 8) || (group != 32 && group != 64 && group != 128))
      fail("bits 4 or 8, group size 32, 64 or 128");
    if (w.dtype() != mx::uint32 || w.ndim() != 2 || s.ndim() != 2 || s.shape() != b.shape())
      fail("weights uint32 (N, K * bits / 32), scales and biases (N, K / group)");
    scale_type(s.dtype()), scale_type(b.dtype());
    const int64_t K = w.shape(1) * 32 / bits, N = w.shape(0);
    const int64_t want_k = p == PROJ_O ? QD : p == PROJ_DOWN ? weights[3 * PROJ_GATE].shape(0) : D;
    const int64_t want_n = p == PROJ_Q ? QD : (p == PROJ_K || p == PROJ_V) ? KD : (p == PROJ_O || p == PROJ_DOWN) ? D
                                                                                    : weights[3 * PROJ_GATE].shape(0);
    if (K != want_k || N != want_n || K % group || s.shape() != mx::Shape{(int)N, (int)(K / group)})
      fail("projection shapes do not match the layer");
  }
  auto stream = mx::to_stream({});
  auto contiguous = [&](const mx::array &a) {
    return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
  };
  std::vector<mx::array> first = {x, contiguous(norm1), cos, sin};
  std::vector<mx::array> rest = {x, x, x, x, contiguous(norm2)};  // qkv, keys, values set below
  for (int i = 0; i < 3 * LAYER_PROJECTIONS; ++i)
    (i < 3 * (PROJ_V + 1) ? first : rest).push_back(contiguous(weights[i]));
  const int64_t qkv_size = (int64_t)M * (QD + 2 * KD);
  mx::array qkv({(int)qkv_size}, mx::float32, std::make_shared<LayerQkv>(stream, config), first);
  mx::array new_keys(keys.shape(), mx::float32,
                     std::make_shared<CacheRows>(stream, config.offset, M, M * QD), {keys, qkv});
  mx::array new_values(values.shape(), mx::float32,
                       std::make_shared<CacheRows>(stream, config.offset, M, M * (QD + KD)),
                       {values, qkv});
  rest[1] = qkv, rest[2] = new_keys, rest[3] = new_values;
  mx::array out(x.shape(), mx::float32, std::make_shared<LayerRest>(stream, std::move(config)),
                std::move(rest));
  return {out, new_keys, new_values};
}

}  // namespace
