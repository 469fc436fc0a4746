// Ends a call that stops making progress: a file transfer over a slow link may take hours, so its bound
// is time without progress, not a deadline that must guess the link's rate.
#ifndef MERIDIAN_RPC_IDLE_WATCH_H_
#define MERIDIAN_RPC_IDLE_WATCH_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace meridian::rpc {

// Calls `cancel` once when Touch() has not been called for `idle` (counted from construction). Runs its
// own thread, joined by the destructor, which never calls `cancel`. `cancel` must be safe to call from
// that thread while the call runs (grpc::ClientContext::TryCancel and grpc::ServerContext::TryCancel are).
// Touch and fired are thread-safe.
class IdleWatch {
 public:
  IdleWatch(std::chrono::milliseconds idle, std::function<void()> cancel)
      : idle_(idle), cancel_(std::move(cancel)), last_(Now()), thread_([this] { Watch(); }) {}
  ~IdleWatch() {
    {
      std::lock_guard<std::mutex> l(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  IdleWatch(const IdleWatch&) = delete;
  IdleWatch& operator=(const IdleWatch&) = delete;

  void Touch() { last_.store(Now(), std::memory_order_relaxed); }
  // Whether `cancel` was called (the call then failed for want of progress).
  bool fired() const { return fired_.load(); }
  std::chrono::milliseconds idle() const { return idle_; }

 private:
  static int64_t Now() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void Watch() {
    const auto tick = std::max(std::chrono::milliseconds(10), idle_ / 4);
    std::unique_lock<std::mutex> l(mu_);
    while (!cv_.wait_for(l, tick, [this] { return done_; })) {
      if (Now() - last_.load(std::memory_order_relaxed) >= idle_.count()) {
        fired_ = true;
        cancel_();
        return;
      }
    }
  }

  const std::chrono::milliseconds idle_;
  const std::function<void()> cancel_;
  std::atomic<int64_t> last_;
  std::atomic<bool> fired_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;   // guarded by mu_
  std::thread thread_;  // last: starts once the members above are built
};

}  // namespace meridian::rpc

#endif  // MERIDIAN_RPC_IDLE_WATCH_H_
