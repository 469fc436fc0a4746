#include "coordinator/coordinator.h"

#include "absl/strings/str_cat.h"

namespace meridian::coordinator {

Coordinator::Coordinator(core::ClusterSpec spec, std::string run_id) : spec_(std::move(spec)), run_id_(std::move(run_id)) {
  for (const auto& s : spec_.sites) sites_[s.name];
}

absl::StatusOr<v1::RegisterResponse> Coordinator::Register(const v1::RegisterRequest& r) {
  v1::RegisterResponse resp;
  {
    std::lock_guard<std::mutex> l(mu_);
    Site& s = sites_[r.site()];
    s.registered = true;
    s.listen = r.listen_address();
    s.device = r.device();
    s.state = "idle";
    s.last_heartbeat = Clock::now();
    resp.set_cluster(spec_.name);
    resp.set_run_id(run_id_);
    resp.set_heartbeat_interval_seconds(spec_.heartbeat_interval_seconds);
    resp.set_heartbeat_timeout_seconds(spec_.heartbeat_timeout_seconds);
    for (const auto& site : spec_.sites) resp.add_sites(site.name);
  }
  cv_.notify_all();
  return resp;
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& r) {
  v1::HeartbeatResponse resp;
  {
    std::lock_guard<std::mutex> l(mu_);
    Site& s = sites_[r.site()];
    if (!s.registered) return absl::FailedPreconditionError(absl::StrCat("site '", r.site(), "' has not registered"));
    s.last_heartbeat = Clock::now();
    s.state = r.state();
    s.step = r.step();
    resp.set_stop(stopping_);
  }
  cv_.notify_all();
  return resp;
}

absl::StatusOr<std::optional<v1::Command>> Coordinator::NextCommand(const std::string& site,
                                                                    std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  Site& s = sites_[site];
  cv_.wait_for(l, timeout, [&] { return !s.commands.empty(); });
  if (s.commands.empty()) return std::optional<v1::Command>();
  v1::Command c = std::move(s.commands.front());
  s.commands.pop_front();
  return std::optional<v1::Command>(std::move(c));
}

void Coordinator::Requeue(const std::string& site, v1::Command c) {
  {
    std::lock_guard<std::mutex> l(mu_);
    sites_[site].commands.push_front(std::move(c));
  }
  cv_.notify_all();
}

absl::Status Coordinator::Metrics(const v1::MetricsReport& r) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!r.job_id().empty() && r.job_id() != job_id_) return absl::OkStatus();  // an abandoned attempt
    if (r.step() > progress_.step) {
      progress_.step = r.step();
      progress_.loss = r.loss();
      progress_.step_seconds = r.step_seconds();
      progress_.tokens += r.tokens();
    }
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status Coordinator::Profile(const v1::ProfileReport& r) {
  {
    std::lock_guard<std::mutex> l(mu_);
    sites_[r.site()].profile = r;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status Coordinator::Done(const v1::StageDone& d) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!d.job_id().empty() && d.job_id() != job_id_) return absl::OkStatus();  // an abandoned attempt
    sites_[d.site()].done = d;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

void Coordinator::BeginJob(const std::string& job_id) {
  {
    std::lock_guard<std::mutex> l(mu_);
    job_id_ = job_id;
    for (auto& [name, site] : sites_) site.done.reset();
    progress_.step = -1;
  }
  cv_.notify_all();
}

void Coordinator::Send(const std::string& site, v1::Command c) {
  {
    std::lock_guard<std::mutex> l(mu_);
    sites_[site].commands.push_back(std::move(c));
  }
  cv_.notify_all();
}

void Coordinator::StopAll() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
    v1::Command stop;
    stop.set_stop(true);
    for (auto& [name, s] : sites_)
      if (s.registered) s.commands.push_back(stop);
  }
  cv_.notify_all();
}

bool Coordinator::WaitFor(const Predicate& pred, Clock::time_point deadline) {
  std::unique_lock<std::mutex> l(mu_);
  return cv_.wait_until(l, deadline, [&] { return pred(sites_, progress_); });
}

std::vector<std::string> Coordinator::Silent() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::string> out;
  const auto limit = std::chrono::duration<double>(spec_.heartbeat_timeout_seconds);
  for (const auto& [name, s] : sites_)
    if (s.registered && s.state != "done" && Clock::now() - s.last_heartbeat > limit) out.push_back(name);
  return out;
}

std::map<std::string, Coordinator::Site> Coordinator::Snapshot() const {
  std::lock_guard<std::mutex> l(mu_);
  return sites_;
}

Coordinator::Progress Coordinator::progress() const {
  std::lock_guard<std::mutex> l(mu_);
  return progress_;
}

}  // namespace meridian::coordinator
