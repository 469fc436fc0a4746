#include "executor/diloco.h"

#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/thread_name.h"
#include "partitioner/schedule.h"

namespace meridian::executor {

std::vector<std::vector<int>> SplitFragments(const std::vector<int64_t>& numels, int fragments) {
  const int n = static_cast<int>(numels.size());
  fragments = std::max(1, std::min(fragments, std::max(n, 1)));
  int64_t total = 0;
  for (int64_t x : numels) total += x;
  std::vector<std::vector<int>> out(static_cast<size_t>(fragments));
  int64_t seen = 0;
  for (int i = 0, f = 0; i < n; ++i) {
    // Move to the next group once this one holds its share, keeping a parameter for every later group.
    while (f + 1 < fragments && !out[f].empty() && (seen * fragments >= total * (f + 1) || n - i <= fragments - 1 - f))
      ++f;
    out[f].push_back(i);
    seen += numels[i];
  }
  return out;
}

void OuterStep(const core::SyncSpec& spec, const torch::Tensor& delta, torch::Tensor& momentum, torch::Tensor& outer) {
  torch::NoGradGuard no_grad;
  if (spec.sparseloco()) {  // its momentum is the replicas' decayed residuals
    outer.add_(delta, -spec.outer_lr);
    return;
  }
  momentum.mul_(spec.outer_momentum).add_(delta);
  if (spec.outer_optimizer == "nesterov")
    outer.add_(delta + spec.outer_momentum * momentum, -spec.outer_lr);
  else
    outer.add_(momentum, -spec.outer_lr);
}

OuterSync::OuterSync(core::SyncSpec spec, double weight, std::vector<std::pair<std::string, torch::Tensor>> params)
    : spec_(std::move(spec)), weight_(weight), params_(std::move(params)) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> numels;
  for (const auto& [name, p] : params_) {
    outer_.push_back(p.detach().clone());
    momentum_.push_back(torch::zeros_like(p.detach()));
    numels.push_back(p.numel());
  }
  snapshot_.resize(params_.size());
  fragments_ = SplitFragments(numels, spec_.fragments);
  for (const auto& fragment : fragments_) {
    buffers_.emplace_back();
    for (int i : fragment)
      buffers_.back().emplace_back(params_[i].first,
                                   torch::zeros(params_[i].second.sizes(), torch::kFloat32).set_requires_grad(true));
  }
}

OuterSync::~OuterSync() {
  if (exchange_.joinable()) {  // the exchange thread may be inside its averager's Finish: cancel, then join it
    cancelled_ = true;
    if (pending_ >= 0 && pending_ < static_cast<int>(averagers_.size())) averagers_[pending_]->Cancel();
    exchange_.join();
  }
}

absl::Status OuterSync::Attach(std::vector<std::unique_ptr<GradientAverager>> averagers) {
  averagers_ = std::move(averagers);
  if (absl::Status s = ImportResiduals(); !s.ok()) return s;
  if (run_again_) return BeginAgain();  // resumed: at once, as the other replicas do
  return absl::OkStatus();
}

absl::Status OuterSync::ImportResiduals() {
  if (restored_residuals_.empty()) return absl::OkStatus();
  for (size_t f = 0; f < averagers_.size(); ++f) {
    std::map<std::string, torch::Tensor> mine;
    for (const auto& [name, buffer] : buffers_[f]) mine[name] = restored_residuals_.at(name);
    if (absl::Status s = averagers_[f]->ImportResiduals(mine); !s.ok())
      return core::Annotate(s, absl::StrCat("outer synchronisation: restoring fragment ", f, "'s residuals"));
  }
  restored_residuals_.clear();
  return absl::OkStatus();
}

void OuterSync::Exchange(int f, int64_t number) {
  struct Done {
    std::atomic<bool>* done;
    ~Done() { done->store(true); }
  } done{&exchange_done_};
  try {
    GradientAverager& averager = *averagers_[f];
    if (cancelled_) {
      exchange_status_ = absl::CancelledError("outer synchronisation: the stage ended");
      return;
    }
    // The frames' step is the exchange's own number (ExchangeNumber), the same on every replica.
    averager.BeginStep(number);  // clears the averager's own abort flag: look at ours again after it
    if (cancelled_ || cancel_requested_) averager.Cancel();
    exchange_status_ = averager.Finish();
  } catch (const std::exception& e) {  // on its own thread, outside the stage's torch boundary
    exchange_status_ = absl::InternalError(absl::StrCat("outer synchronisation of fragment ", f, ": ", e.what()));
  }
}

