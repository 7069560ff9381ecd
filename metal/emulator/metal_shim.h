// metal_shim.h: stand-in for MLX's Metal prelude (metal::utils()) so that the exact source
// mx.fast.metal_kernel generates compiles as C++17 and runs on a CPU (the tests, and MLXSPEC_KERNELS=emulate):
// "logic verified", never "Metal verified".
//
// Two modes:
// - default (g++): a runnable emulation. A threadgroup's threads are real OS threads; `threadgroup`
//   variables are function statics (one threadgroup runs at a time and the driver poisons them
//   with NaN bytes before each); threadgroup_barrier and the simd_* operations are rendezvous
//   points guarded by one monitor per threadgroup, which also reports barriers reached in
//   non-uniform control flow, lanes of a simdgroup at different simd operations, and deadlocks.
//   TSan and ASan/UBSan builds of the same text see every synchronisation (mutex + condvar).
// - EMU_ADDRESS_SPACES (clang -fsyntax-only, freestanding, aarch64 for _Float16): device,
//   constant and threadgroup become distinct address spaces, so passing a `constant` buffer where
//   a `device` pointer is expected fails to compile, as it would in Metal.
#pragma once

#ifndef EMU_ADDRESS_SPACES
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <type_traits>
#include <unistd.h>
#include <vector>
#else
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef unsigned long size_t;
namespace std {
template <class T>
struct numeric_limits {
  static constexpr T max() { return T(0); }
  static constexpr T min() { return T(0); }
  static constexpr T lowest() { return T(0); }
  static constexpr T infinity() { return T(0); }
};
}  // namespace std
#endif

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef half float16_t;

#ifdef EMU_ADDRESS_SPACES
// A builtin type, like Metal's bfloat (a class would need address-space-qualified methods).
typedef _Float16 bfloat16_t;
#else
// bfloat16: storage of the top 16 bits of a float, round-to-nearest-even on conversion.
struct bfloat16_t {
  uint16_t bits_;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits_ = uint16_t((u >> 16) | 0x40u);  // quiet NaN
    } else {
      bits_ = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    uint32_t u = uint32_t(bits_) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
};
#endif
typedef bfloat16_t bfloat;

// Small vector types (members only; the kernels use them for attributes).
template <class T>
struct emu_vec2 {
  T x, y;
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <class T>
struct emu_vec3 {
  T x, y, z;
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <class T>
struct emu_vec4 {
  T x, y, z, w;
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
#define EMU_VECTORS(T)        \
  typedef emu_vec2<T> T##2; \
  typedef emu_vec3<T> T##3; \
  typedef emu_vec4<T> T##4;
EMU_VECTORS(float)
EMU_VECTORS(half)
EMU_VECTORS(int)
EMU_VECTORS(uint)
EMU_VECTORS(short)
EMU_VECTORS(ushort)
EMU_VECTORS(uchar)
#undef EMU_VECTORS

#ifndef EMU_ADDRESS_SPACES
// ---------------------------------------------------------------------------------------------
// Runtime: one Monitor per running threadgroup.
namespace emu {

[[noreturn]] inline void fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::fprintf(stderr, "metal-emu: ");
  std::vfprintf(stderr, fmt, args);
  std::fprintf(stderr, "\n");
  va_end(args);
  std::fflush(stderr);
  _exit(3);
}

enum State { RUNNING, AT_BARRIER, AT_SIMD, EXITED };
enum SimdKind { SUM, PRODUCT, MAX, MIN, SHUFFLE, SHUFFLE_XOR, SHUFFLE_UP, SHUFFLE_DOWN,
                BROADCAST_FIRST, PREFIX_EXCLUSIVE_SUM, PREFIX_INCLUSIVE_SUM, ALL, ANY, SIMD_BARRIER };

struct Lane {
  alignas(16) unsigned char in[32];
  alignas(16) unsigned char out[32];
  int arg, kind;
};
typedef void (*Combine)(int kind, Lane* lanes, uint32_t active);

struct Monitor {
  struct Simdgroup {
    int first = 0, count = 0, kind = 0;
    Combine combine = nullptr;
    Lane lanes[32];
  };
  std::mutex mu;
  std::condition_variable cv;
  int threads = 0, exited = 0, at_barrier = 0;
  bool shared_memory = false;  // the kernel has threadgroup variables
  std::vector<int> state, line;
  // Each lane's call path to its simd operation (the code address of the call and of its caller):
  // two divergent branches calling one helper reach the same line by different paths.
  std::vector<std::pair<const void*, const void*>> site;
  std::vector<Simdgroup> simd;

