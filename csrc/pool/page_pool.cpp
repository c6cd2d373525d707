// PagePool: see page_pool.h for the interface. This file includes ATen's core tensor and the
// one factory it needs (and the CUDA runtime / c10 stream headers when ELASTIC_WITH_CUDA), not
// torch/extension.h, so an edit here recompiles quickly.
//
// [Note: page pool layout]
// The arena is a table of *segments*; each segment is one `at::empty` uint8 tensor on the
// pool's device (so torch's memory accounting, snapshots and OOM handling see it) cut into
// pages of `page_bytes`. A page is named by its *slot*:
//     slot = segment_index * pages_per_segment + page_index_in_segment,
// with pages_per_segment = max(1, segment_bytes / page_bytes) fixed per pool (segment_bytes is
// 64 MiB unless the caller picks another size). A new segment has
// min(pages_per_segment, (budget - reserved) / page_bytes) pages, so segments are added
// lazily, at most 64 MiB at a time (or one page, if pages are larger), and never take the
// reserved bytes past the budget. Whenever a call ends with reserved > budget (after a
// shrink), segments without live pages are given back at once. 64 MiB is large enough that torch's caching allocator
// serves each segment from one block and small enough that a shrinking budget finds whole
// segments to give back. A slot stays valid while its segment lives; a released segment's
// index is reused by the next new segment (lowest free index first), so slots stay small.
//
// Placement: a ready page is taken from the *lowest* free slot, new segments take the lowest
// free index, and a shrinking budget releases empty segments from the *highest* index down.
// Live pages therefore pack into low segments and high ones drain, which is what lets a later
// shrink find whole empty segments without moving anything ([Note: no relocation]).
//
// Every live page has a view tensor (`storage.narrow(0, i * page_bytes, page_bytes)`), made on
// first use and cached per slot: `page(slot)` and `get(key)` return the cached view, so the
// hot path creates no tensor. Views share the segment's storage: a view kept by a caller keeps
// that segment's memory alive after the pool gives the segment back (never a dangling
// pointer), so callers drop views of evicted pages (drain_evicted says which).
//
// [Note: eviction order]
// Live unpinned pages sit in one doubly linked list per priority (std::map priority -> list),
// ordered by last use, least recent at the head. Eviction takes the head of the lowest
// priority's list. A *use* (the page moves to the tail, a new tick) is: allocate, a get() hit,
// and the moment the last pin goes away (unpin / unpin_many reaching zero; lookup_pin and pin
// take the page out of the lists, so the unpin decides its place). set_priority is not a use:
// the page keeps its tick and is inserted in tick order into the other list (a walk from the
// most recent end: O(1) for recently used pages, O(pages of that priority) at worst). All other
// list operations are O(1) plus a map lookup over the few distinct priorities.
// Budget: in-use bytes never exceed the budget except by pinned pages. A shrink evicts in this
// order until in_use <= budget; if only pinned pages remain the excess is reported as
// over_budget_bytes, and each later unpin of such a page evicts again (in this order) until the
// pool is back under its budget. The evicted keys queue up, in eviction order, for
// drain_evicted().
//
// [Note: no relocation]
// A shrink gives back only segments without live pages; it never moves a live page to empty a
// segment. Moving would silently change the data behind views the runtime already holds (page
// tables, tensors saved for backward, arguments of kernels queued on other streams): after a
// move those views alias a page that the pool hands to another key, a wrong-result bug rather
// than a crash. Making moves safe would need a "moved" protocol through every holder plus a
// stream-ordered device copy exactly when memory is tightest (before an activation peak). A
// cache has a cheaper exit: an unpinned page may always be *evicted* (its chunk is re-gathered
// from the shards). So fragmentation is handled by placement (above), by releasing empty
// segments, and, when the caller asks for it with set_budget(..., evict_to_release=True), by
// evicting the live pages of whole segments until reserved <= budget: segments whose pages all
// have low priority first, then those with fewest live pages, then least recently used
// (segments holding pinned pages are never chosen). Without the flag a shrink evicts strictly in
// eviction order and reports the remaining gap as reserved_over_budget_bytes.
//
// [Note: stream-ordered reuse]
// CUDA pools follow the semantics of torch's caching allocator with record_stream, without
// per-stream free lists:
//  * A page remembers `last_stream`, the stream current when it was handed out (for a fresh
//    segment: the stream torch allocated it on). record_stream(key, s) adds other streams.
//  * free/evict of a page with recorded streams records one event on each and parks the page
//    as *pending* in one FIFO per stream (one stream's events complete in order, so polling
//    stops at the first unfinished one: no head-of-line blocking between streams, an idea
//    taken from CUDACachingAllocator's process_events). A pending page becomes free when all
//    its events completed (cudaEventQuery). allocate() polls only when no page is free, and
//    when nothing is free and the budget allows no new segment it waits on the single oldest
//    event (cudaEventSynchronize on one event: never a device or stream synchronisation).
//  * Handing a page to a stream other than its last_stream enqueues a device-side wait
//    (an event recorded now on last_stream, cudaStreamWaitEvent on the new stream), since the
//    last owner's work on last_stream was never tracked by an event. Same-stream reuse, the
//    common case, costs nothing.
//  * Giving a segment back to torch: torch will reuse the block only for allocations on the
//    stream the segment was allocated on, so that stream waits (device-side) on every other
//    stream that used a page of the segment. Segments whose pages are free or merely pending
//    can therefore be released at once, without waiting on the host.
// CPU pools skip all of this: record_stream only checks the key.
//
// [Note: locking and the GIL]
// One mutex guards all state; the communication thread and the main thread (and C++ callers)
// share the pool. The binding releases the GIL around every call, before taking the mutex, so a
// thread never waits for the mutex while holding the GIL. That matters because code run under
// the mutex may itself need the GIL: destroying a tensor whose Python object is kept alive by
// C++ does, and so can torch's allocator (memory-history recording captures Python stacks). As a
// second guard, tensors released under the mutex (segments, page views) are parked and
// destroyed only after the mutex is dropped (Guard in page_pool.h). The only blocking call made
// under the mutex is the one-event host wait of [Note: stream-ordered reuse].
// Cost: releasing the GIL and taking the mutex add ~150 ns to every call (`_impl.contains(1)`
// 243 ns vs the lock-free property `_impl.page_bytes` 91 ns, timeit, min of 5x200k, on the
// 2-core AMD EPYC dev machine, 2026-11-29); the batched calls pay it once per batch.
//
// [Note: errors leave the pool unchanged]
// Every call validates before it mutates: allocate checks the key, then whether eviction can
// make room (PoolExhausted otherwise) before evicting anything; batched calls check every key
// (and, for allocate_many, that enough pages can be found) before changing anything;
// unpin_many undoes its pin-count decrements if a later key is bad. The only partial effect is
// on a torch allocation failure inside allocate_many: pages already allocated by the call are
// freed again, pages evicted to make room stay evicted (and are reported by drain_evicted).

