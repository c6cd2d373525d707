// HostStore: the shared host segment of the host tier (see host_store.h).
//
// [Note: a segment that cannot leak]
// The segment is an anonymous memfd (memfd_create, MFD_CLOEXEC): it has no name in any file
// system, so nothing can be left behind in /dev/shm. The creator ftruncates it, reserves its
// pages ([Note: reserving the pages]), seals its size (F_SEAL_SHRINK | F_SEAL_GROW, so no
// process can truncate it under another's mapping and turn reads into SIGBUS) and maps it
// MAP_SHARED. Other local processes open it through /proc/<creator pid>/fd/<fd> (a new open
// file of the same inode, allowed to a process of the same user: ptrace "read" access), map it
// and close their fd at once. Once every local rank has mapped it, the creator calls
// close_fd(): from then on the only references to the memory are the mappings, and the
// kernel frees it when the last one goes, whether its process returns, raises, or is killed by
// SIGTERM or SIGKILL. Before that moment a process that dies also takes its references with it
// (fd and mapping are both released by the kernel at exit); the only cost of a creator dying
// early is that the others cannot attach (they get an error naming the dead process).
// The handle carries the inode; attach() checks it (and the memfd's name in the /proc link),
// so an fd number that the creator closed and reused for another file is refused instead of
// mapping the wrong file.
//
// [Note: the shm fallback and its window]
// /proc/<pid>/fd of the creator cannot be opened from another PID namespace (containers that
// share a host but not a PID namespace), nor across users. kind "shm" is then used: a POSIX
// shared-memory object (shm_open, O_EXCL, mode 0600) with a recognisable, unique name
// "/elastic-hs-<creator pid>-<64 random bits>", which close_fd() unlinks (shm_unlink) as soon
// as every local rank has mapped it. Window: between shm_open in create() and that unlink, a
// SIGKILL of the creator (or of the whole job) leaves the name in /dev/shm with its memory;
// it is then removed by hand (`rm /dev/shm/elastic-hs-*`, after checking that the pid in the
// name is gone). An exception or SIGTERM does not leave it when the caller closes the store in
// its error path, as python_api/host/store.py does. The window lasts one exchange of handles
// and one barrier (milliseconds to a few seconds), not the fill.
//
// [Note: reserving the pages]
// ftruncate alone reserves nothing: a segment larger than the memory the node (or its cgroup,
// or /dev/shm's size limit for kind "shm": 64 MiB in a default Docker container) can give
// would be discovered as a SIGBUS in the middle of the fill. create() therefore fallocate()s
// the whole size, so that shortage is an error (ENOMEM / ENOSPC) at create time, naming the
// segment, before any rank has attached. Cost: the creator zeroes every page once (about
// the speed of memset), and the pages are charged to the creator's memory cgroup. On a file
// system without fallocate (EOPNOTSUPP) the reservation is skipped.
//
// [Note: pinning a shared mapping]
// pin() page-locks this process's mapping with cudaHostRegister, so that cudaMemcpyAsync from
// it is a true asynchronous DMA (from pageable memory the driver stages through its own
// pinned buffer and the copy is synchronous with the host). Every process registers its own
// mapping (a registration is per address range of one process); the physical pages are shared
// and locked as long as any registration holds them. The flag is cudaHostRegisterPortable
// rather than cudaHostRegisterDefault: with Default the range counts as pinned only for the
// context current at the call, and a rank that called pin() before selecting its device
// would copy from it as pageable memory on its own device; Portable costs nothing more.
// unpin() (and the destructor, before munmap) unregisters. The CUDA part is compiled only in
// the CUDA build (ELASTIC_WITH_CUDA); elsewhere pin() returns false and does nothing.
#include "host_store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#ifdef ELASTIC_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace elastic {
namespace {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

std::string errno_text(int err) {
  return cat(std::strerror(err), " (errno ", err, ")");
}

std::string human(int64_t n) {
  std::ostringstream os;
  os << n << " bytes";
  if (n >= (int64_t{1} << 20)) os << " (" << (n >> 20) << " MiB)";
  return os.str();
}

std::string unique_name() {
  std::random_device rd;
  uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(r));
  return cat("elastic-hs-", ::getpid(), "-", hex);
}

void check_nbytes(const char* what, int64_t nbytes) {
  if (nbytes <= 0) throw std::invalid_argument(cat(what, ": nbytes must be positive, got ", nbytes));
  if (static_cast<uint64_t>(nbytes) > static_cast<uint64_t>(SIZE_MAX / 2)) {
    throw std::invalid_argument(cat(what, ": nbytes ", nbytes, " is too large to map"));
  }
}

void close_quietly(int fd) {
  if (fd >= 0) (void)::close(fd);
}

// The memory-shortage errors of ftruncate / fallocate / mmap get a hint.
std::string hint(int err) {
  if (err == ENOMEM || err == ENOSPC) return "; not enough free memory (or cgroup / /dev/shm limit) for the segment";
  if (err == EACCES || err == EPERM) return "; permission denied (another user, or a PID namespace without access)";
  return "";
}