  explicit Monitor(int n)
      : threads(n), state(n, RUNNING), line(n, 0), site(n), simd((n + 31) / 32) {
    for (int s = 0; s < int(simd.size()); s++) {
      simd[s].first = 32 * s;
      simd[s].count = std::min(32, n - 32 * s);
    }
  }

  // Called with `mu` held after any state change: complete what can complete, report misuse.
  void progress() {
    bool released = false;
    for (auto& sg : simd) {
      int live = 0, waiting = 0, at_line = -1, at_kind = -1, first = -1;
      uint32_t active = 0;
      for (int l = 0; l < sg.count; l++) {
        int t = sg.first + l;
        if (state[t] == EXITED) continue;
        live++;
        if (state[t] != AT_SIMD) continue;
        waiting++;
        active |= 1u << l;
        if (at_line < 0) {
          at_line = line[t];
          at_kind = sg.lanes[l].kind;
          first = t;
        } else if (line[t] != at_line || sg.lanes[l].kind != at_kind) {
          fail("simdgroup %d: lanes reached different simd operations (lines %d and %d)",
               int(&sg - simd.data()), at_line, line[t]);
        } else if (site[t] != site[first]) {
          fail("simdgroup %d: lanes reached different simd operations (line %d by different "
               "call paths: divergent branches calling one helper)",
               int(&sg - simd.data()), at_line);
        }
      }
      if (live > 0 && waiting == live) {
        sg.combine(sg.kind, sg.lanes, active);
        for (int l = 0; l < sg.count; l++) {
          if (active & (1u << l)) state[sg.first + l] = RUNNING;
        }
        released = true;
      }
    }
    if (at_barrier > 0 && exited > 0) {
      int t = 0;
      while (state[t] != AT_BARRIER) t++;
      fail("threadgroup_barrier at line %d reached in non-uniform control flow: %d of %d threads "
           "of the threadgroup returned before it",
           line[t], exited, threads);
    }
    if (at_barrier == threads) {
      for (int t = 1; t < threads; t++) {
        if (line[t] != line[0]) {
          fail("threads reached different threadgroup_barrier calls (lines %d and %d)", line[0],
               line[t]);
        }
      }
      for (int t = 0; t < threads; t++) state[t] = RUNNING;
      at_barrier = 0;
      released = true;
    }
    if (released) {
      cv.notify_all();
      return;
    }
    int running = 0, waiting = 0;
    for (int t = 0; t < threads; t++) {
      running += state[t] == RUNNING;
      waiting += state[t] == AT_BARRIER || state[t] == AT_SIMD;
    }
    if (running == 0 && waiting > 0) {
      int a = -1, b = -1;
      for (int t = 0; t < threads; t++) {
        if (state[t] == AT_BARRIER && a < 0) a = t;
        if (state[t] == AT_SIMD && b < 0) b = t;
      }
      fail("deadlock: thread %d waits at threadgroup_barrier (line %d) while thread %d waits at "
           "a simd operation (line %d)",
           a, a >= 0 ? line[a] : -1, b, b >= 0 ? line[b] : -1);
    }
  }