#include "page_pool.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <sstream>
#include <tuple>

#ifdef ELASTIC_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace elastic {
namespace {

constexpr int64_t kPageAlign = 512;

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

int64_t checked_page_bytes(int64_t page_bytes) {
  if (page_bytes <= 0 || page_bytes % kPageAlign != 0) {
    throw std::invalid_argument(cat("PagePool: page_bytes must be a positive multiple of ", kPageAlign,
                                    ", got ", page_bytes));
  }
  return page_bytes;
}

int64_t checked_pages_per_segment(int64_t page_bytes, int64_t segment_bytes) {
  if (segment_bytes <= 0) {
    throw std::invalid_argument(cat("PagePool: segment_bytes must be positive, got ", segment_bytes));
  }
  return std::max<int64_t>(1, segment_bytes / page_bytes);
}

c10::Device checked_device(const std::string& name) {
  c10::Device device(c10::kCPU);
  try {
    device = c10::Device(name);
  } catch (const std::exception&) {
    throw std::invalid_argument(cat("PagePool: cannot parse device '", name, "'"));
  }
  if (device.is_cpu()) return c10::Device(c10::kCPU);
  if (!device.is_cuda()) {
    throw std::invalid_argument(cat("PagePool: device must be cpu or cuda, got '", name, "'"));
  }
#ifdef ELASTIC_WITH_CUDA
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(cat("PagePool: device '", name, "' requested but CUDA is unusable here: ",
                                 cudaGetErrorString(err)));
  }
  int index = device.has_index() ? device.index() : c10::cuda::current_device();
  if (index < 0 || index >= count) {
    throw std::invalid_argument(cat("PagePool: device '", name, "' does not exist (", count, " CUDA devices)"));
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
#else
  throw std::invalid_argument(cat("PagePool: device '", name,
                                  "' needs the CUDA part of elastic_kernels._C, and this build has none"));
#endif
}

#ifdef ELASTIC_WITH_CUDA
void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(cat("PagePool: ", what, " failed: ", cudaGetErrorString(err)));
  }
}
#endif

}  // namespace

PagePool::PagePool(int64_t page_bytes, int64_t budget_bytes, const std::string& device, int64_t segment_bytes)
    : page_bytes_(checked_page_bytes(page_bytes)),
      pages_per_segment_(checked_pages_per_segment(page_bytes_, segment_bytes)),
      device_(checked_device(device)),
      is_cuda_(device_.is_cuda()),
      budget_(budget_bytes) {
  if (budget_bytes < page_bytes_) {
    throw std::invalid_argument(cat("PagePool: budget_bytes (", budget_bytes, ") must hold at least one page (",
                                    page_bytes_, " bytes)"));
  }
}

