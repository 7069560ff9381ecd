// zp_qmm: Y = X W^T for 2..16 activation rows (speculative verification, short prefills); each
// packed weight is read once for all rows.
//
// Template: T (activation and output float type), BITS, GROUP_SIZE (G), BM (row capacity: 4, 8
//           or 16; the loader picks the smallest >= M).
// Inputs:   x T (M, K); weight uint32 (N, K*BITS/32); scales (N, K/G) float16|bfloat16;
//           zeros uint32 (N, ceil(K/G*BITS/32)); M, K, N int scalars (M <= BM).
// Output:   y T (M, N).
// Grid:     (32, ceil(N/ROWS), 1) threads with ROWS = 4 (BM <= 8) or 2 (BM = 16);
//           threadgroup (32, 4, 1): four simdgroups, each owning ROWS consecutive output rows.
//           A partial last threadgroup has fewer simdgroups; all of its threads still take part
//           in every barrier.
// K is walked in tiles of 256: the threadgroup stages X[0:M, tile] in threadgroup memory as
// float (BM * 256 * 4 bytes <= 16 KB), then each lane unpacks its 8 weights of each of its rows
// once and applies them to all M rows: acc[r][m] += s * (dot(x_m, q) - z * sum(x_m)).

constexpr int TILE = 256;
constexpr int ROWS = BM <= 8 ? 4 : 2;
threadgroup float x_tile[BM * TILE];

const uint lane = thread_position_in_threadgroup.x;
const uint tid = thread_index_in_threadgroup;
const uint threads = threads_per_threadgroup.x * threads_per_threadgroup.y;
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

for (uint k0 = 0; k0 < uint(K); k0 += TILE) {
  // Stage X[:, k0:k0+TILE]; rows >= M and columns >= K are zero.
  for (uint i = tid; i < BM * TILE; i += threads) {
    const uint m = i / TILE;
    const uint k = k0 + i % TILE;
    x_tile[i] = (m < uint(M) && k < uint(K)) ? float(x[m * uint(K) + k]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint k = k0 + 8 * lane;
  if (k < uint(K)) {
    const uint g = k / GROUP_SIZE;
    for (int r = 0; r < ROWS; r++) {
      const uint n = n0 + r;
      if (n >= uint(N)) {
        break;
      }
      float q[8];
      zp_unpack8<BITS>(weight + n * row_words, k / 8, q);
      const float s = float(scales[n * groups + g]);
      const float z = zp_zero<BITS>(zeros + n * zero_words, g);
      for (int m = 0; m < BM; m++) {
        if (m < M) {
          const uint base = m * TILE + 8 * lane;
          float dot = 0.0f;
          float xsum = 0.0f;
          for (int j = 0; j < 8; j++) {
            dot += x_tile[base + j] * q[j];
            xsum += x_tile[base + j];
          }
          acc[r][m] += s * (dot - z * xsum);
        }
      }
    }
  }
  // The next tile overwrites x_tile: every simdgroup must be done reading it.
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int r = 0; r < ROWS; r++) {
  for (int m = 0; m < BM; m++) {
    const float total = simd_sum(acc[r][m]);
    if (lane == 0 && m < M && n0 + r < uint(N)) {
      y[m * uint(N) + n0 + r] = static_cast<T>(total);
    }
  }
}
