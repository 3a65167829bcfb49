// fakegpu: a PrivateUse1 backend for CPU-only tests (built by tests/fakedevice/__init__.py).
//
// Tensors live in host memory but carry a device "fakegpu:N", so every rule a GPU
// enforces (same device for all operands, no NumPy view, explicit copies both ways) fails
// here as it would on CUDA, while the arithmetic is exactly torch's CPU kernels.
//
// Pieces:
//   - devices (PSTAR_FAKEGPU_DEVICES, default 2) with a per-thread current device;
//   - streams and events: a default stream per device that runs everything at once, and
//     new streams on which copies wait until something waits for them (see [Note: streams]);
//   - an allocator per device that counts live and peak bytes against a capacity
//     (memory_allocated, mem_get_info, OutOfMemoryError);
//   - pinned host memory: a caching power-of-two allocator (pin_memory()) and registered
//     host ranges (host_register, as cudaHostRegister);
//   - the few kernels a backend must own (empty, copies, views, resize_, set_, record_stream);
//   - a boxed fallback for every other op: check devices, alias each fakegpu tensor as a
//     CPU tensor sharing its memory, run the CPU kernel, turn CPU results back into
//     fakegpu tensors (views stay views, fresh results are copied);
//   - ops whose CompositeExplicitAutograd kernel would beat the fallback (layer norm, ...)
//     and scaled_dot_product_attention's kernel choice are sent to the CPU kernels too, so
//     a fakegpu run is bitwise a CPU run;
//   - autocast with CUDA's op policy;
//   - device guard, hooks (generator, pinned host memory, storage resize) and an RNG;
//   - FakeNcclBackend: a c10d Backend whose collectives are implemented in Python
//     (tests/fakedevice/fakenccl.py), because c10d::Backend cannot be subclassed there.
//
// [Note: streams] Stream 0 of each device is the default stream: work on it runs when it
// is issued. A copy (`_copy_from`, either side on fakegpu) issued while another stream is
// current is queued on that stream instead, and runs only when something waits for it:
// an event recorded after it is synchronized or waited on (wait_event, wait_stream), the
// stream or the device is synchronized, a blocking host copy or any other op is issued on
// that same stream (stream order), or, with a modeled link, an event after it is queried
// once the copy's time has passed. Nothing else runs it: a reader that forgot to wait
// sees the old bytes, as it could on a GPU. As on CUDA, a blocking copy with a host side
// runs at once (after the stream's queue), a device-to-device one is queued. Fakegpu
// memory a queued copy uses stays allocated until the copy ran; if its tensor is dropped
// before (a block allocated on another stream, without record_stream on the copy's
// stream), that is a hazard on a GPU (the caching allocator may hand the block out
// again): counted (stream_hazards), not raised, and the memory is still kept.
//
// [Note: a modeled link] Off by default, copies between host and device cost nothing
// here. With a link set (set_link, or PSTAR_FAKEGPU_LINK="H2D_GBps,D2H_GBps,latency_us")
// each direction has a copy engine, as PCIe has: a copy takes latency + bytes / bandwidth
// of wall time on its direction's engine, after the copies issued before it in that
// direction and the copies queued before it on its stream (streams order their work; the
// two directions overlap when on two streams). Compute is the real CPU. A copy queued on a
// side stream is given the time it would be done when issued; whoever waits for it
// sleeps until then (not at all if the host computed meanwhile), and only then are its
// bytes written (so a missing wait still reads old bytes). A copy that runs at once
// (blocking, or on the default stream, where the compute stream would wait for it)
// makes the host sleep until it is done. link_stats() counts, per direction, bytes, the
// engine time issued and the time the host slept waiting: the copy time not hidden.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace {

constexpr auto kFake = c10::DeviceType::PrivateUse1;

bool is_fake(const at::Tensor& t) {
  return t.defined() && t.device().type() == kFake;
}

// ---------------------------------------------------------------------------------------
// Devices: how many (PSTAR_FAKEGPU_DEVICES, checked by load()), and the current one,
// per thread as CUDA's
// ---------------------------------------------------------------------------------------

constexpr int kMaxDevices = 16;

c10::DeviceIndex device_count() {
  static const c10::DeviceIndex n = [] {
    const char* env = std::getenv("PSTAR_FAKEGPU_DEVICES");
    const long v = env ? std::strtol(env, nullptr, 10) : 2;
    return static_cast<c10::DeviceIndex>(v >= 1 && v <= kMaxDevices ? v : 2);
  }();
  return n;
}

thread_local c10::DeviceIndex t_device = 0;
// the current stream of each device, per thread as CUDA's; 0 is the default stream
thread_local std::array<c10::StreamId, kMaxDevices> t_stream{};

c10::DeviceIndex check_index(c10::DeviceIndex i) {
  TORCH_CHECK(
      i >= 0 && i < device_count(), "fakegpu: invalid device ordinal ", static_cast<int>(i),
      " (", static_cast<int>(device_count()), " devices; PSTAR_FAKEGPU_DEVICES sets how many)");
  return i;
}

// -1 (a device without an index) is the current device
c10::DeviceIndex resolve(c10::DeviceIndex i) {
  return i < 0 ? t_device : check_index(i);
}

c10::Device fake_device(c10::DeviceIndex i) {
  return c10::Device(kFake, i);
}

std::string format_bytes(uint64_t n) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[80];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%llu bytes", static_cast<unsigned long long>(n));
  } else {
    std::snprintf(
        buf, sizeof(buf), "%.2f %s (%llu bytes)", v, units[u], static_cast<unsigned long long>(n));
  }
  return buf;
}

// ---------------------------------------------------------------------------------------
// Streams (see [Note: streams]). One lock guards the queues and the device allocator's
// blocks, because freeing a block asks whether a queued copy still uses it.
// ---------------------------------------------------------------------------------------

using StreamKey = std::pair<c10::DeviceIndex, c10::StreamId>;

StreamKey key_of(const c10::Stream& s) {
  return {resolve(s.device_index()), s.id()};
}

// A queued copy: CPU tensors over the fakegpu memory it reads or writes (non-owning) and
// the host tensors themselves (owning), plus the fakegpu blocks, kept until it ran.
struct PendingCopy {
  int64_t seq;
  at::Tensor dst;
  at::Tensor src;
  std::vector<void*> blocks;
  int64_t ready_ns = 0;  // [Note: a modeled link] when the copy is done; 0: no link
  int direction = -1;  // 0 host to device, 1 device to host, -1 neither (no link time)
  at::Tensor issued;  // [Note: a source written under a queued copy] the source as issued
};

// [Note: a source written under a queued copy] A GPU's copy engine reads a copy's source
// at some time between its issue and its event: any time, so a write to the source in
// between (a kernel on another stream, the host into pinned memory) is a race whose
// outcome depends on timing. Here the copy reads when it runs (late), which always sees
// such a write and so hides the race; so the source's bytes are kept as issued and
// compared when the copy runs, and a difference is raised, naming the copy. Not with a
// modeled link (keeping the bytes takes host time the link's timings would count).
bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return x.nbytes() == y.nbytes() && std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

struct StreamQueue {
  int64_t issued = 0;  // seq of the last copy queued (events record it)
  int64_t done = 0;  // seq of the last copy run
  std::deque<PendingCopy> pending;
  int64_t ready_ns = 0;  // [Note: a modeled link] when its last queued copy is done
};

