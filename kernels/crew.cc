// jtile's crew: the helper threads of parallel_for (common.h), one per core
// of XLA's intra-op pool beside the caller's. A member that finishes a section
// stays awake for kLinger, polling for the next one (yielding its core to any
// thread that wants it), and only then sleeps. A model's kernel calls come
// microseconds apart, so within a run the helpers are awake when a section
// starts. Tasks on XLA's pool, as the kernels used before, wake a sleeping
// pool thread at almost every call, tens of microseconds late on a virtual
// machine; a poll inside a pool task would hold up XLA's own tasks queued
// behind it. SqueezeNet's median run went from 2.80 to 2.41 ms with the crew,
// MobileNetV2's from 2.67 to 2.43. ONNX Runtime's workers spin between its
// nodes for the same reason (and for about 30 ms after a run; the crew sleeps
// after kLinger).
//
// A member never works or polls on the core of the thread that last offered
// a section (the caller, worker 0): it moves off it (step_aside). Linux may
// wake a member onto the caller's core, and keep it there, while the other
// core idles; the two then time-share one core. Seen on this project's 2-core
// virtual machines after ONNX Runtime had run in the same process: the helper
// took no task in two calls of three, and SqueezeNet's median run took 3.06 ms
// against 1.81-1.85 once the helper moved off.
//
// A member also sleeps barred from the caller's core (AwayFromCaller), so that
// Linux wakes it on another one. Woken on the caller's core, it waited there
// behind the busy caller for about a millisecond before it could step aside,
// and the kernels ran on one core meanwhile: a model called after a pause ran
// its first millisecond at half speed (MobileNetV2's blocks 7-10, 220 us a
// run back to back, run after 5 ms idle and 0, 2 or 4 untimed calls: 470,
// 397 and 397 us median, against 323, 257 and 229 with the member barred).
#include <condition_variable>
#include <pthread.h>
#include <sched.h>

#include "common.h"

namespace jtile::detail {
namespace {

constexpr auto kLinger = std::chrono::microseconds(2000);
constexpr int kMaxMembers = 1024;

std::atomic<int> caller_cpu{-1};  // the core of the thread that last offered a section

// While it lives, the calling thread may run on any of its allowed cores but
// the caller's, if it has another; Linux moves it off that core at once.
class AwayFromCaller {
 public:
  AwayFromCaller() {
#if defined(__linux__)
    const int cpu = caller_cpu.load(std::memory_order_relaxed);
    if (cpu < 0 || sched_getaffinity(0, sizeof allowed_, &allowed_) != 0) return;
    cpu_set_t elsewhere = allowed_;
    CPU_CLR(cpu, &elsewhere);
    moved_ = CPU_COUNT(&elsewhere) > 0 && sched_setaffinity(0, sizeof elsewhere, &elsewhere) == 0;
#endif
  }
  ~AwayFromCaller() {
#if defined(__linux__)
    if (moved_) sched_setaffinity(0, sizeof allowed_, &allowed_);
#endif
  }
  AwayFromCaller(const AwayFromCaller&) = delete;
  AwayFromCaller& operator=(const AwayFromCaller&) = delete;

 private:
#if defined(__linux__)
  cpu_set_t allowed_;
#endif
  bool moved_ = false;
};

// Moves the calling member off the caller's core, if it is there and may run
// elsewhere (the move stays when the allowed cores are restored).
void step_aside() {
#if defined(__linux__)
  const int cpu = caller_cpu.load(std::memory_order_relaxed);
  if (cpu < 0 || sched_getcpu() != cpu) return;
  const AwayFromCaller move;
#endif
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One helper thread and its mailbox: at most one section waits in it; a
// newer section replaces one not yet taken (its caller has drained it).
struct Member {
  std::atomic<std::shared_ptr<ForState>*> job{nullptr};
  std::atomic<bool> asleep{false};
  std::mutex mutex;
  std::condition_variable wake;

  void post(const std::shared_ptr<ForState>& state) {
    delete job.exchange(new std::shared_ptr<ForState>(state));
    if (asleep.load()) {  // seq_cst, paired with serve's store: no wake-up is lost
      std::lock_guard<std::mutex> lock(mutex);
      wake.notify_one();
    }
  }

  std::shared_ptr<ForState>* take() {
    return job.load(std::memory_order_relaxed) == nullptr ? nullptr : job.exchange(nullptr);
  }

  [[noreturn]] void serve(int worker) {
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kLinger;
      std::shared_ptr<ForState>* state;
      for (unsigned polls = 1; (state = take()) == nullptr; ++polls) {
        if (std::chrono::steady_clock::now() < until) {
          for (int i = 0; i < 8; ++i) cpu_relax();
          if (polls % 16 == 0) {
            step_aside();
            sched_yield();  // a thread that wants this core gets it
          }
          continue;
        }
        const AwayFromCaller away;  // so that it wakes on another core
        std::unique_lock<std::mutex> lock(mutex);
        asleep.store(true);
        wake.wait(lock, [this] { return job.load() != nullptr; });
        asleep.store(false);
      }
      step_aside();
      (*state)->drain(worker);
      delete state;
    }
  }
};

// Members are started on first need and never destroyed (a member may be
// polling while the process exits).
class Crew {
 public:
  Member* member(int worker) {
    if (worker <= started_.load(std::memory_order_acquire)) return members_[worker - 1];
    std::lock_guard<std::mutex> lock(grow_);
    for (int next = started_.load(); next < worker; ++next) {
      members_[next] = new Member;
      std::thread([m = members_[next], id = next + 1] {
        pthread_setname_np(pthread_self(), ("jtile-crew-" + std::to_string(id)).c_str());
        m->serve(id);
      }).detach();
      started_.store(next + 1, std::memory_order_release);
    }
    return members_[worker - 1];
  }

 private:
  Member* members_[kMaxMembers] = {};
  std::atomic<int> started_{0};
  std::mutex grow_;
};

Crew& the_crew() {
  static Crew* crew = new Crew;
  return *crew;
}

}  // namespace

void crew_offer(const std::shared_ptr<ForState>& state, int helpers) {
#if defined(__linux__)
  caller_cpu.store(sched_getcpu(), std::memory_order_relaxed);
#endif
  Crew& c = the_crew();
  for (int worker = 1; worker <= std::min(helpers, kMaxMembers); ++worker) c.member(worker)->post(state);
}

}  // namespace jtile::detail
