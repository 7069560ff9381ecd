// zp_qmm: Y = X W^T for 2..16 activation rows (speculative verification, short prefills); each
// packed weight is read and dequantized once for all rows.
//
// Template: T (activation and output float type), BITS, GROUP_SIZE (G), BM (row capacity: 4, 8
//           or 16; the loader picks the smallest >= M).
// Inputs:   x T (M, K); weight uint32 (N, K*BITS/32); scales (N, K/G) float16|bfloat16|float32;
//           zeros uint32 (N, ceil(K/G*BITS/32)); M, K, N int scalars (M <= BM).
// Output:   y T (M, N).
// Grid:     (32, ceil(N/4), 1) threads; threadgroup (32, 2, 1): two simdgroups of 32 lanes, each
//           owning 4 consecutive output rows (as zp_qmv; a partial last threadgroup has one).
// Each lane takes 8 consecutive inputs per step (a simdgroup covers 256), so every packed word is
// read once, by one lane. Nothing is staged: a lane reads only its own 8 columns of each row of X
// (M*K values, small next to W, served by the cache), so there is no threadgroup memory and no
// barrier. Per step a lane dequantizes the 8 weights of each of its 4 rows once, w = s * (q - z),
// and applies them to the M rows: M FMAs per weight. Partial sums are reduced with simd_sum in
// uniform control flow (every lane runs every m < BM).

constexpr int ROWS = 4;
constexpr int VALUES = 8;
const uint lane = thread_position_in_grid.x;
const uint n0 = thread_position_in_grid.y * ROWS;
const uint row_words = uint(K) * BITS / 32;
const uint groups = K / GROUP_SIZE;
const uint zero_words = (groups * BITS + 31) / 32;

float acc[ROWS][BM];
for (int r = 0; r < ROWS; r++) {
  for (int m = 0; m < BM; m++) {
    acc[r][m] = 0.0f;
  }
}

for (uint k = lane * VALUES; k < uint(K); k += 32 * VALUES) {
  const uint g = k / GROUP_SIZE;
  float w[ROWS][VALUES];
  for (int r = 0; r < ROWS; r++) {
    const uint n = n0 + r;
    if (n >= uint(N)) {  // past the last output row: contributes nothing, stored nowhere
      for (int j = 0; j < VALUES; j++) {
        w[r][j] = 0.0f;
      }
      continue;
    }
    float q[VALUES];
    zp_unpack8<BITS>(weight + n * row_words, k / 8, q);
    const float s = float(scales[n * groups + g]);
    const float z = zp_zero<BITS>(zeros + n * zero_words, g);
    for (int j = 0; j < VALUES; j++) {
      w[r][j] = s * (q[j] - z);
    }
  }
  for (int m = 0; m < BM; m++) {
    if (m < M) {
      float xv[VALUES];
      for (int j = 0; j < VALUES; j++) {
        xv[j] = float(x[m * uint(K) + k + j]);
      }
      for (int r = 0; r < ROWS; r++) {
        for (int j = 0; j < VALUES; j++) {
          acc[r][m] += xv[j] * w[r][j];
        }
      }
    }
  }
}

for (int r = 0; r < ROWS; r++) {
  for (int m = 0; m < BM; m++) {
    const float total = simd_sum(acc[r][m]);
    if (lane == 0 && m < M && n0 + r < uint(N)) {
      y[m * uint(N) + n0 + r] = static_cast<T>(total);
    }
  }
}
