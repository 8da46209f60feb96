// How the exact kernels share work among threads: tasks a parallel region's threads take
// between them (parallel_tasks), the team a whole decoder call runs in (one parallel
// region for all of its ops), and the helper threads on cores another worker lends
// (helpers.h), which take tasks too while that worker is idle.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace exact {

// One cache line fetched toward the core. asm volatile: gcc 12 dropped every
// __builtin_prefetch / _mm_prefetch of the attention's key loops they were inlined into
// (not one prefetch instruction in the binary).
// 3: into L1 (prefetcht0), 2: into L2 (prefetcht1), 0: toward L1 with the non-temporal
// hint (prefetchnta: a decode linear's weights, each read once).
template <int Locality>
inline void prefetch_line(const void* p) {
  static_assert(Locality == 0 || Locality == 2 || Locality == 3, "locality 0, 2 or 3");
  if constexpr (Locality == 3) asm volatile("prefetcht0 %0" : : "m"(*(const char*)p));
  else if constexpr (Locality == 2) asm volatile("prefetcht1 %0" : : "m"(*(const char*)p));
  else asm volatile("prefetchnta %0" : : "m"(*(const char*)p));
}

// Tasks [0, n) of one parallel region. Each thread starts with a contiguous share, as
// at::parallel_for would hand it, and when its share is done takes the rest of another's.
// On cores the engine shares (the frontend, the client, the KV listener beside it) the OS
// preempts one thread now and then; with fixed shares the region ends when that thread's
// does, the others waiting at the barrier; here they take over its tasks. Each share's
// counter has its own cache line, so taking from one's own share costs an uncontended
// atomic add (one counter for all threads cost ~0.5 ms more a decode step than fixed
// shares on a Zen 1: its line moved between the cores at every task). A task's outputs are
// its own and computed by the same code whichever thread runs it, so the bits do not
// depend on who takes what.
class TaskShares {
 public:
  static constexpr int64_t kMaxThreads = 64;
  TaskShares(int64_t n, int64_t threads) : threads_(std::min(threads, kMaxThreads)) {
    TORCH_CHECK(n < (int64_t(1) << 31), "parallel_tasks: too many tasks");
    for (int64_t t = 0; t < threads_; ++t) reset(t, n);
  }
  int64_t threads() const { return threads_; }

  // Thread t's share of a new op's tasks [0, n), of `parts` shares (all of them by
  // default; the team's members alone when no helper takes part). In a team (below) each
  // thread sets its own as it starts the op; another that looks before finds the previous
  // op's, used up.
  void reset(int64_t t, int64_t n, int64_t parts = 0) {
    if (parts <= 0) parts = threads_;
    share_[t].pair.store(pair(n * t / parts, n * (t + 1) / parts), std::memory_order_release);
  }

  // The next task of thread `me`'s share, else one from another share; false when none
  // is left.
  bool take(int64_t me, int64_t& task) {
    for (int64_t i = 0; i < threads_; ++i) {
      Share& s = share_[(me + i) % threads_];
      uint64_t v = s.pair.load(std::memory_order_relaxed);
      if (next_of(v) >= end_of(v)) continue;
      v = s.pair.fetch_add(1, std::memory_order_acq_rel);  // the next, in the low half
      if (next_of(v) < end_of(v)) {
        task = next_of(v);
        return true;
      }
    }
    return false;
  }

 private:
  // A share: its next task and its end in one word, so a share set anew is read whole.
  static uint64_t pair(int64_t next, int64_t end) { return (uint64_t)end << 32 | (uint64_t)next; }
  static int64_t next_of(uint64_t v) { return (int64_t)(v & 0xFFFFFFFFu); }
  static int64_t end_of(uint64_t v) { return (int64_t)(v >> 32); }
  struct alignas(64) Share {
    std::atomic<uint64_t> pair{0};
  };
  const int64_t threads_;
  Share share_[kMaxThreads];
};

// One thread's view of the shares: `take(task)` until it returns false. A helper's
// (helpers.h) also stops at its lease's `stop` word: it takes no task more once the
// worker that lent its core wants the core back.
class Tasks {
 public:
  Tasks(TaskShares& shares, int64_t me, const std::atomic<uint32_t>* stop = nullptr)
      : shares_(shares), me_(me), stop_(stop) {}
  bool take(int64_t& task) {
    if (stop_ && stop_->load(std::memory_order_relaxed)) return false;
    if (!shares_.take(me_, task)) return false;
    ++taken_;
    return true;
  }
  int64_t taken() const { return taken_; }

 private:
  TaskShares& shares_;
  const int64_t me_;
  const std::atomic<uint32_t>* const stop_;
  int64_t taken_ = 0;
};

}  // namespace exact

#include "helpers.h"

namespace exact {

// A team: the threads of one parallel region that runs a whole decoder call (decoder.cpp).
// With each op in a region of its own, a batch-1 step paid a region's start and end ~150
// times, ~2 us each on two threads (the master's way in 0.6-1.3 us, the join 0.5-0.8,
// timed around 0.66 MB linears): every thread of a team runs the decoder's code, each op
// shares its tasks out through the team (parallel_tasks, parallel_rows), and the threads
// meet at a spin barrier (~0.1 us) after each op.
class Team {
 public:
  // Runs body() on every thread of a team of the pool's threads, in one parallel region
  // (on the caller alone when there is one thread). body must not throw: the _into ops
  // check nothing (their callers check the operands first); if it does anyway, the
  // others stop waiting for the thread that threw and the first error is rethrown.
  template <typename F>
  static void run(const F& body) {
    const int64_t want = std::min<int64_t>(at::get_num_threads(), TaskShares::kMaxThreads);
    Team team(want);
    std::exception_ptr error;
    std::mutex error_mutex;
    auto member = [&](int64_t me) {
      Team* const outer = current_;
      current_ = &team, me_ = me;
      try {
        body();
      } catch (...) {
        std::lock_guard<std::mutex> hold(error_mutex);
        if (!error) error = std::current_exception();
        team.failed_.store(true, std::memory_order_release);
      }
      current_ = outer;
    };
    if (want <= 1) {
      member(0);
    } else {
#pragma omp parallel num_threads(want)
      {
        if (omp_get_num_threads() == want) member(omp_get_thread_num());
        else if (omp_get_thread_num() == 0) run_alone(team, member);
      }
    }
    if (error) std::rethrow_exception(error);
  }

