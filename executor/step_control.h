// What the coordinator's heartbeat answers say about the running attempt's steps (proto
// HeartbeatResponse): its step boundary (the attempt ends there: a switch to another plan), its step lease
// (how many steps its stages may complete) and the DiLoCo workers left out.
//
// The lease makes a boundary safe however late a stage hears of it: the coordinator places every boundary
// at or after each lease it granted, and a stage that has used up its lease waits between steps until the
// next answer grants more, sets the boundary, or abandons the attempt. A heartbeat answer that is late or
// lost costs a pause, never a stage past the boundary.
//
// Thread-safe: the heartbeat thread calls Update, the stage's thread WaitAfter.
#ifndef MERIDIAN_EXECUTOR_STEP_CONTROL_H_
#define MERIDIAN_EXECUTOR_STEP_CONTROL_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "proto/meridian.pb.h"

namespace meridian::executor {

class StepControl {
 public:
  // Takes one heartbeat answer's boundary, lease and left-out sites; wakes WaitAfter.
  void Update(const v1::HeartbeatResponse& answer);

  // Called by attempt `job_id`'s stage after `steps_done` steps, with more to come. Returns:
  // - S > 0, the attempt's step boundary, once one is set (the stage ends at S when S == steps_done; a
  //   boundary below steps_done was missed, which the lease rules out unless the coordinator broke it);
  // - 0 once the lease covers the next step (lease_steps > steps_done) and no boundary is set;
  // - Aborted, naming the attempt, when the coordinator abandoned it, or moved on to another attempt
  //   after this one's lease had come (a site frozen past the heartbeat timeout wakes to find its attempt
  //   replaced: the answers, in order, name the newer one).
  // Waits meanwhile, however long: the heartbeat thread ends the process when the coordinator stops
  // answering. While it waits it calls `ask` (ask for a heartbeat now) at once and then every `ask_every`,
  // and `waiting(seconds)` every `say_every` (for a log line). A lease of another attempt before this
  // one's first came (an answer computed before this attempt began) grants nothing.
  absl::StatusOr<int64_t> WaitAfter(const std::string& job_id, int64_t steps_done, const std::function<void()>& ask,
                                    std::chrono::milliseconds ask_every,
                                    const std::function<void(double seconds)>& waiting = {},
                                    std::chrono::milliseconds say_every = std::chrono::seconds(10));

  // The DiLoCo workers lost from attempt `job_id` that the others leave out (with its boundary).
  std::set<std::string> LeftOut(const std::string& job_id) const;

  // The seconds WaitAfter has waited for attempt `job_id`'s lease so far (0 for another attempt).
  double waited_seconds(const std::string& job_id) const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string boundary_job_;  // guarded by mu_
  int64_t boundary_steps_ = 0;
  std::set<std::string> left_out_;
  std::string lease_job_;
  int64_t lease_steps_ = 0;
  bool abandoned_ = false;
  std::set<std::string> leased_;  // every attempt whose lease an answer named
  std::string waited_job_;        // the attempt of waited_ (WaitAfter)
  double waited_ = 0;
};

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_STEP_CONTROL_H_