void OuterSync::LoadPseudoGradient(int f, const std::vector<torch::Tensor>& local) {
  torch::NoGradGuard no_grad;
  drift2_ = 0;
  const auto& fragment = fragments_[f];
  for (size_t k = 0; k < fragment.size(); ++k) {
    const int i = fragment[k];
    torch::Tensor delta = outer_[i] - local[k];
    drift2_ += delta.to(torch::kFloat64).pow(2).sum().item<double>();
    buffers_[f][k].second.mutable_grad() = (delta * weight_).to(torch::kCPU, torch::kFloat32);
  }
}

int64_t OuterSync::ExchangeNumber(int64_t step, int f) const {
  return step * static_cast<int64_t>(fragments_.size()) + f;
}

void OuterSync::StartExchange(int f, int64_t step, bool overlap, int64_t number) {
  pending_ = -1;
  wire_bytes_at_begin_ = averagers_[f]->wire_bytes();
  raw_bytes_at_begin_ = averagers_[f]->raw_bytes();
  pending_step_ = step;
  began_ = std::chrono::steady_clock::now();
  pending_overlapped_ = overlap;
  cancel_requested_ = false;
  sum_restored_ = false;
  // An overlapped exchange may be checkpointed in flight and run again on resume, from these residuals.
  pending_residuals_.clear();
  pending_residuals_status_ = absl::OkStatus();
  if (overlap) {
    auto residuals = averagers_[f]->ExportResiduals();  // idle until the exchange begins below
    if (residuals.ok())
      pending_residuals_ = std::move(*residuals);
    else
      pending_residuals_status_ = residuals.status();  // a checkpoint taken while it runs fails with it
  }
  // On a thread of its own also when not overlapped, if it may have to be cancelled while awaited.
  exchange_done_ = false;
  if (overlap || cancel_check_)
    exchange_ =
        core::NamedThread("mrd-diloco", [this, f, number] { Exchange(f, number); });  // may throw: nothing pending
  else
    Exchange(f, number);
  pending_ = f;
}

void OuterSync::Begin(int f, int64_t step, bool overlap, int64_t number) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> local;
  for (int i : fragments_[f]) {
    local.push_back(params_[i].second.detach());
    if (overlap) snapshot_[i] = local.back().clone();
  }
  LoadPseudoGradient(f, local);
  StartExchange(f, step, overlap, number);
}

absl::Status OuterSync::BeginAgain() {
  if (averagers_.size() != fragments_.size())
    return absl::FailedPreconditionError("outer synchronisation: no averager attached");
  const int f = pending_;
  run_again_ = false;
  std::vector<torch::Tensor> local;
  for (int i : fragments_[f]) local.push_back(snapshot_[i]);
  LoadPseudoGradient(f, local);
  StartExchange(f, pending_step_, /*overlap=*/true, ExchangeNumber(pending_step_, f));
  return absl::OkStatus();
}

