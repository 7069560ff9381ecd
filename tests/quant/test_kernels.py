"""The zero-point kernels and their loader.

Without a Mac, the Metal kernels run in the emulator of ``metal/emulator`` (``mlxspec.metal.emulator``): the exact text MLX
generates, compiled with g++ against a shim of the Metal prelude, one OS thread per GPU thread.
Passing here means "logic verified", never "Metal verified". Every result is compared with a
float64 numpy reference built from the integer codes, and deliberately broken kernels show that
the harness catches wrong bit order, missing barriers, barriers in non-uniform control flow,
out-of-bounds reads, oversized shifts and address-space misuse.
"""


import mlx.core as mx
import numpy as np
import pytest
from emulated_kernels import Emulator, emulated

from mlxspec.errors import MlxspecError, QuantizationError
from mlxspec.metal import emulator
from mlxspec.metal.emulator import EmulationError
from mlxspec.quant import kernel_check, kernels, zp_format

# Linux with g++ (on a Mac the real kernels run: doctor --kernels checks them there).
needs_gxx = pytest.mark.skipif(emulator.unavailable() is not None,
                               reason=str(emulator.unavailable()))
needs_clang = pytest.mark.skipif(
    emulator.clang() is None or emulator.unavailable() is not None,
    reason="the address-space check needs clang (apt-get install clang) and the emulator's "
           "generated source (Linux)",
)
EPS = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-24}


def make_layer(n, k, bits, group_size, scale_dtype=mx.float16, seed=0):
    """Random codes and the packed layer; also the float64 dense weight w = s * (q - z)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (n, k))
    z = rng.integers(0, 2**bits, (n, k // group_size))
    scales = mx.array((rng.random((n, k // group_size)) * 0.05 + 1e-3).astype(np.float32))
    scales = scales.astype(scale_dtype)
    s64 = np.array(scales.astype(mx.float32)).astype(np.float64)
    dense = np.repeat(s64, group_size, 1) * (q - np.repeat(z, group_size, 1))
    layer = (mx.array(zp_format.pack(q, bits)), scales, mx.array(zp_format.pack(z, bits)))
    return layer, dense


def make_input(shape, dtype, seed=1):
    x = mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
    x = x.astype(dtype)
    return x, np.array(x.astype(mx.float32)).astype(np.float64)


def assert_matmul_close(y: mx.array, x64: np.ndarray, dense: np.ndarray, dtype, dense_in=None):
    """y == x @ W.T up to float32 accumulation and one rounding to ``dtype``.

    ``dense_in``: the dtype W was rounded to before a plain matmul (the dequantize path), which
    adds up to one rounding of every weight and product to the error.
    """
    assert y.dtype == dtype
    want = x64 @ dense.T
    magnitude = np.abs(x64) @ np.abs(dense).T
    got = np.array(y.astype(mx.float32)).astype(np.float64)
    rounding = 2e-6 if dense_in is None or dense_in == mx.float32 else 2 * EPS[dense_in]
    bound = EPS[dtype] * np.abs(want) + rounding * magnitude + 1e-30
    bad = np.abs(got - want) > bound
    assert not bad.any(), f"{bad.sum()} of {bad.size} outputs off, worst {np.abs(got - want).max()}"


# --------------------------------------------------------------------------------------------
# Loader and fallback (run everywhere).


def test_backend_is_the_mlx_fallback_without_metal(monkeypatch):
    if mx.metal.is_available():
        monkeypatch.setenv("MLXSPEC_KERNELS", "mlx")
    assert kernels.backend() == "mlx"
    assert "MLX fallback" in kernels.describe()


def test_check_on_device_refuses_clearly_without_metal(monkeypatch):
    monkeypatch.delenv("MLXSPEC_KERNELS", raising=False)
    if mx.metal.is_available():
        pytest.skip("Metal is available: the check runs for real (mlxspec doctor --kernels)")
    with pytest.raises(MlxspecError, match="needs Metal"):
        kernel_check.check_on_device()


@pytest.mark.parametrize("bits", zp_format.SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_fallback_matmul_matches_float64_reference(bits, dtype):
    (weight, scales, zeros), dense = make_layer(40, 256, bits, 64)
    x, x64 = make_input((2, 3, 256), dtype)
    _, _, biases = zp_format.to_mlx_affine(weight, scales, zeros, bits, 64)
    for b in (None, biases):
        y = kernels.fallback_matmul(x, weight, scales, zeros, bits=bits, group_size=64, biases=b)
        assert y.shape == (2, 3, 40)
        assert_matmul_close(y.reshape(6, 40), x64.reshape(6, 256), dense, dtype)


def test_zp_matmul_uses_the_active_backend():
    (weight, scales, zeros), dense = make_layer(8, 64, 4, 32)
    x, x64 = make_input((1, 64), mx.float32)
    y = kernels.zp_matmul(x, weight, scales, zeros, bits=4, group_size=32)
    assert_matmul_close(y, x64, dense, mx.float32)


def test_metal_matmul_refuses_inputs_it_cannot_run():
    (weight, scales, zeros), _ = make_layer(8, 64, 4, 32)
    with pytest.raises(QuantizationError, match="input has 32 features"):
        kernels.metal_matmul(mx.zeros((1, 32)), weight, scales, zeros, bits=4, group_size=32)
    with pytest.raises(QuantizationError, match="activations must be"):
        kernels.metal_matmul(
            mx.zeros((1, 64), mx.int32), weight, scales, zeros, bits=4, group_size=32
        )
    with pytest.raises(QuantizationError, match="group size 48"):
        kernels.metal_matmul(mx.zeros((1, 64)), weight, scales, zeros, bits=4, group_size=48)


# --------------------------------------------------------------------------------------------
# Emulated kernels.


@needs_gxx
def test_emulator_compiles_the_exact_text_mlx_generates():
    (weight, scales, zeros), _ = make_layer(9, 64, 4, 32)
    launch = dict(
        inputs=[mx.zeros((64,), mx.float16), weight, scales, zeros, 64, 9],
        template=[("T", mx.float16), ("BITS", 4), ("GROUP_SIZE", 32)],
        grid=(32, 3, 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(1, 9)],
        output_dtypes=[mx.float16],
    )
    text = emulator.generated_source(kernels._kernel("zp_qmv"), launch)
    assert text.startswith(kernels._source("zp_common.h"))
    assert kernels._source("zp_qmv.metal") in text
    assert (
        "template <typename T, int BITS, int GROUP_SIZE>\n[[kernel]] void custom_kernel_zp_qmv_"
        in text
    )
    assert "const device float16_t* x [[buffer(0)]]" in text
    assert "const constant int32_t& K [[buffer(4)]]" in text
    assert "uint3 thread_position_in_grid [[thread_position_in_grid]]" in text
    assert text.rstrip().endswith("<float16_t, 4, 32>;")


def emulate_matmul(x, layer, bits, group_size, flavor="plain", edit=None):
    """The custom kernel for x's rows: zp_qmv for one row, zp_qmm for 2-16."""
    with emulated(flavor, edit) as emu:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1:
            y = kernels.metal_matmul(x, *layer, bits=bits, group_size=group_size)
        else:
            y = kernels.metal_qmm(rows, *layer, bits=bits, group_size=group_size)
        mx.eval(y)
    return y, [name for name, _, _ in emu.launches]


