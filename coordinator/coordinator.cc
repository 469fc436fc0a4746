#include "coordinator/coordinator.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/step_figures.h"
#include "core/checkpoint_dir.h"
#include "core/files.h"
#include "core/run_layout.h"

namespace meridian::coordinator {

const char* SiteStateName(v1::SiteState state) {
  switch (state) {
    case v1::SITE_IDLE:
      return "idle";
    case v1::SITE_PROFILING:
      return "profiling";
    case v1::SITE_TRAINING:
      return "training";
    case v1::SITE_DONE:
      return "done";
    case v1::SITE_FAILED:
      return "failed";
    default:
      return "unknown";
  }
}

void EventQueue::Push(Body event) {
  {
    std::lock_guard<std::mutex> l(mu_);
    events_.push_back(std::move(event));
  }
  cv_.notify_one();
}

std::optional<EventQueue::Body> EventQueue::PopUntil(Clock::time_point deadline) {
  std::unique_lock<std::mutex> l(mu_);
  if (!cv_.wait_until(l, deadline, [&] { return !events_.empty(); })) return std::nullopt;
  Body e = std::move(events_.front());
  events_.pop_front();
  return e;
}

Coordinator::Coordinator(core::ClusterSpec spec, std::string run_id, EventQueue* events)
    : spec_(std::move(spec)), run_id_(std::move(run_id)), events_(events) {
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
    s.state = v1::SITE_IDLE;
    s.last_heartbeat = Clock::now();
    resp.set_cluster(spec_.name);
    resp.set_run_id(run_id_);
    resp.set_heartbeat_interval_seconds(spec_.heartbeat_interval_seconds);
    resp.set_heartbeat_timeout_seconds(spec_.heartbeat_timeout_seconds);
    for (const auto& site : spec_.sites) {
      resp.add_sites(site.name);
      if (site.name == r.site() && site.devices.size() > 1)
        for (const auto& d : site.devices) resp.add_devices(d);
    }
  }
  cv_.notify_all();
  if (events_) events_->Push(SiteRegistered{r.site(), r.listen_address(), r.device()});
  return resp;
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& r) {
  v1::HeartbeatResponse resp;
  bool leaving = false;  // the first heartbeat that says so
  {
    std::lock_guard<std::mutex> l(mu_);
    Site& s = sites_[r.site()];
    if (!s.registered) return absl::FailedPreconditionError(absl::StrCat("site '", r.site(), "' has not registered"));
    s.last_heartbeat = Clock::now();
    s.state = r.state();
    s.step = r.step();
    resp.set_stop(stopping_);
    resp.set_end_after_step(boundary_step_);
    resp.set_end_job_id(boundary_job_);
    resp.set_lease_job_id(lease_job_);
    resp.set_lease_steps(lease_steps_);
    resp.set_lease_abandoned(lease_abandoned_);
    for (const auto& site : left_out_) resp.add_left_out(site);
    for (const auto& p : probers_) resp.add_probe_from(p);
    leaving = r.leaving() && !s.leaving;
    s.leaving = s.leaving || r.leaving();
  }
  cv_.notify_all();
  if (leaving && events_) events_->Push(SiteLeaving{r.site(), "its executor got SIGTERM"});
  return resp;
}

absl::StatusOr<v1::DrainResponse> Coordinator::Drain(const std::string& site) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!spec_.FindSite(site))
      return absl::NotFoundError(absl::StrCat("site '", site, "' is not in cluster '", spec_.name, "'"));
    Site& s = sites_[site];
    if (!s.registered) return absl::FailedPreconditionError(absl::StrCat("site '", site, "' has not joined"));
    if (s.leaving) {
      v1::DrainResponse r;
      r.set_message(absl::StrCat("site '", site, "' is already leaving"));
      return r;
    }
    s.leaving = true;
  }
  if (events_) events_->Push(SiteLeaving{site, "meridian drain"});
  v1::DrainResponse r;
  r.set_message(absl::StrCat("site '", site,
                             "' leaves at the next step boundary: the stages save that step, and the run goes on "
                             "without it from there"));
  return r;
}