// Process-wide state is never destroyed (as torch's allocators): a tensor may outlive
// static destruction at exit, and a queued copy may hold a pinned host tensor.
std::recursive_mutex& g_mu = *new std::recursive_mutex();
// created on first use, default streams too
std::map<StreamKey, StreamQueue>& g_queues = *new std::map<StreamKey, StreamQueue>();
c10::StreamId g_next_stream = 1;
int64_t g_hazards = 0;

bool queued_uses(const StreamQueue& q, void* block) {
  for (const auto& c : q.pending) {
    if (std::find(c.blocks.begin(), c.blocks.end(), block) != c.blocks.end()) return true;
  }
  return false;
}

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto x = reinterpret_cast<uintptr_t>(a.data_ptr());
  const auto y = reinterpret_cast<uintptr_t>(b.data_ptr());
  return x < y + b.nbytes() && y < x + a.nbytes();
}

// [Note: copies on two streams] Two streams' queued work is unordered, as on a GPU: a copy
// reading what a copy queued on another stream writes, or writing what one there reads
// or writes, races with it. Found when the second copy is issued (a wait in between
// would have run the first). On its own stream a queued write is ordered before it.
// Guarded by g_mu.
void check_unordered(StreamKey key, const at::Tensor& src, const at::Tensor& dst) {
  for (const auto& [other, q] : g_queues) {
    if (other == key) continue;
    for (const auto& c : q.pending) {
      const char* what = overlap(c.dst, src)   ? "reads what"
                         : overlap(c.dst, dst) ? "writes what"
                         : overlap(c.src, dst) ? "writes what"
                                               : nullptr;
      if (what == nullptr) continue;
      TORCH_CHECK(
          false, "fakegpu: a copy issued on stream ", key.second, " ", what,
          " a copy still queued on stream ", other.second,
          overlap(c.dst, src) || overlap(c.dst, dst) ? " writes" : " reads",
          ": a race on a GPU (make this stream wait for that copy's event first)");
    }
  }
}

// Whether a copy queued on stream `key` writes memory `t` covers (`t`'s bytes are then
// not yet final: a copy behind it reads them after that write). Guarded by g_mu.
bool queued_writes(StreamKey key, const at::Tensor& t) {
  auto it = g_queues.find(key);
  if (it == g_queues.end()) return false;
  for (const auto& c : it->second.pending) {
    if (overlap(c.dst, t)) return true;
  }
  return false;
}

void release_blocks(const std::vector<void*>& blocks);  // the allocator's, below

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// [Note: a modeled link] Guarded by g_mu.
struct LinkModel {
  double bytes_per_ns[2] = {0.0, 0.0};  // 0: no link (copies cost nothing)
  int64_t latency_ns = 0;
  int64_t free_at_ns[2] = {0, 0};  // when each direction's engine is next free
  int64_t bytes[2] = {0, 0};
  int64_t busy_ns[2] = {0, 0};  // engine time issued
  int64_t waited_ns[2] = {0, 0};  // the host asleep waiting for a copy: not hidden
  int64_t copies[2] = {0, 0};

  bool on() const {
    return bytes_per_ns[0] > 0 || bytes_per_ns[1] > 0;
  }

  // A copy of `n` bytes in `direction` issued now, behind its stream's work done at
  // `after`: when it will be done (0: it costs nothing).
  int64_t issue(int direction, int64_t n, int64_t after = 0) {
    if (direction < 0 || bytes_per_ns[direction] <= 0) return 0;
    const int64_t takes = latency_ns + static_cast<int64_t>(n / bytes_per_ns[direction]);
    const int64_t done = std::max({now_ns(), free_at_ns[direction], after}) + takes;
    free_at_ns[direction] = done;
    bytes[direction] += n;
    busy_ns[direction] += takes;
    copies[direction] += 1;
    return done;
  }

  // The host waits for a copy done at `ready` (in `direction`).
  void wait(int direction, int64_t ready) {
    if (ready <= 0) return;
    const int64_t now = now_ns();
    if (ready <= now) return;
    waited_ns[direction] += ready - now;
    std::this_thread::sleep_for(std::chrono::nanoseconds(ready - now));
  }
};

LinkModel& g_link = *new LinkModel();

// Run the copies queued on `key` up to and including `seq`, in order.
void run_until(StreamKey key, int64_t seq) {
  std::lock_guard<std::recursive_mutex> g(g_mu);
  auto it = g_queues.find(key);
  if (it == g_queues.end()) return;
  StreamQueue& q = it->second;
  at::AutoDispatchBelowADInplaceOrView no_autograd;  // autograd saw the copy when issued
  while (!q.pending.empty() && q.pending.front().seq <= seq) {
    PendingCopy& c = q.pending.front();
    g_link.wait(c.direction, c.ready_ns);  // the bytes land when the modeled copy is done
    std::exception_ptr err;
    try {
      TORCH_CHECK(
          !c.issued.defined() || same_bytes(c.src, c.issued), "fakegpu: the source of a copy (",
          c.src.nbytes(), " bytes, ", c.direction == 0 ? "host to device" : "device to host",
          ", issued on stream ", key.second,
          ") was written after the copy was issued and before it ran: a race on a GPU, where "
          "the copy may read either (record an event after the copy and wait on it first)");
      c.dst.copy_(c.src);
    } catch (...) {
      err = std::current_exception();
    }
    std::vector<void*> blocks = std::move(c.blocks);
    q.done = c.seq;
    q.pending.pop_front();
    release_blocks(blocks);  // frees those dropped while the copy was queued
    if (err) std::rethrow_exception(err);
  }
}

void run_all(StreamKey key) {
  run_until(key, std::numeric_limits<int64_t>::max());
}

void synchronize_device(c10::DeviceIndex d) {
  std::lock_guard<std::recursive_mutex> g(g_mu);
  for (auto& [key, q] : g_queues) {
    if (key.first == d) run_all(key);
  }
}

// Work issued now on the device's current stream: a non-default stream first runs what is
// queued on it (stream order).
void before_work_on(c10::DeviceIndex d) {
  if (t_stream[d] != 0) run_all({d, t_stream[d]});
}

struct FakeEvent {
  StreamKey stream{0, 0};
  int64_t seq = 0;
  std::chrono::steady_clock::time_point recorded_at;
};

bool event_done(const FakeEvent* e) {
  std::lock_guard<std::recursive_mutex> g(g_mu);
  auto it = g_queues.find(e->stream);
  return it == g_queues.end() || it->second.done >= e->seq;
}

// ---------------------------------------------------------------------------------------
// Device memory: host memory, counted per device against a capacity. Each live block
// keeps its size, device and the stream it was allocated on (for hazards).
// ---------------------------------------------------------------------------------------

constexpr int64_t kDefaultCapacity = int64_t{16} << 30;

struct Block {
  size_t nbytes;
  StreamKey stream;  // allocated while this stream was current
  std::vector<StreamKey> recorded;  // record_stream
  bool dropped = false;  // freed by its owner while a queued copy used it
};

