#include "executor/receive_ahead.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/thread_name.h"

namespace meridian::executor {

namespace {
using Clock = std::chrono::steady_clock;
// How often the receiving thread's wait for a frame checks whether it was stopped.
constexpr auto kStopCheck = std::chrono::milliseconds(100);
}  // namespace

ReceiveAhead::ReceiveAhead(rpc::TensorInbox* inbox, std::vector<ExpectedTensor> expected, Decode decode, int lookahead)
    : inbox_(inbox),
      expected_(std::move(expected)),
      decode_(std::move(decode)),
      lookahead_(std::max(lookahead, 1)),
      thread_(core::NamedThread("mrd-recv-ahead", [this] { Loop(); })) {}

ReceiveAhead::~ReceiveAhead() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ReceiveAhead::Loop() {
  for (const ExpectedTensor& e : expected_) {
    {  // at most lookahead_ decoded tensors wait for Take
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || static_cast<int>(ready_.size()) < lookahead_; });
      if (stop_) return;
    }
    absl::StatusOr<std::vector<uint8_t>> frame;
    while (true) {
      frame = inbox_->Wait(e.peer, e.key, Clock::now() + kStopCheck);
      if (frame.ok() || !absl::IsDeadlineExceeded(frame.status())) break;
      std::lock_guard<std::mutex> l(mu_);
      if (stop_) return;
    }
    absl::StatusOr<torch::Tensor> tensor = absl::UnknownError("not decoded");
    double seconds = 0;
    if (!frame.ok()) {
      tensor = frame.status();
    } else {
      const auto t0 = Clock::now();
      try {
        tensor = decode_(e, *frame);
      } catch (const std::exception& ex) {  // libtorch's exceptions end here, as at every torch boundary
        tensor =
            absl::InternalError(absl::StrCat("decoding ", e.key.ToString(), " from peer '", e.peer, "': ", ex.what()));
      }
      seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    std::lock_guard<std::mutex> l(mu_);
    decode_seconds_ += seconds;
    if (!tensor.ok()) {
      error_ = tensor.status();
      cv_.notify_all();
      return;
    }
    ready_.push_back(std::move(*tensor));
    cv_.notify_all();
  }
}

absl::StatusOr<torch::Tensor> ReceiveAhead::Take(const std::string& peer, const rpc::TensorKey& key,
                                                 Clock::duration timeout) {
  std::unique_lock<std::mutex> l(mu_);
  if (!error_.ok() && ready_.empty()) return error_;
  if (taken_ >= expected_.size() || expected_[taken_].peer != peer || !(expected_[taken_].key == key))
    return absl::InvalidArgumentError(absl::StrCat("asked for ", key.ToString(), " from peer '", peer,
                                                   "' out of the order the step expects (a bug)"));
  // The tensors decoded before a failure are handed out first; the failure then ends the receiving.
  const bool ready = cv_.wait_for(l, timeout, [&] { return !ready_.empty() || !error_.ok(); });
  if (!ready)
    return absl::DeadlineExceededError(
        absl::StrCat("no ", key.ToString(), " from peer '", peer, "' before the deadline"));
  if (ready_.empty()) return error_;
  torch::Tensor t = std::move(ready_.front());
  ready_.pop_front();
  ++taken_;
  cv_.notify_all();
  return t;
}

double ReceiveAhead::decode_seconds() const {
  std::lock_guard<std::mutex> l(mu_);
  return decode_seconds_;
}

int ReceiveAhead::decoded() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int>(taken_ + ready_.size());
}

}  // namespace meridian::executor