PagePool::~PagePool() {
  try {
    close();
  } catch (...) {
    // Destructors must not throw; at interpreter exit the CUDA driver may already be gone.
  }
}

int64_t PagePool::budget_bytes() const {
  Guard g(*this);
  return budget_;
}

bool PagePool::closed() const {
  Guard g(*this);
  return closed_;
}

void PagePool::check_open() const {
  if (closed_) throw std::runtime_error("PagePool is closed");
}

int64_t PagePool::find_slot(int64_t key, const char* op) const {
  auto it = slot_of_.find(key);
  if (it == slot_of_.end()) throw PoolKeyError(cat("PagePool.", op, ": key ", key, " is not in the pool"));
  return it->second;
}

// ---- LRU lists ([Note: eviction order]) ----

void PagePool::lru_remove(int64_t slot) {
  Page& p = page_at(slot);
  auto it = buckets_.find(p.priority);
  Bucket& b = it->second;
  if (p.prev >= 0) page_at(p.prev).next = p.next; else b.head = p.next;
  if (p.next >= 0) page_at(p.next).prev = p.prev; else b.tail = p.prev;
  p.prev = p.next = -1;
  p.in_lru = false;
  if (b.head < 0) buckets_.erase(it);
}

void PagePool::lru_push_back(int64_t slot) {
  Page& p = page_at(slot);
  p.tick = ++tick_;
  Bucket& b = buckets_[p.priority];
  p.prev = b.tail;
  p.next = -1;
  if (b.tail >= 0) page_at(b.tail).next = slot; else b.head = slot;
  b.tail = slot;
  p.in_lru = true;
}

void PagePool::lru_insert_ordered(int64_t slot) {
  Page& p = page_at(slot);
  Bucket& b = buckets_[p.priority];
  int64_t after = b.tail;
  while (after >= 0 && page_at(after).tick > p.tick) after = page_at(after).prev;
  p.prev = after;
  p.next = after >= 0 ? page_at(after).next : b.head;
  if (p.next >= 0) page_at(p.next).prev = slot; else b.tail = slot;
  if (after >= 0) page_at(after).next = slot; else b.head = slot;
  p.in_lru = true;
}

// ---- pages ----

at::Tensor PagePool::view_locked(int64_t slot) {
  Segment& seg = seg_of(slot);
  const int64_t i = slot % pages_per_segment_;
  at::Tensor& v = seg.views[i];
  if (!v.defined()) v = seg.storage.narrow(0, i * page_bytes_, page_bytes_);
  return v;
}

void PagePool::pin_locked(int64_t slot) {
  Page& p = page_at(slot);
  if (p.pins == 0) {
    if (p.in_lru) lru_remove(slot);
    pinned_ += page_bytes_;
    ++seg_of(slot).pinned;
  }
  ++p.pins;
  p.tick = ++tick_;
}

void PagePool::unpinned_to_zero_locked(int64_t slot) {
  pinned_ -= page_bytes_;
  --seg_of(slot).pinned;
  lru_push_back(slot);
}

void PagePool::hand_out_locked(int64_t slot, int64_t key, bool pin) {
  Page& p = page_at(slot);
#ifdef ELASTIC_WITH_CUDA
  if (is_cuda_) {
    const StreamHandle cur = current_stream();
    if (p.last_stream != cur) {  // [Note: stream-ordered reuse]
      order_after(cur, p.last_stream);
      ++stream_waits_;
    }
    p.last_stream = cur;
  }
#endif
  slot_of_.emplace(key, slot);
  p.key = key;
  p.priority = 0;
  p.pins = 0;
  p.state = State::kLive;
  p.streams.clear();
  in_use_ += page_bytes_;
  peak_in_use_ = std::max(peak_in_use_, in_use_);
  ++seg_of(slot).live;
  ++allocations_;
  if (pin) pin_locked(slot); else lru_push_back(slot);
}