struct FakeAllocator final : c10::DeviceAllocator {
  std::unordered_map<void*, Block> blocks;  // guarded by g_mu, as the counts below
  std::array<int64_t, kMaxDevices> live{};
  std::array<int64_t, kMaxDevices> peak{};
  std::array<int64_t, kMaxDevices> capacity;

  FakeAllocator() {
    capacity.fill(kDefaultCapacity);
  }

  static void deleter(void* p);

  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex d = t_device;
    if (n == 0) return {nullptr, nullptr, &deleter, fake_device(d)};
    std::lock_guard<std::recursive_mutex> g(g_mu);
    const auto want = static_cast<int64_t>(n);
    TORCH_CHECK_WITH(
        OutOfMemoryError, live[d] + want <= capacity[d],
        "fakegpu out of memory: tried to allocate ", format_bytes(n), "; ",
        format_bytes(live[d]), " of ", format_bytes(capacity[d]), " in use on ", fake_device(d),
        " (its capacity: torch.fakegpu.set_capacity or PSTAR_FAKEGPU_CAPACITY)");
    void* p = c10::alloc_cpu(n);
    blocks.emplace(p, Block{n, {d, t_stream[d]}, {}});
    live[d] += want;
    peak[d] = std::max(peak[d], live[d]);
    return {p, p, &deleter, fake_device(d)};
  }

  void free_block(std::unordered_map<void*, Block>::iterator it) {
    live[it->second.stream.first] -= static_cast<int64_t>(it->second.nbytes);
    c10::free_cpu(it->first);
    blocks.erase(it);
  }

  // The owner dropped the block (last tensor gone, or its storage resized)
  void release(void* p) {
    if (!p) return;
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto it = blocks.find(p);
    TORCH_INTERNAL_ASSERT(it != blocks.end(), "fakegpu: freeing an unknown pointer");
    Block& b = it->second;
    for (const auto& [key, q] : g_queues) {
      if (!queued_uses(q, p)) continue;
      b.dropped = true;
      const auto& rec = b.recorded;
      if (key != b.stream && std::find(rec.begin(), rec.end(), key) == rec.end()) ++g_hazards;
    }
    if (!b.dropped) free_block(it);
  }

  void record_stream(void* p, StreamKey key) {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto it = blocks.find(p);
    if (it == blocks.end() || it->second.stream == key) return;
    auto& rec = it->second.recorded;
    if (std::find(rec.begin(), rec.end(), key) == rec.end()) rec.push_back(key);
  }

  c10::Device device_of(void* p) {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto it = blocks.find(p);
    return fake_device(it == blocks.end() ? t_device : it->second.stream.first);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &deleter;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // c10::DeviceAllocator: what torch.accelerator.memory_* and get_memory_info read
  bool initialized() override {
    return true;
  }
  void emptyCache(c10::MempoolId_t) override {}  // nothing is cached
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    record_stream(ptr.get(), key_of(stream));
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex d) override {
    d = resolve(d);
    std::lock_guard<std::recursive_mutex> g(g_mu);
    c10::CachingDeviceAllocator::DeviceStats stats;
    for (auto* s : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                    &stats.requested_bytes}) {
      auto& agg = (*s)[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      agg.current = live[d];
      agg.peak = peak[d];
    }
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex d) override {
    d = resolve(d);
    std::lock_guard<std::recursive_mutex> g(g_mu);
    peak[d] = live[d];
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex d) override {
    d = resolve(d);
    std::lock_guard<std::recursive_mutex> g(g_mu);
    const int64_t free = std::max<int64_t>(capacity[d] - live[d], 0);
    return {static_cast<size_t>(free), static_cast<size_t>(capacity[d])};
  }
};

FakeAllocator& g_alloc = *new FakeAllocator();
void FakeAllocator::deleter(void* p) {
  g_alloc.release(p);
}
// what c10::GetAllocator(PrivateUse1) returns (torch.UntypedStorage(n, device=...), ...)
REGISTER_ALLOCATOR(kFake, &g_alloc)

// After a copy ran: free the blocks dropped meanwhile that no other queued copy uses.
void release_blocks(const std::vector<void*>& blocks) {
  for (void* p : blocks) {
    auto it = g_alloc.blocks.find(p);
    if (it == g_alloc.blocks.end() || !it->second.dropped) continue;
    bool used = false;
    for (const auto& [key, q] : g_queues) used = used || queued_uses(q, p);
    if (!used) g_alloc.free_block(it);
  }
}

// ---------------------------------------------------------------------------------------
// Pinned host memory. pin_memory() / torch.empty(pin_memory=True) take blocks from a
// caching allocator shaped like torch's CUDA host allocator: each request rounded up to a
// power of two, freed blocks kept for reuse, never returned to the system. host_register
// page-locks a range of ordinary host memory, as cudaHostRegister. is_pinned() is true
// inside either.
// ---------------------------------------------------------------------------------------

struct PinnedBlock {
  size_t held;  // rounded size
  size_t requested;
  bool live;
};

struct PinnedMemory final : c10::Allocator {
  std::mutex mu;
  std::map<uintptr_t, PinnedBlock> blocks;  // every block taken from the system
  std::unordered_map<size_t, std::vector<void*>> cached;  // free blocks by rounded size
  std::map<uintptr_t, size_t> registered;  // host_register: start -> bytes
  int64_t requested_bytes = 0;  // live allocator blocks, as requested
  int64_t held_bytes = 0;  // every allocator block, rounded
  int64_t registered_bytes = 0;