void OuterSync::AwaitExchange() {
  if (!exchange_.joinable()) return;
  const auto t0 = std::chrono::steady_clock::now();
  while (cancel_check_ && !exchange_done_.load()) {
    if (cancel_check_()) {
      cancel_requested_ = true;  // before Cancel: an exchange not yet in BeginStep sees it after
      averagers_[pending_]->Cancel();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  exchange_.join();
  last_wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

absl::Status OuterSync::Complete() {
  if (pending_ < 0) return absl::OkStatus();
  if (run_again_)  // resumed, and not begun at Attach
    if (absl::Status s = BeginAgain(); !s.ok()) return s;
  const int f = pending_;
  const bool overlapped = pending_overlapped_;
  AwaitExchange();
  pending_ = -1;
  sum_restored_ = false;
  pending_residuals_.clear();
  if (!exchange_status_.ok()) return exchange_status_;
  torch::NoGradGuard no_grad;
  const auto& fragment = fragments_[f];
  for (size_t k = 0; k < fragment.size(); ++k) {
    const int i = fragment[k];
    torch::Tensor& p = params_[i].second;
    const torch::Tensor sum = buffers_[f][k].second.grad().to(p.device(), p.scalar_type());
    if (!torch::isfinite(sum).all().item<bool>())
      return absl::DataLossError(absl::StrCat("outer synchronisation after step ", pending_step_ + 1,
                                              ": the replicas' ", "summed pseudo-gradient of ", params_[i].first,
                                              " is not finite"));
    OuterStep(spec_, sum, momentum_[i], outer_[i]);
    if (overlapped) {  // keep what this replica learnt while the exchange ran
      p.detach().copy_(outer_[i] + (p.detach() - snapshot_[i]));
      snapshot_[i] = torch::Tensor();
    } else {
      p.detach().copy_(outer_[i]);
    }
  }
  GradientAverager& averager = *averagers_[f];  // counters since the exchange began (a resumed one: before)
  last_.fragment = f;
  last_.step = pending_step_;
  last_.wire_bytes = averager.wire_bytes() - wire_bytes_at_begin_;
  last_.raw_bytes = averager.raw_bytes() - raw_bytes_at_begin_;
  last_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began_).count();
  last_.drift = std::sqrt(drift2_);
  wire_bytes_ += last_.wire_bytes;
  raw_bytes_ += last_.raw_bytes;
  ++applied_;
  return absl::OkStatus();
}

void OuterSync::Suspend() {
  suspended_ = true;
  if (exchange_.joinable()) {
    cancel_requested_ = true;
    if (pending_ >= 0 && pending_ < static_cast<int>(averagers_.size())) averagers_[pending_]->Cancel();
    exchange_.join();
  }
  pending_ = -1;
  run_again_ = false;
  sum_restored_ = false;
  pending_residuals_.clear();
  for (auto& s : snapshot_) s = torch::Tensor();
}

absl::Status OuterSync::AfterInnerStep(int64_t step) {
  last_wait_seconds_ = 0;
  if (suspended_) return absl::OkStatus();
  const int f = partitioner::FragmentDueAfter(step, spec_.inner_steps, static_cast<int>(fragments_.size()));
  if (f < 0) return absl::OkStatus();
  if (averagers_.size() != fragments_.size())
    return absl::FailedPreconditionError("outer synchronisation: no averager attached");
  if (absl::Status s = Complete(); !s.ok()) return s;
  Begin(f, step, spec_.overlap, ExchangeNumber(step, f));
  if (!spec_.overlap) return Complete();
  return absl::OkStatus();
}

absl::Status OuterSync::Finish(int64_t step) {
  if (suspended_)
    return absl::FailedPreconditionError(absl::StrCat(
        "the outer synchronisation is suspended (a replica was lost) and the run's last step came before the "
        "switch that re-plans without it: the replicas' weights differ"));
  return SynchroniseAll(step, /*numbered_after=*/step);
}

absl::Status OuterSync::FinishAtBoundary(int64_t step) {
  last_wait_seconds_ = 0;
  if (suspended_) return absl::OkStatus();
  // AfterInnerStep(step) may have begun an exchange numbered after `step`: these come after step + 1's
  // numbers, which this attempt never uses, so that no frame of them can replace one of that exchange.
  return SynchroniseAll(step, /*numbered_after=*/step + 1);
}

absl::Status OuterSync::SynchroniseAll(int64_t step, int64_t numbered_after) {
  const auto t0 = std::chrono::steady_clock::now();
  if (averagers_.size() != fragments_.size())
    return absl::FailedPreconditionError("outer synchronisation: no averager attached");
  absl::Status s = Complete();
  for (int f = 0; s.ok() && f < static_cast<int>(fragments_.size()); ++f) {
    Begin(f, step, /*overlap=*/false, ExchangeNumber(numbered_after, f));
    s = Complete();
  }
  last_wait_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (s.ok()) synchronised_after_ = step;
  return s;
}

std::vector<std::string> OuterSync::StateNames(const std::string& name) {
  return {"outer.param." + name, "outer.momentum." + name};
}

std::map<std::string, torch::Tensor> OuterSync::ExportState() const {
  std::map<std::string, torch::Tensor> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto names = StateNames(params_[i].first);
    out[names[0]] = outer_[i].detach().cpu();
    out[names[1]] = momentum_[i].detach().cpu();
  }
  return out;
}

absl::Status OuterSync::ImportState(const std::map<std::string, torch::Tensor>& state) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> outer, momentum;  // by default: the parameters as they are now (just restored)
  for (const auto& [name, p] : params_) {
    outer.push_back(p.detach().clone());
    momentum.push_back(torch::zeros_like(p.detach()));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto names = StateNames(params_[i].first);
    for (int k = 0; k < 2; ++k) {
      auto it = state.find(names[k]);
      if (it == state.end()) continue;
      const torch::Tensor& p = params_[i].second;
      if (it->second.sizes() != p.sizes())
        return absl::DataLossError(absl::StrCat(names[k], " has shape ", c10::str(it->second.sizes()),
                                                " but parameter ", params_[i].first, " has ", c10::str(p.sizes())));
      (k == 0 ? outer : momentum)[i] = it->second.to(p.device(), p.scalar_type()).clone();
    }
  }
  outer_ = std::move(outer);
  momentum_ = std::move(momentum);
  return absl::OkStatus();
}