void Coordinator::SetLease(const std::string& job_id, int64_t steps, bool abandoned) {
  std::lock_guard<std::mutex> l(mu_);
  lease_job_ = job_id;
  lease_steps_ = steps;
  lease_abandoned_ = abandoned;
}

void Coordinator::SetProbers(std::set<std::string> sites) {
  std::lock_guard<std::mutex> l(mu_);
  probers_ = std::move(sites);
}

void Coordinator::SetBoundary(const std::string& job_id, int64_t step, std::vector<std::string> left_out) {
  std::lock_guard<std::mutex> l(mu_);
  const bool keep = step > 0 || !left_out.empty();  // step 0 with left-out sites: a boundary still to be placed
  boundary_job_ = keep ? job_id : "";
  boundary_step_ = step;
  left_out_ = keep ? std::move(left_out) : std::vector<std::string>{};
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
  LogSite(site, "a command could not be delivered (the stream broke); queued again");
}

absl::Status Coordinator::Metrics(const v1::MetricsReport& r) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (r.job_id() != job_id_) return absl::OkStatus();  // an abandoned attempt's
    auto stage = stages_.find(r.site());
    const auto& last = sites_[r.site()].metrics;
    if (stage == stages_.end() || stage->second != r.stage() || r.step() < 0 ||
        (file_max_step_ > 0 && r.step() >= file_max_step_) || (last && r.step() <= last->step()))
      return absl::OkStatus();  // forged or stale; the run machine logs it
    sites_[r.site()].metrics = r;
    // Replica 0 of stage 0 (the stage's writer) reports the step's loss; in a one-stage DiLoCo plan the
    // other replicas report their own shares of it (RunMachine's reporter, the same rule).
    auto writer = file_writers_.find(r.site());
    if (r.stage() == 0 && writer != file_writers_.end() && writer->second == 0 && r.step() > progress_.step) {
      progress_.step = r.step();
      progress_.loss = r.loss();
      progress_.step_seconds = r.step_seconds();
      progress_.tokens += r.tokens();
    }
  }
  cv_.notify_all();
  if (events_) events_->Push(MetricsReported{r});
  return absl::OkStatus();
}

absl::Status Coordinator::Profile(const v1::ProfileReport& r) {
  {
    std::lock_guard<std::mutex> l(mu_);
    sites_[r.site()].profile = r;
  }
  cv_.notify_all();
  if (events_) events_->Push(ProfileReported{r});
  return absl::OkStatus();
}

absl::Status Coordinator::Done(const v1::StageDone& d) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (d.job_id() == job_id_) sites_[d.site()].done = d;
  }
  cv_.notify_all();
  if (events_) events_->Push(StageReportedDone{d});  // the machine logs an abandoned attempt's too
  return absl::OkStatus();
}

void Coordinator::SetRunInfo(std::string profile_json, std::string graph_json, std::string plan_json) {
  std::lock_guard<std::mutex> l(mu_);
  profile_json_ = std::move(profile_json);
  graph_json_ = std::move(graph_json);
  plan_json_ = std::move(plan_json);
  plan_ = nlohmann::json::parse(plan_json_, nullptr, false);
  if (plan_.is_discarded()) plan_ = nullptr;
  const nlohmann::json profile = nlohmann::json::parse(profile_json_, nullptr, false);
  links_ = nlohmann::json::array();
  gemm_flops_.clear();
  if (profile.is_object()) {
    if (profile.contains("links") && profile["links"].is_array()) links_ = profile["links"];
    if (profile.contains("sites") && profile["sites"].is_array())
      for (const auto& site : profile["sites"])
        if (site.is_object() && site.contains("name") && site["name"].is_string() &&
            site.contains("flops_per_second") && site["flops_per_second"].is_number())
          gemm_flops_[site["name"].get<std::string>()] = site["flops_per_second"].get<double>();
  }
}

void Coordinator::SetFileDir(const std::string& dir) {
  std::lock_guard<std::mutex> l(mu_);
  file_dir_ = dir;
}

