// A caching CPU allocator held under a resident-memory limit: what CUDA's caching allocator
// is to device memory, for host tensors under a memory budget (docs/memory.md).
//
// Blocks of `min_bytes` and more are kept when freed and handed out again to a request of the
// same size, so a step's activations reuse the pages the last step freed instead of mapping,
// faulting in and zeroing fresh ones. Before a block is mapped fresh, cached blocks are
// released (largest first) until the process's resident size plus the new block fits under
// `limit_bytes`: the cache never lifts the process above the limit that releasing everything
// would keep it under. Smaller blocks go to the allocator that was in place before.
//
// Loaded with ctypes (memory/host_cache.py); built once per torch version with
// torch.utils.cpp_extension (C10 headers only, no Python API).
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <unordered_map>

namespace {

// The process's resident bytes now (/proc/self/statm's second field, in pages).
int64_t resident_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long size = 0, resident = 0;
  int read = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  return read == 2 ? static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE) : 0;
}

void release(void* data);

struct HostCache final : c10::Allocator {
  c10::Allocator* fallback = nullptr;  // blocks under min_bytes
  size_t min_bytes = 0;
  int64_t limit_bytes = 0;  // resident bytes the cache may not lift the process above
  std::mutex mutex;
  std::multimap<size_t, void*> free_blocks;  // size -> block
  std::unordered_map<void*, size_t> sizes;   // every block handed out, cached or live
  int64_t cached_bytes = 0;
  int64_t hits = 0, misses = 0, released = 0;

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes) return fallback->allocate(n);
    void* data = take(n);
    if (data == nullptr) {
      data = c10::alloc_cpu(n);
      std::lock_guard<std::mutex> lock(mutex);
      sizes[data] = n;
    }
    c10::profiledCPUMemoryReporter().New(data, n);  // torch.profiler's memory events
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  // A cached block of exactly n bytes, or nullptr after making room for a fresh one.
  void* take(size_t n) {
    std::multimap<size_t, void*> evicted;
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = free_blocks.find(n);
      if (it != free_blocks.end()) {
        data = it->second;
        free_blocks.erase(it);
        cached_bytes -= static_cast<int64_t>(n);
        ++hits;
        return data;
      }
      ++misses;
      // Release cached blocks, largest first, until the new block fits under the limit.
      int64_t resident = resident_bytes();
      while (!free_blocks.empty() && resident + static_cast<int64_t>(n) > limit_bytes) {
        auto largest = std::prev(free_blocks.end());
        resident -= static_cast<int64_t>(largest->first);
        cached_bytes -= static_cast<int64_t>(largest->first);
        sizes.erase(largest->second);
        evicted.insert(*largest);
        free_blocks.erase(largest);
        ++released;
      }
    }
    for (auto& block : evicted) c10::free_cpu(block.second);  // outside the lock: munmap
    return nullptr;
  }

  // Keep one of our blocks for reuse. A pointer that is not ours (raw_deallocate of a block
  // the allocator before us made: a small one, or one from before the cache was installed)
  // goes to that allocator's deleter.
  void give_back(void* data) {
    bool data_is_ours = false;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = sizes.find(data);
      if (it != sizes.end() && limit_bytes > 0) {
        c10::profiledCPUMemoryReporter().Delete(data);
        free_blocks.emplace(it->second, data);
        cached_bytes += static_cast<int64_t>(it->second);
        return;
      }
      if (it != sizes.end()) {  // paused (limit 0): nothing is kept
        c10::profiledCPUMemoryReporter().Delete(data);
        sizes.erase(it);
        ++released;
        data_is_ours = true;
      }
    }
    if (data_is_ours) {
      c10::free_cpu(data);
      return;
    }
    c10::DeleterFnPtr theirs = fallback->raw_deleter();
    (theirs != nullptr ? theirs : &c10::free_cpu)(data);
  }

  // Every cached block back to the OS.
  void empty() {
    std::multimap<size_t, void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex);
      evicted.swap(free_blocks);
      for (auto& block : evicted) sizes.erase(block.second);
      released += static_cast<int64_t>(evicted.size());
      cached_bytes = 0;
    }
    for (auto& block : evicted) c10::free_cpu(block.second);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

HostCache* cache = nullptr;  // never destroyed: tensors may outlive any scope

void release(void* data) { cache->give_back(data); }

}  // namespace

extern "C" {

// Install the cache as torch's CPU allocator (once per process; later calls change the
// limit; a limit of 0 pauses it: nothing freed is kept). Returns 1 when torch's CPU
// allocator is the cache afterwards.
int phalanx_host_cache_install(int64_t min_bytes, int64_t limit_bytes) {
  if (cache == nullptr) {
    cache = new HostCache();
    cache->fallback = c10::GetCPUAllocator();
    cache->min_bytes = static_cast<size_t>(min_bytes);
    cache->limit_bytes = limit_bytes;
    c10::SetCPUAllocator(cache, /*priority=*/1);
  } else {
    std::lock_guard<std::mutex> lock(cache->mutex);
    cache->limit_bytes = limit_bytes;
  }
  return c10::GetCPUAllocator() == cache ? 1 : 0;
}

// hits, misses, blocks released, bytes cached now.
void phalanx_host_cache_stats(int64_t* out) {
  if (cache == nullptr) {
    out[0] = out[1] = out[2] = out[3] = 0;
    return;
  }
  std::lock_guard<std::mutex> lock(cache->mutex);
  out[0] = cache->hits;
  out[1] = cache->misses;
  out[2] = cache->released;
  out[3] = cache->cached_bytes;
}

void phalanx_host_cache_empty() {
  if (cache != nullptr) cache->empty();
}

}  // extern "C"