int64_t PagePool::obtain_slot_locked(int64_t key) {
  for (;;) {
    if (in_use_ + page_bytes_ > budget_) {
      // Over budget only pinned pages may remain, so one eviction always makes room
      // ([Note: eviction order]); nothing has changed yet if there is none to evict.
      if (!evict_one_locked()) {
        throw PoolExhaustedError(cat("PagePool: no page for key ", key, ": the budget of ", budget_, " bytes is full (",
                                     in_use_ / page_bytes_, " pages of ", page_bytes_,
                                     " bytes in use) and every page is pinned; unpin or free pages, or raise the "
                                     "budget"));
      }
      continue;
    }
    if (!free_.empty()) {
      const int64_t slot = *free_.begin();
      free_.erase(free_.begin());
      return slot;
    }
    if (pending_pages_ > 0 && poll_locked()) continue;
    if (reserved_ + page_bytes_ <= budget_) {
      add_segment_locked();
      continue;
    }
    if (pending_pages_ > 0) {
      wait_oldest_locked();
      continue;
    }
    // reserved = in_use + free + pending, so in_use + page <= budget < reserved + page with
    // nothing free or pending is impossible.
    throw std::logic_error("PagePool: internal error: no page to hand out although the budget allows one");
  }
}

bool PagePool::evict_one_locked() {
  if (buckets_.empty()) return false;
  release_page_locked(buckets_.begin()->second.head, /*evicted=*/true);
  return true;
}

void PagePool::release_page_locked(int64_t slot, bool evicted) {
  Page& p = page_at(slot);
  Segment& seg = seg_of(slot);
  if (p.in_lru) lru_remove(slot);
  slot_of_.erase(p.key);
  if (evicted) {
    evicted_.push_back(p.key);
    ++evictions_;
  }
  in_use_ -= page_bytes_;
  --seg.live;
#ifdef ELASTIC_WITH_CUDA
  if (is_cuda_ && !p.streams.empty()) {  // [Note: stream-ordered reuse]
    c10::cuda::CUDAGuard device_guard(device_.index());
    for (StreamHandle s : p.streams) {
      void* ev = acquire_event();
      cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(ev), reinterpret_cast<cudaStream_t>(s)), "cudaEventRecord");
      pending_[s].push_back(PendingEvent{++event_seq_, ev, slot, seg.gen});
      ++p.pending;
    }
    p.state = State::kPending;
    ++seg.pending;
    ++pending_pages_;
    return;
  }
#endif
  p.state = State::kFree;
  free_.insert(slot);
}

void PagePool::enforce_budget_locked() {
  while (in_use_ > budget_ && evict_one_locked()) {
  }
  settle_locked();
}

void PagePool::settle_locked() {
  if (reserved_ > budget_) release_empty_segments_locked(budget_);
}

// ---- segments ----

void PagePool::add_segment_locked() {
  const int64_t n = std::min(pages_per_segment_, (budget_ - reserved_) / page_bytes_);
  if (n < 1) throw std::logic_error("PagePool: internal error: new segment without room in the budget");
  size_t index = 0;
  while (index < segs_.size() && segs_[index].storage.defined()) ++index;
  // May throw (out of memory): nothing has been changed yet.
  at::Tensor storage = at::empty({n * page_bytes_}, at::TensorOptions().dtype(at::kByte).device(device_));
  if (index == segs_.size()) segs_.emplace_back();
  Segment& seg = segs_[index];
  seg.storage = std::move(storage);
  seg.views.assign(n, at::Tensor());
  seg.pages.assign(n, Page());
  seg.live = seg.pinned = seg.pending = 0;
  seg.stream = is_cuda_ ? current_stream() : 0;
  const int64_t base = static_cast<int64_t>(index) * pages_per_segment_;
  for (int64_t i = 0; i < n; ++i) {
    seg.pages[i].last_stream = seg.stream;
    free_.insert(free_.end(), base + i);
  }
  reserved_ += n * page_bytes_;
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  ++n_segments_;
  ++segment_allocs_;
}

void PagePool::release_segment_locked(int64_t index) {
  Segment& seg = segs_[index];
#ifdef ELASTIC_WITH_CUDA
  if (is_cuda_) {  // [Note: stream-ordered reuse]: torch reuses the block on seg.stream only
    std::vector<StreamHandle> users;
    auto add = [&](StreamHandle s) {
      if (s != seg.stream && std::find(users.begin(), users.end(), s) == users.end()) users.push_back(s);
    };
    for (const Page& p : seg.pages) {
      add(p.last_stream);
      if (p.state != State::kFree) for (StreamHandle s : p.streams) add(s);
    }
    for (StreamHandle s : users) {
      order_after(seg.stream, s);
      ++stream_waits_;
    }
  }
#endif
  const int64_t base = index * pages_per_segment_;
  free_.erase(free_.lower_bound(base), free_.lower_bound(base + pages_per_segment_));
  pending_pages_ -= seg.pending;
  reserved_ -= static_cast<int64_t>(seg.pages.size()) * page_bytes_;
  graveyard_.push_back(std::move(seg.storage));
  seg.storage = at::Tensor();
  for (at::Tensor& v : seg.views) {
    if (v.defined()) graveyard_.push_back(std::move(v));
  }
  seg.views = {};
  seg.pages = {};
  seg.live = seg.pinned = seg.pending = 0;
  ++seg.gen;
  --n_segments_;
  ++segment_releases_;
}

