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
// run(n, f) calls f(begin, end) over [0, n) split into one contiguous chunk per thread
// (the caller takes the first), and returns when all are done. Chunks are a pure function
// of n and the thread count, so a kernel whose rows do not interact stays batch-invariant.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
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
    std::lock_guard<std::mutex> lock(creating);
    const int threads = std::max(1, at::get_num_threads());
    if (pool == nullptr || pool->threads_ != threads || pool->pid_ != getpid()) {
      if (pool != nullptr && pool->pid_ == getpid()) pool->stop();
      pool = new SpinPool(threads);  // the old one is left to its (exited) helpers
    }
    return *pool;
  }

  int threads() const { return threads_; }

  // f over [0, n) in up to `max_chunks` chunks (one per thread at most).
  void run(int64_t n, const std::function<void(int64_t, int64_t)>& f, int64_t max_chunks = INT64_MAX) {
    const int t = static_cast<int>(std::min<int64_t>({threads_, n, max_chunks}));
    if (t <= 1) {
      if (n > 0) f(0, n);
      return;
    }
    std::lock_guard<std::mutex> one_job(running_);  // callers on other threads take turns
    job_ = &f;
    n_ = n;
    active_ = t;
    // Every helper reports, the idle ones too: none may still be looking at this job's
    // fields when the next one writes them.
    pending_.store(threads_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    f(0, chunk_end(0));
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
  }

 private:
  // How long a helper spins for the next job before sleeping: longer than the Python
  // between two kernels of a step, far shorter than the scheduler's gap between steps.
  static constexpr auto kSpin = std::chrono::microseconds(200);
  static constexpr auto kPause = std::chrono::microseconds(20);

  explicit SpinPool(int threads) : threads_(threads), pid_(getpid()) {
    for (int i = 1; i < threads; ++i) std::thread([this, i] { loop(i); }).detach();
  }

  int64_t chunk_end(int i) const { return n_ * (i + 1) / active_; }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      epoch_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }

  void loop(int i) {
    uint64_t seen = 0;  // the epoch at construction: a job may be posted before this thread runs
    while (true) {
      // Pause-spin briefly, then yield-spin: a yielding helper hands its core to any other
      // runnable thread (an OpenMP helper of a torch op, the scheduler) instead of fighting it.
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 1; epoch_.load(std::memory_order_acquire) == seen; ++spins) {
        if (spins % 64 == 0) {
          const auto waited = std::chrono::steady_clock::now() - start;
          if (waited > kSpin) break;
          if (waited > kPause) sched_yield();
        }
        _mm_pause();
      }
      if (epoch_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
      }
      seen = epoch_.load(std::memory_order_acquire);
      if (stopping_) return;
      if (i < active_) (*job_)(n_ * i / active_, chunk_end(i));
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  const int threads_;
  const pid_t pid_;
  std::mutex mu_, running_;
  std::condition_variable cv_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0;
  int active_ = 0;
  bool stopping_ = false;
};

// at::parallel_for(0, n, grain, f) on the SpinPool: inline below `grain` items, else at
// most one chunk per `grain` items.
inline void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  if (n <= 0) return;
  if (n < grain) return f(0, n);
  SpinPool::get().run(n, f, (n + grain - 1) / grain);
}

}  // namespace sluice
