// Helpers shared by the zero-point kernels (zp_*.metal). Passed to mx.fast.metal_kernel as the
// `header`, so MLX's own prelude (metal_stdlib, float16_t, bfloat16_t) is already in scope.
//
// Format (the one definition is mlxspec/quant/zp_format.py): each row of `weight` is a little-endian
// bit stream of BITS-bit unsigned values, value i at bit i*BITS of the row's uint32 words; 8
// consecutive values (a "pack") fill exactly BITS bytes. `zeros` rows use the same packing along
// the group axis. A weight is w = s * (q - z).
//
// Pointers are template parameters so that the same helper serves `device` and `constant`
// buffers (MLX passes inputs with fewer than 8 elements in the `constant` address space).

// Unpack pack `p` (values 8p .. 8p+7) of one packed row into q[0..7] as floats.
template <int BITS, typename Words>
inline void zp_unpack8(Words row, uint p, thread float* q) {
  static_assert(BITS == 2 || BITS == 3 || BITS == 4 || BITS == 8, "unsupported bit width");
  if (BITS == 4) {
    uint w = row[p];
    for (int j = 0; j < 8; j++) {
      q[j] = float((w >> (4 * j)) & 0xfu);
    }
  } else if (BITS == 8) {
    uint w0 = row[2 * p];
    uint w1 = row[2 * p + 1];
    for (int j = 0; j < 4; j++) {
      q[j] = float((w0 >> (8 * j)) & 0xffu);
      q[j + 4] = float((w1 >> (8 * j)) & 0xffu);
    }
  } else if (BITS == 2) {
    uint w = row[p / 2] >> (16 * (p % 2));
    for (int j = 0; j < 8; j++) {
      q[j] = float((w >> (2 * j)) & 0x3u);
    }
  } else {
    // 3 bits: the pack is 3 bytes at byte 3p, possibly running into the next word.
    uint byte = 3 * p;
    uint shift = 8 * (byte % 4);
    uint w = row[byte / 4] >> shift;
    if (shift > 8) {
      w |= row[byte / 4 + 1] << (32 - shift);
    }
    for (int j = 0; j < 8; j++) {
      q[j] = float((w >> (3 * j)) & 0x7u);
    }
  }
}

// The zero-point of group `g` from one packed zeros row.
template <int BITS, typename Words>
inline float zp_zero(Words zrow, uint g) {
  uint bit = g * BITS;
  uint shift = bit % 32;
  uint z = zrow[bit / 32] >> shift;
  if (shift + BITS > 32) {
    z |= zrow[bit / 32 + 1] << (32 - shift);
  }
  return float(z & ((1u << BITS) - 1u));
}
