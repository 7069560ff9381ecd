/*
 * x @ W^T for MLX's affine-quantized W on the CPU back-end, reading W as packed (4 or 8 bits per
 * weight) instead of through a float32 copy; mlxspec/cpu/quantized.py builds and loads it.
 *
 * Layout (MLX's own, mx.quantize with mode "affine"): W (N, K) is stored row-major as uint32
 * words, each holding 32 / bits consecutive weights from its lowest bits up, so byte j of a row
 * holds weights 2j (low nibble) and 2j + 1 (high nibble) at 4 bits, weight j at 8 bits. Every
 * group of g = 32, 64 or 128 consecutive weights of a row has a scale s and a bias b (float32,
 * float16 or bfloat16, shapes (N, K / g)): w = s * q + b.
 *
 * Products of M <= MAX_KERNEL_ROWS rows (decode, verification, small batches) run here. The
 * integers q are widened to float in registers (LANES floats at a time: 16 with AVX-512, 8 with
 * AVX2), dequantized there, w = fma(q, s, b) (at 4 bits with AVX-512: looked up in a register
 * holding the group's 16 values fma(q, s, b), the same numbers), and multiplied into one vector
 * accumulator per output, acc = fma(w, x, acc), the chunks of the row in order; the lanes are
 * summed once at the end in a fixed order. A tile of NR rows of W and MR rows of x shares each
 * dequantized vector over its MR rows of x. Every output's sequence of operations depends only on
 * its row of x and of W, never on M, on the tile it was computed in, or on the threads: a product
 * of 21 rows gives each row the bits it gets alone (mlxspec/serving/fused_prefill.py relies on
 * it). At 4 bits the low nibbles of a chunk are its even weights and the high ones its odd
 * weights, so x is copied once per call into the same order (chunks of 2 * LANES: even elements,
 * then odd ones).
 *
 * int8 activations (AVX512-VNNI only, opt-in with MLXSPEC_CPU_QMM_ACTIVATIONS=int8): llama.cpp's
 * trick. Each block of 32 elements of a row of x is rounded to int8, x ~ dx * xq with
 * dx = max|x| / 127, and W's integers are multiplied into xq by vpdpbusd (64 byte products per
 * instruction): sum_k w_k x_k ~ sum_groups (s * dx * sum q xq) + b * sum dx * xq. The last sum
 * is over the rounded x, not the exact one: then the error is sum (s q + b)(dx xq - x), whose
 * weights s q + b are centred, where b * sum x leaves sum s q (dx xq - x), q all >= 0 (twice
 * the error at 4 bits, measured). Each output's operations still depend only on its rows of x
 * and W. The rounding of x costs accuracy (measured in docs/linux-cpu.md); products of more than
 * MAX_KERNEL_ROWS rows stay float32 (sgemm).
 *
 * Threads: output rows in chunks on the BLAS shim's pool (mlxspec_blas_parallel_for), each chunk
 * computed whole by one thread. Larger M (prefill) dequantizes W a tile of rows at a time (the
 * kernel's own w, in x's chunk order, on the pool's threads) and multiplies each tile with
 * cblas_sgemm (OpenBLAS through the shim).
 */
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "_mlx_bits.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