void PagePool::release_empty_segments_locked(int64_t target_reserved) {
  for (int64_t i = static_cast<int64_t>(segs_.size()) - 1; i >= 0 && reserved_ > target_reserved; --i) {
    if (segs_[i].storage.defined() && segs_[i].live == 0) release_segment_locked(i);
  }
}

void PagePool::evict_to_release_locked() {
  // [Note: no relocation]: choose whole segments, cheapest first, evict their pages, release.
  while (reserved_ > budget_) {
    int64_t best = -1;
    std::tuple<int64_t, int64_t, uint64_t> best_cost;
    for (int64_t i = 0; i < static_cast<int64_t>(segs_.size()); ++i) {
      const Segment& seg = segs_[i];
      if (!seg.storage.defined() || seg.pinned > 0 || seg.live == 0) continue;
      int64_t max_priority = INT64_MIN;
      uint64_t max_tick = 0;
      for (const Page& p : seg.pages) {
        if (p.state != State::kLive) continue;
        max_priority = std::max(max_priority, p.priority);
        max_tick = std::max(max_tick, p.tick);
      }
      auto cost = std::make_tuple(max_priority, seg.live, max_tick);
      if (best < 0 || cost < best_cost) {
        best = i;
        best_cost = cost;
      }
    }
    if (best < 0) return;
    std::vector<int64_t> victims;
    const Segment& seg = segs_[best];
    for (int64_t i = 0; i < static_cast<int64_t>(seg.pages.size()); ++i) {
      if (seg.pages[i].state == State::kLive) victims.push_back(best * pages_per_segment_ + i);
    }
    std::sort(victims.begin(), victims.end(), [&](int64_t a, int64_t b) {
      const Page& pa = page_at(a);
      const Page& pb = page_at(b);
      return std::tie(pa.priority, pa.tick) < std::tie(pb.priority, pb.tick);
    });
    for (int64_t s : victims) release_page_locked(s, /*evicted=*/true);
    release_segment_locked(best);
  }
}

// ---- CUDA events ([Note: stream-ordered reuse]) ----

StreamHandle PagePool::current_stream() const {
#ifdef ELASTIC_WITH_CUDA
  return reinterpret_cast<StreamHandle>(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
#else
  return 0;
#endif
}

void* PagePool::acquire_event() {
#ifdef ELASTIC_WITH_CUDA
  if (!spare_events_.empty()) {
    void* ev = spare_events_.back();
    spare_events_.pop_back();
    return ev;
  }
  c10::cuda::CUDAGuard device_guard(device_.index());
  cudaEvent_t ev = nullptr;
  cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  all_events_.push_back(ev);
  return ev;
#else
  throw std::logic_error("PagePool: CUDA event requested in a build without CUDA");
#endif
}

void PagePool::order_after(StreamHandle waiter, StreamHandle user) {
#ifdef ELASTIC_WITH_CUDA
  c10::cuda::CUDAGuard device_guard(device_.index());
  void* ev = acquire_event();
  cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(ev), reinterpret_cast<cudaStream_t>(user)), "cudaEventRecord");
  // The wait captures the event's state now, so the event can be re-recorded right away.
  cuda_check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(waiter), static_cast<cudaEvent_t>(ev), 0),
             "cudaStreamWaitEvent");
  spare_events_.push_back(ev);
#else
  (void)waiter;
  (void)user;
#endif
}

bool PagePool::poll_locked() {
#ifdef ELASTIC_WITH_CUDA
  bool freed = false;
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      const PendingEvent& e = queue.front();
      Segment& seg = seg_of(e.slot);
      if (seg.gen == e.gen) {  // else: the segment was released meanwhile, the entry is stale
        cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(e.event));
        if (err == cudaErrorNotReady) {
          (void)cudaGetLastError();
          break;
        }
        cuda_check(err, "cudaEventQuery");
        Page& p = page_at(e.slot);
        if (--p.pending == 0) {
          p.state = State::kFree;
          --seg.pending;
          --pending_pages_;
          free_.insert(e.slot);
          freed = true;
        }
      }
      spare_events_.push_back(e.event);
      queue.pop_front();
    }
    it = queue.empty() ? pending_.erase(it) : std::next(it);
  }
  return freed;
#else
  return false;
#endif
}

void PagePool::wait_oldest_locked() {
#ifdef ELASTIC_WITH_CUDA
  const PendingEvent* oldest = nullptr;
  for (auto& [stream, queue] : pending_) {
    while (!queue.empty() && seg_of(queue.front().slot).gen != queue.front().gen) {
      spare_events_.push_back(queue.front().event);
      queue.pop_front();
    }
    if (!queue.empty() && (oldest == nullptr || queue.front().seq < oldest->seq)) oldest = &queue.front();
  }
  if (oldest == nullptr) throw std::logic_error("PagePool: internal error: pending pages without pending events");
  cuda_check(cudaEventSynchronize(static_cast<cudaEvent_t>(oldest->event)), "cudaEventSynchronize");
  ++event_waits_;
  poll_locked();
#endif
}