  static void deleter(void* p);

  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &deleter, c10::Device(c10::kCPU)};
    size_t rounded = 1;
    while (rounded < n) rounded <<= 1;
    std::lock_guard<std::mutex> g(mu);
    void* p;
    auto& free_list = cached[rounded];
    if (!free_list.empty()) {
      p = free_list.back();
      free_list.pop_back();
    } else {
      p = c10::alloc_cpu(rounded);
      held_bytes += static_cast<int64_t>(rounded);
    }
    blocks[reinterpret_cast<uintptr_t>(p)] = {rounded, n, true};
    requested_bytes += static_cast<int64_t>(n);
    return {p, p, &deleter, c10::Device(c10::kCPU)};
  }

  void release(void* p) {
    if (!p) return;
    std::lock_guard<std::mutex> g(mu);
    PinnedBlock& b = blocks.at(reinterpret_cast<uintptr_t>(p));
    b.live = false;
    requested_bytes -= static_cast<int64_t>(b.requested);
    cached[b.held].push_back(p);
  }

  template <typename Map, typename SizeOf>
  static bool overlaps(const Map& m, uintptr_t start, size_t n, SizeOf size_of) {
    auto it = m.lower_bound(start + n);  // first range starting at or after the end
    if (it == m.begin()) return false;
    --it;
    return it->first + size_of(it->second) > start;
  }

  bool contains(const void* ptr) {
    std::lock_guard<std::mutex> g(mu);
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    return ptr && (overlaps(registered, p, 1, [](size_t n) { return n; }) ||
                   overlaps(blocks, p, 1, [](const PinnedBlock& b) { return b.held; }));
  }

  void host_register(uintptr_t p, size_t n) {
    TORCH_CHECK(p != 0 && n > 0, "fakegpu host_register: invalid range (cudaErrorInvalidValue)");
    std::lock_guard<std::mutex> g(mu);
    TORCH_CHECK(
        !overlaps(registered, p, n, [](size_t m) { return m; }) &&
            !overlaps(blocks, p, n, [](const PinnedBlock& b) { return b.held; }),
        "fakegpu host_register: ", n, " bytes at 0x", std::hex, p,
        " overlap memory already page-locked (cudaErrorHostMemoryAlreadyRegistered)");
    registered[p] = n;
    registered_bytes += static_cast<int64_t>(n);
    // cudaHostRegister makes every page of the range resident to lock it: so does this,
    // writing each page's first byte back (nothing else writes the range while it is
    // being registered), so a process's resident memory grows as it would on a GPU host
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    volatile char* bytes = reinterpret_cast<volatile char*>(p);
    for (uintptr_t at = 0; at < n; at += page - ((p + at) % page)) bytes[at] = bytes[at];
  }

  // A copy's host side must lie inside one page-locked range when it touches any: CUDA
  // answers a copy that runs past the end of its registration (into the next one, say)
  // with cudaErrorInvalidValue. Seen on an H200: chunks of a pool locked in slices, a
  // chunk straddling two slices.
  void check_copy_range(const at::Tensor& t) {
    if (!t.is_cpu() || !t.is_contiguous() || t.numel() == 0) return;
    const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
    const auto n = static_cast<size_t>(t.numel()) * t.element_size();
    std::lock_guard<std::mutex> g(mu);
    auto it = registered.upper_bound(start);  // the first range starting after `start`
    const bool starts_inside = it != registered.begin() &&
                               std::prev(it)->first + std::prev(it)->second > start;
    const bool inside = starts_inside && std::prev(it)->first + std::prev(it)->second >= start + n;
    const bool touches = starts_inside || (it != registered.end() && it->first < start + n);
    TORCH_CHECK(
        inside || !touches, "fakegpu: a copy of ", n, " host bytes at 0x", std::hex, start,
        " runs outside the page-locked range it touches (cudaErrorInvalidValue)");
  }

  void host_unregister(uintptr_t p) {
    std::lock_guard<std::mutex> g(mu);
    auto it = registered.find(p);
    TORCH_CHECK(
        it != registered.end(), "fakegpu host_unregister: 0x", std::hex, p,
        " is not the start of a registered range (cudaErrorHostMemoryNotRegistered)");
    registered_bytes -= static_cast<int64_t>(it->second);
    registered.erase(it);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &deleter;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

PinnedMemory& g_pinned = *new PinnedMemory();
void PinnedMemory::deleter(void* p) {
  g_pinned.release(p);
}

// ---------------------------------------------------------------------------------------
// Random numbers: each device has its own generator state (as CUDA does), kept in a CPU
// generator so torch's CPU kernels can use it.
// ---------------------------------------------------------------------------------------

struct FakeGeneratorImpl final : c10::GeneratorImpl {
  at::Generator inner;  // a CPUGeneratorImpl

  explicit FakeGeneratorImpl(
      c10::DeviceIndex d, at::Generator cpu = at::detail::createCPUGenerator())
      : c10::GeneratorImpl(fake_device(d), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        inner(std::move(cpu)) {}

  void set_current_seed(uint64_t seed) override {
    inner.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    inner.set_offset(offset);
  }
  uint64_t get_offset() const override {
    return inner.get_offset();
  }
  uint64_t current_seed() const override {
    return inner.current_seed();
  }
  uint64_t seed() override {
    return inner.seed();
  }
  void set_state(const c10::TensorImpl& state) override {
    inner.unsafeGetGeneratorImpl()->set_state(state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return inner.unsafeGetGeneratorImpl()->get_state();
  }

 private:
  FakeGeneratorImpl* clone_impl() const override {
    return new FakeGeneratorImpl(device().index(), inner.clone());
  }
};

const at::Generator& default_generator(c10::DeviceIndex d) {
  static const std::vector<at::Generator> gens = [] {
    std::vector<at::Generator> out;
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      out.push_back(at::make_generator<FakeGeneratorImpl>(i));
    }
    return out;
  }();
  return gens[resolve(d)];
}

FakeGeneratorImpl* fake_gen(const at::Generator& g) {
  return static_cast<FakeGeneratorImpl*>(g.unsafeGetGeneratorImpl());
}

// ---------------------------------------------------------------------------------------
// Hooks and device guard
// ---------------------------------------------------------------------------------------

void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes) {
  // resize_bytes_cpu allocates with the storage's own allocator (ours, on the current
  // device: the storage's) and memcpy's
  c10::DeviceGuard guard(storage->device());
  at::native::resize_bytes_cpu(storage, nbytes);
}

struct FakeHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return device_count();
  }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    t_device = check_index(d);
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return t_device;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    const c10::DeviceIndex old = t_device;
    if (d >= 0) t_device = check_index(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override {
    return exchangeDevice(d);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex d) const override {
    return default_generator(d);
  }
  at::Generator getNewGenerator(c10::DeviceIndex d) const override {
    return at::make_generator<FakeGeneratorImpl>(resolve(d));
  }
  at::Device getDeviceFromPtr(void* p) const override {
    return g_alloc.device_of(p);
  }
  bool isPinnedPtr(const void* data) const override {
    return g_pinned.contains(data);
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return &g_pinned;
  }
  // untyped_storage().resize_(n) on a fakegpu storage lands here
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), nbytes);
  }
};

struct RegisterHooks {
  RegisterHooks() {
    at::RegisterPrivateUse1HooksInterface(new FakeHooks());
  }
} g_register_hooks;