namespace {
constexpr char kRoundName[] = "outer.round";
std::string SnapshotName(const std::string& name) { return "outer.snapshot." + name; }
std::string SumName(const std::string& name) { return "outer.sum." + name; }
std::string ResidualName(const std::string& name) { return "outer.residual." + name; }
}  // namespace

absl::Status OuterSync::ExportResiduals(bool in_flight_runs_again, std::map<std::string, torch::Tensor>* out) {
  if (averagers_.size() != fragments_.size()) {  // not attached: what was restored, if anything
    for (const auto& [name, t] : restored_residuals_) (*out)[ResidualName(name)] = t.clone();
    return absl::OkStatus();
  }
  for (int f = 0; f < static_cast<int>(fragments_.size()); ++f) {
    std::map<std::string, torch::Tensor> residuals;
    if (f == pending_ && in_flight_runs_again) {
      if (!pending_residuals_status_.ok()) return pending_residuals_status_;
      residuals = pending_residuals_;
    } else {
      auto exported = averagers_[f]->ExportResiduals();
      if (!exported.ok()) return exported.status();
      residuals = std::move(*exported);
    }
    for (auto& [name, t] : residuals) (*out)[ResidualName(name)] = std::move(t);
  }
  return absl::OkStatus();
}

std::pair<int64_t, int64_t> OuterSync::AveragerBytes(int f) const {
  if (static_cast<size_t>(f) >= averagers_.size()) return {0, 0};  // restored, not yet attached
  return {averagers_[f]->wire_bytes(), averagers_[f]->raw_bytes()};
}

absl::StatusOr<std::map<std::string, torch::Tensor>> OuterSync::ExportRoundState(bool await_exchange) {
  std::map<std::string, torch::Tensor> out;
  torch::Tensor round = torch::full({6}, -1.0, torch::kFloat64);
  // Without its snapshot (not overlapped) the exchange cannot be run again: it is awaited. A sum restored
  // from a round state is saved again (the residuals it left are the averager's now).
  const bool with_sum = await_exchange || !pending_overlapped_ || sum_restored_;
  if (pending_ >= 0) {
    if (with_sum) {
      if (run_again_)  // resumed, and not begun at Attach
        if (absl::Status s = BeginAgain(); !s.ok()) return s;
      AwaitExchange();
      if (!exchange_status_.ok())
        return absl::Status(exchange_status_.code(),
                            absl::StrCat("the outer exchange of fragment ", pending_, " begun after step ",
                                         pending_step_ + 1, ": ", exchange_status_.message()));
    }
    const int f = pending_;
    round[0] = static_cast<double>(f);
    round[1] = static_cast<double>(pending_step_);
    round[2] = drift2_;
    const auto [wire, raw] = AveragerBytes(f);
    round[3] = static_cast<double>(wire - wire_bytes_at_begin_);
    round[4] = static_cast<double>(raw - raw_bytes_at_begin_);
    round[5] = std::chrono::duration<double>(std::chrono::steady_clock::now() - began_).count();
    const auto& fragment = fragments_[f];
    for (size_t k = 0; k < fragment.size(); ++k) {
      const int i = fragment[k];
      const std::string& name = params_[i].first;
      // The exchange thread writes the sum into the buffers' .grad: read only once it has ended.
      if (with_sum) out[SumName(name)] = buffers_[f][k].second.grad().detach().cpu().clone();
      if (pending_overlapped_) out[SnapshotName(name)] = snapshot_[i].detach().cpu().clone();
    }
  }
  // Without its sum the exchange in flight runs again on resume, from the residuals it began with.
  if (absl::Status s = ExportResiduals(/*in_flight_runs_again=*/pending_ >= 0 && !with_sum, &out); !s.ok()) return s;
  out[kRoundName] = round;
  return out;
}

