// zp_qmv: y = W x for one activation row (decode), W in zero-point form, fused dequantization.
//
// Template: T (activation and output float type), BITS, GROUP_SIZE (G).
// Inputs:   x T (K); weight uint32 (N, K*BITS/32); scales (N, K/G) float16|bfloat16|float32;
//           zeros uint32 (N, ceil(K/G*BITS/32)); K, N int scalars.
// Output:   y T (N).
// Grid:     (32, ceil(N/4), 1) threads; threadgroup (32, 2, 1): two simdgroups of 32 lanes, each
//           simdgroup owns 4 consecutive output rows (a partial last threadgroup has one).
// Each lane takes 16 consecutive inputs per step (a simdgroup covers 512), so every packed word
// is read exactly once, by one lane, in coalesced runs. A lane's 16 inputs lie in one group
// (G is a multiple of 16), so it folds the zero-point in once per step:
//     sum_k x_k s (q_k - z) = s * (dot(x, q) - z * sum(x)).
// Partial sums are reduced across the simdgroup with simd_sum in uniform control flow.

constexpr int ROWS = 4;
constexpr int VALUES = 16;
const uint lane = thread_position_in_grid.x;
const uint n0 = thread_position_in_grid.y * ROWS;
const uint row_words = uint(K) * BITS / 32;
const uint groups = K / GROUP_SIZE;
const uint zero_words = (groups * BITS + 31) / 32;

float acc[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
for (uint k = lane * VALUES; k < uint(K); k += 32 * VALUES) {
  float xv[VALUES];
  float xsum = 0.0f;
  for (int j = 0; j < VALUES; j++) {
    xv[j] = float(x[k + j]);
    xsum += xv[j];
  }
  const uint g = k / GROUP_SIZE;
  for (int r = 0; r < ROWS; r++) {
    const uint n = n0 + r;
    if (n >= uint(N)) {
      break;
    }
    float q[VALUES];
    zp_unpack8<BITS>(weight + n * row_words, k / 8, q);
    zp_unpack8<BITS>(weight + n * row_words, k / 8 + 1, q + 8);
    float dot = 0.0f;
    for (int j = 0; j < VALUES; j++) {
      dot += xv[j] * q[j];
    }
    const float s = float(scales[n * groups + g]);
    const float z = zp_zero<BITS>(zeros + n * zero_words, g);
    acc[r] += s * (dot - z * xsum);
  }
}

for (int r = 0; r < ROWS; r++) {
  const float total = simd_sum(acc[r]);
  if (lane == 0 && n0 + r < uint(N)) {
    y[n0 + r] = static_cast<T>(total);
  }
}
