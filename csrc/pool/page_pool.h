// PagePool: the paged caching allocator behind the persistent frozen-weight pool
// (ARCHITECTURE.md: pool, page table). Fixed-size pages carved out of a few large torch
// allocations ("segments"), keyed by an int64 chosen by the runtime, evicted by
// (priority, least recently used), with a budget that may move at any time and, on CUDA,
// stream-ordered reuse. The design notes are in page_pool.cpp; the Python face is
// elastic_kernels/pool.py and the binding page_pool_py.cpp.
//
// This header stays free of CUDA and pybind11 headers so that page_pool.cpp compiles fast
// and the core can be called from C++ (the offload engine) without Python.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace elastic {

// Raised when a page is needed, the budget is full and every page is pinned.
// Python: elastic_kernels.PoolExhausted (a RuntimeError).
class PoolExhaustedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A key that must be in the pool is not, or one that must not be is. Python: KeyError.
class PoolKeyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// Other bad input is std::invalid_argument (Python ValueError), a bad slot is
// std::out_of_range (IndexError), use after close() is std::runtime_error (RuntimeError).

// A cudaStream_t as an integer (0 on CPU pools, where streams mean nothing).
using StreamHandle = std::uintptr_t;

struct PoolStats {
  int64_t page_bytes = 0;
  int64_t budget_bytes = 0;
  int64_t reserved_bytes = 0;   // bytes of all segments (what torch sees as allocated)
  int64_t in_use_bytes = 0;     // live pages
  int64_t pinned_bytes = 0;     // live pages with a pin count > 0
  int64_t free_bytes = 0;       // pages ready to hand out
  int64_t pending_bytes = 0;    // freed pages waiting for their stream events (CUDA)
  int64_t peak_in_use_bytes = 0;
  int64_t peak_reserved_bytes = 0;
  int64_t over_budget_bytes = 0;           // max(0, in_use - budget): pinned pages only
  int64_t reserved_over_budget_bytes = 0;  // max(0, reserved - budget): see [Note: no relocation]
  int64_t segments = 0;
  int64_t pages = 0;  // live pages
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions = 0;
  int64_t allocations = 0;       // pages handed out
  int64_t frees = 0;             // explicit free / free_many
  int64_t segment_allocs = 0;    // torch allocations made
  int64_t segment_releases = 0;  // torch allocations given back
  int64_t event_waits = 0;       // host waits on one stream event (CUDA)
  int64_t stream_waits = 0;      // cross-stream waits enqueued when a page changes stream (CUDA)
};

struct SegmentInfo {
  int64_t index = 0;
  int64_t pages = 0;
  int64_t live = 0;
  int64_t pinned = 0;
  int64_t pending = 0;
  int64_t bytes = 0;
  int64_t data_ptr = 0;
};

class PagePool {
 public:
  // Pages are 1-D uint8 views of exactly page_bytes (a positive multiple of 512);
  // budget_bytes >= page_bytes; device is "cpu" or "cuda:<index>"; segments hold up to
  // max(1, segment_bytes / page_bytes) pages ([Note: page pool layout]).
  static constexpr int64_t kDefaultSegmentBytes = int64_t{64} << 20;
  PagePool(int64_t page_bytes, int64_t budget_bytes, const std::string& device,
           int64_t segment_bytes = kDefaultSegmentBytes);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  int64_t page_bytes() const { return page_bytes_; }
  int64_t pages_per_segment() const { return pages_per_segment_; }
  const c10::Device& device() const { return device_; }
  int64_t budget_bytes() const;
  bool closed() const;

  // Single-key calls.
  at::Tensor allocate(int64_t key, bool pin);
  at::Tensor get(int64_t key);  // undefined tensor on a miss
  int64_t slot(int64_t key) const;  // -1 when absent; no hit/miss, no touch
  bool contains(int64_t key) const;
  void free(int64_t key);
  void pin(int64_t key);
  void unpin(int64_t key);
  int64_t pin_count(int64_t key) const;
  int64_t priority(int64_t key) const;
  void set_priority(int64_t key, int64_t priority);
  void record_stream(int64_t key, StreamHandle stream);

  // Batched calls: one lock and one Python transition for many pages.
  std::vector<int64_t> allocate_many(const std::vector<int64_t>& keys, bool pin);
  void free_many(const std::vector<int64_t>& keys);
  std::vector<int64_t> lookup_pin(const std::vector<int64_t>& keys);
  void unpin_many(const std::vector<int64_t>& keys);
  at::Tensor page(int64_t slot);

  std::vector<int64_t> drain_evicted();
  void set_budget(int64_t budget_bytes, bool evict_to_release);
  int64_t trim();  // give every segment without live pages back to torch; returns bytes
  PoolStats stats() const;
  void reset_peak();
  void reset_counters();
  std::vector<SegmentInfo> snapshot() const;
  std::vector<int64_t> keys() const;
  int64_t size() const;
  void close();