# (bits, group size, K): K is a multiple of the group size but not of the 256/512 K steps, and
# N = 33 leaves a partial simdgroup row set and a partial last threadgroup.
BITS_GROUPS = [(b, g) for b in zp_format.SUPPORTED_BITS for g in zp_format.SUPPORTED_GROUP_SIZES]
K_FOR_GROUP = {32: 352, 64: 576, 128: 640}


@needs_gxx
@pytest.mark.parametrize("bits,group_size", BITS_GROUPS)
def test_emulated_qmv_matches_float64_reference(bits, group_size):
    k = K_FOR_GROUP[group_size]
    layer, dense = make_layer(33, k, bits, group_size, seed=bits)
    x, x64 = make_input((1, 1, k), mx.float16)
    y, launched = emulate_matmul(x, layer, bits, group_size)
    assert launched == ["zp_qmv"] and y.shape == (1, 1, 33)
    assert_matmul_close(y.reshape(1, 33), x64.reshape(1, k), dense, mx.float16)


@needs_gxx
@pytest.mark.parametrize(
    "bits,group_size,m",
    [
        (2, 64, 5),
        (3, 64, 7),
        (4, 64, 8),
        (8, 64, 6),
        (4, 32, 3),
        (4, 128, 16),
        (4, 64, 2),
        (8, 128, 11),
    ],
)
def test_emulated_qmm_matches_float64_reference(bits, group_size, m):
    k = K_FOR_GROUP[group_size]
    layer, dense = make_layer(33, k, bits, group_size, seed=bits + m)
    x, x64 = make_input((m, k), mx.float16, seed=m)
    y, launched = emulate_matmul(x, layer, bits, group_size)
    assert launched == ["zp_qmm"]
    assert_matmul_close(y, x64, dense, mx.float16)


