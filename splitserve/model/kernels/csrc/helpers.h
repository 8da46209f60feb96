// Helpers: threads on cores another worker lends, taking the tasks of this process's ops
// (parallel_tasks, a team's ops) while that worker is idle (cluster/worker/lending.py).
//
// A prefill worker of a disaggregated layout on few cores borrows the decode worker's core:
// one helper thread there at the lowest priority. It used to be a member of the team
// (tasks.h), and when the decode worker stepped, the kernel preempted it inside a task:
// the whole team then waited at the op's barrier until the decode step ended (TTFT 1.85x
// at one decoding stream, 4.4x at 16: docs/benchmarks.md, "TTFT under decode load").
// A helper is no member: no barrier waits for it, and an op waits only for a task it has
// begun. Before the lender steps it raises its lease's `wanted` word and waits (briefly,
// sleeping: the helper needs its core to finish) until no helper is inside an op; a
// helper takes no task while `wanted` is up. So the ops never wait on a preempted helper
// for a decode step, only for what a short preemption by another thread costs.
//
// An op's outputs are those of its tasks, each computed by the same code whoever runs it:
// the bits do not depend on whether, or how much, a helper took part.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <memory>
#include <vector>

namespace exact {

// A lender's lease on one core it lends, in a small file both processes map (shared
// memory: std::atomic<uint32_t> is lock-free and address-free).
struct Lease {
  alignas(64) std::atomic<uint32_t> wanted{0};  // the lender steps: helpers keep out
  alignas(64) std::atomic<uint32_t> active{0};  // helpers inside an op now
  // The borrower has prompts to compute: a pacing lender spaces its steps meanwhile
  // (written and read from Python only: lending.py).
  std::atomic<uint32_t> demand{0};
};
static_assert(sizeof(Lease) == 128, "the lease file's layout");

inline void futex_wait(const std::atomic<uint32_t>* word, uint32_t expected, int64_t ns,
                       bool shared) {
  const timespec timeout{(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
  syscall(SYS_futex, word, shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, expected, &timeout,
          nullptr, 0);
}

inline void futex_wake(const std::atomic<uint32_t>* word, bool shared) {
  syscall(SYS_futex, word, shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

class Helpers {
 public:
  static Helpers& get() {
    static Helpers* const helpers = new Helpers();  // never destroyed: its threads outlive
    return *helpers;
  }
  int64_t count() const { return count_.load(std::memory_order_acquire); }
  int64_t tasks_run() const { return tasks_run_.load(std::memory_order_relaxed); }

  // One helper thread on each of `cores`, at niceness `nice`, watching `leases[i]`; once
  // a process (helpers.cpp).
  void start(const std::vector<int64_t>& cores, const std::vector<Lease*>& leases, int nice);

  // Offers an op's tasks to the helpers: they take from shares [first, first + count())
  // first, then from any. False when none can (no helpers, or another thread's op has
  // them); the caller takes every task then. `worker` must outlive close().
  template <typename F>
  bool open(TaskShares& shares, int64_t first, const F& worker) {
    if (!count() || !owner_.try_lock()) return false;
    shares_ = &shares, first_ = first, worker_ = &worker;
    invoke_ = [](const void* f, Tasks& tasks) { (*static_cast<const F*>(f))(tasks); };
    const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;  // odd: open
    gen_.store(g, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst)) futex_wake(&gen_, false);
    return true;
  }

  // Ends the op open()ed: no helper begins a task of it after this, and it returns once
  // none is inside it. Called when the caller's worker found no task left, so it waits
  // only for the tasks helpers hold. Rethrows what a helper's worker threw.
  void close() {
    const uint32_t g = gen_.load(std::memory_order_relaxed);
    gen_.store(g + 1, std::memory_order_seq_cst);  // even: closed
    for (const auto& slot : slots_)
      for (int64_t spins = 0; slot->active.load(std::memory_order_seq_cst) == g; ++spins) {
        if (spins < 4000) _mm_pause();
        else std::this_thread::yield();
      }
    std::exception_ptr error;
    std::swap(error, error_);
    owner_.unlock();
    if (error) std::rethrow_exception(error);
  }

 private:
  struct alignas(64) Slot {
    std::atomic<uint32_t> active{0};  // the open op this helper is inside, else 0
    Lease* lease = nullptr;
    int64_t core = 0, index = 0;
  };
  Helpers() = default;
  void serve(Slot& slot, int nice);
  uint32_t next_op(uint32_t seen);

  std::vector<std::unique_ptr<Slot>> slots_;
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> tasks_run_{0};
  std::mutex owner_;  // held from open() to close()
  alignas(64) std::atomic<uint32_t> gen_{0};  // odd: an op is open
  std::atomic<uint32_t> sleepers_{0};
  TaskShares* shares_ = nullptr;
  int64_t first_ = 0;
  const void* worker_ = nullptr;
  void (*invoke_)(const void*, Tasks&) = nullptr;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace exact