// Devices, streams and events (see [Note: streams]) as torch's generic stream and event
// machinery (torch.Stream, torch.Event, torch.accelerator, autograd) drives them.
struct FakeGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kFake;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::DeviceIndex old = t_device;
    if (d.index() >= 0) t_device = check_index(d.index());
    return fake_device(old);
  }
  c10::Device getDevice() const override {
    return fake_device(t_device);
  }
  void setDevice(c10::Device d) const override {
    if (d.index() >= 0) t_device = check_index(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) t_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    const c10::DeviceIndex i = resolve(d.index());
    return c10::Stream(c10::Stream::UNSAFE, fake_device(i), t_stream[i]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, fake_device(resolve(d.index())));
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    const c10::DeviceIndex i = resolve(d.index());
    std::lock_guard<std::recursive_mutex> g(g_mu);
    const c10::StreamId id = g_next_stream++;
    g_queues[{i, id}];
    return c10::Stream(c10::Stream::UNSAFE, fake_device(i), id);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return getNewStream(d, 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::DeviceIndex i = resolve(s.device_index());
    const c10::Stream old(c10::Stream::UNSAFE, fake_device(i), t_stream[i]);
    t_stream[i] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count();
  }
  void record(
      void** event, const c10::Stream& s, const c10::DeviceIndex index,
      const c10::EventFlag) const override {
    TORCH_CHECK(
        index == -1 || index == s.device_index(), "Event device index ", static_cast<int>(index),
        " does not match recording stream's device index ", static_cast<int>(s.device_index()));
    auto* e = static_cast<FakeEvent*>(*event);
    if (!e) *event = e = new FakeEvent();
    std::lock_guard<std::recursive_mutex> g(g_mu);
    e->stream = key_of(s);
    e->seq = g_queues[e->stream].issued;
    e->recorded_at = std::chrono::steady_clock::now();
  }
  // `stream` waits for the event: what is queued up to it runs now (no concurrency here)
  void block(void* event, const c10::Stream& s) const override {
    const auto* e = static_cast<const FakeEvent*>(event);
    if (e && e->stream != key_of(s)) run_until(e->stream, e->seq);
  }
  // Done once the copies queued up to it ran; with a link, also once their modeled time
  // has passed (they land then: asking is waiting for a copy known to be done, as on a
  // GPU). Without a link a queued copy has no time of its own: it stays queued.
  bool queryEvent(void* event) const override {
    const auto* e = static_cast<const FakeEvent*>(event);
    if (!e || event_done(e)) return true;
    std::lock_guard<std::recursive_mutex> g(g_mu);
    const auto it = g_queues.find(e->stream);
    const int64_t now = now_ns();
    for (const auto& c : it->second.pending) {
      if (c.seq <= e->seq && (c.ready_ns <= 0 || c.ready_ns > now)) return false;
    }
    run_until(e->stream, e->seq);
    return true;
  }
  void synchronizeEvent(void* event) const override {
    const auto* e = static_cast<const FakeEvent*>(event);
    if (e) run_until(e->stream, e->seq);
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<FakeEvent*>(event);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    const auto* a = static_cast<const FakeEvent*>(start);
    const auto* b = static_cast<const FakeEvent*>(end);
    TORCH_CHECK(
        a && b && event_done(a) && event_done(b),
        "Both events must be recorded and completed before calculating elapsed time.");
    return std::chrono::duration<double, std::milli>(b->recorded_at - a->recorded_at).count();
  }
  bool queryStream(const c10::Stream& s) const override {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    auto it = g_queues.find(key_of(s));
    return it == g_queues.end() || it->second.pending.empty();
  }
  void synchronizeStream(const c10::Stream& s) const override {
    run_all(key_of(s));
  }
  void synchronizeDevice(const c10::DeviceIndex d) const override {
    synchronize_device(resolve(d));
  }
  void recordDataPtrOnStream(const c10::DataPtr& ptr, const c10::Stream& s) const override {
    g_alloc.record_stream(ptr.get(), key_of(s));
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGuardImpl);

// ---------------------------------------------------------------------------------------
// CPU aliases: a CPU tensor over the very memory of a fakegpu tensor
// ---------------------------------------------------------------------------------------

// One CPU storage per fakegpu storage within one call, so that CPU kernels see arguments
// that share memory as sharing a storage (overlap checks, views) exactly as the originals.
struct AliasMap {
  std::unordered_map<c10::StorageImpl*, c10::Storage> cpu_of;  // fakegpu -> CPU storage
  std::unordered_map<c10::StorageImpl*, c10::Storage> fake_of;  // CPU -> fakegpu storage

  at::Tensor alias(const at::Tensor& t) {
    const c10::Storage& st = t.storage();
    auto it = cpu_of.find(st.unsafeGetStorageImpl());
    if (it == cpu_of.end()) {
      // non-owning, not resizable: the fakegpu tensor keeps the memory alive (or, for a
      // queued copy, the allocator: see FakeAllocator::release)
      c10::Storage cpu(
          c10::Storage::use_byte_size_t(), st.nbytes(),
          c10::DataPtr(st.mutable_data(), c10::Device(c10::kCPU)), nullptr, false);
      fake_of.emplace(cpu.unsafeGetStorageImpl(), st);
      it = cpu_of.emplace(st.unsafeGetStorageImpl(), std::move(cpu)).first;
    }
    auto out = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(it->second), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
    out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    if (t.is_conj()) out._set_conj(true);
    if (t.is_neg()) out._set_neg(true);
    return out;
  }

  // A CPU result sharing an aliased storage: the same view over the fakegpu storage.
  at::Tensor unalias(const at::Tensor& cpu) {
    auto it = fake_of.find(cpu.storage().unsafeGetStorageImpl());
    if (it == fake_of.end()) return at::Tensor();
    auto out = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(it->second), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
        cpu.dtype());
    out.unsafeGetTensorImpl()->set_sizes_and_strides(
        cpu.sizes(), cpu.strides(), cpu.storage_offset());
    if (cpu.is_conj()) out._set_conj(true);
    if (cpu.is_neg()) out._set_neg(true);
    return out;
  }
};

// A fresh fakegpu tensor (on the current device) holding a copy of a CPU tensor (dense
// layouts keep their strides).
at::Tensor to_fake(const at::Tensor& cpu) {
  at::Tensor out = cpu.is_non_overlapping_and_dense()
      ? at::detail::empty_strided_generic(
            cpu.sizes(), cpu.strides(), &g_alloc,
            c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), cpu.scalar_type())
      : at::detail::empty_generic(
            cpu.sizes(), &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
            cpu.scalar_type(), std::nullopt);
  AliasMap m;
  m.alias(out).copy_(cpu);
  return out;
}

// ---------------------------------------------------------------------------------------
// Kernels a backend must own. Out-of-tree kernels get no device guard from the dispatcher:
// the ones that allocate set it to the tensor's device themselves.
// ---------------------------------------------------------------------------------------

at::Tensor fake_empty(
    c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
    std::optional<at::Device> device, std::optional<bool>,
    std::optional<at::MemoryFormat> fmt) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(
      size, &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype), fmt);
}

at::Tensor fake_empty_strided(
    c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
    std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(
      size, stride, &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
}

// dst.copy_(self) with both sides CPU aliases or host tensors: CPU copy_ handles dtype
// casts, broadcasting and any strides.
void copy_now(const at::Tensor& self, const at::Tensor& dst) {
  AliasMap m;
  at::Tensor src = is_fake(self) ? m.alias(self) : self;
  at::Tensor out = is_fake(dst) ? m.alias(dst) : dst;
  out.copy_(src);
}

// dst.copy_(self) where either side is on fakegpu (CPU<->fakegpu, fakegpu<->fakegpu). As
// on CUDA it belongs to the current stream of the device side (the source's, device to
// device); on a stream other than the default one it is queued ([Note: streams]), except a
// blocking copy with a host side, which CUDA runs and then synchronizes the stream.
at::Tensor fake_copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  for (const auto* t : {&self, &dst}) {
    TORCH_CHECK(
        t->is_cpu() || is_fake(*t), "fakegpu: copy between ", self.device(), " and ",
        dst.device(), " is not supported");
  }
  const c10::DeviceIndex d = (is_fake(self) ? self : dst).device().index();
  const StreamKey key{d, t_stream[d]};
  const bool host_side = !is_fake(self) || !is_fake(dst);
  const int direction = !host_side ? -1 : (is_fake(dst) ? 0 : 1);
  const int64_t nbytes = dst.numel() * static_cast<int64_t>(dst.element_size());
  for (const auto* t : {&self, &dst}) g_pinned.check_copy_range(*t);
  if (key.second == 0 || (host_side && !non_blocking)) {
    if (key.second != 0) run_all(key);
    {
      std::lock_guard<std::recursive_mutex> g(g_mu);
      g_link.wait(direction, g_link.issue(direction, nbytes));  // the host waits it out
    }
    copy_now(self, dst);
    return dst;
  }
  TORCH_CHECK(
      at::is_expandable_to(self.sizes(), dst.sizes()), "fakegpu: cannot copy a tensor of shape ",
      self.sizes(), " into one of shape ", dst.sizes());
  AliasMap m;
  PendingCopy c{0, is_fake(dst) ? m.alias(dst) : dst, at::Tensor(), {}};
  if (is_fake(self)) {
    c.src = m.alias(self);
  } else if (g_pinned.contains(self.storage().data())) {
    c.src = self;  // read when the copy runs, as a DMA from page-locked memory would
  } else {
    c.src = self.clone(at::MemoryFormat::Preserve);  // CUDA stages pageable memory at once
  }
  std::lock_guard<std::recursive_mutex> g(g_mu);
  check_unordered(key, c.src.is_same(self) || is_fake(self) ? c.src : at::Tensor(), c.dst);
  // (not with a modeled link: the copy of the source would delay the copy's issue, and
  // the link's timings are what such a run measures)
  if ((c.src.is_same(self) || is_fake(self)) && !g_link.on() && !queued_writes(key, c.src)) {
    c.issued = c.src.clone(at::MemoryFormat::Contiguous);  // as its writers left it
  }
  for (const auto* t : {&self, &dst}) {
    if (is_fake(*t) && t->storage().data()) c.blocks.push_back(t->storage().mutable_data());
  }
  StreamQueue& q = g_queues[key];
  c.seq = ++q.issued;
  c.direction = direction;
  c.ready_ns = g_link.issue(direction, nbytes, q.ready_ns);  // in stream order
  q.ready_ns = std::max(q.ready_ns, c.ready_ns);
  q.pending.push_back(std::move(c));
  return dst;
}