@needs_gxx
@pytest.mark.parametrize(
    "kernel_rows,dtype,scale_dtype",
    [
        (1, mx.bfloat16, mx.bfloat16),
        (1, mx.float32, mx.float16),
        (4, mx.bfloat16, mx.bfloat16),
        (12, mx.float32, mx.bfloat16),
    ],
)
def test_emulated_kernels_take_every_activation_dtype(kernel_rows, dtype, scale_dtype):
    layer, dense = make_layer(21, 576, 4, 64, scale_dtype=scale_dtype)
    x, x64 = make_input((kernel_rows, 576), dtype)
    y, _ = emulate_matmul(x, layer, 4, 64)
    assert_matmul_close(y, x64, dense, dtype)


@needs_gxx
@pytest.mark.parametrize("m", [2, 20])
def test_two_or_more_rows_use_quantized_matmul_without_dequantizing_the_layer(
    m, monkeypatch, tmp_path
):
    # No kernel launch (in particular no whole-layer zp_dequantize): mx.quantized_matmul on the
    # exact affine form, unless zp_qmm was measured faster.
    monkeypatch.setenv("MLXSPEC_HOME", str(tmp_path))
    monkeypatch.delenv("MLXSPEC_QMM", raising=False)
    kernels._measured_speedups.cache_clear()
    layer, dense = make_layer(19, 320, 4, 32)
    x, x64 = make_input((2, m // 2, 320), mx.float32)
    with emulated() as emu:
        y = kernels.metal_matmul(x, *layer, bits=4, group_size=32)
        mx.eval(y)
    assert emu.launches == [] and y.shape == (2, m // 2, 19)
    assert_matmul_close(y.reshape(m, 19), x64.reshape(m, 320), dense, mx.float32)
    # Where doctor --kernels measured zp_qmm faster (or with MLXSPEC_QMM=zp), it runs for 2-16.
    monkeypatch.setenv("MLXSPEC_HOME", str(tmp_path))
    kernels.save_qmm_choice([{"bits": 4, "group_size": 32, "rows": 2, "speedup": 1.3}])
    for setting in ("auto", "zp"):
        monkeypatch.setenv("MLXSPEC_QMM", setting)
        with emulated() as emu:
            y = kernels.metal_matmul(x, *layer, bits=4, group_size=32)
            mx.eval(y)
        assert [name for name, _, _ in emu.launches] == (["zp_qmm"] if m <= 16 else [])
        assert_matmul_close(y.reshape(m, 19), x64.reshape(m, 320), dense, mx.float32)
    kernels._measured_speedups.cache_clear()


@needs_gxx
@pytest.mark.parametrize(
    "bits,group_size,k,dtype,scale_dtype",
    [
        (2, 32, 96, mx.float16, mx.float16),
        (3, 32, 96, mx.float16, mx.float16),
        (4, 32, 96, mx.float16, mx.float16),
        (8, 32, 96, mx.float16, mx.float16),
        (4, 64, 2112, mx.float32, mx.bfloat16),  # 264 packs a row: a partial threadgroup
        (3, 128, 384, mx.bfloat16, mx.bfloat16),
    ],
)
def test_emulated_dequantize_equals_format_dequantize_exactly(
    bits, group_size, k, dtype, scale_dtype
):
    (weight, scales, zeros), _ = make_layer(13, k, bits, group_size, scale_dtype=scale_dtype)
    with emulated():
        got = kernels.metal_dequantize(
            weight, scales, zeros, bits=bits, group_size=group_size, dtype=dtype
        )
    want = zp_format.dequantize(weight, scales, zeros, bits, group_size, dtype=dtype)
    assert got.dtype == dtype
    assert mx.array_equal(got, want).item()


@needs_gxx
@pytest.mark.parametrize("rows", [1, 3, 6, 16])  # qmv; qmm at BM = 4, 8 and 16
def test_kernels_are_race_free_under_thread_sanitizer(rows):
    layer, dense = make_layer(33, 576, 4, 64)
    x, x64 = make_input((rows, 576), mx.float16)
    y, _ = emulate_matmul(x, layer, 4, 64, flavor="tsan")
    assert_matmul_close(y, x64, dense, mx.float16)


@needs_gxx
@pytest.mark.parametrize("rows", [1, 3, 16])  # qmv, and qmm at BM = 4 and BM = 16
def test_kernels_stay_in_bounds_under_address_sanitizer(rows):
    layer, dense = make_layer(33, 352, 3, 32)  # 3 bits: packs straddle words
    x, x64 = make_input((rows, 352), mx.float16)
    y, _ = emulate_matmul(x, layer, 3, 32, flavor="asan")
    assert_matmul_close(y, x64, dense, mx.float16)


# --------------------------------------------------------------------------------------------
# Deliberately broken kernels are caught.


def replacing(file_name: str, old: str, new: str):
    """An emulator edit that replaces ``old`` (which must occur) in one kernel file."""

    def edit(name: str, text: str) -> str:
        if name != file_name:
            return text
        assert old in text, f"{old!r} not in {name}: update the broken-kernel test"
        return text.replace(old, new, 1)

    return edit


@needs_gxx
def test_wrong_nibble_order_is_caught():
    layer, dense = make_layer(8, 256, 4, 64)
    x, x64 = make_input((1, 256), mx.float32)
    edit = replacing("zp_common.h", "(w >> (4 * j)) & 0xfu", "(w >> (4 * (7 - j))) & 0xfu")
    y, _ = emulate_matmul(x, layer, 4, 64, edit=edit)
    with pytest.raises(AssertionError, match="outputs off"):
        assert_matmul_close(y, x64, dense, mx.float32)


# The harness's threadgroup-memory checks, on a kernel written for the purpose (the production
# kernels need no threadgroup memory): each threadgroup of 32 threads stages its 64 values of x,
# each thread reads a value another thread wrote; then the tile is staged again (doubled).
STAGE = """
threadgroup float tile[64];
const uint i = thread_index_in_threadgroup;
const uint base = threadgroup_position_in_grid.x * 64;
for (uint t = i; t < 64; t += 32) {
  tile[t] = x[base + t];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float first = tile[(i + 1) % 64] + tile[(i + 33) % 64];
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint t = i; t < 64; t += 32) {
  tile[t] = 2.0f * x[base + t];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
out[base / 2 + i] = first + tile[(i + 5) % 64];
"""
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
RACE_RUNS = 5  # runs of a racy kernel under ThreadSanitizer before the race counts as missed


def run_stage(edit=lambda text: text, flavor: str = "plain") -> np.ndarray:
    """STAGE (after ``edit``) on 128 values, 2 threadgroups of 32: its 64 outputs."""
    kernel = mx.fast.metal_kernel(name="emu_stage", input_names=["x"], output_names=["out"],
                                  source=edit(STAGE))
    launch = dict(inputs=[mx.arange(128, dtype=mx.float32)], grid=(64, 1, 1),
                  threadgroup=(32, 1, 1), output_shapes=[(64,)], output_dtypes=[mx.float32])
    binary = emulator.build(emulator.generated_source(kernel, launch), flavor)
    return np.array(emulator.run(binary, launch)[0])


@needs_gxx
def test_staging_kernel_runs_as_on_a_gpu():
    x = np.arange(128, dtype=np.float32).reshape(2, 64)
    i = np.arange(32)
    want = x[:, (i + 1) % 64] + x[:, (i + 33) % 64] + 2 * x[:, (i + 5) % 64]
    np.testing.assert_array_equal(run_stage(flavor="tsan"), want.reshape(-1))


@needs_gxx
@pytest.mark.parametrize("which", ["after staging", "before restaging"])
def test_missing_barrier_is_caught_by_thread_sanitizer(which):
    def drop_barrier(text):
        at = text.index(BARRIER)
        if which == "before restaging":
            at = text.index(BARRIER, at + 1)
        return text[:at] + text[at + len(BARRIER) :]

    # ThreadSanitizer reports the unordered accesses it still remembers: each 8 bytes keep the
    # last few, and which ones get evicted depends on how the threads interleave (a suite
    # running beside this test once made it miss the race), so the kernel gets a few runs.
    for _ in range(RACE_RUNS):
        try:
            run_stage(drop_barrier, flavor="tsan")
        except EmulationError as e:
            assert "ThreadSanitizer: data race" in str(e)
            return
    pytest.fail(f"ThreadSanitizer missed the missing barrier in {RACE_RUNS} runs")


@needs_gxx
def test_reading_threadgroup_memory_nobody_wrote_gives_nan():
    out = run_stage(lambda text: text.replace("t += 32)", "t += 64)", 1))  # stages half a tile
    assert np.isnan(out).any()


@needs_gxx
def test_barrier_in_non_uniform_control_flow_is_caught():
    def early_return(text):
        return text.replace("for (uint t = i;", "if (i >= 16) return;\nfor (uint t = i;", 1)

    with pytest.raises(EmulationError, match="non-uniform control flow"):
        run_stage(early_return)


@needs_gxx
def test_out_of_bounds_read_is_caught_even_when_the_numbers_are_right():
    layer, dense = make_layer(33, 576, 4, 64)
    x, x64 = make_input((6, 576), mx.float16)
    edit = replacing("zp_qmm.metal", "if (m < M) {", "if (m < BM) {")  # rows 6, 7 of BM = 8
    y, _ = emulate_matmul(x, layer, 4, 64, edit=edit)
    assert_matmul_close(y, x64, dense, mx.float16)  # the stray values are never used...
    with pytest.raises(EmulationError, match="AddressSanitizer: heap-buffer-overflow"):
        emulate_matmul(x, layer, 4, 64, flavor="asan", edit=edit)  # ...but they are read


@needs_gxx
def test_oversized_shift_is_caught_by_undefined_behaviour_sanitizer():
    layer, _ = make_layer(37, 576, 2, 64)
    x, _ = make_input((1, 576), mx.float16)
    edit = replacing("zp_common.h", "row[p / 2] >> (16 * (p % 2))", "row[p / 2] >> (32 * (p % 2))")
    with pytest.raises(EmulationError, match="shift exponent 32"):
        emulate_matmul(x, layer, 2, 64, flavor="asan", edit=edit)


# --------------------------------------------------------------------------------------------
# Address spaces (clang), including inputs small enough for MLX to pass them as `constant`.


def generated_sources(m: int, n: int, k: int, edit=None) -> list[str]:
    """MLX's text for every kernel the loader launches for an (m, k) x (n, k)^T product."""
    layer, _ = make_layer(n, k, 3, 32, scale_dtype=mx.bfloat16)
    x, _ = make_input((m, k), mx.bfloat16)
    emu = Emulator(edit=edit)
    sources = []

    def record(name, **launch):
        sources.append(emu.source(name, launch))
        return [
            mx.zeros(s, d)
            for s, d in zip(launch["output_shapes"], launch["output_dtypes"], strict=True)
        ]

    saved, kernels._launch = kernels._launch, record
    try:
        rows = x.reshape(-1, x.shape[-1])
        if m == 1:
            kernels.metal_matmul(x, *layer, bits=3, group_size=32)
        else:
            kernels.metal_qmm(rows, *layer, bits=3, group_size=32)
        kernels.metal_dequantize(*layer, bits=3, group_size=32, dtype=mx.float32)
    finally:
        kernels._launch = saved
    return sources


@needs_clang
@pytest.mark.parametrize("m,n,k", [(1, 37, 352), (5, 37, 352), (16, 1, 32), (1, 1, 32)])
def test_kernels_respect_address_spaces(m, n, k):
    sources = generated_sources(m, n, k)
    if n == 1:  # tiny layers: MLX passes the scales and zeros in the constant address space
        assert any("const constant uint32_t* zeros" in s for s in sources)
    for source in sources:
        emulator.syntax_check(source)


@needs_clang
def test_address_space_misuse_is_caught_by_clang():
    edit = replacing(
        "zp_common.h",
        "template <int BITS, typename Words>\ninline float zp_zero(Words zrow",
        "template <int BITS>\ninline float zp_zero(const device uint32_t* zrow",
    )
    sources = generated_sources(1, 1, 32, edit=edit)
    with pytest.raises(EmulationError, match="clang rejects"):
        emulator.syntax_check(sources[0])


# --------------------------------------------------------------------------------------------
# The emulator's own semantics, on a kernel written for the purpose.

SELF_TEST = """
const uint i = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
threadgroup float partial[2];
float v = x[threadgroup_position_in_grid.x * 64 + i];
float total = simd_sum(v);
float butterfly = v;
for (ushort d = 16; d > 0; d /= 2) {
  butterfly += simd_shuffle_xor(butterfly, d);
}
float down = simd_shuffle_down(v, 1);
float prefix = simd_prefix_exclusive_sum(v);
if (lane == 0) {
  partial[simdgroup_index_in_threadgroup] = total;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const uint o = 5 * (threadgroup_position_in_grid.x * 64 + i);
out[o] = total;
out[o + 1] = butterfly;
out[o + 2] = down;
out[o + 3] = prefix;
out[o + 4] = partial[0] + partial[1];
"""


@needs_gxx
def test_emulator_simd_and_threadgroup_semantics():
    kernel = mx.fast.metal_kernel(
        name="emu_self_test", input_names=["x"], output_names=["out"], source=SELF_TEST
    )
    values = np.arange(128, dtype=np.float32) % 7 - 3  # exact in float32 whatever the order
    launch = dict(
        inputs=[mx.array(values)],
        grid=(128, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(128, 5)],
        output_dtypes=[mx.float32],
    )
    binary = emulator.build(emulator.generated_source(kernel, launch))
    out = np.array(emulator.run(binary, launch)[0])
    simd = values.reshape(4, 32)
    np.testing.assert_array_equal(out[:, 0], np.repeat(simd.sum(1), 32))
    np.testing.assert_array_equal(out[:, 1], np.repeat(simd.sum(1), 32))
    down = np.concatenate([simd[:, 1:], simd[:, 31:]], 1)  # the last lane keeps its value
    np.testing.assert_array_equal(out[:, 2], down.reshape(-1))
    np.testing.assert_array_equal(out[:, 3], (np.cumsum(simd, 1) - simd).reshape(-1))
    np.testing.assert_array_equal(out[:, 4], np.repeat(values.reshape(2, 64).sum(1), 64))


@needs_gxx
def test_emulator_reports_lanes_at_different_simd_operations():
    source = """
    float v = x[thread_position_in_grid.x];
    if (thread_index_in_simdgroup < 16) {
      v = simd_sum(v);
    } else {
      v = simd_sum(v);
    }
    out[thread_position_in_grid.x] = v;
    """
    kernel = mx.fast.metal_kernel(
        name="emu_divergent", input_names=["x"], output_names=["out"], source=source
    )
    launch = dict(
        inputs=[mx.zeros((32,))],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(32,)],
        output_dtypes=[mx.float32],
    )
    binary = emulator.build(emulator.generated_source(kernel, launch))
    with pytest.raises(EmulationError, match="different simd operations"):
        emulator.run(binary, launch)


@needs_gxx
def test_a_barrier_without_mem_threadgroup_cannot_exchange_threadgroup_data():
    # mem_none orders execution, not memory: the staged values need not be visible.
    with pytest.raises(EmulationError, match="lacks mem_flags::mem_threadgroup"):
        run_stage(lambda text: text.replace("mem_flags::mem_threadgroup", "mem_flags::mem_none", 1))


@needs_gxx
def test_emulator_keeps_divergent_calls_of_one_simd_helper_apart():
    # Both branches reach simd_sum at the same line (inside the helper): on a GPU each branch
    # sums only its own 16 lanes; an emulator merging them would sum all 32 and pass.
    header = "float total(float v) { return simd_sum(v); }\n"
    source = """
    float v = x[thread_position_in_grid.x];
    if (thread_index_in_simdgroup < 16) {
      v = total(v) + 1.0f;
    } else {
      v = total(v) - 1.0f;
    }
    out[thread_position_in_grid.x] = v;
    """
    kernel = mx.fast.metal_kernel(name="emu_divergent_helper", input_names=["x"],
                                  output_names=["out"], source=source, header=header)
    launch = dict(inputs=[mx.zeros((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                  output_shapes=[(32,)], output_dtypes=[mx.float32])
    binary = emulator.build(emulator.generated_source(kernel, launch))
    with pytest.raises(EmulationError, match="different call paths"):
        emulator.run(binary, launch)


@needs_gxx
def test_threadgroup_memory_over_32_kb_is_caught():
    with pytest.raises(EmulationError, match="threadgroup memory exceed"):
        run_stage(lambda text: text.replace("tile[64];", "tile[64 * 160];", 1))  # 40 KB


@needs_gxx
def test_threads_over_the_threadgroup_limit_are_caught():
    layer, _ = make_layer(8, 64, 4, 32)
    x, _ = make_input((1, 64), mx.float16)
    with emulated() as emu:

        def oversized(name, **kwargs):
            return emu(name, **{**kwargs, "threadgroup": (32, 64, 1)})

        # (not monkeypatch: its undo would put the emulator back after the block restored the
        # real launcher, and every later test would run emulated)
        kernels._launch = oversized
        with pytest.raises(EmulationError, match="2048 threads exceeds the limit of 1024"):
            mx.eval(kernels.metal_matmul(x, *layer, bits=4, group_size=32))