  void wait_until_released(std::unique_lock<std::mutex>& lock, int t) {
    cv.wait(lock, [&] { return state[t] == RUNNING; });
  }
};

struct ThreadContext {
  Monitor* monitor = nullptr;
  int index = 0;  // thread_index_in_threadgroup
};
inline thread_local ThreadContext context;

inline void barrier(int at_line, int flags = 2) {
  Monitor& m = *context.monitor;
  if (m.shared_memory && !(flags & 2)) {
    // Without mem_threadgroup the barrier orders execution only: threadgroup memory written
    // before it need not be visible after it (the emulator's mutex would make it so).
    fail("threadgroup_barrier at line %d lacks mem_flags::mem_threadgroup, but the kernel "
         "exchanges data through threadgroup memory", at_line);
  }
  std::unique_lock<std::mutex> lock(m.mu);
  int t = context.index;
  m.state[t] = AT_BARRIER;
  m.line[t] = at_line;
  m.at_barrier++;
  m.progress();
  m.wait_until_released(lock, t);
}

inline void thread_exit() {
  Monitor& m = *context.monitor;
  std::lock_guard<std::mutex> lock(m.mu);
  m.state[context.index] = EXITED;
  m.exited++;
  m.progress();
}

template <class V>
V add(V a, V b) { return V(a + b); }
template <class V>
V mul(V a, V b) { return V(a * b); }

template <class V>
void combine(int kind, Lane* lanes, uint32_t active) {
  V v[32];
  for (int l = 0; l < 32; l++) {
    if (active & (1u << l)) std::memcpy(&v[l], lanes[l].in, sizeof(V));
  }
  auto source_lane = [&](int l, int src) -> V {
    if (src < 0 || src >= 32 || !(active & (1u << src))) {
      fail("lane %d reads lane %d, which is not active", l, src);
    }
    return v[src];
  };
  V out[32];
  if (kind == SUM || kind == PRODUCT || kind == MAX || kind == MIN || kind == ALL ||
      kind == ANY) {
    // Butterfly order over the active lanes (inactive lanes contribute nothing).
    V r[32];
    bool has[32];
    for (int l = 0; l < 32; l++) {
      has[l] = active & (1u << l);
      if (has[l]) r[l] = v[l];
    }
    for (int stride = 1; stride < 32; stride *= 2) {
      for (int l = 0; l < 32; l += 2 * stride) {
        int o = l + stride;
        if (!has[o]) continue;
        if (!has[l]) {
          r[l] = r[o];
          has[l] = true;
          continue;
        }
        if (kind == SUM) r[l] = add(r[l], r[o]);
        if (kind == PRODUCT) r[l] = mul(r[l], r[o]);
        if (kind == MAX) r[l] = r[o] > r[l] ? r[o] : r[l];
        if (kind == MIN) r[l] = r[o] < r[l] ? r[o] : r[l];
        if (kind == ALL) r[l] = V(r[l] && r[o]);
        if (kind == ANY) r[l] = V(r[l] || r[o]);
      }
    }
    for (int l = 0; l < 32; l++) out[l] = r[0];
  } else if (kind == PREFIX_EXCLUSIVE_SUM || kind == PREFIX_INCLUSIVE_SUM) {
    V run = V(0);
    for (int l = 0; l < 32; l++) {
      if (!(active & (1u << l))) continue;
      if (kind == PREFIX_INCLUSIVE_SUM) run = add(run, v[l]);
      out[l] = run;
      if (kind == PREFIX_EXCLUSIVE_SUM) run = add(run, v[l]);
    }
  } else if (kind == BROADCAST_FIRST) {
    int first = __builtin_ctz(active);
    for (int l = 0; l < 32; l++) out[l] = v[first];
  } else if (kind != SIMD_BARRIER) {
    for (int l = 0; l < 32; l++) {
      if (!(active & (1u << l))) continue;
      int arg = lanes[l].arg;
      if (kind == SHUFFLE) out[l] = source_lane(l, arg);
      if (kind == SHUFFLE_XOR) out[l] = source_lane(l, l ^ arg);
      // Lanes shifted in from outside the simdgroup keep their own value.
      if (kind == SHUFFLE_DOWN) out[l] = l + arg < 32 ? source_lane(l, l + arg) : v[l];
      if (kind == SHUFFLE_UP) out[l] = l - arg >= 0 ? source_lane(l, l - arg) : v[l];
    }
  }
  for (int l = 0; l < 32; l++) {
    if (active & (1u << l)) std::memcpy(lanes[l].out, &out[l], sizeof(V));
  }
}

template <class V>
__attribute__((noinline)) V simd_op(int kind, V value, int arg, int at_line) {
  static_assert(sizeof(V) <= 32, "simd value too large");
  Monitor& m = *context.monitor;
  std::unique_lock<std::mutex> lock(m.mu);
  int t = context.index;
  auto& sg = m.simd[t / 32];
  Lane& lane = sg.lanes[t % 32];
  std::memcpy(lane.in, &value, sizeof(V));
  lane.arg = arg;
  lane.kind = kind;
  sg.kind = kind;
  sg.combine = &combine<V>;
  m.state[t] = AT_SIMD;
  m.line[t] = at_line;
  m.site[t] = {__builtin_return_address(0), __builtin_return_address(1)};
  m.progress();
  m.wait_until_released(lock, t);
  V result;
  std::memcpy(&result, lane.out, sizeof(V));
  return result;
}

}  // namespace emu
#include "emu_driver.h"
#define EMU_SIMD_OP(kind, v, arg, line) ::emu::simd_op(::emu::kind, v, int(arg), line)
#define EMU_BARRIER(line, flags) ::emu::barrier(line, flags)
#else
#define EMU_SIMD_OP(kind, v, arg, line) (v)
#define EMU_BARRIER(line, flags) ((void)(line))
#endif  // EMU_ADDRESS_SPACES

// ---------------------------------------------------------------------------------------------
// The Metal standard library subset the kernels may use.
namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

inline void threadgroup_barrier(mem_flags flags, int line = __builtin_LINE()) {
  EMU_BARRIER(line, int(flags));
}
__attribute__((always_inline)) inline void simdgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  (void)EMU_SIMD_OP(SIMD_BARRIER, 0, 0, line);
}

template <class V>
__attribute__((always_inline)) inline V simd_sum(V v, int line = __builtin_LINE()) { return EMU_SIMD_OP(SUM, v, 0, line); }
template <class V>
__attribute__((always_inline)) inline V simd_product(V v, int line = __builtin_LINE()) { return EMU_SIMD_OP(PRODUCT, v, 0, line); }
template <class V>
__attribute__((always_inline)) inline V simd_max(V v, int line = __builtin_LINE()) { return EMU_SIMD_OP(MAX, v, 0, line); }
template <class V>
__attribute__((always_inline)) inline V simd_min(V v, int line = __builtin_LINE()) { return EMU_SIMD_OP(MIN, v, 0, line); }
template <class V>
__attribute__((always_inline)) inline V simd_prefix_exclusive_sum(V v, int line = __builtin_LINE()) {
  return EMU_SIMD_OP(PREFIX_EXCLUSIVE_SUM, v, 0, line);
}
template <class V>
__attribute__((always_inline)) inline V simd_prefix_inclusive_sum(V v, int line = __builtin_LINE()) {
  return EMU_SIMD_OP(PREFIX_INCLUSIVE_SUM, v, 0, line);
}
template <class V>
__attribute__((always_inline)) inline V simd_shuffle(V v, ushort lane, int line = __builtin_LINE()) {
  return EMU_SIMD_OP(SHUFFLE, v, lane, line);
}
template <class V>
__attribute__((always_inline)) inline V simd_broadcast(V v, ushort lane, int line = __builtin_LINE()) {
  return EMU_SIMD_OP(SHUFFLE, v, lane, line);
}
template <class V>
__attribute__((always_inline)) inline V simd_shuffle_xor(V v, ushort mask, int line = __builtin_LINE()) {
  return EMU_SIMD_OP(SHUFFLE_XOR, v, mask, line);
}
template <class V>
__attribute__((always_inline)) inline V simd_shuffle_down(V v, ushort delta, int line = __builtin_LINE()) {
  return EMU_SIMD_OP(SHUFFLE_DOWN, v, delta, line);
}
template <class V>
__attribute__((always_inline)) inline V simd_shuffle_up(V v, ushort delta, int line = __builtin_LINE()) {
  return EMU_SIMD_OP(SHUFFLE_UP, v, delta, line);
}
template <class V>
__attribute__((always_inline)) inline V simd_broadcast_first(V v, int line = __builtin_LINE()) {
  return EMU_SIMD_OP(BROADCAST_FIRST, v, 0, line);
}
__attribute__((always_inline)) inline bool simd_all(bool v, int line = __builtin_LINE()) { return EMU_SIMD_OP(ALL, v, 0, line); }
__attribute__((always_inline)) inline bool simd_any(bool v, int line = __builtin_LINE()) { return EMU_SIMD_OP(ANY, v, 0, line); }

template <class T>
struct numeric_limits : std::numeric_limits<T> {};

template <class T>
T min(T a, T b) { return b < a ? b : a; }
template <class T>
T max(T a, T b) { return a < b ? b : a; }
template <class T>
T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T>
T select(T a, T b, bool c) { return c ? b : a; }
template <class T>
T abs(T x) { return x < T(0) ? T(-x) : x; }

#define EMU_MATH1(name, builtin) \
  inline float name(float x) { return builtin(x); } \
  inline half name(half x) { return half(builtin(float(x))); }
EMU_MATH1(exp, __builtin_expf)
EMU_MATH1(exp2, __builtin_exp2f)
EMU_MATH1(log, __builtin_logf)
EMU_MATH1(log2, __builtin_log2f)
EMU_MATH1(sqrt, __builtin_sqrtf)
EMU_MATH1(floor, __builtin_floorf)
EMU_MATH1(ceil, __builtin_ceilf)
EMU_MATH1(round, __builtin_roundf)
EMU_MATH1(rint, __builtin_rintf)
EMU_MATH1(trunc, __builtin_truncf)
EMU_MATH1(tanh, __builtin_tanhf)
EMU_MATH1(sin, __builtin_sinf)
EMU_MATH1(cos, __builtin_cosf)
#undef EMU_MATH1
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline bool isnan(float x) { return x != x; }
inline bool isinf(float x) { return x == __builtin_inff() || x == -__builtin_inff(); }
namespace precise {
using metal::exp;
using metal::log;
using metal::rsqrt;
using metal::sqrt;
}  // namespace precise
namespace fast {
using metal::exp;
using metal::log;
using metal::rsqrt;
using metal::sqrt;
}  // namespace fast

}  // namespace metal
using namespace metal;

// ---------------------------------------------------------------------------------------------
// Address spaces last, so that the standard headers above never see these macros.
#ifdef EMU_ADDRESS_SPACES
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup static __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup static
#endif
#define thread
