#include "executor/run_stage.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "core/run_layout.h"

namespace meridian::executor {

std::set<std::string> StagePeers(const StageAssignment& a, const std::string& self) {
  std::set<std::string> peers;
  if (!a.prev_site.empty()) peers.insert(a.prev_site);
  if (!a.next_site.empty()) peers.insert(a.next_site);
  for (const auto* g : {&a.prev_replicas, &a.replicas, &a.next_replicas})
    for (const auto& site : g->sites)
      if (site != self) peers.insert(site);
  return peers;
}

StageRunResult RunStage(StageWorker& worker, const StageRun& run) {
  StageRunResult r;
  if (run.resume) {
    absl::StatusOr<Checkpoint> c = run.resume();
    if (!c.ok()) return {0, c.status()};
    if (absl::Status s = worker.Restore(*c); !s.ok()) return {0, s};
    r.steps_done = worker.restored_step();  // worker 0's, on a site of several devices
    if (run.forget_checkpoints_after_resume) worker.ForgetCheckpointsAfter(run.checkpoint_dir, c->step);
  }
  if (absl::Status s = worker.Connect(); !s.ok()) return {r.steps_done, s};
  worker.set_final_step(run.steps - 1);
  if (run.left_out) worker.set_left_out(run.left_out, run.left_out_wait);
  for (int64_t i = r.steps_done; i < run.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto loss = worker.Step(i, run.total_steps);
    if (!loss.ok()) return {r.steps_done, loss.status()};
    r.steps_done = i + 1;
    if (run.on_step)
      run.on_step({i, *loss, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()});
    const bool interval = run.checkpoint_interval > 0 && (i + 1) % run.checkpoint_interval == 0;
    int64_t boundary = 0;
    if (run.end_after && i + 1 < run.steps) {
      absl::StatusOr<int64_t> b = run.end_after(i + 1);
      if (!b.ok()) return {r.steps_done, b.status()};
      boundary = *b;
    }
    if (boundary > 0 && boundary < i + 1)  // past it (the lease rules that out): its neighbours may have ended there
      return {r.steps_done, absl::FailedPreconditionError(absl::StrCat("missed the step boundary ", boundary,
                                                                       ": heard of it after step ", i + 1,
                                                                       ", so the stages end unaligned"))};
    const bool at_boundary = boundary > 0 && boundary == i + 1 && i + 1 < run.steps;
    if (at_boundary)  // DiLoCo: every replica leaves the boundary with the outer parameters
      if (absl::Status s = worker.SynchroniseAtBoundary(i); !s.ok()) return {r.steps_done, s};
    if ((interval || at_boundary) && worker.saves_checkpoints()) {
      if (absl::Status s = worker.SaveCheckpoint(run.checkpoint_dir, i + 1, run.checkpoint_keep, at_boundary); !s.ok())
        return {r.steps_done, s};
      if (run.on_checkpoint)
        if (absl::Status s = run.on_checkpoint(i + 1); !s.ok()) return {r.steps_done, s};
    }
    if (at_boundary) {
      r.at_boundary = true;
      break;
    }
  }
  if (run.before_finish)
    if (absl::Status s = run.before_finish(); !s.ok()) return {r.steps_done, s};
  r.status = worker.Finish();
  return r;
}

}  // namespace meridian::executor