void PagePool::destroy_events() noexcept {
#ifdef ELASTIC_WITH_CUDA
  if (all_events_.empty()) return;
  try {
    c10::cuda::CUDAGuard device_guard(device_.index());
    // Destroying an event that has not completed is allowed: its resources go when it does.
    for (void* ev : all_events_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(ev));
  } catch (...) {
  }
  (void)cudaGetLastError();
#endif
  all_events_.clear();
  spare_events_.clear();
}

// ---- public calls ----

at::Tensor PagePool::allocate(int64_t key, bool pin) {
  Guard g(*this);
  check_open();
  if (slot_of_.count(key)) {
    throw PoolKeyError(cat("PagePool.allocate: key ", key, " is already in the pool (free it first)"));
  }
  const int64_t slot = obtain_slot_locked(key);
  hand_out_locked(slot, key, pin);
  settle_locked();
  return view_locked(slot);
}

std::vector<int64_t> PagePool::allocate_many(const std::vector<int64_t>& keys, bool pin) {
  Guard g(*this);
  check_open();
  std::vector<int64_t> sorted(keys);
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) throw PoolKeyError(cat("PagePool.allocate_many: key ", *dup, " appears twice"));
  for (int64_t key : keys) {
    if (slot_of_.count(key)) {
      throw PoolKeyError(cat("PagePool.allocate_many: key ", key, " is already in the pool (free it first)"));
    }
  }
  // Pages of this call are pinned until it ends, so they cannot evict each other: what can be
  // found is the headroom under the budget plus the unpinned live pages.
  const int64_t n = static_cast<int64_t>(keys.size());
  const int64_t headroom = budget_ > in_use_ ? (budget_ - in_use_) / page_bytes_ : 0;
  const int64_t available = headroom + (in_use_ - pinned_) / page_bytes_;
  if (n > available) {
    throw PoolExhaustedError(cat("PagePool.allocate_many: ", n, " pages requested but only ", available,
                                 " can be found (budget ", budget_, " bytes, ", in_use_ / page_bytes_,
                                 " pages in use, ", pinned_ / page_bytes_, " pinned)"));
  }
  std::vector<int64_t> slots;
  slots.reserve(keys.size());
  try {
    for (int64_t key : keys) {
      const int64_t slot = obtain_slot_locked(key);
      hand_out_locked(slot, key, /*pin=*/true);
      slots.push_back(slot);
    }
  } catch (...) {  // [Note: errors leave the pool unchanged]: only a torch allocation failure
    for (int64_t slot : slots) {
      page_at(slot).pins = 0;
      pinned_ -= page_bytes_;
      --seg_of(slot).pinned;
      release_page_locked(slot, /*evicted=*/false);
    }
    throw;
  }
  if (!pin) {
    for (int64_t slot : slots) {
      page_at(slot).pins = 0;
      unpinned_to_zero_locked(slot);
    }
  }
  settle_locked();
  return slots;
}

at::Tensor PagePool::get(int64_t key) {
  Guard g(*this);
  check_open();
  auto it = slot_of_.find(key);
  if (it == slot_of_.end()) {
    ++misses_;
    return at::Tensor();
  }
  ++hits_;
  const int64_t slot = it->second;
  Page& p = page_at(slot);
  if (p.in_lru) {
    Bucket& b = buckets_.find(p.priority)->second;
    if (b.tail != slot) {  // move to the most recent end of its list
      lru_remove(slot);
      lru_push_back(slot);
    } else {
      p.tick = ++tick_;
    }
  } else {
    p.tick = ++tick_;
  }
  return view_locked(slot);
}

int64_t PagePool::slot(int64_t key) const {
  Guard g(*this);
  check_open();
  auto it = slot_of_.find(key);
  return it == slot_of_.end() ? -1 : it->second;
}

bool PagePool::contains(int64_t key) const {
  Guard g(*this);
  check_open();
  return slot_of_.count(key) != 0;
}

void PagePool::free(int64_t key) {
  Guard g(*this);
  check_open();
  const int64_t slot = find_slot(key, "free");
  const Page& p = page_at(slot);
  if (p.pins > 0) {
    throw std::invalid_argument(cat("PagePool.free: the page of key ", key, " is pinned (", p.pins,
                                    " pins); unpin it first"));
  }
  release_page_locked(slot, /*evicted=*/false);
  ++frees_;
  settle_locked();
}