void Coordinator::SetFileWriters(std::map<std::string, int> writers, int64_t max_step, int64_t max_bytes,
                                 int checkpoint_interval, int64_t resume_step,
                                 std::map<std::string, std::set<std::string>> readable, int64_t quota_bytes,
                                 std::map<std::string, std::pair<int, int>> round_writers) {
  std::lock_guard<std::mutex> l(mu_);
  readable_ = std::move(readable);
  quota_bytes_ = quota_bytes;
  file_writers_ = std::move(writers);
  round_writers_ = std::move(round_writers);
  file_max_step_ = max_step;
  file_max_bytes_ = max_bytes;
  checkpoint_interval_ = checkpoint_interval;
  resume_step_ = std::max<int64_t>(resume_step, 0);
  uploads_.clear();
}

absl::StatusOr<rpc::CoordinatorHandler::FileGrant> Coordinator::FileDestination(const std::string& site,
                                                                                const std::string& job_id,
                                                                                const std::string& path) {
  // The service admits only weights/stage-K.safetensors and checkpoints/step-S/stage-K.{safetensors,json}
  // (and stage-K.replica-R.{safetensors,json}).
  const std::optional<core::SiteFile> file = core::ParseSiteFile(path);
  if (!file) return absl::InvalidArgumentError(absl::StrCat("site '", site, "': ", path, " names no stage"));
  const int64_t step = file->step;
  const int stage = file->stage;
  FileGrant grant;
  std::string dir;
  int64_t quota = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (file_dir_.empty())
      return absl::FailedPreconditionError(
          absl::StrCat("site '", site, "' sent ", path, ", but this coordinator keeps no files"));
    if (job_id != job_id_)
      return absl::FailedPreconditionError(absl::StrCat("site '", site, "' sent ", path, " of attempt '", job_id,
                                                        "', but the attempt now running is '", job_id_, "'"));
    if (file->replica < 0) {
      auto w = file_writers_.find(site);
      if (w == file_writers_.end())
        return absl::PermissionDeniedError(absl::StrCat("site '", site, "' sent ", path,
                                                        ", but it writes no stage's files in attempt '", job_id_, "'"));
      if (w->second != stage)
        return absl::PermissionDeniedError(absl::StrCat("site '", site, "' sent ", path, ", but it writes stage ",
                                                        w->second, "'s files, not stage ", stage, "'s"));
    } else {
      auto w = round_writers_.find(site);
      if (w == round_writers_.end())
        return absl::PermissionDeniedError(
            absl::StrCat("site '", site, "' sent ", path, ", but it is no DiLoCo replica in attempt '", job_id_, "'"));
      if (w->second != std::make_pair(stage, file->replica))
        return absl::PermissionDeniedError(absl::StrCat("site '", site, "' sent ", path, ", but it is replica ",
                                                        w->second.second, " of stage ", w->second.first,
                                                        ", not replica ", file->replica, " of stage ", stage));
    }
    if (step > file_max_step_)
      return absl::InvalidArgumentError(
          absl::StrCat("site '", site, "' sent ", path, ", a step beyond the job's ", file_max_step_));
    // A checkpoint's step: the attempt's step boundary (a switch: every stage saves it, whatever the
    // interval), or an interval's step the run can have reached.
    const int64_t boundary = boundary_job_ == job_id_ ? boundary_step_ : 0;  // 0: none set for this attempt
    const bool at_boundary = boundary > 0 && step == boundary;
    if (file->kind != core::SiteFile::Kind::kWeights && step <= resume_step_)
      return absl::InvalidArgumentError(absl::StrCat("site '", site, "' sent ", path, ": a step at or before step ",
                                                     resume_step_, ", which this attempt resumed from"));
    if (file->kind != core::SiteFile::Kind::kWeights && !at_boundary) {
      if (checkpoint_interval_ <= 0)
        return absl::InvalidArgumentError(absl::StrCat(
            "site '", site, "' sent ", path, ": this run checkpoints only at a switch's step boundary, and ",
            boundary > 0 ? absl::StrCat("that is step ", boundary) : std::string("none is set"),
            " (job.checkpoint.interval is 0)"));
      // Reports arrive late and best-effort: the furthest step any site of the attempt reported, and two
      // intervals of slack, still refuse a step far ahead of the run.
      int64_t reached = resume_step_;
      for (const auto& [name, st] : sites_)
        if (st.metrics && stages_.count(name)) reached = std::max(reached, st.metrics->step() + 1);
      if (step % checkpoint_interval_ != 0 || step > reached + 2 * checkpoint_interval_)
        return absl::InvalidArgumentError(absl::StrCat(
            "site '", site, "' sent ", path, ": not a checkpoint step this run can have reached (every ",
            checkpoint_interval_, " steps, after step ", resume_step_, ", at most two intervals past step ", reached,
            "; nor the step boundary", boundary > 0 ? absl::StrCat(" ", boundary) : "", ")"));
    }
    dir = file_dir_;
    grant.max_bytes = file_max_bytes_;
    quota = quota_bytes_;
  }
  const std::filesystem::path dest = std::filesystem::path(dir) / path;
  std::error_code ec;
  std::filesystem::create_directories(dest.parent_path(), ec);
  if (ec)
    return absl::InternalError(absl::StrCat("site '", site, "' sent ", path, ": cannot create ",
                                            dest.parent_path().string(), ": ", ec.message()));
  if (quota > 0) {  // what is stored (partial uploads included) and what the disk has left bound the grant
    int64_t used = 0;
    for (const char* sub : {"checkpoints", "weights"})
      for (auto it = std::filesystem::recursive_directory_iterator(std::filesystem::path(dir) / sub, ec);
           !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
        std::error_code entry;  // a file renamed or removed meanwhile is skipped, not the end of the walk
        if (it->is_regular_file(entry)) {
          const auto size = it->file_size(entry);
          if (!entry) used += static_cast<int64_t>(size);
        }
      }
    ec.clear();
    const std::filesystem::space_info disk = std::filesystem::space(dest.parent_path(), ec);
    const int64_t free_bytes = ec ? 0 : static_cast<int64_t>(disk.available);
    const int64_t room = std::min(quota - used, free_bytes - (int64_t{64} << 20));
    if (room <= 0)
      return absl::ResourceExhaustedError(
          absl::StrCat("site '", site, "' sent ", path, ", but the coordinator's store is full: ", used,
                       " bytes stored of its ", quota, "-byte quota, ", free_bytes, " bytes free on the disk"));
    grant.max_bytes = std::min(grant.max_bytes, room);
    ec.clear();
  }
  grant.path = dest.string();
  return grant;
}