struct ParsedHandle {
  HostStore::Kind kind;
  long pid;
  int fd;
  unsigned long long ino;
  std::string name;
};

ParsedHandle parse_handle(const std::string& handle) {
  auto bad = [&](const char* why) {
    return std::invalid_argument(cat("HostStore.attach: malformed handle '", handle, "' (", why,
                                     "; expected '<memfd|shm>:<pid>:<fd>:<inode>:<name>', as handle() returns)"));
  };
  std::vector<std::string> parts;
  size_t start = 0;
  for (int i = 0; i < 4; ++i) {
    size_t colon = handle.find(':', start);
    if (colon == std::string::npos) throw bad("too few fields");
    parts.push_back(handle.substr(start, colon - start));
    start = colon + 1;
  }
  parts.push_back(handle.substr(start));
  ParsedHandle h{};
  if (parts[0] == "memfd") {
    h.kind = HostStore::Kind::kMemfd;
  } else if (parts[0] == "shm") {
    h.kind = HostStore::Kind::kShm;
  } else {
    throw bad("unknown kind");
  }
  try {
    size_t used = 0;
    h.pid = std::stol(parts[1], &used);
    if (used != parts[1].size() || h.pid <= 0) throw bad("bad pid");
    h.fd = std::stoi(parts[2], &used);
    if (used != parts[2].size() || h.fd < 0) throw bad("bad fd");
    h.ino = std::stoull(parts[3], &used);
    if (used != parts[3].size()) throw bad("bad inode");
  } catch (const std::invalid_argument&) {
    throw bad("non-numeric pid, fd or inode");
  } catch (const std::out_of_range&) {
    throw bad("number out of range");
  }
  h.name = parts[4];
  if (h.name.rfind("elastic-hs-", 0) != 0 || h.name.find('/') != std::string::npos) throw bad("bad name");
  return h;
}

bool process_alive(long pid) {
  if (::kill(static_cast<pid_t>(pid), 0) == 0) return true;
  return errno == EPERM;  // exists, another user's
}

}  // namespace