const at::Tensor& fake_resize_(
    const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> fmt) {
  // grows the storage through its allocator (ours, on the tensor's device) when needed
  c10::DeviceGuard guard(self.device());
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), size, std::nullopt);
  if (fmt.has_value()) {
    TORCH_CHECK(*fmt != at::MemoryFormat::Preserve, "unsupported memory format ", *fmt);
    self.unsafeGetTensorImpl()->empty_tensor_restride(*fmt);
  }
  return self;
}

at::Tensor fake_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return fake_copy_from(self, dst, false);
}

at::Tensor& fake_set_storage(
    at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
    c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& fake_set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return fake_set_storage(self, std::move(source), 0, {n}, {});
}

at::Tensor& fake_set_source_tensor(at::Tensor& self, const at::Tensor& src) {
  return fake_set_storage(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}

at::Tensor& fake_set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, &g_alloc, true);
  return fake_set_storage(self, std::move(st), 0, {0}, {});
}

// tensor.record_stream(s): the block may be freed while `s` still has work queued on it
void fake_record_stream(at::Tensor& self, c10::Stream s) {
  TORCH_CHECK(
      s.device_type() == kFake && s.device_index() == self.device().index(),
      "record_stream: the stream is on ", s.device(), ", the tensor on ", self.device());
  if (self.storage().data()) g_alloc.record_stream(self.storage().mutable_data(), key_of(s));
}

// `param.data = t` across CPU and fakegpu: allowed between dense CPU and CUDA tensors, so
// allowed here too (torch's own check only knows the built-in dense backends).
bool fake_has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](c10::DispatchKeySet ks) {
    return ks.has(c10::DispatchKey::Dense) &&
        ks.has_any(c10::DispatchKeySet(
            {c10::BackendComponent::CPUBit, c10::BackendComponent::PrivateUse1Bit}));
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) ||
      (dense(self.key_set()) && dense(from.key_set()));
}

// scaled_dot_product_attention asks this stub which fused kernel the device has; answer
// as the CPU does, so fakegpu runs the very CPU kernel (bitwise equal to CPU) instead of
// the unfused math path torch takes for an unknown device.
int64_t fake_sdp_choice(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa) {
  AliasMap m;
  std::optional<at::Tensor> cpu_mask;
  if (mask.has_value() && mask->defined()) cpu_mask = is_fake(*mask) ? m.alias(*mask) : *mask;
  return at::_fused_sdp_choice(
      m.alias(q), m.alias(k), m.alias(v), cpu_mask, dropout_p, is_causal, scale, enable_gqa);
}
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(fake_empty));
  m.impl("empty_strided", TORCH_FN(fake_empty_strided));
  m.impl("_copy_from", TORCH_FN(fake_copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(fake_copy_from_and_resize));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("resize_", TORCH_FN(fake_resize_));
  m.impl("set_.source_Storage", TORCH_FN(fake_set_source_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(fake_set_storage));
  m.impl("set_.source_Tensor", TORCH_FN(fake_set_source_tensor));
  m.impl("set_", TORCH_FN(fake_set_empty));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(fake_has_compatible_shallow_copy_type));
  m.impl("record_stream", TORCH_FN(fake_record_stream));
}

// ---------------------------------------------------------------------------------------
// Boxed fallback for every other op
// ---------------------------------------------------------------------------------------

// CUDA's rule: all tensors on one device, except 0-dim CPU tensors (scalars) and CPU
// index tensors in `Tensor?[] indices` (index / index_put_ move them to the device).
// Returns the device of the fakegpu tensors, or of a fakegpu device argument (factories).
std::optional<c10::Device> check_same_device(
    const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  const auto& schema = op.schema();
  std::optional<c10::Device> fake;
  const char* cpu_arg = nullptr;
  auto visit = [&](const at::Tensor& t, const std::string& name, bool cpu_ok) {
    if (!t.defined()) return;
    if (is_fake(t)) {
      if (!fake) fake = t.device();
      TORCH_CHECK(
          t.device() == *fake,
          "Expected all tensors to be on the same device, but found at least two devices, ",
          *fake, " and ", t.device(), "! (when checking argument for argument ", name,
          " in method ", schema.operator_name(), ")");
    } else if (t.is_cpu() && t.dim() > 0 && !cpu_ok) {
      if (!cpu_arg) cpu_arg = name.c_str();
    }
  };
  std::optional<c10::Device> device_arg;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& iv = args[i];
    const auto& name = schema.arguments()[i].name();
    if (iv.isTensor()) {
      visit(iv.toTensor(), name, false);
    } else if (iv.isTensorList()) {
      for (const at::Tensor& t : iv.toTensorList()) visit(t, name, false);
    } else if (iv.isOptionalTensorList()) {
      for (const std::optional<at::Tensor>& t : iv.toOptionalTensorList()) {
        if (t.has_value()) visit(*t, name, true);
      }
    } else if (iv.isDevice() && iv.toDevice().type() == kFake && !device_arg) {
      device_arg = fake_device(resolve(iv.toDevice().index()));
    }
  }
  TORCH_CHECK(
      !(fake && cpu_arg),
      "Expected all tensors to be on the same device, but found at least two devices, ", *fake,
      " and cpu! (when checking argument for argument ", cpu_arg, " in method ",
      schema.operator_name(), ")");
  return fake ? fake : device_arg;
}

// While a random op runs on the CPU, the CPU default generator holds the fakegpu state.
struct RngSwap {
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  at::Generator fake;
  at::Tensor saved;
  explicit RngSwap(c10::DeviceIndex d) : fake(default_generator(d)) {
    saved = cpu.get_state();
    cpu.set_state(fake.get_state());
  }
  ~RngSwap() {
    fake.set_state(cpu.get_state());
    cpu.set_state(saved);
  }
};

