// SpinPool: the threads of the decode-step kernels, which keep spinning between calls.
//
// Why not at::parallel_for (OpenMP): libgomp gives every thread that opens a parallel
// region its own team, and a process always has two (`import torch` runs one on the main
// thread, the engine's forwards run on its worker thread). Once the teams hold more threads
// than there are cores, libgomp stops spinning between regions, and each of a decode
// step's ~300 small regions pays a futex wake-up of the sleeping helper: SmolLM2's 120
// linears at 16 rows took 31 ms a step on 2 threads, 27 ms on 1 (bench/RESULTS.md item 17).
// These helpers spin for kSpin iterations after each job (a layer's next kernel is tens
// of microseconds away), then sleep on a condition variable until the next job.
//
// run(n, f) calls f(begin, end) over [0, n) split into one contiguous chunk per thread,
// and returns when all are done. Chunks are a pure function of n and the thread count, so
// a kernel whose rows do not interact stays batch-invariant; which thread runs a chunk is
// not fixed: the caller and the helpers claim chunks from one atomic ticket, and the
// caller takes every chunk no helper claimed by the time it is free. So a helper that
// is not on a core (OpenMP's helper of the previous torch op still spinning there, or the
// scheduler's thread) delays nothing: the caller runs its chunk itself.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sluice {

class SpinPool {
 public:
  // The pool for the calling thread's torch thread count (at::get_num_threads), rebuilt
  // when that count changes or after a fork (a child has none of the parent's threads).
  static SpinPool& get() {
    static SpinPool* pool = nullptr;
    static std::mutex creating;
    // A fork is told by a count the child bumps, not by getpid() per call: a system call on
    // every kernel call (py-spy put ~3% of a prefill's samples there; forward times did not
    // move measurably, item 21).
    static const int registered = pthread_atfork(nullptr, nullptr, [] { forks().fetch_add(1); });
    (void)registered;
    std::lock_guard<std::mutex> lock(creating);
    const int threads = std::max(1, at::get_num_threads());
    const uint64_t fork = forks().load(std::memory_order_relaxed);
    if (pool == nullptr || pool->threads_ != threads || pool->fork_ != fork) {
      if (pool != nullptr && pool->fork_ == fork) pool->stop();
      pool = new SpinPool(threads, fork);  // the old one is left to its (exited) helpers
    }
    return *pool;
  }

  int threads() const { return threads_; }

  // f over [0, n) in up to `max_chunks` chunks: one per thread, or `per_thread` per thread for
  // a long job whose threads may run at different speeds (the LM head: on a KVM guest the
  // helper's half of it took 18% longer than the caller's, who then waited ~0.5 ms a step;
  // in pieces the faster thread takes more of them).
  void run(int64_t n, const std::function<void(int64_t, int64_t)>& f, int64_t max_chunks = INT64_MAX,
           int64_t per_thread = 1) {
    const int t = threads_ <= 1 ? 1 : static_cast<int>(std::min<int64_t>({threads_ * per_thread, n, max_chunks, 0xffff}));
    if (t <= 1) {
      if (n > 0) f(0, n);
      return;
    }
    std::lock_guard<std::mutex> one_job(running_);  // callers on other threads take turns
    // The job's fields, then the ticket that publishes them (release): a claim that
    // succeeds on this job's ticket sees them, and they stay until its chunk is done.
    job_ = &f;
    n_ = n;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t job = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ticket_.store(job << 32 | static_cast<uint64_t>(t) << 16, std::memory_order_release);
    }
    cv_.notify_all();
    work(job);
    while (done_.load(std::memory_order_acquire) != t) _mm_pause();
  }

 private:
  // How long a helper spins for the next job before sleeping: longer than the Python
  // between two kernels of a step, far shorter than the scheduler's gap between steps.
  static constexpr auto kSpin = std::chrono::microseconds(200);
  static constexpr auto kPause = std::chrono::microseconds(20);

  static std::atomic<uint64_t>& forks() {
    static std::atomic<uint64_t> count{0};
    return count;
  }

  SpinPool(int threads, uint64_t fork) : threads_(threads), fork_(fork) {
    for (int i = 1; i < threads; ++i) std::thread([this] { loop(); }).detach();
  }

  // Claim and run chunks of job `job` until none is left. The ticket carries the job's
  // chunk count, so a claim is checked against its own job in the one compare-exchange:
  // a late helper can never claim past a finished job's last chunk (whose fields the
  // caller may be overwriting for the next).
  void work(uint64_t job) {
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    while ((ticket >> 32) == job && (ticket & 0xffff) < ((ticket >> 16) & 0xffff)) {
      if (!ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel)) continue;
      const int64_t i = static_cast<int64_t>(ticket & 0xffff), chunks = static_cast<int64_t>((ticket >> 16) & 0xffff);
      (*job_)(n_ * i / chunks, n_ * (i + 1) / chunks);
      done_.fetch_add(1, std::memory_order_release);
      ticket = ticket_.load(std::memory_order_acquire);
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      ticket_.fetch_add(uint64_t{1} << 32, std::memory_order_release);
    }
    cv_.notify_all();
  }

  void loop() {
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    auto posted = [&] { return (ticket_.load(std::memory_order_acquire) >> 32) != seen; };
    while (true) {
      // Pause-spin briefly, then yield-spin: a yielding helper hands its core to any other
      // runnable thread (an OpenMP helper of a torch op, the scheduler) instead of fighting it.
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; !posted(); ++spins) {
        if (spins % 64 == 0) {
          const auto waited = std::chrono::steady_clock::now() - start;
          if (waited > kSpin) break;
          if (waited > kPause) sched_yield();
        }
        _mm_pause();
      }
      if (!posted()) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, posted);
      }
      if (stopping_) return;
      seen = ticket_.load(std::memory_order_acquire) >> 32;
      work(seen);
    }
  }

  const int threads_;
  const uint64_t fork_;  // forks() when built: a child has none of the parent's threads
  std::mutex mu_, running_;
  std::condition_variable cv_;
  std::atomic<uint64_t> ticket_{0};  // job << 32 | chunks << 16 | next unclaimed chunk
  std::atomic<int> done_{0};         // chunks of the current job finished
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0;
  bool stopping_ = false;
};

// at::parallel_for(0, n, grain, f) on the SpinPool: inline below `grain` items, else at
// most one chunk per `grain` items (and per_thread chunks a thread: SpinPool::run).
inline void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f,
                         int64_t per_thread = 1) {
  if (n <= 0) return;
  if (n < grain) return f(0, n);
  SpinPool::get().run(n, f, (n + grain - 1) / grain, per_thread);
}

}  // namespace sluice
