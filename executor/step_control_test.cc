#include "executor/step_control.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>

namespace meridian::executor {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

v1::HeartbeatResponse Answer(const std::string& lease_job, int64_t lease_steps, const std::string& boundary_job = "",
                             int64_t boundary = 0, bool abandoned = false) {
  v1::HeartbeatResponse a;
  a.set_lease_job_id(lease_job);
  a.set_lease_steps(lease_steps);
  a.set_lease_abandoned(abandoned);
  a.set_end_job_id(boundary_job);
  a.set_end_after_step(boundary);
  return a;
}

// Within its lease a stage goes on at once, without asking for a heartbeat.
TEST(StepControl, WithinTheLeaseTheStageGoesOnAtOnce) {
  StepControl c;
  c.Update(Answer("r", 10));
  int asked = 0;
  auto go = c.WaitAfter(
      "r", 9, [&] { ++asked; }, 1000ms);
  ASSERT_TRUE(go.ok()) << go.status();
  EXPECT_EQ(*go, 0);
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(c.waited_seconds("r"), 0);
}

// Past its lease the stage asks for a heartbeat and waits: the answer that grants more lets it go on.
TEST(StepControl, PastTheLeaseTheStageAsksAndWaitsForMore) {
  StepControl c;
  c.Update(Answer("r", 10));
  std::atomic<int> asked{0};
  std::promise<void> first_ask;
  auto waiting = std::async(std::launch::async, [&] {
    return c.WaitAfter(
        "r", 10,
        [&] {
          if (asked++ == 0) first_ask.set_value();
        },
        20ms);
  });
  first_ask.get_future().wait();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(waiting.wait_for(0ms), std::future_status::timeout) << "it went past its lease";
  EXPECT_GE(asked.load(), 2) << "it asks again while it waits";
  c.Update(Answer("r", 40));
  auto go = waiting.get();
  ASSERT_TRUE(go.ok()) << go.status();
  EXPECT_EQ(*go, 0);
  EXPECT_GT(c.waited_seconds("r"), 0.05);
}

// The boundary ends the wait: the stage at it ends there. A boundary beyond the steps done also lets it go
// on without a lease (up to the boundary).
TEST(StepControl, ABoundaryEndsTheWaitWhereverTheLease) {
  StepControl c;
  c.Update(Answer("r", 10));
  auto waiting = std::async(std::launch::async, [&] { return c.WaitAfter("r", 10, {}, 1000ms); });
  std::this_thread::sleep_for(50ms);
  c.Update(Answer("r", 10, "r", 10));
  auto at = waiting.get();
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(*at, 10);
  c.Update(Answer("r", 10, "r", 12));
  auto beyond = c.WaitAfter("r", 11, {}, 1000ms);
  ASSERT_TRUE(beyond.ok());
  EXPECT_EQ(*beyond, 12);
}

// An answer about another attempt (computed before this one began) grants nothing, nor does its
// boundary end this attempt; an abandoned attempt's stage ends with Aborted, naming it.
TEST(StepControl, AnotherAttemptsLeaseGrantsNothingAndAnAbandonedAttemptEnds) {
  StepControl c;
  c.Update(Answer("r", 100, "r", 50));
  auto waiting = std::async(std::launch::async, [&] { return c.WaitAfter("r-1", 5, {}, 1000ms); });
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(waiting.wait_for(0ms), std::future_status::timeout);
  EXPECT_TRUE(c.LeftOut("r-1").empty());
  c.Update(Answer("r-1", 5, "", 0, /*abandoned=*/true));
  auto ended = waiting.get();
  EXPECT_EQ(ended.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(ended.status().message()), HasSubstr("abandoned attempt r-1 after step 5"));
}

// A stage that finds its attempt replaced once its lease had come (its site was frozen past the heartbeat
// timeout, and the coordinator went on without it) ends at once, naming both attempts.
TEST(StepControl, AStageWhoseAttemptWasReplacedEnds) {
  StepControl c;
  c.Update(Answer("r", 3));
  ASSERT_TRUE(c.WaitAfter("r", 2, {}, 1000ms).ok());
  c.Update(Answer("r-1", 0));
  auto ended = c.WaitAfter("r", 3, {}, 1000ms);
  EXPECT_EQ(ended.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(ended.status().message()), HasSubstr("moved on from attempt r to attempt r-1"));
}

// The DiLoCo workers left out come with the boundary of their attempt.
TEST(StepControl, LeftOutSitesAreThoseOfTheAttemptsBoundary) {
  StepControl c;
  v1::HeartbeatResponse a = Answer("r", 10, "r", 12);
  a.add_left_out("b");
  c.Update(a);
  EXPECT_THAT(c.LeftOut("r"), ::testing::ElementsAre("b"));
  EXPECT_TRUE(c.LeftOut("r-1").empty());
}

// While it waits, a line says so every `say_every`.
TEST(StepControl, ALongWaitIsSaid) {
  StepControl c;
  std::atomic<int> said{0};
  auto waiting = std::async(std::launch::async, [&] {
    return c.WaitAfter(
        "r", 1, {}, 1000ms, [&](double) { ++said; }, 20ms);
  });
  std::this_thread::sleep_for(150ms);
  c.Update(Answer("r", 2));
  ASSERT_TRUE(waiting.get().ok());
  EXPECT_GE(said.load(), 2);
}

}  // namespace
}  // namespace meridian::executor