// Replace fakegpu tensors in one argument: in-place/mutable ones are aliases (the CPU
// kernel writes straight into fakegpu memory, through any view); out= ones are CPU copies
// (the kernel may resize them) copied back after the call.
struct OutCopy {
  at::Tensor fake;
  at::Tensor cpu;
};

at::Tensor convert(const at::Tensor& t, bool is_out, AliasMap& m, std::vector<OutCopy>& outs) {
  if (!is_fake(t)) return t;
  if (!is_out) return m.alias(t);
  at::Tensor cpu = m.alias(t).clone(at::MemoryFormat::Preserve);
  outs.push_back({t, cpu});
  return cpu;
}

at::Tensor convert_result(
    const at::Tensor& r, AliasMap& m, const std::vector<OutCopy>& outs,
    const std::unordered_map<c10::TensorImpl*, at::Tensor>& originals) {
  if (!r.defined() || !r.is_cpu()) return r;
  auto it = originals.find(r.unsafeGetTensorImpl());
  if (it != originals.end()) return it->second;  // returned self / out
  for (const auto& o : outs) {
    if (o.cpu.unsafeGetTensorImpl() == r.unsafeGetTensorImpl()) return o.fake;
  }
  at::Tensor view = m.unalias(r);  // a view of an input stays a view
  return view.defined() ? view : to_fake(r);
}

bool is_optional_generator(const c10::Argument& arg) {
  const auto& type = arg.type();
  return type->kind() == c10::TypeKind::OptionalType &&
      type->containedType(0)->kind() == c10::TypeKind::GeneratorType;
}

void fake_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t first = stack->size() - nargs;
  const std::optional<c10::Device> device =
      check_same_device(op, c10::ArrayRef<c10::IValue>(stack->data() + first, nargs));
  const bool has_fake = device.has_value();
  // on the op's device: fresh results are allocated there; on a non-default stream, what
  // is queued on it runs first (stream order)
  c10::OptionalDeviceGuard guard(device);
  if (has_fake) before_work_on(device->index());

  AliasMap m;
  std::vector<OutCopy> outs;
  std::unordered_map<c10::TensorImpl*, at::Tensor> originals;  // CPU alias -> fakegpu arg
  bool default_rng = false;
  for (size_t i = 0; i < nargs; ++i) {
    c10::IValue& iv = (*stack)[first + i];
    const bool is_out = schema.arguments()[i].is_out();
    if (iv.isTensor()) {
      const at::Tensor t = iv.toTensor();
      at::Tensor c = convert(t, is_out, m, outs);
      if (is_fake(t) && !is_out) originals.emplace(c.unsafeGetTensorImpl(), t);
      iv = c;
    } else if (iv.isTensorList()) {
      auto list = iv.toTensorList().copy();
      for (size_t j = 0; j < list.size(); ++j) list.set(j, convert(list.get(j), is_out, m, outs));
      iv = list;
    } else if (iv.isOptionalTensorList()) {
      auto list = iv.toOptionalTensorList().copy();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> t = list.get(j);
        if (t.has_value()) list.set(j, convert(*t, is_out, m, outs));
      }
      iv = list;
    } else if (iv.isDevice() && iv.toDevice().type() == kFake) {
      iv = c10::Device(c10::kCPU);  // factory-style ops: build on the CPU, copy below
    } else if (iv.isGenerator()) {
      const c10::Device gd = iv.toGenerator().device();
      TORCH_CHECK(
          gd.type() == kFake || !has_fake,
          "Expected a 'fakegpu' device type for generator but found '", gd, "'");
      if (gd.type() == kFake) iv = fake_gen(iv.toGenerator())->inner;
    } else if (iv.isNone() && is_optional_generator(schema.arguments()[i])) {
      default_rng = true;  // the kernel will draw from the default generator
    }
  }
  {
    // random ops without a generator argument (native_dropout) use the default one too
    if (op.hasTag(at::Tag::nondeterministic_seeded)) default_rng = true;
    std::optional<RngSwap> swap;
    if (default_rng) swap.emplace(has_fake ? device->index() : t_device);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  for (auto& o : outs) {
    if (o.fake.sizes() != o.cpu.sizes()) o.fake.resize_(o.cpu.sizes());
    copy_now(o.cpu, o.fake);
  }
  const size_t nret = schema.returns().size();
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
    c10::IValue& iv = (*stack)[i];
    if (iv.isTensor()) {
      iv = convert_result(iv.toTensor(), m, outs, originals);
    } else if (iv.isTensorList()) {
      auto list = iv.toTensorList().copy();
      for (size_t j = 0; j < list.size(); ++j) {
        list.set(j, convert_result(list.get(j), m, outs, originals));
      }
      iv = list;
    }
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fake_fallback>());
}

// torch.autocast("fakegpu"): CUDA's policy lists (matmuls/convs in lower precision, the
// numerically sensitive ops in fp32); everything else falls through.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  using namespace at;  // the policy macros spell signatures as in namespace at
#define FAKE_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define FAKE_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define FAKE_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define FAKE_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(FAKE_LOWER_PRECISION_FP)
  AT_FORALL_FP32(FAKE_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(FAKE_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(FAKE_PROMOTE)
#undef FAKE_LOWER_PRECISION_FP
#undef FAKE_FP32
#undef FAKE_FP32_SET_OPT_DTYPE
#undef FAKE_PROMOTE
}

// Ops with both a CPU kernel and a CompositeExplicitAutograd one (native_layer_norm,
// native_group_norm, ...): the composite would win over the fallback and compute
// differently from the CPU; route them to the fallback (the CPU kernel) instead, so a
// fakegpu run is bitwise a CPU run. Found at load time, so the list follows the torch
// version; returns the op names.
std::vector<std::string> route_cpu_kernels() {
  static std::unique_ptr<torch::Library> lib;
  static std::vector<std::string> routed;
  if (lib) return routed;
  lib = std::make_unique<torch::Library>(
      torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    std::string full = name.name.substr(6);
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fake_fallback>());
    routed.push_back(full);
  }
  return routed;
}

// The kernels registered above by name; every other op goes through the fallback.
const std::vector<std::string> kKernels = {
    "empty.memory_format",
    "empty_strided",
    "_copy_from",
    "_copy_from_and_resize",
    "view",
    "as_strided",
    "_reshape_alias",
    "resize_",
    "set_.source_Storage",
    "set_.source_Storage_storage_offset",
    "set_.source_Tensor",
    "set_",
    "_has_compatible_shallow_copy_type",
    "record_stream",
};

// ---------------------------------------------------------------------------------------
// c10d backend: forwards each collective to a Python object (fakenccl.py)
// ---------------------------------------------------------------------------------------

namespace py = pybind11;

std::string op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    default:
      return "UNSUPPORTED";
  }
}

// A collective's Work whose isCompleted() asks fakenccl (`poll`): done once its gloo work
// is, as an NCCL work is once the device has run it (a caller may then wait without a
// stall). wait() and the future are the Python work's.
class PolledWork final : public c10d::Work {
 public:
  PolledWork(c10::intrusive_ptr<c10d::Work> work, py::object poll)
      : work_(std::move(work)), poll_(std::move(poll)) {}

