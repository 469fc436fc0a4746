#include "executor/step_control.h"

#include "absl/strings/str_cat.h"

namespace meridian::executor {

using Clock = std::chrono::steady_clock;

void StepControl::Update(const v1::HeartbeatResponse& answer) {
  {
    std::lock_guard<std::mutex> l(mu_);
    boundary_job_ = answer.end_job_id();
    boundary_steps_ = answer.end_after_step();
    left_out_ = {answer.left_out().begin(), answer.left_out().end()};
    lease_job_ = answer.lease_job_id();
    lease_steps_ = answer.lease_steps();
    abandoned_ = answer.lease_abandoned();
    if (!lease_job_.empty()) leased_.insert(lease_job_);
  }
  cv_.notify_all();
}

absl::StatusOr<int64_t> StepControl::WaitAfter(const std::string& job_id, int64_t steps_done,
                                               const std::function<void()>& ask, std::chrono::milliseconds ask_every,
                                               const std::function<void(double)>& waiting,
                                               std::chrono::milliseconds say_every) {
  const Clock::time_point start = Clock::now();
  Clock::time_point next_ask = start, next_say = start + say_every;
  bool blocked = false;  // not granted at the first look
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    if (lease_job_ == job_id && abandoned_)
      return absl::AbortedError(absl::StrCat("the coordinator abandoned attempt ", job_id, " after step ", steps_done));
    if (!lease_job_.empty() && lease_job_ != job_id && leased_.count(job_id))
      return absl::AbortedError(absl::StrCat("the coordinator moved on from attempt ", job_id, " to attempt ",
                                             lease_job_, " (this stage is after step ", steps_done, ")"));
    if (boundary_job_ == job_id && boundary_steps_ > 0) break;
    if (lease_job_ == job_id && lease_steps_ > steps_done) break;
    blocked = true;
    const Clock::time_point now = Clock::now();
    if (now >= next_ask) {
      next_ask = now + ask_every;
      if (ask) {
        l.unlock();
        ask();
        l.lock();
        continue;  // the answer may have come meanwhile
      }
    }
    if (now >= next_say) {
      next_say = now + say_every;
      if (waiting) {
        l.unlock();
        waiting(std::chrono::duration<double>(now - start).count());
        l.lock();
        continue;
      }
    }
    cv_.wait_until(l, std::min(next_ask, next_say));
  }
  if (waited_job_ != job_id) waited_job_ = job_id, waited_ = 0;
  if (blocked) waited_ += std::chrono::duration<double>(Clock::now() - start).count();
  return boundary_job_ == job_id ? boundary_steps_ : 0;
}

std::set<std::string> StepControl::LeftOut(const std::string& job_id) const {
  std::lock_guard<std::mutex> l(mu_);
  return boundary_job_ == job_id ? left_out_ : std::set<std::string>{};
}

double StepControl::waited_seconds(const std::string& job_id) const {
  std::lock_guard<std::mutex> l(mu_);
  return waited_job_ == job_id ? waited_ : 0;
}

}  // namespace meridian::executor
