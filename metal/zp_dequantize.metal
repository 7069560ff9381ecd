// zp_dequantize: w[n, k] = s[n, k / G] * (q[n, k] - z[n, k / G]), written as T.
//
// Template: T (output float type), BITS, GROUP_SIZE (G).
// Inputs:   weight uint32 (N, K*BITS/32); scales (N, K/G) float16|bfloat16;
//           zeros uint32 (N, ceil(K/G*BITS/32)); K, N int scalars.
// Output:   out T (N, K).
// Grid:     (K/8, N, 1) threads, one thread per pack of 8 weights; threadgroup (min(K/8, 256), 1, 1).
//           Partial threadgroups at the edges are fine: there is no threadgroup memory or simd op.
// The product is formed in float32, where it is exact, and rounded once to T.

const uint p = thread_position_in_grid.x;
const uint n = thread_position_in_grid.y;
if (p >= uint(K) / 8 || n >= uint(N)) {
  return;
}
const uint groups = K / GROUP_SIZE;
const uint zero_words = (groups * BITS + 31) / 32;
const uint g = (8 * p) / GROUP_SIZE;

float q[8];
zp_unpack8<BITS>(weight + n * (uint(K) * BITS / 32), p, q);
const float s = float(scales[n * groups + g]);
const float z = zp_zero<BITS>(zeros + n * zero_words, g);
for (int j = 0; j < 8; j++) {
  out[n * uint(K) + 8 * p + j] = static_cast<T>(s * (q[j] - z));
}
