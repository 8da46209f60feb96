// The helper threads (helpers.h) and the lender's side of a lease.
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // every binding file has the same casters (exact.cpp and
                            // decoder.cpp: through torch/csrc/utils/pybind.h)

#include <chrono>

#include "tasks.h"

namespace exact {

namespace {

constexpr int64_t kLeaseFutexNs = 20'000'000;  // a helper re-reads its lease this often
constexpr int64_t kIdleFutexNs = 100'000'000;  // and the op word, asleep
constexpr auto kSpin = std::chrono::microseconds(200);  // between ops: a prefill's row ops

Lease* lease_at(int64_t address) {
  TORCH_CHECK(address != 0 && address % 64 == 0, "a lease must be 64-byte aligned");
  return reinterpret_cast<Lease*>(address);
}

}  // namespace

void Helpers::start(const std::vector<int64_t>& cores, const std::vector<Lease*>& leases,
                    int nice) {
  TORCH_CHECK(cores.size() == leases.size(), "one lease per lent core");
  TORCH_CHECK(count() == 0, "this process's helpers are started already");
  TORCH_CHECK(!cores.empty() && (int64_t)cores.size() < TaskShares::kMaxThreads / 2,
              "1 to ", TaskShares::kMaxThreads / 2 - 1, " helpers");
  for (size_t i = 0; i < cores.size(); ++i) {
    auto slot = std::make_unique<Slot>();
    slot->lease = leases[i], slot->core = cores[i], slot->index = (int64_t)i;
    // a restarted worker finds its predecessor's count: no helper of ours is inside yet
    if (slot->lease) slot->lease->active.store(0, std::memory_order_seq_cst);
    slots_.push_back(std::move(slot));
  }
  for (const auto& slot : slots_) std::thread([this, s = slot.get(), nice] { serve(*s, nice); })
      .detach();
  count_.store((int64_t)slots_.size(), std::memory_order_release);
}

// The next open op after `seen`: spins a while (the next op of a decoder call comes within
// ~0.2 ms, after its row ops), then sleeps on the op word.
uint32_t Helpers::next_op(uint32_t seen) {
  auto until = std::chrono::steady_clock::now() + kSpin;
  for (int64_t spins = 1;; ++spins) {
    const uint32_t g = gen_.load(std::memory_order_acquire);
    if (g != seen && (g & 1)) return g;
    if (spins % 64 || std::chrono::steady_clock::now() < until) {
      _mm_pause();
      continue;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (gen_.load(std::memory_order_seq_cst) == g) futex_wait(&gen_, g, kIdleFutexNs, false);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    until = std::chrono::steady_clock::now() + kSpin;
  }
}

void Helpers::serve(Slot& slot, int nice) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET((int)slot.core, &set);
  sched_setaffinity(0, sizeof set, &set);  // this thread
  setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice);
  Lease* const lease = slot.lease;
  uint32_t seen = gen_.load(std::memory_order_acquire);
  for (;;) {
    const uint32_t g = next_op(seen);
    seen = g;
    if (lease && lease->wanted.load(std::memory_order_acquire)) {
      while (lease->wanted.load(std::memory_order_acquire))
        futex_wait(&lease->wanted, 1, kLeaseFutexNs, true);
      seen = g - 2;  // the op may still be open: join it
      continue;
    }
    // Inside, then check: close() (and the lender) see this thread inside, or it sees
    // the op closed (the lease wanted) and takes nothing. The lease first: preempted
    // before the op's word, this thread holds up no close(), and the lender, sleeping
    // while it waits, gives it the core back to leave.
    if (lease) lease->active.fetch_add(1, std::memory_order_seq_cst);
    slot.active.store(g, std::memory_order_seq_cst);
    if (gen_.load(std::memory_order_seq_cst) == g &&
        !(lease && lease->wanted.load(std::memory_order_seq_cst))) {
      Tasks mine(*shares_, first_ + slot.index, lease ? &lease->wanted : nullptr);
      try {
        invoke_(worker_, mine);
      } catch (...) {
        std::lock_guard<std::mutex> hold(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      tasks_run_.fetch_add(mine.taken(), std::memory_order_relaxed);
    }
    slot.active.store(0, std::memory_order_release);
    if (lease) lease->active.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace exact

namespace {

// The lease file at `path`, mapped here and never unmapped: the helper threads watching it
// live as long as the process, past the interpreter's exit, when Python's own mapping of the
// file (lending.py's LeaseFile) is gone.
exact::Lease* map_lease(const std::string& path) {
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open the lease file ", path);
  struct stat st {};
  const bool sized = fstat(fd, &st) == 0 && st.st_size >= (off_t)sizeof(exact::Lease);
  void* const at = sized ? mmap(nullptr, sizeof(exact::Lease), PROT_READ | PROT_WRITE,
                                MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  TORCH_CHECK(at != MAP_FAILED, "cannot map the lease file ", path);
  return static_cast<exact::Lease*>(at);
}

// Helper threads on `cores` at niceness `nice`, the lease file leases[i] (or "" for none)
// watched by the one on cores[i].
void start_helpers(const std::vector<int64_t>& cores, const std::vector<std::string>& leases,
                   int64_t nice) {
  std::vector<exact::Lease*> mapped;
  for (const auto& path : leases) mapped.push_back(path.empty() ? nullptr : map_lease(path));
  exact::Helpers::get().start(cores, mapped, (int)nice);
}

// The lender wants its core: helpers keep out of new tasks; waits until none is inside
// an op (they finish the task they hold), at most `timeout_s`. False on the timeout.
bool lease_hold(int64_t address, double timeout_s) {
  exact::Lease* const lease = exact::lease_at(address);
  lease->wanted.store(1, std::memory_order_seq_cst);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  const timespec nap{0, 20'000};  // sleep: the helper needs this core to finish its task
  while (lease->active.load(std::memory_order_seq_cst) != 0) {
    if (std::chrono::steady_clock::now() >= end) return false;
    nanosleep(&nap, nullptr);
  }
  return true;
}

void lease_free(int64_t address) {
  exact::Lease* const lease = exact::lease_at(address);
  lease->wanted.store(0, std::memory_order_seq_cst);
  exact::futex_wake(&lease->wanted, true);
}

}  // namespace

void register_helpers(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("start_helpers", &start_helpers, "helper threads on lent cores (helpers.h)",
        py::arg("cores"), py::arg("leases"), py::arg("nice"));
  m.def("helper_count", [] { return exact::Helpers::get().count(); });
  m.def("helper_tasks", [] { return exact::Helpers::get().tasks_run(); },
        "tasks the helpers have run so far");
  m.def("lease_hold", &lease_hold, py::call_guard<py::gil_scoped_release>(),
        py::arg("address"), py::arg("timeout_s"));
  m.def("lease_free", &lease_free, py::arg("address"));
  m.def("lease_bytes", [] { return (int64_t)sizeof(exact::Lease); });
}