void PagePool::free_many(const std::vector<int64_t>& keys) {
  Guard g(*this);
  check_open();
  std::vector<int64_t> slots;
  slots.reserve(keys.size());
  // Validate everything first; pins = -1 marks "listed already" (free pages have pins == 0).
  auto restore = [&] {
    for (int64_t s : slots) page_at(s).pins = 0;
  };
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = slot_of_.find(keys[i]);
    if (it == slot_of_.end()) {
      restore();
      throw PoolKeyError(cat("PagePool.free_many: key ", keys[i], " (position ", i, ") is not in the pool"));
    }
    Page& p = page_at(it->second);
    if (p.pins != 0) {
      const bool listed_twice = p.pins < 0;
      restore();
      if (listed_twice) throw PoolKeyError(cat("PagePool.free_many: key ", keys[i], " appears twice"));
      throw std::invalid_argument(cat("PagePool.free_many: the page of key ", keys[i], " (position ", i,
                                      ") is pinned; unpin it first"));
    }
    p.pins = -1;
    slots.push_back(it->second);
  }
  for (int64_t s : slots) {
    page_at(s).pins = 0;
    release_page_locked(s, /*evicted=*/false);
    ++frees_;
  }
  settle_locked();
}

void PagePool::pin(int64_t key) {
  Guard g(*this);
  check_open();
  pin_locked(find_slot(key, "pin"));
}

void PagePool::unpin(int64_t key) {
  Guard g(*this);
  check_open();
  const int64_t slot = find_slot(key, "unpin");
  Page& p = page_at(slot);
  if (p.pins == 0) throw std::invalid_argument(cat("PagePool.unpin: the page of key ", key, " is not pinned"));
  if (--p.pins == 0) {
    unpinned_to_zero_locked(slot);
    if (in_use_ > budget_) enforce_budget_locked();
  }
}

int64_t PagePool::pin_count(int64_t key) const {
  Guard g(*this);
  check_open();
  return page_at(find_slot(key, "pin_count")).pins;
}

int64_t PagePool::priority(int64_t key) const {
  Guard g(*this);
  check_open();
  return page_at(find_slot(key, "priority")).priority;
}

void PagePool::set_priority(int64_t key, int64_t priority) {
  Guard g(*this);
  check_open();
  const int64_t slot = find_slot(key, "set_priority");
  Page& p = page_at(slot);
  if (p.priority == priority) return;
  if (p.in_lru) {
    lru_remove(slot);
    p.priority = priority;
    lru_insert_ordered(slot);
  } else {
    p.priority = priority;
  }
}

void PagePool::record_stream(int64_t key, StreamHandle stream) {
  Guard g(*this);
  check_open();
  Page& p = page_at(find_slot(key, "record_stream"));
  if (!is_cuda_ || stream == p.last_stream) return;
  if (std::find(p.streams.begin(), p.streams.end(), stream) == p.streams.end()) p.streams.push_back(stream);
}

std::vector<int64_t> PagePool::lookup_pin(const std::vector<int64_t>& keys) {
  Guard g(*this);
  check_open();
  std::vector<int64_t> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = slot_of_.find(keys[i]);
    if (it == slot_of_.end()) {
      ++misses_;
      out[i] = -1;
    } else {
      ++hits_;
      pin_locked(it->second);
      out[i] = it->second;
    }
  }
  return out;
}

void PagePool::unpin_many(const std::vector<int64_t>& keys) {
  Guard g(*this);
  check_open();
  std::vector<int64_t> slots(keys.size());
  size_t i = 0;
  try {
    for (; i < keys.size(); ++i) {
      auto it = slot_of_.find(keys[i]);
      if (it == slot_of_.end()) {
        throw PoolKeyError(cat("PagePool.unpin_many: key ", keys[i], " (position ", i, ") is not in the pool"));
      }
      Page& p = page_at(it->second);
      if (p.pins == 0) {
        throw std::invalid_argument(cat("PagePool.unpin_many: the page of key ", keys[i], " (position ", i,
                                        ") is not pinned (as often as it is listed)"));
      }
      --p.pins;
      slots[i] = it->second;
    }
  } catch (...) {
    for (size_t j = 0; j < i; ++j) ++page_at(slots[j]).pins;
    throw;
  }
  for (int64_t slot : slots) {
    const Page& p = page_at(slot);
    if (p.pins == 0 && !p.in_lru) unpinned_to_zero_locked(slot);
  }
  if (in_use_ > budget_) enforce_budget_locked();
}