constexpr int MAX_KERNEL_ROWS = 24;  // larger products: dequantized tiles through sgemm
constexpr size_t TILE_FLOATS = 1 << 20;  // a dequantized tile of W at most (sgemm path)
constexpr double PARALLEL_MIN_WORK = 1 << 16;  // multiply-adds below which one thread computes
constexpr double TASK_BYTES = 1 << 16;         // bytes of W per thread task at least

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int LANES = 16;
constexpr int NR = 4, MR = 4;  // rows of W and of x per tile: 16 accumulators of 32 zmm
constexpr const char *ISA = "avx512";
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float *p) { return _mm512_loadu_ps(p); }
inline void vstore(float *p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vset1(float s) { return _mm512_set1_ps(s); }
inline float vsum(V a) {  // fixed order: halves added until one lane is left
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline __m512i widen(const uint8_t *p) {  // LANES bytes -> LANES int32
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}
inline V to_float(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512i low4(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
inline __m512i high4(__m512i v) { return _mm512_srli_epi32(v, 4); }
/* At 4 bits a group's 16 possible weights fit one register: table[q] = fma(q, s, b), the very
 * numbers the element-wise dequantization gives, and vpermps looks a lane's weight up by the low
 * 4 bits of its index: one instruction per vector instead of an and/shift, a conversion and an
 * fma, on a loop bound by its instruction ports (the same bits out). */
constexpr bool LOOKUP4 = true;
inline V lookup_table(V s, V b) {
  const V q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(q, s, b);
}
inline void lookup4(const uint8_t *p, V table, V &a, V &b) {
  const __m512i v = widen(p);                                   // LANES bytes = CHUNK nibbles
  a = _mm512_permutexvar_ps(v, table);                          // low nibbles: bits 3..0
  b = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);  // high nibbles
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int LANES = 8;
constexpr int NR = 2, MR = 3;  // 6 accumulators of 16 ymm
constexpr const char *ISA = "avx2";
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float *p) { return _mm256_loadu_ps(p); }
inline void vstore(float *p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vset1(float s) { return _mm256_set1_ps(s); }
inline float vsum(V a) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline __m256i widen(const uint8_t *p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
}
inline V to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
inline __m256i high4(__m256i v) { return _mm256_srli_epi32(v, 4); }
constexpr bool LOOKUP4 = false;  // vpermps on 8 lanes indexes 8 entries, not 16
inline V lookup_table(V s, V) { return s; }
inline void lookup4(const uint8_t *, V, V &, V &) {}
#else
#error "mlxspec's quantized CPU kernel needs AVX2 and FMA"
#endif

constexpr int CHUNK = 2 * LANES;  // weights per unpacking step: two vectors

enum ScaleType { F32 = 0, F16 = 1, BF16 = 2 };

inline float scalar_at(const void *p, size_t i, int type) {
  if (type == F32) return static_cast<const float *>(p)[i];
  const uint16_t h = static_cast<const uint16_t *>(p)[i];
  if (type == F16) return _cvtsh_ss(h);  // exact, as MLX's float16 -> float32
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Job {
  int M, N, K, bits, group, groups;
  size_t row_bytes;
  const uint8_t *w;
  const void *scales, *biases;
  int scale_type, bias_type;
  const float *xp;  // (M, K) x in chunk order (see the header)
  float *out;       // (M, N)
  int rows_per_task;
  // int8 activations (VNNI): per row of x, `blocks` blocks of 64 bytes of W; see prepare_xq
  const int8_t *xq;  // (M, blocks * 64 * 8 / bits) int8
  const float *dxv;  // (M, blocks * 16): each lane's dx
  const float *xs;   // (M, groups): the sum of the rounded x, dx * xq, over each group of W
  int blocks;
};

/* The CHUNK integers at `p` as two float vectors whose elements match xp's order. */
template <int BITS>
inline void unpack(const uint8_t *p, V &a, V &b) {
  if constexpr (BITS == 4) {
    const auto v = widen(p);  // LANES bytes = CHUNK nibbles
    a = to_float(low4(v));    // weights 0, 2, 4, ...
    b = to_float(high4(v));   // weights 1, 3, 5, ...
  } else {
    a = to_float(widen(p));
    b = to_float(widen(p + LANES));
  }
}

/* The CHUNK weights at `p` dequantized, w = fma(q, s, b), as two vectors in xp's order; at 4 bits
 * with AVX-512 looked up in `table` (lookup_table(s, b), once per group; unused otherwise). */
template <int BITS>
inline void dequantize(const uint8_t *p, V s, V b, V table, V &wa, V &wb) {
  if constexpr (BITS == 4 && LOOKUP4) {
    lookup4(p, table, wa, wb);
  } else {
    unpack<BITS>(p, wa, wb);
    wa = vfma(wa, s, b), wb = vfma(wb, s, b);
  }
}

/* count scales (or biases) from element `at` on as float32 into dst: exact conversions. */
void to_floats(const void *src, int type, size_t at, int count, float *dst) {
  int i = 0;
  if (type == F32) {
    std::memcpy(dst, static_cast<const float *>(src) + at, count * sizeof(float));
    return;
  }
  const uint16_t *h = static_cast<const uint16_t *>(src) + at;
  if (type == F16)
    for (; i + 8 <= count; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(h + i))));
  for (; i < count; ++i) dst[i] = scalar_at(h, i, type);
}

/* Row n's scales (or biases) as float32 into dst (groups). */
inline void row_floats(const void *src, int type, size_t n, int groups, float *dst) {
  to_floats(src, type, n * groups, groups, dst);
}

/* Outputs (m0 .. m0 + R - 1, n0 .. n0 + C - 1). Each weight vector is dequantized in registers,
 * w = fma(q, s, b), and multiplied into its output's one accumulator: acc = fma(w, x, acc), the
 * chunks in order, the two vectors of a chunk in order; the lanes summed by vsum at the end.
 * The same operations for every output in every instance (see the header). sb holds each of the
 * C rows' (scale, bias) pairs, (C, groups, 2) float32. The loop walks one pointer each for W, x
 * and sb with the rows at fixed distances: with an index per row and group, GCC ran out of
 * general registers and reloaded them from vector registers at every group (g = 32: one chunk). */
template <int BITS, int R, int C>
void tile(const Job &j, int m0, int n0, const float *sb) {
  V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const size_t row_bytes = j.row_bytes, pairs = 2 * (size_t)j.groups, K = j.K;
  const uint8_t *w = j.w + (size_t)n0 * row_bytes;
  const float *x = j.xp + (size_t)m0 * K;
  const int chunks = j.group / CHUNK;
  for (int g = 0; g < j.groups; ++g, sb += 2) {
    V s[C], b[C], table[C];
    for (int c = 0; c < C; ++c) {
      s[c] = vset1(sb[c * pairs]), b[c] = vset1(sb[c * pairs + 1]);
      table[c] = lookup_table(s[c], b[c]);
    }
    for (int k = 0; k < chunks; ++k, x += CHUNK, w += CHUNK * BITS / 8) {
      V xa[R], xb[R];
      for (int r = 0; r < R; ++r) xa[r] = vload(x + r * K), xb[r] = vload(x + r * K + LANES);
      for (int c = 0; c < C; ++c) {
        V wa, wb;
        dequantize<BITS>(w + c * row_bytes, s[c], b[c], table[c], wa, wb);
        for (int r = 0; r < R; ++r) {
          acc[r][c] = vfma(wa, xa[r], acc[r][c]);
          acc[r][c] = vfma(wb, xb[r], acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) j.out[(size_t)(m0 + r) * j.N + n0 + c] = vsum(acc[r][c]);
}

/* Decode streams W from memory once per token, a few hundred bytes per row: the hardware
 * prefetchers barely start within a task's rows. So each block of rows asks for the rows
 * PREFETCH_ROWS ahead (and their scales and biases) while it computes. */
constexpr int PREFETCH_ROWS = 16;
inline void prefetch_rows(const Job &j, int n, int rows) {
  if (n >= j.N) return;
  const int count = std::min(rows, j.N - n);
  const char *w = reinterpret_cast<const char *>(j.w) + (size_t)n * j.row_bytes;
  for (size_t at = 0; at < count * j.row_bytes; at += 64) _mm_prefetch(w + at, _MM_HINT_T0);
  const size_t sbytes = (j.scale_type == F32 ? 4 : 2) * (size_t)j.groups;
  const size_t bbytes = (j.bias_type == F32 ? 4 : 2) * (size_t)j.groups;
  for (size_t at = 0; at < count * sbytes; at += 64)
    _mm_prefetch(static_cast<const char *>(j.scales) + n * sbytes + at, _MM_HINT_T0);
  for (size_t at = 0; at < count * bbytes; at += 64)
    _mm_prefetch(static_cast<const char *>(j.biases) + n * bbytes + at, _MM_HINT_T0);
}

/* s[0 .. n) and b[0 .. n) -> dst (n, 2): the pairs (s[i], b[i]). */
inline void interleave(const float *s, const float *b, int n, float *dst) {
  int i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(s + i), c = _mm256_loadu_ps(b + i);
    const __m256 lo = _mm256_unpacklo_ps(a, c), hi = _mm256_unpackhi_ps(a, c);
    _mm256_storeu_ps(dst + 2 * i, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(dst + 2 * i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
#endif
  for (; i < n; ++i) dst[2 * i] = s[i], dst[2 * i + 1] = b[i];
}

/* One block of C output rows over every row of x: their scales and biases as floats into sb,
 * then Tile::run<BITS, R, C> on MR rows of x at a time and the 1-3 left over (R < MR only). The
 * C rows' scales (and biases) are one run in memory: converted in one pass, then laid out as the
 * tile reads them, Tile::PAIRS: (C, groups, 2) (scale, bias) pairs, else the scales (C, groups)
 * then the biases (C, groups). sb holds 4 * C * groups floats. */
template <class Tile, int MR_, int BITS, int C>
void row_block_with(const Job &j, int n0, float *sb) {
  prefetch_rows(j, n0 + PREFETCH_ROWS, C);
  const int count = C * j.groups;
  float *scales = Tile::PAIRS ? sb + 2 * count : sb;
  to_floats(j.scales, j.scale_type, (size_t)n0 * j.groups, count, scales);
  to_floats(j.biases, j.bias_type, (size_t)n0 * j.groups, count, scales + count);
  if constexpr (Tile::PAIRS) interleave(scales, scales + count, count, sb);
  int m = 0;
  for (; m + MR_ <= j.M; m += MR_) Tile::template run<BITS, MR_, C>(j, m, n0, sb);
  switch (j.M - m) {
    case 1: Tile::template run<BITS, 1, C>(j, m, n0, sb); break;
    case 2: if constexpr (MR_ > 2) Tile::template run<BITS, 2, C>(j, m, n0, sb); break;
    case 3: if constexpr (MR_ > 3) Tile::template run<BITS, 3, C>(j, m, n0, sb); break;
    default: break;
  }
}

struct FloatTile {
  static constexpr bool PAIRS = true;
  template <int BITS, int R, int C>
  static void run(const Job &j, int m0, int n0, const float *sb) { tile<BITS, R, C>(j, m0, n0, sb); }
};

template <int BITS, int C>
void row_block(const Job &j, int n0, float *sb) { row_block_with<FloatTile, MR, BITS, C>(j, n0, sb); }

/* A buffer of at least n floats owned by the calling thread (grown, never shrunk): no allocation
 * per call or per task. `slot` tells the buffers of one thread apart. */
float *scratch(size_t n, int slot) {
  static thread_local std::vector<float> buffers[3];
  auto &b = buffers[slot];
  if (b.size() < n) b.resize(n);
  return b.data();
}

template <int BITS>
void rows(const Job &j, int n0, int n1) {
  float *sb = scratch((size_t)4 * NR * j.groups, 0);
  int n = n0;
  for (; n + NR <= n1; n += NR) row_block<BITS, NR>(j, n, sb);
  for (; n < n1; ++n) row_block<BITS, 1>(j, n, sb);
}

void task(void *context, int i) {
  const Job &j = *static_cast<const Job *>(context);
  const int n0 = i * j.rows_per_task, n1 = std::min(j.N, n0 + j.rows_per_task);
  if (j.bits == 4)
    rows<4>(j, n0, n1);
  else
    rows<8>(j, n0, n1);
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool HAS_VNNI = true;

/* Weights per 64-byte block of a row of W, and the group of W (relative to the block's first) of
 * each of the 16 int32 lanes vpdpbusd sums 4 bytes into. */
template <int BITS>
constexpr int block_weights() { return 64 * 8 / BITS; }
/* log2 of a group size (32, 64 or 128): group indices by shift, no division per block. */
inline int group_shift(int group) { return group == 32 ? 5 : group == 64 ? 6 : 7; }

template <int BITS>
inline __m512i lane_groups(int group) {
  const int shift = group_shift(group);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i first = BITS == 4 ? _mm512_slli_epi32(_mm512_srli_epi32(lane, 2), 5)  // (l / 4) * 32
                                  : _mm512_slli_epi32(lane, 2);                      // 4 * l
  return _mm512_srlv_epi32(first, _mm512_set1_epi32(shift));
}

/* x (M, K) -> j.xq, j.dxv, j.xs (int8 activations; see the header). Blocks of 32 elements of x
 * (subblocks) are rounded to int8 with their own dx. At 4 bits a block of W holds 4 subblocks,
 * byte j the weights 2j and 2j + 1 of the block; xq puts the even elements (64 bytes) and then
 * the odd ones (64 bytes) in that byte order, so one vpdpbusd takes the low nibbles, one the
 * high. At 8 bits xq is x's own order. Padding past K is zero. */
void prepare_xq(const float *x, const int64_t *rows, int64_t cs, Job &j, int8_t *xq, float *dxv,
                float *xs) {
  const int sub = j.K / 32, per_row = j.blocks * 64 * 8 / j.bits;
  for (int m = 0; m < j.M; ++m) {
    const float *row = x + rows[m];
    int8_t *q = xq + (size_t)m * per_row;
    float *d = dxv + (size_t)m * j.blocks * 16;
    std::memset(q, 0, per_row);
    std::memset(d, 0, sizeof(float) * j.blocks * 16);
    float *sums = xs + (size_t)m * j.groups;
    std::fill(sums, sums + j.groups, 0.0f);
    for (int u = 0; u < sub; ++u) {
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(row[(u * 32 + i) * cs]));
      const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const int lanes = j.bits == 4 ? 4 : 8;  // vpdpbusd lanes of a subblock
      for (int l = 0; l < lanes; ++l) d[(u / (16 / lanes)) * 16 + (u % (16 / lanes)) * lanes + l] = dx;
      int total = 0;
      for (int i = 0; i < 32; ++i) {
        const int v = (int)std::nearbyint(row[(u * 32 + i) * cs] * inv);
        total += v;
        int at;
        if (j.bits == 4) {
          const int b = u / 4, t = u % 4;
          at = b * 128 + (i % 2) * 64 + t * 16 + i / 2;
        } else {
          at = u * 32 + i;
        }
        q[at] = (int8_t)v;
      }
      sums[u * 32 / j.group] += dx * (float)total;
    }
  }
}

/* One 64-byte block b of W's rows n0 .. n0 + C - 1 into acc (see tile_q8). Full blocks load
 * whole; the last block of a row whose bytes are not a multiple of 64 loads under wmask. */
template <int BITS, int R, int C, bool LAST>
__attribute__((always_inline)) inline void block_q8(const Job &j, int m0, int n0, const float *sb, int b, int gshift,
                     __mmask64 wmask, const __m512i idx, __m512 (&acc)[R][C]) {
  constexpr int WB = block_weights<BITS>();
  const __m512i nib = _mm512_set1_epi8(15);
  const size_t at = (size_t)b * 64;
  const int g0 = (b * WB) >> gshift;
  const int gl = std::min(std::max(WB >> gshift, 1), j.groups - g0);
  const __mmask16 gmask = (__mmask16)((1u << gl) - 1);
  const int per_row = j.blocks * WB;
  __m512 dx[R];
  for (int r = 0; r < R; ++r) dx[r] = _mm512_loadu_ps(j.dxv + ((size_t)(m0 + r) * j.blocks + b) * 16);
  for (int c = 0; c < C; ++c) {
    const uint8_t *wp = j.w + (size_t)(n0 + c) * j.row_bytes + at;
    const __m512i v = LAST ? _mm512_maskz_loadu_epi8(wmask, wp) : _mm512_loadu_si512(wp);
    const __m512 s = _mm512_permutexvar_ps(
        idx, _mm512_maskz_loadu_ps(gmask, sb + (size_t)c * j.groups + g0));
    for (int r = 0; r < R; ++r) {
      const int8_t *xr = j.xq + (size_t)(m0 + r) * per_row + (size_t)b * (BITS == 4 ? 128 : 64);
      __m512i d;
      if constexpr (BITS == 4) {
        d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, nib),
                                _mm512_loadu_si512(xr));
        d = _mm512_dpbusd_epi32(d, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib),
                                _mm512_loadu_si512(xr + 64));
      } else {
        d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_loadu_si512(xr));
      }
      acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, dx[r]), acc[r][c]);
    }
  }
}

/* Outputs (m0 .. m0 + R - 1, n0 .. n0 + C - 1) with int8 activations: per block of W and output,
 * acc = fma(float(sum q xq), s * dx, acc) (lanes: 4 or 8 products of a subblock), then b . xs
 * added into the lanes group by group (16 at a time, in order), then the lanes summed in vsum's
 * order. */
template <int BITS, int R, int C>
void tile_q8(const Job &j, int m0, int n0, const float *sb) {
  const __m512i idx = lane_groups<BITS>(j.group);
  const int gshift = group_shift(j.group);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int full = (int)(j.row_bytes / 64);
  for (int b = 0; b < full; ++b) block_q8<BITS, R, C, false>(j, m0, n0, sb, b, gshift, 0, idx, acc);
  if (full < j.blocks) {
    const __mmask64 wmask = (1ULL << (j.row_bytes - (size_t)full * 64)) - 1;
    block_q8<BITS, R, C, true>(j, m0, n0, sb, full, gshift, wmask, idx, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float *xs = j.xs + (size_t)(m0 + r) * j.groups, *bias = sb + (size_t)(C + c) * j.groups;
      __m512 t = acc[r][c];  // the b . xs terms join the lanes before the one horizontal sum
      for (int g = 0; g < j.groups; g += 16) {
        const __mmask16 m = (__mmask16)((1u << std::min(16, j.groups - g)) - 1);
        t = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, bias + g), _mm512_maskz_loadu_ps(m, xs + g), t);
      }
      j.out[(size_t)(m0 + r) * j.N + n0 + c] = vsum(t);
    }
}

constexpr int NR8 = 4, MR8 = 4;

struct Int8Tile {
  static constexpr bool PAIRS = false;
  template <int BITS, int R, int C>
  static void run(const Job &j, int m0, int n0, const float *sb) { tile_q8<BITS, R, C>(j, m0, n0, sb); }
};

template <int BITS, int C>
void row_block_q8(const Job &j, int n0, float *sb) { row_block_with<Int8Tile, MR8, BITS, C>(j, n0, sb); }

void task_q8(void *context, int i) {
  const Job &j = *static_cast<const Job *>(context);
  const int n0 = i * j.rows_per_task, n1 = std::min(j.N, n0 + j.rows_per_task);
  float *sb = scratch((size_t)4 * NR8 * j.groups, 0);
  int n = n0;
  if (j.bits == 4) {
    for (; n + NR8 <= n1; n += NR8) row_block_q8<4, NR8>(j, n, sb);
    for (; n < n1; ++n) row_block_q8<4, 1>(j, n, sb);
  } else {
    for (; n + NR8 <= n1; n += NR8) row_block_q8<8, NR8>(j, n, sb);
    for (; n < n1; ++n) row_block_q8<8, 1>(j, n, sb);
  }
}
#else
constexpr bool HAS_VNNI = false;
constexpr int NR8 = 4;
void prepare_xq(const float *, const int64_t *, int64_t, Job &, int8_t *, float *, float *) {}
void task_q8(void *, int) {}
#endif

/* x (M, K) with element (m, k) at rows[m] + k * cs -> xp (M, K) in chunk order. */
void prepare_x(const float *x, const int64_t *rows, int64_t cs, int M, int K, int bits, float *xp) {
  for (int m = 0; m < M; ++m) {
    const float *row = x + rows[m];
    float *dst = xp + (size_t)m * K;
    for (int e = 0; e < K; e += CHUNK)
      for (int i = 0; i < CHUNK; ++i) {
        const int from = bits == 4 ? e + (i < LANES ? 2 * i : 2 * (i - LANES) + 1) : e + i;
        dst[e + i] = row[from * cs];
      }
  }
}

/* W's rows cut into tasks of >= TASK_BYTES of W each (a contiguous stream the prefetchers can
 * follow), at most 16, each a multiple of `align` rows: sets j.rows_per_task, returns the count. */
int split_rows(Job &j, int align) {
  const int tasks = std::max(1, std::min(std::min(16, j.N / (4 * align)),
                                         (int)((double)j.N * j.row_bytes / TASK_BYTES)));
  j.rows_per_task = ((j.N + tasks - 1) / tasks + align - 1) / align * align;
  return (j.N + j.rows_per_task - 1) / j.rows_per_task;
}

/* Rows over the pool's threads, each task's rows computed whole by one thread. */
void run_rows(Job &j, void (*fn)(void *, int), int align) {
  const double work = (double)j.M * j.N * j.K;
  ParallelFor pf = parallel_for();
  if (pf && work >= PARALLEL_MIN_WORK && j.N >= 8 * align) {
    pf(split_rows(j, align), fn, &j);
  } else {
    j.rows_per_task = j.N;
    fn(&j, 0);
  }
}

/* Rows n0 .. n0 + count - 1 of W as float32 into dst (count, K), in xp's chunk order: the
 * numbers of the kernel's registers, fma(q, s, b). */
template <int BITS>
void dequantize_rows(const Job &j, int n0, int count, float *dst) {
  std::vector<float> sb((size_t)2 * j.groups);
  const int chunks = j.group / CHUNK;
  for (int n = 0; n < count; ++n) {
    row_floats(j.scales, j.scale_type, n0 + n, j.groups, sb.data());
    row_floats(j.biases, j.bias_type, n0 + n, j.groups, sb.data() + j.groups);
    const uint8_t *w = j.w + (size_t)(n0 + n) * j.row_bytes;
    float *d = dst + (size_t)n * j.K;
    for (int g = 0; g < j.groups; ++g) {
      const V s = vset1(sb[g]), b = vset1(sb[j.groups + g]);
      const V table = lookup_table(s, b);
      for (int k = 0; k < chunks; ++k) {
        const int e = (g * chunks + k) * CHUNK;
        V wa, wb;
        dequantize<BITS>(w + e * BITS / 8, s, b, table, wa, wb);
        vstore(d + e, wa);
        vstore(d + e + LANES, wb);
      }
    }
  }
}

struct TileJob {
  const Job *j;
  const float *xp;
  int n0, count;
  float *tile;
};

void dequantize_task(void *context, int i) {
  auto &t = *static_cast<TileJob *>(context);
  const int per = (t.count + 7) / 8, from = i * per, count = std::min(per, t.count - from);
  if (count <= 0) return;
  float *dst = t.tile + (size_t)from * t.j->K;
  if (t.j->bits == 4)
    dequantize_rows<4>(*t.j, t.n0 + from, count, dst);
  else
    dequantize_rows<8>(*t.j, t.n0 + from, count, dst);
}

/* M > MAX_KERNEL_ROWS: W a tile of rows at a time dequantized (on the pool's threads) and
 * multiplied by sgemm (OpenBLAS's threads), x in the same chunk order as the tile's columns. */
void sgemm_product(const Job &j) {
  // tiles of up to 4 MB (a whole matrix of a small model: fewer, larger sgemm calls), in this
  // thread's scratch (not zeroed: every element is written before it is read)
  const int tile_rows = std::max(8, std::min(j.N, (int)(TILE_FLOATS / j.K)));
  float *tile = scratch((size_t)tile_rows * j.K, 2);
  ParallelFor pf = parallel_for();
  for (int n0 = 0; n0 < j.N; n0 += tile_rows) {
    TileJob t{&j, j.xp, n0, std::min(tile_rows, j.N - n0), tile};
    if (pf)
      pf(8, dequantize_task, &t);
    else
      for (int i = 0; i < 8; ++i) dequantize_task(&t, i);
    cblas_sgemm(101, 111, 112, j.M, t.count, j.K, 1.0f, j.xp, j.K, t.tile, j.K, 0.0f,
                j.out + n0, j.N);
  }
}

int scale_type(mx::Dtype t) {
  if (t == mx::float32) return F32;
  if (t == mx::float16) return F16;
  if (t == mx::bfloat16) return BF16;
  throw std::invalid_argument("[mlxspec quantized] scales and biases are float32/16 or bfloat16");
}

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, bool int8)
      : mx::UnaryPrimitive(stream), group_(group_size), bits_(bits), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    const mx::array &x = inputs[0], &w = inputs[1], &s = inputs[2], &b = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream());
    for (const auto &input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    Job j{};
    j.K = (int)x.shape(-1), j.N = (int)w.shape(0), j.M = (int)(x.size() / std::max(j.K, 1));
    j.bits = bits_, j.group = group_, j.groups = j.K / group_;
    j.row_bytes = (size_t)j.K * bits_ / 8;
    j.w = reinterpret_cast<const uint8_t *>(w.data<uint32_t>());
    j.scales = s.data<void>(), j.biases = b.data<void>();
    j.scale_type = scale_type(s.dtype()), j.bias_type = scale_type(b.dtype());
    j.out = out.data<float>();
    const bool int8 = int8_ && HAS_VNNI && j.M <= MAX_KERNEL_ROWS;
    std::vector<int64_t> rows(j.M);  // x's leading axes (any strides) flattened: row m's offset
    for (int m = 0; m < j.M; ++m) {
      int64_t at = 0;
      for (int d = x.ndim() - 2, rest = m; d >= 0; --d) {
        at += (int64_t)(rest % x.shape(d)) * x.strides(d);
        rest /= x.shape(d);
      }
      rows[m] = at;
    }
    encoder.dispatch([j, int8, rows = std::move(rows), xd = x.data<float>(),
                      cs = x.strides().back()]() mutable {
      if (int8) {
        j.blocks = (int)((j.row_bytes + 63) / 64);
        const size_t per_row = (size_t)j.blocks * 64 * 8 / j.bits;
        auto *xq = reinterpret_cast<int8_t *>(scratch((size_t)j.M * per_row / 4 + 16, 1));
        float *f = scratch((size_t)j.M * (j.blocks * 16 + j.groups), 2);
        prepare_xq(xd, rows.data(), cs, j, xq, f, f + (size_t)j.M * j.blocks * 16);
        j.xq = xq, j.dxv = f, j.xs = f + (size_t)j.M * j.blocks * 16;
        run_rows(j, task_q8, NR8);
        return;
      }
      float *xp = scratch((size_t)j.M * j.K, 1);
      prepare_x(xd, rows.data(), cs, j.M, j.K, j.bits, xp);
      j.xp = xp;
      if (j.M > MAX_KERNEL_ROWS)
        sgemm_product(j);
      else
        run_rows(j, task, NR);
    });
  }

  void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
    throw std::runtime_error("[mlxspec quantized] runs on the CPU stream only");
  }

  const char *name() const override { return "MlxspecCpuQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive &other) const override {
    auto &o = static_cast<const QuantizedMatmul &>(other);
    return group_ == o.group_ && bits_ == o.bits_ && int8_ == o.int8_;
  }

 private:
  int group_, bits_;
  bool int8_;
};