absl::Status Coordinator::FileCommit(const std::string& site, const std::string& job_id, const std::string& path,
                                     const std::string& part, const std::string& dest, int64_t bytes,
                                     const std::string& sha) {
  const std::optional<core::SiteFile> file = core::ParseSiteFile(path);
  const bool checkpoint = file && file->kind != core::SiteFile::Kind::kWeights;
  // Outside the lock: what a stage JSON claims (the digest came with the upload, checked as it arrived).
  std::optional<StageMetaClaims> claims;
  if (checkpoint && file->kind == core::SiteFile::Kind::kCheckpointMeta) {
    auto read = ReadStageMeta(site, path, part, file->replica >= 0);
    if (!read.ok()) return read.status();
    claims = *read;
  }
  {
    std::lock_guard<std::mutex> l(mu_);  // BeginJob takes it too: no file of an ended attempt lands after it
    if (job_id != job_id_)
      return absl::FailedPreconditionError(
          absl::StrCat("site '", site, "' sent ", path, " of attempt '", job_id, "', which ended while it arrived"));
    const bool counted = checkpoint;  // FileDestination admitted its step: an interval's or the boundary
    const std::pair<int, int> key = file ? std::make_pair(file->stage, file->replica) : std::make_pair(0, -1);
    if (counted) {
      StepUploads& u = uploads_[file->step];
      const auto& sent = file->kind == core::SiteFile::Kind::kCheckpointShard ? u.shard_sha256 : u.meta_sha256;
      if (sent.count(key))
        return absl::FailedPreconditionError(
            absl::StrCat("site '", site, "' sent ", path, " again; a step's file is sent once"));
      if (claims) {
        const int n = NumStages();
        if (claims->stage != file->stage || claims->num_stages != n || claims->replica != file->replica)
          return absl::InvalidArgumentError(
              absl::StrCat("site '", site, "' sent ", path, ": it describes ",
                           claims->replica >= 0 ? absl::StrCat("replica ", claims->replica, " of ") : "", "stage ",
                           claims->stage, " of ", claims->num_stages, "; the plan has ",
                           file->replica >= 0 ? absl::StrCat("replica ", file->replica, " of ") : "", "stage ",
                           file->stage, " of ", n));
        auto shard = u.shard_sha256.find(key);
        if (shard == u.shard_sha256.end() || shard->second != claims->sha256)
          return absl::InvalidArgumentError(
              absl::StrCat("site '", site, "' sent ", path,
                           ": its SHA-256 is not the one of the shard this site sent for the step"));
      }
    }
    std::error_code ec;
    std::filesystem::rename(part, dest, ec);
    if (ec)
      return absl::InternalError(
          absl::StrCat("site '", site, "' sent ", path, ": cannot rename ", part, " to ", dest, ": ", ec.message()));
    if (counted) {
      StepUploads& u = uploads_[file->step];
      (file->kind == core::SiteFile::Kind::kCheckpointShard ? u.shard_sha256 : u.meta_sha256)[key] = sha;
      WriteManifestIfComplete(file->step, std::filesystem::path(dest).parent_path().string());
    }
  }
  LogSite(site, absl::StrCat("sent ", path, " (", bytes, " bytes)"));
  return absl::OkStatus();
}