at::Tensor PagePool::page(int64_t slot) {
  Guard g(*this);
  check_open();
  const int64_t index = slot / pages_per_segment_;
  if (slot < 0 || index >= static_cast<int64_t>(segs_.size()) ||
      slot % pages_per_segment_ >= static_cast<int64_t>(segs_[index].pages.size())) {
    throw std::out_of_range(cat("PagePool.page: slot ", slot, " is not a page of this pool"));
  }
  if (page_at(slot).state != State::kLive) {
    throw std::out_of_range(cat("PagePool.page: slot ", slot, " holds no live page"));
  }
  return view_locked(slot);
}

std::vector<int64_t> PagePool::drain_evicted() {
  Guard g(*this);
  check_open();
  std::vector<int64_t> out;
  out.swap(evicted_);
  return out;
}

void PagePool::set_budget(int64_t budget_bytes, bool evict_to_release) {
  Guard g(*this);
  check_open();
  if (budget_bytes < page_bytes_) {
    throw std::invalid_argument(cat("PagePool.set_budget: budget_bytes (", budget_bytes,
                                    ") must hold at least one page (", page_bytes_, " bytes)"));
  }
  budget_ = budget_bytes;
  if (pending_pages_ > 0) poll_locked();
  if (evict_to_release) {
    // [Note: no relocation]: empty segments first, then whole segments, then (if pinned pages
    // kept segments alive) plain eviction order for what is still over the budget.
    release_empty_segments_locked(budget_);
    evict_to_release_locked();
  }
  enforce_budget_locked();
}

int64_t PagePool::trim() {
  Guard g(*this);
  check_open();
  if (pending_pages_ > 0) poll_locked();
  const int64_t before = reserved_;
  release_empty_segments_locked(0);
  return before - reserved_;
}

PoolStats PagePool::stats() const {
  Guard g(*this);
  PoolStats s;
  s.page_bytes = page_bytes_;
  s.budget_bytes = budget_;
  s.reserved_bytes = reserved_;
  s.in_use_bytes = in_use_;
  s.pinned_bytes = pinned_;
  s.pending_bytes = pending_pages_ * page_bytes_;
  s.free_bytes = static_cast<int64_t>(free_.size()) * page_bytes_;
  s.peak_in_use_bytes = peak_in_use_;
  s.peak_reserved_bytes = peak_reserved_;
  s.over_budget_bytes = std::max<int64_t>(0, in_use_ - budget_);
  s.reserved_over_budget_bytes = std::max<int64_t>(0, reserved_ - budget_);
  s.segments = n_segments_;
  s.pages = static_cast<int64_t>(slot_of_.size());
  s.hits = hits_;
  s.misses = misses_;
  s.evictions = evictions_;
  s.allocations = allocations_;
  s.frees = frees_;
  s.segment_allocs = segment_allocs_;
  s.segment_releases = segment_releases_;
  s.event_waits = event_waits_;
  s.stream_waits = stream_waits_;
  return s;
}

void PagePool::reset_peak() {
  Guard g(*this);
  peak_in_use_ = in_use_;
  peak_reserved_ = reserved_;
}

void PagePool::reset_counters() {
  Guard g(*this);
  hits_ = misses_ = evictions_ = allocations_ = frees_ = 0;
  segment_allocs_ = segment_releases_ = event_waits_ = stream_waits_ = 0;
}

std::vector<SegmentInfo> PagePool::snapshot() const {
  Guard g(*this);
  check_open();
  std::vector<SegmentInfo> out;
  for (size_t i = 0; i < segs_.size(); ++i) {
    const Segment& seg = segs_[i];
    if (!seg.storage.defined()) continue;
    SegmentInfo info;
    info.index = static_cast<int64_t>(i);
    info.pages = static_cast<int64_t>(seg.pages.size());
    info.live = seg.live;
    info.pinned = seg.pinned;
    info.pending = seg.pending;
    info.bytes = info.pages * page_bytes_;
    info.data_ptr = reinterpret_cast<int64_t>(seg.storage.data_ptr());
    out.push_back(info);
  }
  return out;
}

std::vector<int64_t> PagePool::keys() const {
  Guard g(*this);
  check_open();
  std::vector<int64_t> out;
  out.reserve(slot_of_.size());
  for (const auto& kv : slot_of_) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

int64_t PagePool::size() const {
  Guard g(*this);
  return static_cast<int64_t>(slot_of_.size());
}

void PagePool::close() {
  Guard g(*this);
  if (closed_) return;
  for (int64_t i = 0; i < static_cast<int64_t>(segs_.size()); ++i) {
    if (segs_[i].storage.defined()) release_segment_locked(i);
  }
  segs_.clear();
  slot_of_.clear();
  buckets_.clear();
  free_.clear();
  evicted_.clear();
  pending_.clear();  // their events are in all_events_
  in_use_ = pinned_ = 0;
  pending_pages_ = 0;
  closed_ = true;
  destroy_events();
}

}  // namespace elastic