std::shared_ptr<HostStore> HostStore::create(int64_t nbytes, const std::string& kind) {
  check_nbytes("HostStore.create", nbytes);
  Kind k;
  if (kind == "memfd") {
    k = Kind::kMemfd;
  } else if (kind == "shm") {
    k = Kind::kShm;
  } else {
    throw std::invalid_argument(cat("HostStore.create: kind must be 'memfd' or 'shm', got '", kind, "'"));
  }
  const std::string name = unique_name();
  const std::string what = cat("HostStore.create(", human(nbytes), ", ", kind, " segment ", name, ")");
  int fd = -1;
  if (k == Kind::kMemfd) {
    fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
      int err = errno;
      throw HostStoreError(err, cat(what, ": memfd_create failed: ", errno_text(err), hint(err)));
    }
  } else {
    fd = ::shm_open(("/" + name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
      int err = errno;
      throw HostStoreError(err, cat(what, ": shm_open failed: ", errno_text(err), hint(err)));
    }
  }
  // From here on every failure closes the fd (and unlinks a shm name) before it throws.
  auto fail = [&](const char* call, int err) {
    close_quietly(fd);
    if (k == Kind::kShm) (void)::shm_unlink(("/" + name).c_str());
    return HostStoreError(err, cat(what, ": ", call, " failed: ", errno_text(err), hint(err)));
  };
  if (::ftruncate(fd, static_cast<off_t>(nbytes)) != 0) throw fail("ftruncate", errno);
  // [Note: reserving the pages]; a signal may interrupt a long fallocate: it resumes.
  int rc;
  do {
    rc = ::fallocate(fd, 0, 0, static_cast<off_t>(nbytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0 && errno != EOPNOTSUPP) throw fail("fallocate (reserving the pages)", errno);
  if (k == Kind::kMemfd) (void)::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw fail("fstat", errno);
  void* p = ::mmap(nullptr, static_cast<size_t>(nbytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw fail("mmap", errno);

  std::shared_ptr<HostStore> s(new HostStore());
  s->kind_ = k;
  s->creator_ = true;
  s->nbytes_ = nbytes;
  s->data_ = p;
  s->name_ = name;
  s->fd_ = fd;
  s->handle_ = cat(kind, ":", ::getpid(), ":", fd, ":", static_cast<unsigned long long>(st.st_ino), ":", name);
  return s;
}

std::shared_ptr<HostStore> HostStore::attach(const std::string& handle, int64_t nbytes) {
  check_nbytes("HostStore.attach", nbytes);
  const ParsedHandle h = parse_handle(handle);
  const std::string what = cat("HostStore.attach(", handle, ", ", human(nbytes), ")");
  int fd = -1;
  if (h.kind == Kind::kMemfd) {
    const std::string path = cat("/proc/", h.pid, "/fd/", h.fd);
    fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      std::string why;
      if (!process_alive(h.pid)) {
        why = cat("; the creating process ", h.pid, " is gone (or lives in another PID namespace: use kind 'shm')");
      } else if (err == ENOENT) {
        why = cat("; process ", h.pid, " no longer has fd ", h.fd,
                  " open (the creator called close_fd(): attach before it does)");
      } else {
        why = hint(err);
      }
      throw HostStoreError(err, cat(what, ": cannot open ", path, ": ", errno_text(err), why));
    }
    // The fd number may have been reused for another file: check the link's name too.
    char link[512];
    ssize_t n = ::readlink(path.c_str(), link, sizeof(link) - 1);
    std::string target = n > 0 ? std::string(link, static_cast<size_t>(n)) : std::string();
    if (target.find("memfd:" + h.name) == std::string::npos) {
      close_quietly(fd);
      throw HostStoreError(ESTALE, cat(what, ": ", path, " is '", target, "', not the memfd ", h.name,
                                       " (the creator closed it and reused the fd number)"));
    }
  } else {
    fd = ::shm_open(("/" + h.name).c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
      int err = errno;
      std::string why = err == ENOENT ? cat("; no segment /dev/shm/", h.name,
                                            " (the creator unlinked it: attach before it calls close_fd(), "
                                            "or it is gone, or lives in another IPC namespace)")
                                      : hint(err);
      throw HostStoreError(err, cat(what, ": shm_open(/", h.name, ") failed: ", errno_text(err), why));
    }
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    close_quietly(fd);
    throw HostStoreError(err, cat(what, ": fstat failed: ", errno_text(err)));
  }
  if (static_cast<unsigned long long>(st.st_ino) != h.ino) {
    close_quietly(fd);
    throw HostStoreError(ESTALE, cat(what, ": the file opened has inode ", st.st_ino, ", the handle names inode ",
                                     h.ino, " (not the same segment)"));
  }
  if (static_cast<int64_t>(st.st_size) != nbytes) {
    close_quietly(fd);
    throw HostStoreError(EINVAL, cat(what, ": size mismatch: segment ", h.name, " has ", human(st.st_size),
                                     ", attach asked for ", human(nbytes)));
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(nbytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close_quietly(fd);  // the mapping holds the segment from here on
  if (p == MAP_FAILED) throw HostStoreError(err, cat(what, ": mmap failed: ", errno_text(err), hint(err)));

  std::shared_ptr<HostStore> s(new HostStore());
  s->kind_ = h.kind;
  s->creator_ = false;
  s->nbytes_ = nbytes;
  s->data_ = p;
  s->name_ = h.name;
  s->handle_ = handle;
  return s;
}

void HostStore::close_fd() {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) return;
  if (kind_ == Kind::kShm) (void)::shm_unlink(("/" + name_).c_str());  // ENOENT: already gone
  close_quietly(fd_);
  fd_ = -1;
}

bool HostStore::fd_open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fd_ >= 0;
}

bool HostStore::can_pin() {
#ifdef ELASTIC_WITH_CUDA
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
#else
  return false;
#endif
}

bool HostStore::pin() {
  std::lock_guard<std::mutex> lock(mu_);
  if (pinned_) return true;
  if (data_ == nullptr) return false;
#ifdef ELASTIC_WITH_CUDA
  if (!can_pin()) return false;
  cudaError_t err = cudaHostRegister(data_, static_cast<size_t>(nbytes_), cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw HostStoreError(err == cudaErrorMemoryAllocation ? ENOMEM : EIO,
                         cat("HostStore.pin(", handle_, ", ", human(nbytes_), "): cudaHostRegister failed: ",
                             cudaGetErrorString(err)));
  }
  pinned_ = true;
  return true;
#else
  return false;
#endif
}

void HostStore::unpin() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pinned_) return;
#ifdef ELASTIC_WITH_CUDA
  cudaError_t err = cudaHostUnregister(data_);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw HostStoreError(EIO, cat("HostStore.unpin(", handle_, "): cudaHostUnregister failed: ",
                                  cudaGetErrorString(err)));
  }
#endif
  pinned_ = false;
}

bool HostStore::pinned() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pinned_;
}

int64_t HostStore::pinned_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pinned_ ? nbytes_ : 0;
}

HostStore::~HostStore() {
  // Unpin before munmap; errors are ignored here (at interpreter exit the CUDA runtime may be
  // unloading already: the process's registrations go with it).
#ifdef ELASTIC_WITH_CUDA
  if (pinned_) {
    if (cudaHostUnregister(data_) != cudaSuccess) (void)cudaGetLastError();
  }
#endif
  pinned_ = false;
  if (data_ != nullptr) (void)::munmap(data_, static_cast<size_t>(nbytes_));
  data_ = nullptr;
  if (fd_ >= 0) {
    if (kind_ == Kind::kShm) (void)::shm_unlink(("/" + name_).c_str());
    close_quietly(fd_);
    fd_ = -1;
  }
}

}  // namespace elastic