int Coordinator::NumStages() const {
  int n = 0;
  for (const auto& [site, stage] : stages_) n = std::max(n, stage + 1);
  return n;
}

absl::StatusOr<Coordinator::StageMetaClaims> Coordinator::ReadStageMeta(const std::string& site,
                                                                        const std::string& path,
                                                                        const std::string& part, bool replica) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("site '", site, "' sent ", path, ": ", why));
  };
  auto text = core::ReadFile(part, int64_t{64} << 20);
  if (!text.ok()) return bad(std::string(text.status().message()));
  if (replica) {
    std::optional<core::ReplicaMeta> m = core::ParseReplicaMeta(*text, 0);
    if (!m) return bad("not a replica's round state description");
    return StageMetaClaims{m->stage, m->num_stages, m->replica, m->sha256};
  }
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (!j.is_object() || !j.contains("stage") || !j["stage"].is_number_integer() || !j.contains("num_stages") ||
      !j["num_stages"].is_number_integer() || !j.contains("sha256") || !j["sha256"].is_string() ||
      !j.contains("tensors") || !j["tensors"].is_array())
    return bad("not a stage checkpoint description");
  return StageMetaClaims{j["stage"].get<int>(), j["num_stages"].get<int>(), -1, j["sha256"].get<std::string>()};
}

void Coordinator::WriteManifestIfComplete(int64_t step, const std::string& step_dir) {
  StepUploads& u = uploads_[step];
  const int n = NumStages();
  core::Manifest m;
  m.step = step;
  m.num_stages = n;
  m.job_id = job_id_;
  for (int k = 0; k < n; ++k) {
    const std::pair<int, int> key{k, -1};
    if (!u.shard_sha256.count(key) || !u.meta_sha256.count(key)) return;
    std::string writer;
    for (const auto& [site, stage] : file_writers_)
      if (stage == k) writer = site;
    m.stages.push_back({writer, u.shard_sha256.at(key), u.meta_sha256.at(key), {}});
  }
  for (const auto& [site, key] : round_writers_)  // the round states complete so far
    if (key.first < n && u.shard_sha256.count(key) && u.meta_sha256.count(key))
      m.stages[key.first].replicas.push_back({key.second, site, u.shard_sha256.at(key), u.meta_sha256.at(key)});
  for (auto& stage : m.stages)
    std::sort(stage.replicas.begin(), stage.replicas.end(),
              [](const auto& x, const auto& y) { return x.replica < y.replica; });
  if (absl::Status s = core::WriteFileAtomic((std::filesystem::path(step_dir) / core::kManifestFile).string(),
                                             core::ManifestJson(m));
      !s.ok()) {
    std::fprintf(stderr, "meridian run: %s\n", std::string(s.message()).c_str());
  } else if (!std::exchange(u.manifested, true)) {
    AddEventLocked("checkpoint", "",
                   absl::StrCat("step ", step, ": every stage's checkpoint arrived and checked out; manifest written"));
  }
}