  static Team* current() { return current_; }
  static int64_t me() { return me_; }  // the calling thread's index in its team
  int64_t threads() const { return threads_; }

  // Every thread of the team comes here before any goes on.
  void barrier() {
    constexpr int64_t kSpins = 4000;  // ~50 us of pause, then yield the core each turn
    const int64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation &&
                            !failed_.load(std::memory_order_relaxed); ++spins) {
      if (spins < kSpins) _mm_pause();
      else std::this_thread::yield();
    }
  }

  // parallel_tasks in a team: every thread calls it; each sets its own share, takes tasks,
  // and waits for the others.
  // Helpers (helpers.h) take part in an op of 2 tasks or more: the master sets their
  // shares, offers them the op, and waits for the tasks they hold before the barrier.
  template <typename F>
  void tasks(int64_t n, const F& worker) {
    n = std::max<int64_t>(n, 0);
    const bool helped = helpers_ > 0 && n > 1;
    shares_.reset(me_, n, helped ? 0 : threads_);
    bool offered = false;
    if (helped && me_ == 0) {
      for (int64_t t = threads_; t < shares_.threads(); ++t) shares_.reset(t, n);
      offered = Helpers::get().open(shares_, threads_, worker);
    }
    if (n > 0 && !failed_.load(std::memory_order_relaxed)) {
      Tasks mine(shares_, me_);
      worker(mine);
    }
    if (offered) Helpers::get().close();
    barrier();
  }

  // Units [begin, end) of n for the calling thread (its heads of a decode step's rotary).
  std::pair<int64_t, int64_t> part(int64_t n) const {
    return {n * me_ / threads_, n * (me_ + 1) / threads_};
  }

 private:
  explicit Team(int64_t threads)
      : threads_(threads), helpers_(Helpers::get().count()), shares_(0, threads + helpers_) {}
  // The pool gave fewer threads than asked: a team of one on the master.
  template <typename M>
  static void run_alone(Team& team, const M& member) {
    team.threads_ = 1;
    member(0);
  }

  int64_t threads_;
  const int64_t helpers_;
  TaskShares shares_;
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
  std::atomic<bool> failed_{false};
  static inline thread_local Team* current_ = nullptr;
  static inline thread_local int64_t me_ = 0;
};

// Runs worker(tasks) on up to `n` threads of the pool (once, inline, inside a parallel
// region); the workers take tasks [0, n) between them until none is left. In a team
// (above), the team's threads take the tasks, and all wait for the last. (A thread out of
// tasks used to fetch its share of the next linear's weights into L2 while the others
// finished: 1-2% of a batch-1 step once, nothing since a decode linear's two shares end
// together and its weights stream past the caches; removed, docs/benchmarks.md 11-30.)
template <typename F>
void parallel_tasks(int64_t n, const F& worker) {
  if (Team* team = Team::current()) {
    team->tasks(n, worker);
    return;
  }
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  const int64_t helpers = n > threads ? Helpers::get().count() : 0;
  TaskShares shares(n, threads + helpers);
  const bool offered = helpers && Helpers::get().open(shares, threads, worker);
  at::parallel_for(0, threads, 1, [&](int64_t me, int64_t) {
    Tasks tasks(shares, me);
    worker(tasks);
  });
  if (offered) Helpers::get().close();
}

// Rows [0, T) of a row-wise op (a norm, SiLU, rotary) as up to kRowTasks tasks of
// consecutive rows (parallel_tasks: in a team, its threads and any helpers take them);
// rows(r0, r1) computes rows [r0, r1) on the calling thread. A row's bits do not depend on
// its task. (They were split among a team's threads once: a disaggregated prefill worker's
// one-thread team then ran them alone while its helper waited, and a 512-token prefill
// with the helper took 926 ms where two threads took 887; 879 with the rows as tasks, a
// Zen 3: docs/benchmarks.md, "Serving overhead: reading the numbers", 2026-12-05.)
// Outside a team a task has kRowsAlone rows at least: there each op with more than one
// task opens a parallel region (~2 us on two threads), more than a few rows' work, so a
// decode step of up to 16 sequences runs its row ops inline, as at::parallel_for with that
// grain did before them (AMX runs its decoder outside a team).
constexpr int64_t kRowTasks = 16;
constexpr int64_t kRowsAlone = 16;
template <typename F>
void parallel_rows(int64_t T, const F& rows) {
  const int64_t per = Team::current() ? 1 : kRowsAlone;
  const int64_t n = std::min<int64_t>((std::max<int64_t>(T, 0) + per - 1) / per, kRowTasks);
  parallel_tasks(n, [&](Tasks& tasks) {
    for (int64_t k; tasks.take(k);) rows(T * k / n, T * (k + 1) / n);
  });
}

}  // namespace exact