/* x (..., K) float32, w (N, K * bits / 32) uint32, scales and biases (N, K / group_size) float32,
 * float16 or bfloat16; bits 4 or 8, group_size 32, 64 or 128. Returns (..., N) float32. */
mx::array quantized_matmul(const mx::array &x, const mx::array &w, const mx::array &scales,
                           const mx::array &biases, int group_size, int bits, bool int8) {
  if ((bits != 4 && bits != 8) || (group_size != 32 && group_size != 64 && group_size != 128))
    throw std::invalid_argument("[mlxspec quantized] bits 4 or 8, group size 32, 64 or 128");
  if (x.dtype() != mx::float32 || w.dtype() != mx::uint32 || x.ndim() < 1 || w.ndim() != 2 ||
      scales.ndim() != 2 || biases.ndim() != 2)
    throw std::invalid_argument("[mlxspec quantized] x float32 (..., K), w uint32 (N, K*bits/32)");
  const int K = (int)x.shape(-1), N = (int)w.shape(0);
  if (K % group_size != 0 || (int64_t)w.shape(1) * 32 / bits != K ||
      scales.shape() != mx::Shape{N, K / group_size} || biases.shape() != scales.shape())
    throw std::invalid_argument("[mlxspec quantized] shapes do not match");
  scale_type(scales.dtype()), scale_type(biases.dtype());
  auto stream = mx::to_stream({});
  // One graph node per product (MLX's CPU back-end pays ~10 us per node here): x of any rank and
  // strides is read in place, and weights already row-contiguous (a model's) are not wrapped.
  auto packed = [&](const mx::array &a) {
    return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
  };
  std::vector<mx::array> inputs = {x, packed(w), packed(scales), packed(biases)};
  mx::Shape shape = x.shape();
  shape.back() = N;
  return mx::array(shape, mx::float32,
                   std::make_shared<QuantizedMatmul>(stream, group_size, bits, int8),
                   std::move(inputs));
}

}  // namespace

#include "_layer.h"

NB_MODULE(_mlxspec_cpu_quantized, m) {
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"), nb::arg("int8") = false);
  m.attr("int8_activations") = HAS_VNNI;
  m.attr("isa") = ISA;
  m.attr("max_kernel_rows") = MAX_KERNEL_ROWS;
  m.def("decode_layer", &decode_layer, nb::arg("x"), nb::arg("norm1"), nb::arg("norm2"),
        nb::arg("cos"), nb::arg("sin"), nb::arg("keys"), nb::arg("values"), nb::arg("weights"),
        nb::arg("heads"), nb::arg("kv_heads"), nb::arg("rope_dims"), nb::arg("offset"),
        nb::arg("traditional"), nb::arg("causal"), nb::arg("scale"), nb::arg("eps1"),
        nb::arg("eps2"), nb::arg("bits"), nb::arg("groups"), nb::arg("int8") = false);
  m.def("layer_cache_copies", []() { return layer_cache_copies.load(); });
}