absl::StatusOr<std::string> Coordinator::FileSource(const std::string& site, const std::string& path) {
  std::string dir;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (file_dir_.empty())
      return absl::FailedPreconditionError(
          absl::StrCat("site '", site, "' asked for ", path, ", but this coordinator keeps no files"));
    // Only the files of the step the running attempt resumes from that the site's stage needs, and only
    // to the attempt's sites.
    const std::optional<core::SiteFile> file = core::ParseSiteFile(path);
    if (!file || file->step != resume_step_ || !stages_.count(site))
      return absl::PermissionDeniedError(absl::StrCat("site '", site, "' asked for ", path,
                                                      ", which is not a file of the step this attempt resumes from"));
    auto mine = readable_.find(site);
    if (mine == readable_.end() || !mine->second.count(path))
      return absl::PermissionDeniedError(
          absl::StrCat("site '", site, "' asked for ", path, ", which holds none of its stage's tensors"));
    dir = file_dir_;
  }
  const std::filesystem::path src = std::filesystem::path(dir) / path;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(src, ec))
    return absl::NotFoundError(
        absl::StrCat("site '", site, "' asked for ", path, ", which the coordinator does not have"));
  LogSite(site, absl::StrCat("fetching ", path));
  return src.string();
}

void Coordinator::SetLogDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  std::lock_guard<std::mutex> l(log_mu_);
  log_dir_ = dir;
  log_files_.clear();
}

void Coordinator::LogSite(const std::string& site, const std::string& text) {
  std::lock_guard<std::mutex> l(log_mu_);
  if (log_dir_.empty()) return;
  // One open file per site (events arrive per stage per step; reopening each time cost a syscall round).
  std::ofstream& out = log_files_[site];
  if (!out.is_open()) out.open(log_dir_ + "/" + site + ".log", std::ios::app);
  out << absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()) << " " << text << std::endl;
}

absl::StatusOr<v1::InspectResponse> Coordinator::Inspect() {
  v1::InspectResponse r;
  r.set_status_json(RunJson(0, kInspectSteps));
  std::lock_guard<std::mutex> l(mu_);  // (a plan made in between shows in plan_json first: both are current)
  r.set_profile_json(profile_json_);
  r.set_graph_json(graph_json_);
  r.set_plan_json(plan_json_);
  return r;
}

void Coordinator::SetRunFacts(int64_t steps, int64_t tokens_per_step) {
  std::lock_guard<std::mutex> l(mu_);
  total_steps_ = steps;
  tokens_per_step_ = tokens_per_step;
}

void Coordinator::RecordStep(nlohmann::json step) {
  std::lock_guard<std::mutex> l(mu_);
  if (!step.is_object()) return;
  step["seq"] = ++step_seq_;
  steps_.push_back(std::move(step));
  while (steps_.size() > kStepsKept) steps_.pop_front();
}

void Coordinator::RecordEvent(const std::string& kind, const std::string& site, const std::string& text) {
  std::lock_guard<std::mutex> l(mu_);
  AddEventLocked(kind, site, text);
}

void Coordinator::SetEventLog(const std::string& path) {
  std::lock_guard<std::mutex> l(mu_);
  event_log_.close();
  event_log_.clear();
  event_log_.open(path, std::ios::app);
  if (!event_log_) std::fprintf(stderr, "meridian run: %s: cannot write the event log\n", path.c_str());
}

void Coordinator::AddEventLocked(const std::string& kind, const std::string& site, const std::string& text) {
  nlohmann::json e = {{"time", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone())},
                      {"step", progress_.step + 1},
                      {"kind", kind},
                      {"site", site},
                      {"text", text}};
  // Text from a site (a stage's error) may carry any bytes: replaced, never thrown on.
  if (event_log_.is_open()) event_log_ << e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  run_events_.push_back(std::move(e));
  while (run_events_.size() > kEventsKept) run_events_.pop_front();
}