  ~PolledWork() override {
    if (!Py_IsInitialized()) {
      poll_.release();  // after interpreter shutdown: leak rather than touch Python
      return;
    }
    py::gil_scoped_acquire gil;
    poll_ = py::object();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    return work_->wait(timeout);
  }
  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return poll_().cast<bool>();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return work_->getFuture();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  py::object poll_;
};

class FakeNcclBackend final : public c10d::Backend {
 public:
  FakeNcclBackend(int rank, int size, py::object impl)
      : c10d::Backend(rank, size), impl_(std::move(impl)) {}

  ~FakeNcclBackend() override {
    if (!Py_IsInitialized()) {
      impl_.release();  // after interpreter shutdown: leak rather than touch Python
      return;
    }
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  const std::string getBackendName() const override {
    return "fakenccl";
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& o) override {
    return call("allreduce", tensors, op_name(o.reduceOp));
  }
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& o) override {
    return call("broadcast", tensors, o.rootRank);
  }
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& o) override {
    return call("reduce", tensors, o.rootRank, op_name(o.reduceOp));
  }
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions&) override {
    return call("allgather", outputs, inputs);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) override {
    return call("allgather_base", output, input);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter", outputs, inputs, op_name(o.reduceOp));
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter_base", output, input, op_name(o.reduceOp));
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return call("barrier");
  }

 private:
  // c10d's Python bindings release the GIL before reaching a backend
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> call(const char* name, Args&&... args) {
    py::gil_scoped_acquire gil;
    py::object out = impl_.attr(name)(std::forward<Args>(args)...);
    if (py::isinstance<py::tuple>(out)) {  // (work, poll): see PolledWork
      auto pair = out.cast<py::tuple>();
      auto work = pair[0].cast<c10::intrusive_ptr<c10d::Work>>();
      return c10::make_intrusive<PolledWork>(work, py::reinterpret_borrow<py::object>(pair[1]));
    }
    return out.cast<c10::intrusive_ptr<c10d::Work>>();
  }

  py::object impl_;
};

}  // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &fake_sdp_choice)
}  // namespace at::native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using Index = c10::DeviceIndex;
  m.doc() = "fakegpu: a PrivateUse1 device in host memory, for CPU-only tests";
  // devices (an index of -1 is the current device)
  m.def("device_count", [] { return device_count(); });
  m.def("current_device", [] { return t_device; });
  m.def("set_device", [](Index d) { t_device = check_index(d); });
  m.def("exchange_device", [](Index d) {
    const Index old = t_device;
    t_device = resolve(d);
    return old;
  });
  // streams
  m.def("synchronize", [](Index d) {
    py::gil_scoped_release no_gil;
    synchronize_device(resolve(d));
  });
  m.def("current_stream", [](Index d) {
    const Index i = resolve(d);
    return c10::Stream(c10::Stream::UNSAFE, fake_device(i), t_stream[i]);
  });
  m.def("default_stream", [](Index d) {
    return c10::Stream(c10::Stream::DEFAULT, fake_device(resolve(d)));
  });
  m.def("pending_copies", [](Index d) {
    const Index i = resolve(d);
    std::lock_guard<std::recursive_mutex> g(g_mu);
    size_t n = 0;
    for (const auto& [key, q] : g_queues) n += key.first == i ? q.pending.size() : 0;
    return n;
  });
  m.def("stream_hazards", [] {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    return g_hazards;
  });
  m.def("set_link", [](double h2d_gbps, double d2h_gbps, double latency_us) {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    g_link = LinkModel();
    g_link.bytes_per_ns[0] = h2d_gbps;  // GB/s is bytes per ns
    g_link.bytes_per_ns[1] = d2h_gbps;
    g_link.latency_ns = static_cast<int64_t>(latency_us * 1000.0);
  });
  m.def("link_stats", [] {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    py::dict out;
    const char* names[2] = {"host_to_device", "device_to_host"};
    for (int i = 0; i < 2; ++i) {
      py::dict one;
      one["GBps"] = g_link.bytes_per_ns[i];
      one["copies"] = g_link.copies[i];
      one["bytes"] = g_link.bytes[i];
      one["busy_s"] = g_link.busy_ns[i] / 1e9;
      one["waited_s"] = g_link.waited_ns[i] / 1e9;
      one["free_at_s"] = g_link.free_at_ns[i] / 1e9;  // steady clock (time.monotonic)
      out[names[i]] = one;
    }
    out["latency_us"] = g_link.latency_ns / 1e3;
    return out;
  });
  // device memory
  m.def("memory_allocated", [](Index d) {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    return g_alloc.live[resolve(d)];
  });
  m.def("max_memory_allocated", [](Index d) {
    std::lock_guard<std::recursive_mutex> g(g_mu);
    return g_alloc.peak[resolve(d)];
  });
  m.def("reset_peak_memory_stats", [](Index d) { g_alloc.resetPeakStats(d); });
  m.def("mem_get_info", [](Index d) { return g_alloc.getMemoryInfo(d); });
  m.def("set_capacity", [](int64_t nbytes, Index d) {
    TORCH_CHECK(nbytes >= 0, "fakegpu: a capacity is a number of bytes >= 0, got ", nbytes);
    std::lock_guard<std::recursive_mutex> g(g_mu);
    for (Index i = 0; i < device_count(); ++i) {
      if (d < 0 || i == check_index(d)) g_alloc.capacity[i] = nbytes;
    }
  });
  // pinned host memory
  m.def("host_register", [](uintptr_t p, size_t n) { g_pinned.host_register(p, n); });
  m.def("host_unregister", [](uintptr_t p) { g_pinned.host_unregister(p); });
  m.def("pinned_bytes", [] {
    std::lock_guard<std::mutex> g(g_pinned.mu);
    return g_pinned.registered_bytes;
  });
  m.def("pinned_allocator_bytes", [] {
    std::lock_guard<std::mutex> g(g_pinned.mu);
    return g_pinned.requested_bytes;
  });
  m.def("pinned_allocator_held_bytes", [] {
    std::lock_guard<std::mutex> g(g_pinned.mu);
    return g_pinned.held_bytes;
  });
  // kernels
  m.def("registered_kernels", [] { return kKernels; });
  m.def("routed_to_cpu_kernels", [] { return route_cpu_kernels(); });
  // ATen's context answers is_pinned() only for an accelerator it has initialized (CUDA
  // is, by torch.cuda's own lazy init): initialize this one as the device is loaded
  m.def("init_context", [] { at::globalContext().lazyInitDevice(c10::DeviceType::PrivateUse1); });
  // random numbers
  m.def("get_rng_state", [](Index d) { return default_generator(d).get_state(); });
  m.def("set_rng_state", [](const at::Tensor& s, Index d) {
    at::Generator g = default_generator(d);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(s);
  });
  m.def("manual_seed", [](uint64_t seed, Index d) {
    at::Generator g = default_generator(d);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(seed);
  });
  m.def("seed", [](Index d) {
    at::Generator g = default_generator(d);
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.seed();
  });
  m.def("initial_seed", [](Index d) { return default_generator(d).current_seed(); });
  py::class_<FakeNcclBackend, c10d::Backend, c10::intrusive_ptr<FakeNcclBackend>>(
      m, "FakeNcclBackend")
      .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("impl"));
}