absl::Status OuterSync::ImportRoundState(const std::map<std::string, torch::Tensor>& state) {
  torch::NoGradGuard no_grad;
  auto round_it = state.find(kRoundName);
  if (round_it == state.end() || round_it->second.numel() != 6)
    return absl::DataLossError(absl::StrCat(kRoundName, " is missing or not 6 values"));
  const torch::Tensor round = round_it->second.to(torch::kFloat64);
  // The error-feedback residuals: every parameter's or none (a lossless codec, or a checkpoint from before
  // they were saved).
  std::map<std::string, torch::Tensor> residuals;
  for (const auto& [name, p] : params_) {
    auto it = state.find(ResidualName(name));
    if (it == state.end()) continue;
    if (it->second.sizes() != p.sizes())
      return absl::DataLossError(absl::StrCat(ResidualName(name), " has shape ", c10::str(it->second.sizes()),
                                              " but parameter ", name, " has ", c10::str(p.sizes())));
    residuals[name] = it->second.to(torch::kCPU, torch::kFloat32).clone();
  }
  if (!residuals.empty() && residuals.size() != params_.size())
    for (const auto& [name, p] : params_)
      if (!residuals.count(name))
        return absl::DataLossError(absl::StrCat(ResidualName(name), " is missing from the round state, which holds ",
                                                residuals.size(), " other parameters' residuals"));
  const int f = static_cast<int>(round[0].item<double>());
  if (f >= static_cast<int>(fragments_.size()))
    return absl::DataLossError(absl::StrCat(kRoundName, " names fragment ", f, " of ", fragments_.size()));
  auto keep_residuals = [&]() -> absl::Status {  // once everything else is set
    restored_residuals_ = std::move(residuals);
    return averagers_.size() == fragments_.size() ? ImportResiduals() : absl::OkStatus();
  };
  if (f < 0) return keep_residuals();  // nothing was in flight
  // Everything checked before anything is set. The exchange's result (every sum) or, to run it again, the
  // snapshots it began from (no sum at all).
  const auto& fragment = fragments_[f];
  const bool again = !state.count(SumName(params_[fragment.front()].first));
  std::vector<torch::Tensor> sums, snapshots;
  for (int i : fragment) {
    const auto& [name, p] = params_[i];
    for (const std::string& key : {SumName(name), SnapshotName(name)}) {
      const bool is_sum = key == SumName(name);
      auto it = state.find(key);
      if (it == state.end()) {
        if (is_sum && again) continue;                      // to be run again from the snapshots
        if (!is_sum && !again && !spec_.overlap) continue;  // not overlapped: no snapshot
        return absl::DataLossError(absl::StrCat(key, " is missing from the round state",
                                                again ? " (it holds no sum: the exchange is to be run again)" : ""));
      }
      if (is_sum && again)
        return absl::DataLossError(
            absl::StrCat(key, " is in the round state, but the sum of ", params_[fragment.front()].first, " is not"));
      if (it->second.sizes() != p.sizes())
        return absl::DataLossError(absl::StrCat(key, " has shape ", c10::str(it->second.sizes()), " but parameter ",
                                                name, " has ", c10::str(p.sizes())));
      (is_sum ? sums : snapshots).push_back(it->second);
    }
  }
  const bool overlapped = snapshots.size() == fragment.size();
  for (size_t k = 0; k < fragment.size(); ++k) {
    const int i = fragment[k];
    if (!again) buffers_[f][k].second.mutable_grad() = sums[k].to(torch::kCPU, torch::kFloat32).clone();
    if (overlapped) snapshot_[i] = snapshots[k].to(params_[i].second.device(), params_[i].second.scalar_type());
  }
  pending_ = f;
  pending_step_ = static_cast<int64_t>(round[1].item<double>());
  pending_overlapped_ = overlapped;
  exchange_status_ = absl::OkStatus();
  exchange_done_ = true;
  if (again) {  // begun again at Attach (the averagers' counters and the clock start again then)
    run_again_ = true;
    began_ = std::chrono::steady_clock::now();
    return keep_residuals();
  }
  sum_restored_ = true;
  drift2_ = round[2].item<double>();
  // Complete counts the averager's bytes since wire_bytes_at_begin_: the fresh averager's (none yet) plus
  // what the exchange took before the checkpoint.
  const auto [wire, raw] = AveragerBytes(f);
  wire_bytes_at_begin_ = wire - static_cast<int64_t>(round[3].item<double>());
  raw_bytes_at_begin_ = raw - static_cast<int64_t>(round[4].item<double>());
  began_ = std::chrono::steady_clock::now() - std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                  std::chrono::duration<double>(round[5].item<double>()));
  return keep_residuals();
}

}  // namespace meridian::executor