std::string Coordinator::RunJson(int64_t after, size_t max_steps) const {
  nlohmann::json status;
  {
    std::lock_guard<std::mutex> l(mu_);
    nlohmann::json sites = nlohmann::json::array();
    const auto now = Clock::now();
    for (const auto& [name, s] : sites_) {
      const double age = std::chrono::duration<double>(now - s.last_heartbeat).count();
      auto stage = stages_.find(name);
      nlohmann::json site = {{"name", name},
                             {"registered", s.registered},
                             {"state", s.registered ? SiteStateName(s.state) : "not joined"},
                             {"step", s.step + 1},
                             {"heartbeat_age_seconds", s.registered ? age : -1.0},
                             {"answering", s.registered && age <= spec_.heartbeat_timeout_seconds},
                             {"listen", s.listen},
                             {"device", s.device},
                             {"stage", stage == stages_.end() ? -1 : stage->second}};
      if (auto g = gemm_flops_.find(name); g != gemm_flops_.end()) site["gemm_flops_per_second"] = g->second;
      if (s.metrics) {  // its stage's latest step
        nlohmann::json m = StepFiguresJson(*s.metrics);
        m["sent_bytes"] = s.metrics->wire_bytes();
        m["uncompressed_bytes"] = s.metrics->raw_bytes();
        site["metrics"] = std::move(m);
      }
      if (s.metrics && s.metrics->outer_sync_step() > 0)  // a DiLoCo replica: its last outer synchronisation
        site["outer_sync"] = {{"after_step", s.metrics->outer_sync_step()},
                              {"bytes", s.metrics->outer_sync_bytes()},
                              {"seconds", s.metrics->outer_sync_seconds()},
                              {"drift", s.metrics->outer_drift()}};
      sites.push_back(std::move(site));
    }
    nlohmann::json run = {{"steps", total_steps_}, {"tokens_per_step", tokens_per_step_}};
    auto number = [&](const char* key) {  // a plan's figure; 0 when missing or not a number (NaN is null)
      return plan_.contains(key) && plan_[key].is_number() ? plan_[key].get<double>() : 0.0;
    };
    if (plan_.is_object() && tokens_per_step_ > 0) {
      const double predicted = number("predicted_step_seconds");
      const double bound = number("compute_bound_seconds");
      if (predicted > 0) run["predicted_tokens_per_second"] = tokens_per_step_ / predicted;
      if (bound > 0) run["compute_bound_tokens_per_second"] = tokens_per_step_ / bound;
    }
    nlohmann::json steps = nlohmann::json::array();
    size_t first = steps_.size() > max_steps ? steps_.size() - max_steps : 0;
    for (size_t i = first; i < steps_.size(); ++i)
      if (steps_[i]["seq"].get<int64_t>() > after) steps.push_back(steps_[i]);
    status = {{"cluster", spec_.name},
              {"run_id", run_id_},
              {"job_id", job_id_},
              {"progress",
               {{"step", progress_.step + 1},
                {"loss", progress_.loss},
                {"step_seconds", progress_.step_seconds},
                {"tokens", progress_.tokens}}},
              {"sites", sites},
              {"run", run},
              {"plan", plan_},
              {"links", links_.is_array() ? links_ : nlohmann::json::array()},
              {"steps", steps},
              {"events", nlohmann::json(run_events_)}};
  }
  return status.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void Coordinator::BeginJob(const std::string& job_id, std::map<std::string, int> stages) {
  {
    std::lock_guard<std::mutex> l(mu_);
    job_id_ = job_id;
    stages_ = std::move(stages);
    file_writers_.clear();
    readable_.clear();
    for (auto& [name, site] : sites_) site.done.reset(), site.metrics.reset();
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

std::vector<std::string> Coordinator::Silent(Clock::time_point now) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::string> out;
  const auto limit = std::chrono::duration<double>(spec_.heartbeat_timeout_seconds);
  for (const auto& [name, s] : sites_)
    if (s.registered && s.state != v1::SITE_DONE && now - s.last_heartbeat > limit) out.push_back(name);
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
