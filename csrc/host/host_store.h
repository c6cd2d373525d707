// HostStore: one shared host-memory segment per node, mapped by every local rank
// (ARCHITECTURE.md, "Sources and the plan": the host store). The mechanism only: create,
// attach, pin; the per-node handshake (who creates, when the creator lets go of its fd) is
// policy and lives in python_api/host/store.py. The design notes are in host_store.cpp
// ([Note: a segment that cannot leak], [Note: the shm fallback and its window],
// [Note: reserving the pages], [Note: pinning a shared mapping]); the Python face is
// elastic_kernels/host_store.py and the binding host_store_py.cpp.
//
// This header and host_store.cpp include no torch, pybind11 or CUDA headers (the CUDA
// runtime is included by host_store.cpp only in the CUDA build), so the core compiles in
// seconds and can be used from C++ without Python.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

namespace elastic {

// An operating-system (or CUDA registration) failure on a segment: the message names the
// segment and the errno text. Python: elastic_kernels.HostStoreError (an OSError with .errno).
// Bad arguments (nbytes <= 0, a malformed handle) are std::invalid_argument (ValueError).
class HostStoreError : public std::runtime_error {
 public:
  HostStoreError(int error_code, const std::string& what) : std::runtime_error(what), error_code_(error_code) {}
  int error_code() const noexcept { return error_code_; }

 private:
  int error_code_;
};

class HostStore : public std::enable_shared_from_this<HostStore> {
 public:
  enum class Kind { kMemfd, kShm };

  // A new segment of `nbytes` bytes (zeroed, its pages reserved: [Note: reserving the pages]),
  // mapped read-write and shared; this process keeps the fd open (and, for kShm, the name
  // linked) until close_fd(), so that other processes can attach. kind: "memfd" or "shm".
  static std::shared_ptr<HostStore> create(int64_t nbytes, const std::string& kind = "memfd");
  // Map the segment that `handle` (another process's handle()) names; it must have exactly
  // `nbytes` bytes. The fd opened for it is closed as soon as it is mapped.
  static std::shared_ptr<HostStore> attach(const std::string& handle, int64_t nbytes);

  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  // "<kind>:<creator pid>:<fd>:<inode>:<name>", e.g. "memfd:4242:17:98765:elastic-hs-4242-1f2e..".
  const std::string& handle() const { return handle_; }
  const std::string& name() const { return name_; }
  std::string kind() const { return kind_ == Kind::kMemfd ? "memfd" : "shm"; }
  bool creator() const { return creator_; }
  void* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }

  // Creator only (a no-op elsewhere, and the second time): close the fd (kShm: unlink the
  // name first). Call it once every local rank has attached; from then on no other process
  // can attach, and the memory goes away with the last mapping.
  void close_fd();
  bool fd_open() const;

  // Page-lock the mapping for DMA (cudaHostRegister) on a CUDA build with a visible GPU;
  // returns whether it is pinned (false, and nothing done, on a CPU-only build or without a
  // GPU). Idempotent. unpin() undoes it (a no-op when not pinned).
  bool pin();
  void unpin();
  bool pinned() const;
  int64_t pinned_bytes() const;

  // Whether pin() can page-lock on this build and machine.
  static bool can_pin();

 private:
  HostStore() = default;

  Kind kind_ = Kind::kMemfd;
  bool creator_ = false;
  int64_t nbytes_ = 0;
  void* data_ = nullptr;
  std::string name_;
  std::string handle_;
  mutable std::mutex mu_;  // fd_ and pinned_
  int fd_ = -1;
  bool pinned_ = false;
};

}  // namespace elastic