 private:
  enum class State : uint8_t { kFree, kLive, kPending };

  struct Page {
    int64_t key = 0;
    int64_t priority = 0;
    uint64_t tick = 0;   // last use; LRU order among pages of equal priority
    int64_t prev = -1;   // neighbours (slots) in the page's priority bucket
    int64_t next = -1;
    int32_t pins = 0;
    int32_t pending = 0;  // stream events still outstanding (CUDA)
    State state = State::kFree;
    bool in_lru = false;  // live and unpinned: an eviction candidate
    StreamHandle last_stream = 0;       // stream current when the page was last handed out
    std::vector<StreamHandle> streams;  // record_stream'd streams other than last_stream
  };

  struct Segment {
    at::Tensor storage;              // undefined when this index holds no segment
    std::vector<at::Tensor> views;   // page views, created on first use
    std::vector<Page> pages;
    int64_t live = 0;
    int64_t pinned = 0;   // live pages with pins > 0
    int64_t pending = 0;  // pages waiting for stream events
    uint64_t gen = 0;     // bumped on release; stale pending events are recognised by it
    StreamHandle stream = 0;  // stream current when torch allocated `storage` (CUDA)
  };

  struct Bucket {
    int64_t head = -1;  // least recently used
    int64_t tail = -1;  // most recently used
  };

  struct PendingEvent {
    uint64_t seq;
    void* event;  // cudaEvent_t
    int64_t slot;
    uint64_t gen;
  };

  // Every public method holds one of these: the lock, plus the tensors (segments, page
  // views) released meanwhile, which are destroyed only after the lock is dropped.
  // [Note: locking and the GIL] explains why.
  struct Guard {
    explicit Guard(const PagePool& p) : pool(p), lock(p.mutex_) {}
    ~Guard() { dead.swap(pool.graveyard_); }
    const PagePool& pool;
    std::vector<at::Tensor> dead;  // destroyed after `lock` (members die in reverse order)
    std::unique_lock<std::mutex> lock;
  };

  Page& page_at(int64_t slot) { return segs_[slot / pages_per_segment_].pages[slot % pages_per_segment_]; }
  const Page& page_at(int64_t slot) const {
    return segs_[slot / pages_per_segment_].pages[slot % pages_per_segment_];
  }
  Segment& seg_of(int64_t slot) { return segs_[slot / pages_per_segment_]; }

  void check_open() const;
  int64_t find_slot(int64_t key, const char* op) const;  // throws PoolKeyError
  at::Tensor view_locked(int64_t slot);
  int64_t obtain_slot_locked(int64_t key);
  void hand_out_locked(int64_t slot, int64_t key, bool pin);
  bool evict_one_locked();
  void release_page_locked(int64_t slot, bool evicted);
  void pin_locked(int64_t slot);
  void unpinned_to_zero_locked(int64_t slot);
  void enforce_budget_locked();
  void settle_locked();
  void add_segment_locked();
  void release_segment_locked(int64_t index);
  void release_empty_segments_locked(int64_t target_reserved);
  void evict_to_release_locked();
  void lru_remove(int64_t slot);
  void lru_push_back(int64_t slot);
  void lru_insert_ordered(int64_t slot);
  StreamHandle current_stream() const;
  bool poll_locked();
  void wait_oldest_locked();
  void* acquire_event();
  void order_after(StreamHandle waiter, StreamHandle user);
  void destroy_events() noexcept;

  const int64_t page_bytes_;
  const int64_t pages_per_segment_;
  const c10::Device device_;
  const bool is_cuda_;

  mutable std::mutex mutex_;
  mutable std::vector<at::Tensor> graveyard_;
  bool closed_ = false;
  int64_t budget_;
  int64_t reserved_ = 0;
  int64_t in_use_ = 0;
  int64_t pinned_ = 0;
  int64_t peak_in_use_ = 0;
  int64_t peak_reserved_ = 0;
  int64_t pending_pages_ = 0;
  int64_t n_segments_ = 0;
  uint64_t tick_ = 0;
  uint64_t event_seq_ = 0;
  int64_t hits_ = 0, misses_ = 0, evictions_ = 0, allocations_ = 0, frees_ = 0;
  int64_t segment_allocs_ = 0, segment_releases_ = 0, event_waits_ = 0, stream_waits_ = 0;

  std::vector<Segment> segs_;
  std::unordered_map<int64_t, int64_t> slot_of_;  // key -> slot of its live page
  std::map<int64_t, Bucket> buckets_;             // priority -> LRU list of unpinned pages
  std::set<int64_t> free_;                        // ready pages, lowest slot first
  std::vector<int64_t> evicted_;
  std::map<StreamHandle, std::deque<PendingEvent>> pending_;  // per-stream FIFO (CUDA)
  std::vector<void*> spare_events_;                           // cudaEvent_t, reused
  std::vector<void*> all_events_;
};

}  // namespace elastic
