// Work sharing for the fused CPU layer: the calling thread and a few helpers
// take chunks of a range from one atomic counter.
//
// Why not OpenMP (at::parallel_for): a parallel region splits its range among
// its team up front and ends at a barrier that waits for every team thread. On
// a 2-core machine serving editors, the event loop's thread wakes for every
// token; when it takes a helper's core, the region waits for that helper's
// whole share, and once more OpenMP teams exist than cores (a thread that ever
// ran a parallel torch op keeps one) libgomp stops spinning and every region
// pays futex wakes. Measured: the same decode steps at 9.7 ms each in a bare
// loop, ~20 ms inside the server's threads. Here the caller never waits for a
// helper that has not started: chunks left unclaimed are the caller's, and at
// the end it waits only for chunks already in a helper's hands.

#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define COMPLETER_PAUSE() _mm_pause()
#else
#define COMPLETER_PAUSE() std::this_thread::yield()
#endif

class Workers {
 public:
  explicit Workers(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { serve(); });
  }

  ~Workers() {
    stop_.store(true);
    posted_.fetch_add(1);
    posted_.notify_all();
    for (auto& t : threads_) t.join();
  }

  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  int threads() const { return static_cast<int>(threads_.size()) + 1; }

  // f(begin, end) over [0, n) in chunks of `grain`, on this thread and the helpers.
  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
    std::lock_guard<std::mutex> one_caller(caller_);  // (one engine thread calls: uncontended)
    if (threads_.empty() || n <= grain) {
      if (n > 0) f(0, n);
      return;
    }
    Job job{&f, n, grain};
    job_.store(&job);
    posted_.fetch_add(1);
    posted_.notify_all();
    work(job);
    job_.store(nullptr);  // a helper arriving from here on finds no job
    while (active_.load() != 0) COMPLETER_PAUSE();
  }

 private:
  struct Job {
    const std::function<void(int64_t, int64_t)>* f;
    int64_t n, grain;
    std::atomic<int64_t> next{0};
  };

  static void work(Job& job) {
    for (int64_t begin; (begin = job.next.fetch_add(job.grain)) < job.n;)
      (*job.f)(begin, std::min(job.n, begin + job.grain));
  }

  void serve() {
    uint64_t seen = 0;  // posted_'s first value: a stop posted before this thread ran is still seen
    while (true) {
      // Spin a while (the next layer's job comes within microseconds), then sleep.
      for (int spin = 0; posted_.load() == seen && spin < 20000; ++spin) COMPLETER_PAUSE();
      posted_.wait(seen);
      seen = posted_.load();
      if (stop_.load()) return;
      active_.fetch_add(1);  // before reading the job: run() waits for it once the job is withdrawn
      if (Job* job = job_.load()) work(*job);
      active_.fetch_sub(1);
    }
  }

  std::mutex caller_;
  std::vector<std::thread> threads_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> posted_{0};
  std::atomic<int> active_{0};
  std::atomic<bool> stop_{false};
};
