// emu_driver.h: loads a launch file written by emulator.py, runs the grid threadgroup by
// threadgroup (each threadgroup's threads as real OS threads), and writes the outputs back.
// Included by metal_shim.h (before the address-space macros exist).
//
// Launch file (little-endian): "MEMU", uint32 grid[3], uint32 threadgroup[3], uint32 n_buffers,
// then per buffer uint32 is_output, uint64 n_bytes, the bytes (inputs only); then uint32
// n_statics and per threadgroup variable int64 offset (from the symbol emu_anchor), uint64 size.
#pragma once

namespace emu {

// Every attribute MLX may add to a kernel signature, for one thread.
struct Attrs {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, dispatch_threads_per_threadgroup, threads_per_grid, grid_size;
  uint3 grid_origin, threadgroups_per_grid;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup;
  uint thread_execution_width, thread_index_in_quadgroup, quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

struct Run {
  uint3 grid{}, group{};
  std::vector<unsigned char*> buffers;
  std::vector<uint64_t> sizes;
  std::vector<uint32_t> is_output;
  std::vector<std::pair<int64_t, uint64_t>> statics;

  explicit Run(const char* path) {
    FILE* f = std::fopen(path, "rb");
    if (!f) fail("cannot open %s", path);
    char magic[4];
    read(f, magic, 4);
    if (std::memcmp(magic, "MEMU", 4) != 0) fail("%s is not a launch file", path);
    read(f, &grid, 12);
    read(f, &group, 12);
    uint32_t n = 0;
    read(f, &n, 4);
    for (uint32_t i = 0; i < n; i++) {
      uint32_t out = 0;
      uint64_t size = 0;
      read(f, &out, 4);
      read(f, &size, 8);
      // One exact-size allocation per buffer, so ASan sees every out-of-bounds access.
      auto* data = static_cast<unsigned char*>(std::malloc(size ? size : 1));
      if (out) {
        std::memset(data, 0xff, size);  // NaN for every float type: unwritten outputs show
      } else {
        read(f, data, size);
      }
      buffers.push_back(data);
      sizes.push_back(size);
      is_output.push_back(out);
    }
    uint32_t n_statics = 0;
    read(f, &n_statics, 4);
    for (uint32_t i = 0; i < n_statics; i++) {
      int64_t offset = 0;
      uint64_t size = 0;
      read(f, &offset, 8);
      read(f, &size, 8);
      statics.emplace_back(offset, size);
    }
    std::fclose(f);
  }

  static void read(FILE* f, void* dst, size_t n) {
    if (n && std::fread(dst, 1, n, f) != n) fail("truncated launch file");
  }

  // body(const Attrs&) calls the kernel for one thread.
  template <class Body>
  void launch(Body body, char* anchor) {
    uint3 groups{(grid.x + group.x - 1) / group.x, (grid.y + group.y - 1) / group.y,
                 (grid.z + group.z - 1) / group.z};
    for (uint gz = 0; gz < groups.z; gz++) {
      for (uint gy = 0; gy < groups.y; gy++) {
        for (uint gx = 0; gx < groups.x; gx++) {
          run_group(body, anchor, groups, uint3{gx, gy, gz});
        }
      }
    }
  }

  template <class Body>
  void run_group(Body& body, char* anchor, uint3 groups, uint3 g) {
    // Metal's dispatchThreads: edge threadgroups are smaller (non-uniform threadgroups).
    uint3 size{std::min(group.x, grid.x - g.x * group.x), std::min(group.y, grid.y - g.y * group.y),
               std::min(group.z, grid.z - g.z * group.z)};
    int n = int(size.x * size.y * size.z);
    for (auto& [offset, bytes] : statics) std::memset(anchor + offset, 0xff, bytes);
    Monitor monitor(n);
    monitor.shared_memory = !statics.empty();
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (int i = 0; i < n; i++) {
      Attrs a{};
      uint3 local{uint(i) % size.x, (uint(i) / size.x) % size.y, uint(i) / (size.x * size.y)};
      a.thread_position_in_threadgroup = local;
      a.threadgroup_position_in_grid = g;
      a.thread_position_in_grid = uint3{g.x * group.x + local.x, g.y * group.y + local.y,
                                        g.z * group.z + local.z};
      a.threads_per_threadgroup = size;
      a.dispatch_threads_per_threadgroup = group;
      a.threads_per_grid = grid;
      a.grid_size = grid;
      a.grid_origin = uint3{0, 0, 0};
      a.threadgroups_per_grid = groups;
      a.thread_index_in_threadgroup = uint(i);
      a.thread_index_in_simdgroup = uint(i) % 32;
      a.simdgroup_index_in_threadgroup = uint(i) / 32;
      a.simdgroups_per_threadgroup = uint(n + 31) / 32;
      a.dispatch_simdgroups_per_threadgroup = (group.x * group.y * group.z + 31) / 32;
      a.threads_per_simdgroup = 32;
      a.thread_execution_width = 32;
      a.thread_index_in_quadgroup = uint(i) % 4;
      a.quadgroup_index_in_threadgroup = uint(i) / 4;
      a.quadgroups_per_threadgroup = uint(n + 3) / 4;
      a.dispatch_quadgroups_per_threadgroup = (group.x * group.y * group.z + 3) / 4;
      threads.emplace_back([&monitor, &body, a, i] {
        context.monitor = &monitor;
        context.index = i;
        body(a);
        thread_exit();
      });
    }
    for (auto& t : threads) t.join();
  }

  void write_outputs(const char* path) {
    FILE* f = std::fopen(path, "wb");
    if (!f) fail("cannot write %s", path);
    for (size_t i = 0; i < buffers.size(); i++) {
      if (is_output[i] && sizes[i]) std::fwrite(buffers[i], 1, sizes[i], f);
    }
    std::fclose(f);
  }
};

}  // namespace emu
