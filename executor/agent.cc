#include "executor/agent.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checkpoint_dir.h"
#include "core/files.h"
#include "core/log.h"
#include "core/run_layout.h"
#include "core/thread_name.h"
#include "executor/profiler.h"
#include "executor/run_stage.h"
#include "executor/site_group.h"
#include "executor/stage.h"
#include "executor/torch_boundary.h"
#include "partitioner/model.h"
#include "rpc/credentials.h"

namespace meridian::executor {
namespace {

namespace fs = std::filesystem;

using Clock = std::chrono::steady_clock;
constexpr rpc::CoordinatorClient::Timeout kReportTimeout = std::chrono::seconds(10);

// A fresh directory of this process's own (mkdtemp) under the system's temporary directory, made by
// Create() and removed with this object.
struct ScratchDir {
  explicit ScratchDir(std::string name) : name(std::move(name)) {}
  absl::Status Create() {
    std::error_code ec;
    const fs::path base = fs::temp_directory_path(ec);
    if (ec) return absl::InternalError(absl::StrCat("no temporary directory: ", ec.message()));
    std::string pattern = (base / absl::StrCat("meridian-", name, "-XXXXXX")).string();
    if (::mkdtemp(pattern.data()) == nullptr)
      return absl::InternalError(absl::StrCat("cannot create a directory like ", pattern, ": ", std::strerror(errno)));
    path = pattern;
    return absl::OkStatus();
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
  std::string name;
  fs::path path;
};

// Sends checkpoint steps to the coordinator on a thread of its own, so training goes on while a shard
// crosses the coordinator's link: each shard this site wrote for the step (the stage's, a DiLoCo
// replica's round state), then its JSON (which vouches for it); once all arrived,
// the local copy is removed (kept when the upload failed). One step at a time: Start waits for the previous step's
// upload. Thread-compatible: used by the stage thread only; the destructor waits for the upload in flight.
class CheckpointUploader {
 public:
  CheckpointUploader(rpc::CoordinatorClient* coordinator, std::string site, std::string job_id)
      : coordinator_(coordinator), site_(std::move(site)), job_id_(std::move(job_id)) {}
  ~CheckpointUploader() { (void)Wait(); }
  // Waits for the previous upload and returns its error, if any (then nothing new starts); else starts
  // sending the files of `stage` in `step_dir` (this site's alone) as checkpoints/step-S/.
  absl::Status Start(const std::string& step_dir, int64_t step, int stage) {
    if (absl::Status s = Wait(); !s.ok()) return s;
    std::vector<std::string> shards, metas;  // every shard goes before every JSON
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(step_dir, ec)) {
      const std::string name = e.path().filename().string();
      const std::optional<core::SiteFile> f = core::ParseSiteFile(core::CheckpointFile(step, name));
      if (!f || f->stage != stage) continue;  // a temporary file, or nothing of this site's
      (f->kind == core::SiteFile::Kind::kCheckpointShard ? shards : metas).push_back(name);
    }
    std::vector<std::string> names = shards;
    names.insert(names.end(), metas.begin(), metas.end());
    if (names.empty())
      return absl::InternalError(absl::StrCat(step_dir, ": no checkpoint file of stage ", stage, " to send"));
    pending_ = std::async(std::launch::async, [this, step_dir, step, names] {
      core::NameThisThread("mrd-ckpt-upload");
      absl::Status s;
      for (const std::string& name : names) {
        s = coordinator_->PutFile(site_, job_id_, step_dir + "/" + name, core::CheckpointFile(step, name));
        if (!s.ok()) break;
      }
      std::error_code ec;
      if (s.ok()) fs::remove_all(step_dir, ec);  // kept when the upload failed: the step is still here
      return s;
    });
    return absl::OkStatus();
  }
  // Waits for the upload in flight; its result (OK when none).
  absl::Status Wait() {
    if (!pending_.valid()) return absl::OkStatus();
    return pending_.get();
  }

 private:
  rpc::CoordinatorClient* coordinator_;
  const std::string site_, job_id_;
  std::future<absl::Status> pending_;
};

// Sends metrics reports to the coordinator from its own thread, in order, so the training loop never
// waits on the coordinator. Flush() waits until every queued report was sent (or failed); reports are
// best-effort. Thread-safe.
class MetricsReporter {
 public:
  explicit MetricsReporter(rpc::CoordinatorClient* coordinator)
      : coordinator_(coordinator), thread_(core::NamedThread("mrd-report", [this] { Loop(); })) {}
  ~MetricsReporter() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Post(v1::MetricsReport m) {
    {
      std::lock_guard<std::mutex> l(mu_);
      queue_.push_back(std::move(m));
    }
    cv_.notify_all();
  }
  void Flush() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return queue_.empty() && !sending_; });
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> l(mu_);
    while (true) {
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      v1::MetricsReport m = std::move(queue_.front());
      queue_.pop_front();
      sending_ = true;
      l.unlock();
      (void)coordinator_->ReportMetrics(m, kReportTimeout);
      l.lock();
      sending_ = false;
      cv_.notify_all();
    }
  }
  rpc::CoordinatorClient* coordinator_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::MetricsReport> queue_;
  bool sending_ = false, stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

absl::StatusOr<JobSetup> JobFromText(const std::string& yaml, const std::string& dir) {
  const std::string path = dir + "/job.yaml";  // relative paths in the job resolve against its directory
  auto r = core::ParseSpec(yaml, path);
  if (!r.errors.empty()) return absl::InvalidArgumentError(r.errors[0].ToString());
  if (!r.spec->job) return absl::InvalidArgumentError("the coordinator sent no job section");
  return PrepareJob(*r.spec->job, path);
}

// The assignment's wire form as the stage worker takes it.
StageAssignment FromProto(const v1::StageAssignment& pa) {
  StageAssignment a;
  a.job_id = pa.job_id();
  a.stage = pa.stage();
  a.num_stages = pa.num_stages();
  a.first_op = pa.first_op();
  a.last_op = pa.last_op();
  a.prev_site = pa.prev_site();
  a.next_site = pa.next_site();
  a.prev_address = pa.prev_address();
  a.next_address = pa.next_address();
  if (!pa.forward_codec().empty()) a.forward_codec = pa.forward_codec();
  if (!pa.backward_codec().empty()) a.backward_codec = pa.backward_codec();
  if (!pa.prev_forward_codec().empty()) a.prev_forward_codec = pa.prev_forward_codec();
  if (!pa.gradient_codec().empty()) a.gradient_codec = pa.gradient_codec();
  if (pa.bucket_bytes() > 0) a.bucket_bytes = pa.bucket_bytes();
  a.in_flight = std::max(0, pa.in_flight());
  a.recompute = pa.recompute();
  a.whole_pipelines = pa.whole_pipelines();
  for (auto [from, to] : {std::pair<const v1::StageSites*, StageSites*>{&pa.prev_stage(), &a.prev_replicas},
                          {&pa.this_stage(), &a.replicas},
                          {&pa.next_stage(), &a.next_replicas}}) {
    for (const auto& site : from->sites()) {
      to->sites.push_back(site.site());
      to->addresses.push_back(site.address());
    }
    to->micro_batches.assign(from->micro_batches().begin(), from->micro_batches().end());
  }
  return a;
}

// The job of an assignment, as every worker of the site prepares it: the job's text, the plan's micro-batch
// count, the slice checked against the model.
absl::StatusOr<JobSetup> AssignedJob(const v1::StageAssignment& pa, const StageAssignment& a) {
  auto setup = JobFromText(pa.job_yaml(), pa.job_dir());
  if (!setup.ok()) return setup.status();
  if (pa.micro_batches() > 0) {
    if (setup->job.global_batch % pa.micro_batches() != 0)
      return absl::InvalidArgumentError("micro-batches do not divide the global batch");
    setup->micro_batches = pa.micro_batches();
    setup->micro_batch_size = setup->job.global_batch / pa.micro_batches();
  }
  if (!compression::CodecSpec::Parse(a.gradient_codec).ok())
    return absl::InvalidArgumentError(absl::StrCat("gradient_codec '", a.gradient_codec, "' is not a codec"));
  if (absl::Status s = CheckSlice(setup->model, a.first_op, a.last_op); !s.ok()) return s;
  return setup;
}

// The steps of an assignment and when to checkpoint: what every worker of a site runs alike.
StageRun StageRunOf(const v1::StageAssignment& pa, const JobSetup& setup) {
  StageRun run;
  run.steps = pa.steps() > 0 ? pa.steps() : setup.job.steps;
  run.total_steps = setup.job.steps;
  run.checkpoint_interval = setup.job.checkpoint.interval;
  return run;
}

// The log line that says what optimizer state a worker of a site holds (ZeRO-1 shards it).
void LogOptimizerState(const std::string& where, const StageWorker& worker) {
  int64_t trained = 0;
  for (const auto& [n, p] : worker.Parameters()) trained += p.numel();
  spdlog::info("{}", absl::StrCat(where, ": AdamW moments on this worker: ", worker.optimizer_state_elements(),
                                  " elements (the stage's: ", 2 * trained, ")"));
}

// The model measured as a worker of a site runs it: with this worker's rows of a micro-batch while the
// other workers measure theirs (on a site of one device, the whole micro-batch); then, on a site of several,
// the workers' c10d all-reduce bandwidth. The graph's per-micro-batch figures are the whole micro-batch's.
absl::StatusOr<OpProfile> ProfileAsWorker(SiteGroup* group, const JobSetup& setup, const std::string& site,
                                          torch::Device device, int repeats) {
  const int mbs = setup.micro_batch_size;
  const int rows = group ? static_cast<int>(group->Rows(mbs, group->rank()).second) : mbs;
  torch::Tensor token = torch::zeros({1});
  if (group)  // start together: the workers share the site's memory bandwidth and power
    if (absl::Status s = group->AllReduce(token); !s.ok()) return s;
  // A worker without a row of the job's micro-batch (fewer sequences than workers) idles here; training
  // with that micro-batch is refused at the assignment (StageWorker::CanSplit), naming the site.
  absl::StatusOr<OpProfile> prof =
      rows > 0 ? ProfileModel(setup.model, rows, setup.job.sequence_length, site, device, repeats, setup.job.lora)
               : absl::StatusOr<OpProfile>(OpProfile{});
  if (!prof.ok() || !group) return prof;
  const double scale = static_cast<double>(mbs) / rows;
  for (auto& op : prof->graph.ops) {
    op.forward_flops *= scale;
    op.backward_flops *= scale;
    op.output_bytes *= scale;
    if (op.saved_bytes > 0) op.saved_bytes *= scale;
  }
  // The workers' all-reduce: 16 MiB of float32, one warm-up and three timed; bus bandwidth as NCCL's tests
  // report it (2 (K-1)/K of the bytes per worker over the time).
  torch::Tensor buffer = torch::ones({int64_t{4} << 20}, torch::TensorOptions().device(group->collective_device()));
  if (absl::Status s = group->AllReduce(buffer); !s.ok()) return s;
  const auto t0 = Clock::now();
  for (int i = 0; i < 3; ++i)
    if (absl::Status s = group->AllReduce(buffer); !s.ok()) return s;
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / 3;
  const int k = group->size();
  prof->site.workers = k;
  prof->site.intra_site_bytes_per_second = 2.0 * (k - 1) / k * buffer.numel() * 4 / std::max(seconds, 1e-9);
  if (device.is_cuda()) prof->site.memory_bytes *= k;  // each worker's device memory
  return prof;
}

// A site's workers wait this long for each other in a collective: worker 0 may wait for a neighbouring
// site (or the coordinator's checkpoint) between two of them.
constexpr std::chrono::minutes kSiteGroupTimeout{10};

// The step boundary, the same on every worker of a site: worker 0's (`mine`: StepControl::WaitAfter's
// answer) sent to the others, an abandoned attempt as -1.
absl::StatusOr<int64_t> ShareBoundary(SiteGroup* group, const absl::StatusOr<int64_t>& mine) {
  if (!group) return mine;
  torch::Tensor t = torch::full({1}, mine.ok() ? *mine : int64_t{-1}, torch::kInt64);
  if (absl::Status s = group->Broadcast(t); !s.ok()) return mine;  // the step's next collective fails too
  const int64_t shared = t.item<int64_t>();
  if (shared < 0)
    return mine.ok() ? absl::AbortedError("worker 0 of this site ended the attempt: the coordinator abandoned it")
                     : mine;
  return shared;
}

std::set<std::string> OtherSites(const v1::RegisterResponse& reg, const std::string& self) {
  std::set<std::string> sites(reg.sites().begin(), reg.sites().end());
  sites.erase(self);
  return sites;
}

}  // namespace

Agent::Agent(ExecutorOptions options, v1::RegisterResponse registration, rpc::CoordinatorClient* coordinator)
    : o_(std::move(options)),
      reg_(std::move(registration)),
      coordinator_(coordinator),
      cluster_sites_(OtherSites(reg_, o_.site)),
      device_(o_.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(o_.device)),
      devices_(reg_.devices().begin(), reg_.devices().end()),
      peer_service_(o_.site, cluster_sites_, &inbox_) {}

int Agent::Run() {
  auto started = rpc::StartMtlsServer(
      o_.certs, o_.site, o_.listen, {&peer_service_}, nullptr,
      rpc::ServerThreadsFor(static_cast<int>(cluster_sites_.size()), rpc::PeerLimits().max_streams_per_peer));
  if (!started.ok()) {
    spdlog::error("{}", absl::StrCat(started.status().message()));
    return started.status().code() == absl::StatusCode::kUnavailable ? 1 : 2;
  }
  std::unique_ptr<grpc::Server> server = std::move(*started);
  std::thread heart = core::NamedThread("mrd-heartbeat", [this] { Heartbeats(); });
  const double interval = reg_.heartbeat_interval_seconds() > 0 ? reg_.heartbeat_interval_seconds() : 1.0;
  bool stopped = false;
  while (!stopped) {
    std::unique_ptr<rpc::CoordinatorClient::CommandStream> stream = coordinator_->Commands(o_.site);
    v1::Command cmd;
    while (stream->Next(&cmd)) {
      StopComputing();  // a command comes: the measuring round it kept busy for is over
      if (cmd.has_stop()) {
        spdlog::debug("command: stop");
        stopped = true;
        break;
      }
      if (cmd.has_settle()) spdlog::debug("command: settle (the measuring round is over)");
      if (cmd.has_profile()) OnProfile(cmd.profile());
      if (cmd.has_assign()) OnAssign(cmd.assign());
    }
    stream->Cancel();
    const absl::Status ended = stream->Finish();
    if (stopped) break;
    // The stream broke without a stop (this process was suspended, a network blip): open it again. When the
    // coordinator is really gone, the heartbeat thread ends the process.
    spdlog::warn("{}", absl::StrCat("the command stream ended (", ended.message(), "); reconnecting"));
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(interval * 1000)));
  }
  StopComputing();
  {
    std::lock_guard<std::mutex> l(heartbeat_mu_);
    done_ = true;
  }
  heartbeat_cv_.notify_all();
  heart.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return rc_;
}

std::atomic<int> g_leave_requested{0};

void InstallLeaveHandler() {
  struct sigaction sa {};
  sa.sa_handler = [](int sig) { g_leave_requested.store(sig); };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
}

// Heartbeats; the coordinator not answering for `timeout` of trying ends the process. The clock starts at
// the first failed attempt, not at the last success: a process that was itself stopped (SIGSTOP, a
// suspended VM) gets a full timeout to reach the coordinator again when it resumes. The answers carry the
// coordinator's step boundary and step lease (to step_control_) and the sites that may probe this one.
void Agent::Heartbeats() {
  const double interval = reg_.heartbeat_interval_seconds() > 0 ? reg_.heartbeat_interval_seconds() : 1.0;
  const double timeout = reg_.heartbeat_timeout_seconds() > interval ? reg_.heartbeat_timeout_seconds() : 5 * interval;
  const auto every = std::chrono::milliseconds(static_cast<int64_t>(interval * 1000));
  bool failing = false, said_leaving = false;
  Clock::time_point failing_since;
  std::string late_job;  // --fault late-boundary: the attempt whose boundary is held back, since late_since
  Clock::time_point late_since;
  for (;;) {
    v1::HeartbeatRequest req;
    req.set_site(o_.site);
    req.set_step(step_);
    req.set_state(state_.load());
    const bool leaving = g_leave_requested.load() != 0;
    req.set_leaving(leaving);
    if (leaving && !said_leaving) {
      spdlog::warn(
          "asked to leave (SIGTERM): telling the coordinator, which re-plans without this site at the next "
          "step boundary and then stops it");
      said_leaving = true;
    }
    absl::StatusOr<v1::HeartbeatResponse> answer = coordinator_->Heartbeat(req, every);
    absl::Status hs = answer.status();
    if (hs.ok()) {
      peer_service_.SetProbers({answer->probe_from().begin(), answer->probe_from().end()});  // a site joining
      v1::HeartbeatResponse heard = *answer;
      if (o_.fault_late_boundary_seconds > 0 && heard.end_after_step() > 0) {  // the fault: the boundary comes late
        if (late_job != heard.end_job_id()) late_job = heard.end_job_id(), late_since = Clock::now();
        if (Clock::now() - late_since < std::chrono::duration<double>(o_.fault_late_boundary_seconds)) {
          heard.set_end_after_step(0);
          heard.clear_end_job_id();
          heard.clear_left_out();
        }
      }
      step_control_.Update(heard);
      if (failing) spdlog::warn("the coordinator answers heartbeats again");
      failing = false;
    } else if (!failing) {
      failing = true;
      failing_since = Clock::now();
      spdlog::warn("{}", absl::StrCat("heartbeat failed (", hs.message(), "); retrying for ", timeout, " s"));
    } else if (Clock::now() - failing_since > std::chrono::duration<double>(timeout)) {
      spdlog::error("{}", absl::StrCat("lost the coordinator (no heartbeat answered for ", timeout, " s); stopping"));
      std::_Exit(1);
    }
    // Until the next beat, or at once when the state changes (the coordinator's status follows).
    std::unique_lock<std::mutex> l(heartbeat_mu_);
    heartbeat_cv_.wait_for(l, every, [&] { return done_ || beat_now_; });
    if (done_) return;
    beat_now_ = false;
  }
}

void Agent::SetState(v1::SiteState state) {
  state_ = state;
  BeatNow();
}

void Agent::BeatNow() {
  {
    std::lock_guard<std::mutex> l(heartbeat_mu_);
    beat_now_ = true;
  }
  heartbeat_cv_.notify_all();
}

absl::StatusOr<rpc::TransportCost> Agent::MeasureTransport(const JobSetup& setup) {
  // Over this process's own peer service, at the job's activation frame (float32: the largest a codec
  // sends; the fit's per-byte term scales it down for the others).
  std::string address = o_.listen;
  for (const char* any : {"0.0.0.0:", "[::]:"})
    if (address.rfind(any, 0) == 0) address = "127.0.0.1:" + address.substr(std::string(any).size());
  auto client = rpc::PeerClient::Create(o_.certs, o_.site, o_.site, address);
  if (!client.ok()) return client.status();
  // At most 4 MiB: the per-byte term carries larger frames (a model too large for the site would
  // otherwise stream gigabytes here before its measuring fails).
  const int64_t frame_bytes = std::min<int64_t>(
      int64_t{setup.micro_batch_size} * setup.job.sequence_length * setup.model.shape.hidden_size * 4, 4 << 20);
  auto cost = rpc::MeasureTransportCost(**client, frame_bytes, 16, std::chrono::seconds(60));
  if (!cost.ok())
    return absl::UnavailableError(
        absl::StrCat("measuring the transport's CPU cost over its own peer service: ", cost.status().message()));
  const double share = MeasureCpuShare();
  cpu_share_ = share;
  peer_service_.SetProbeCpuShare(share);  // idle: a peer's link probe may be measured here
  spdlog::info("{}", absl::StrFormat("transport: %.1f us per frame + %.2f ns per byte of CPU, at %.2f of a core",
                                     cost->seconds_per_frame * 1e6, cost->seconds_per_byte * 1e9, share));
  return rpc::TransportCost{cost->seconds_per_frame / share, cost->seconds_per_byte / share};
}

void Agent::OnProfile(const v1::ProfileRequest& p) {
  spdlog::debug("command: profile ({}{} peers to probe, {} repeats)", p.links_only() ? "links only: " : "",
                p.peers_size(), p.repeats());
  SetState(v1::SITE_PROFILING);

  v1::ProfileReport rep;
  rep.set_site(o_.site);
  std::optional<JobSetup> measured_job;  // the job whose model was measured
  absl::Status failure = GuardTorch(absl::StrCat("site '", o_.site, "': profiling"), [&]() -> absl::Status {
    if (!p.links_only()) {  // the device and the model (a links-only request follows them)
      auto setup = JobFromText(p.job_yaml(), p.job_dir());
      if (!setup.ok()) return setup.status();
      measured_job = *setup;
      // Its transport first (a CPU site's transport threads share the CPU with the compute thread): every
      // site starts measuring at once, so no site's transport probe runs while the others time their model
      // (a site done early computes the model's passes instead, as in training: StartComputing).
      rpc::TransportCost transport;  // none on a GPU site: its transport runs beside the device
      if (device_.is_cpu()) {
        auto measured = MeasureTransport(*setup);
        if (!measured.ok()) return measured.status();
        transport = *measured;
      }
      // A site of several devices is measured as its workers run together (ProfileAsWorker).
      ScratchDir site_dir(absl::StrCat(o_.site, "-workers"));
      SiteWorkers site;
      if (devices_.size() > 1) {
        if (absl::Status s = site_dir.Create(); !s.ok()) return s;
        auto started = StartSiteWorkers(site_dir.path.string(), "profile", p.SerializeAsString());
        if (!started.ok()) return started.status();
        site = std::move(*started);
      }
      auto prof = ProfileAsWorker(site.group.get(), *setup, o_.site, device_, p.repeats() > 0 ? p.repeats() : 5);
      if (!prof.ok()) return prof.status();
      if (site.pool) site.pool->Stop(std::chrono::seconds(30));
      prof->site.transport_seconds_per_frame = transport.seconds_per_frame;
      prof->site.transport_seconds_per_byte = transport.seconds_per_byte;
      partitioner::ClusterProfile one;
      one.sites.push_back(prof->site);
      rep.set_site_profile_json(nlohmann::json::parse(partitioner::ProfileToJson(one))["sites"][0].dump());
      rep.set_graph_json(partitioner::GraphToJson(prof->graph));
    }
    nlohmann::json links = nlohmann::json::array();
    for (const auto& peer : p.peers()) {
      auto client = rpc::PeerClient::Create(o_.certs, o_.site, peer.site(), peer.address());
      if (!client.ok()) return client.status();
      rpc::ProbeOptions po;
      po.bulk_bytes = 1 << 20;
      po.cpu_share = cpu_share_;  // the reverse direction's receive cost at this site's share (0 on a GPU site)
      auto probe = [&](rpc::PeerClient* pull_client) {
        auto m = rpc::ProbeLink(**client, po, pull_client);
        if (m.ok())
          for (const std::string& error : m->retried_after)
            spdlog::warn("{}", absl::StrCat("probing the link to '", peer.site(), "' was cut off (", error,
                                            "); measured again"));
        return m;
      };
      auto first = probe(nullptr);
      if (first.ok()) {
        po.bulk_bytes = std::clamp<int64_t>(
            static_cast<int64_t>(first->forward_bytes_per_second * std::max(0.2, p.probe_seconds())), 1 << 20,
            256 << 20);
        po.both_ways = true;
        // A 1 MiB transfer at a few Mbit/s reads 1.0 to 1.9 Mbit/s on identical 2 Mbit/s links
        // (bench/RESULTS.md, the simulator section): the best of two.
        po.repeats = 2;
        // The loaded pull over a connection of its own, as the peer's gradients come over its own.
        auto pull_client = rpc::PeerClient::Create(o_.certs, o_.site, peer.site(), peer.address(), true);
        if (!pull_client.ok()) return pull_client.status();
        first = probe(pull_client->get());
      }
      if (!first.ok())
        return absl::UnavailableError(
            absl::StrCat("probing the link to '", peer.site(), "': ", first.status().message()));
      // A pipeline link carries both directions at once: its bandwidth is what each direction gets then
      // (never more than alone).
      auto loaded = [](double alone, double both) { return both > 0 ? std::min(alone, both) : alone; };
      nlohmann::json forward = {{"from", o_.site},
                                {"to", peer.site()},
                                {"bandwidth_bytes_per_second",
                                 loaded(first->forward_bytes_per_second, first->forward_loaded_bytes_per_second)},
                                {"latency_seconds", first->rtt_seconds / 2}};
      nlohmann::json reverse = {{"from", peer.site()},
                                {"to", o_.site},
                                {"bandwidth_bytes_per_second",
                                 loaded(first->reverse_bytes_per_second, first->reverse_loaded_bytes_per_second)},
                                {"latency_seconds", first->rtt_seconds / 2}};
      // What receiving costs at each end at the link's rate, where measured. Both rest on the peer's word
      // (the reverse is its CPU a byte at this site's share): beyond the bound the profile allows, a figure
      // is left out (logged), so that it cannot fail this report.
      auto receive = [&](nlohmann::json& link, double seconds_per_byte, const std::string& whose) {
        if (seconds_per_byte <= 0) return;
        if (seconds_per_byte > partitioner::kMaxReceiveSecondsPerByte) {
          spdlog::warn("{}", absl::StrFormat("the link %s -> %s: %s receive cost of %.3g s a byte is beyond %.0e; "
                                             "left out",
                                             link["from"].get<std::string>(), link["to"].get<std::string>(), whose,
                                             seconds_per_byte, partitioner::kMaxReceiveSecondsPerByte));
          return;
        }
        link["receive_seconds_per_byte"] = seconds_per_byte;
      };
      receive(forward, first->forward_receive_seconds_per_byte, absl::StrCat("'", peer.site(), "' reported a"));
      receive(reverse, first->reverse_receive_seconds_per_byte, "a derived");
      spdlog::info("{}", absl::StrFormat("link to '%s': receive %.1f ns a byte there, %.1f here (0: not measured)",
                                         peer.site(), first->forward_receive_seconds_per_byte * 1e9,
                                         first->reverse_receive_seconds_per_byte * 1e9));
      links.push_back(std::move(forward));
      links.push_back(std::move(reverse));
    }
    rep.set_links_json(links.dump());
    return absl::OkStatus();
  });
  if (!failure.ok()) rep.set_error(std::string(failure.message()));
  if (absl::Status s = coordinator_->ReportProfile(rep, std::chrono::seconds(30)); !s.ok())
    spdlog::error("{}", absl::StrCat("cannot report the profile: ", s.message()));
  SetState(v1::SITE_IDLE);
  // A GPU site's computing loads no one else's device; a site of several devices is not kept busy.
  if (failure.ok() && measured_job && p.keep_busy_seconds() > 0 && device_.is_cpu() && devices_.size() <= 1)
    StartComputing(*measured_job, p.keep_busy_seconds());
}

void Agent::StartComputing(const JobSetup& setup, double seconds) {
  StopComputing();
  stop_computing_ = false;
  peer_service_.SetProbeCpuShare(0);  // its CPU is the computing's now
  spdlog::info("{}", absl::StrFormat("keeps computing the model, untimed, while the other sites measure theirs "
                                     "(until the next command, at most %.0f s)",
                                     seconds));
  computing_ = core::NamedThread("mrd-keep-busy", [this, setup, seconds] {
    const absl::Status s = KeepComputing(setup.model, setup.micro_batch_size, setup.job.sequence_length, device_,
                                         setup.job.lora, &stop_computing_, seconds);
    if (!s.ok()) spdlog::warn("{}", absl::StrCat("site '", o_.site, "': ", s.message()));
  });
}

void Agent::StopComputing() {
  stop_computing_ = true;
  if (computing_.joinable()) computing_.join();
  peer_service_.SetProbeCpuShare(cpu_share_);
}

void Agent::OnAssign(const v1::StageAssignment& pa) {
  spdlog::info("assigned stage {}/{} (ops {}-{}) of job {}{}", pa.stage() + 1, pa.num_stages(), pa.first_op(),
               pa.last_op(), pa.job_id(), pa.resume_step() != 0 ? ", resuming" : "");
  SetState(v1::SITE_TRAINING);
  peer_service_.SetProbeCpuShare(0);  // a joining site's probes are not measured against training's CPU
  v1::StageDone result;
  result.set_site(o_.site);
  result.set_job_id(pa.job_id());
  const StageAssignment a = FromProto(pa);
  peer_service_.SetAllowedPeers(StagePeers(a, o_.site));
  peer_service_.SetJob(a.job_id);  // a late frame of an abandoned attempt is dropped
  std::unique_ptr<StageWorker> worker;
  StageRunResult run_result;
  MetricsReporter reporter(coordinator_);
  run_result.status = GuardTorch(absl::StrCat("stage ", a.stage, " (site '", o_.site, "')"), [&]() -> absl::Status {
    auto setup = AssignedJob(pa, a);
    if (!setup.ok()) return setup.status();
    auto created = StageWorker::Create(*setup, a, &inbox_, o_.certs, o_.site, device_, std::chrono::seconds(60));
    if (!created.ok()) return created.status();
    worker = std::move(*created);
    // A site of several devices: workers 1..K-1 run the same stage in lock step (executor/site_group.h),
    // started for this assignment and stopped with it.
    ScratchDir site_dir(absl::StrCat(o_.site, "-workers"));
    SiteWorkers site;
    if (devices_.size() > 1) {
      if (absl::Status s = worker->CanSplit(static_cast<int>(devices_.size())); !s.ok()) return s;
      if (absl::Status s = site_dir.Create(); !s.ok()) return s;
      auto started = StartSiteWorkers(site_dir.path.string(), "stage", pa.SerializeAsString());
      if (!started.ok()) return started.status();
      site = std::move(*started);
      if (absl::Status s = worker->JoinSite(site.group.get()); !s.ok()) return s;
    }
    SiteGroup* const group = site.group.get();
    WorkerPool* const pool = site.pool.get();
    peer_service_.SetFrameBounds(worker->ExpectedFrames());
    if (o_.fault_nan_gradient_step >= 0 && !nan_fault_fired_) worker->InjectNanGradientAt(o_.fault_nan_gradient_step);
    // Checkpoints: job.checkpoint.dir (store: shared), or a scratch directory whose shards go to the
    // coordinator (store: coordinator), from which a resumed stage fetches the step it is given.
    const bool via_coordinator = pa.checkpoints_to_coordinator();
    ScratchDir scratch(absl::StrCat(o_.site, "-checkpoints"));
    if (via_coordinator)
      if (absl::Status s = scratch.Create(); !s.ok()) return s;
    CheckpointUploader uploader(coordinator_, o_.site, a.job_id);
    StageRun run = StageRunOf(pa, *setup);
    run.checkpoint_dir = via_coordinator ? (scratch.path / "out").string()
                                         : core::ResolveRelative(pa.job_dir() + "/job.yaml", setup->job.checkpoint.dir);
    run.checkpoint_keep = via_coordinator ? 0 : setup->job.checkpoint.keep;  // the coordinator prunes its store
    if (pa.resume_step() != 0) {  // -1: the newest intact checkpoint; S > 0: step S
      run.forget_checkpoints_after_resume = !via_coordinator;
      run.resume = [&]() -> absl::StatusOr<Checkpoint> {
        absl::StatusOr<Checkpoint> c = absl::UnknownError("not loaded");
        if (via_coordinator) {
          // The step's JSONs first, then only the shards holding this stage's tensors.
          const fs::path in = scratch.path / "in";
          std::string step_dir;
          std::map<std::string, std::string> shard_paths;  // shard file name -> path in the store
          for (const auto& f : pa.resume_files()) {
            const std::optional<core::SiteFile> file = core::ParseSiteFile(f);
            if (!file || file->kind == core::SiteFile::Kind::kWeights)
              return absl::InvalidArgumentError(absl::StrCat("resume file '", f, "' is not a checkpoint file"));
            const fs::path local = in / core::StepDirName(file->step) / fs::path(f).filename();
            step_dir = local.parent_path().string();
            // Stage JSONs, and this replica's DiLoCo round state (named only when its stage resumes them).
            if (file->kind == core::SiteFile::Kind::kCheckpointMeta || file->replica >= 0) {
              if (absl::Status s = coordinator_->GetFile(o_.site, f, local.string()); !s.ok()) return s;
            } else {
              shard_paths[local.filename().string()] = f;
            }
          }
          if (step_dir.empty()) return absl::InvalidArgumentError("the assignment names no resume files");
          const std::set<std::string> wanted = worker->CheckpointTensorNames();
          auto shards = core::ShardsHolding(step_dir, wanted);
          if (!shards.ok()) return shards.status();
          for (const auto& shard : *shards) {
            auto it = shard_paths.find(shard);
            if (it == shard_paths.end())
              return absl::InvalidArgumentError(absl::StrCat("the resume files name no ", shard));
            if (absl::Status s = coordinator_->GetFile(o_.site, it->second, (fs::path(step_dir) / shard).string());
                !s.ok())
              return s;
          }
          c = LoadCheckpointFor(step_dir, wanted);
          if (c.ok()) c->chosen_by_coordinator = true;
        } else {
          std::string skipped;
          c = LoadLatestCheckpoint(run.checkpoint_dir, &skipped, pa.resume_run());
          if (!skipped.empty()) spdlog::warn("{}", absl::StrCat("resuming: skipped ", skipped));
        }
        if (c.ok() && pa.resume_step() > 0 && c->step != pa.resume_step())
          return absl::DataLossError(absl::StrCat("the checkpoint loaded (", c->path, ") is step ", c->step,
                                                  ", not the step ", pa.resume_step(), " assigned"));
        return c;
      };
    }
    // Every stage reports each step's time breakdown and bytes; stage 0 also the loss (a one-stage DiLoCo
    // plan's replicas other than replica 0: their own share of it).
    std::optional<v1::MetricsReport> last_report;  // the stage's latest (its thread's only)
    run.on_step = [&](const StepDone& d) {
      step_ = d.step;
      spdlog::debug(
          "step {}: {:.3f} s, computing {:.3f} s, waiting {:.3f} s, blocked sending {:.3f} s, codecs {:.3f} s",
          d.step + 1, d.seconds, worker->last_compute_seconds(), worker->last_wait_seconds(),
          worker->last_send_blocked_seconds(), worker->last_codec_seconds());
      v1::MetricsReport m;
      m.set_site(o_.site);
      m.set_job_id(a.job_id);
      m.set_step(d.step);
      m.set_loss(d.loss.value_or(0));
      m.set_step_seconds(d.seconds);
      m.set_tokens(static_cast<int64_t>(setup->job.global_batch) * setup->job.sequence_length);
      m.set_wire_bytes(worker->wire_bytes());
      m.set_raw_bytes(worker->raw_bytes());
      m.set_compute_seconds(worker->last_compute_seconds());
      m.set_wait_seconds(worker->last_wait_seconds());
      m.set_send_blocked_seconds(worker->last_send_blocked_seconds());
      m.set_codec_seconds(worker->last_codec_seconds());
      m.set_site_reduce_seconds(worker->last_site_reduce_seconds());
      m.set_cpu_seconds(worker->last_cpu_seconds());
      m.set_compute_cpu_seconds(worker->last_compute_cpu_seconds());
      m.set_compute_thread_cpu_seconds(worker->last_compute_thread_cpu_seconds());
      m.set_compute_thread_preemptions(worker->last_compute_thread_preemptions());
      if (const auto sync = worker->last_outer_sync()) {
        m.set_outer_sync_step(sync->after_step);
        m.set_outer_sync_bytes(sync->wire_bytes);
        m.set_outer_sync_seconds(sync->seconds);
        m.set_outer_drift(sync->drift);
      }
      m.set_stage(a.stage);
      last_report = m;
      reporter.Post(std::move(m));
    };
    if (via_coordinator)
      run.on_checkpoint = [&](int64_t step) {
        return uploader.Start((fs::path(run.checkpoint_dir) / core::StepDirName(step)).string(), step, a.stage);
      };
    run.before_finish = [&] { return uploader.Wait(); };
    // A switch to another plan and the step lease, from the heartbeats' answers: past its lease, the stage
    // asks for a heartbeat at once and then four times an interval until the next answer grants more.
    const double interval_seconds = std::max(reg_.heartbeat_interval_seconds(), 0.2);
    const auto ask_every = std::chrono::milliseconds(static_cast<int64_t>(250 * interval_seconds));
    run.end_after = [&](int64_t steps_done) -> absl::StatusOr<int64_t> {
      // The coordinator grants leases from the step reports. Reports are best-effort (one can be lost when
      // the coordinator was unreachable for a while), so one still waited for after a few heartbeats
      // is sent again (the coordinator ignores a step it has).
      const auto resend_after = std::chrono::milliseconds(static_cast<int64_t>(3000 * interval_seconds));
      Clock::time_point resend_at = Clock::now() + resend_after;
      absl::StatusOr<int64_t> boundary = step_control_.WaitAfter(
          a.job_id, steps_done,
          [&] {
            BeatNow();
            if (last_report && Clock::now() >= resend_at) {
              resend_at = Clock::now() + resend_after;
              reporter.Post(*last_report);
            }
          },
          ask_every,
          [&](double seconds) {
            spdlog::warn("{}", absl::StrFormat("waiting %.0f s after step %d for the coordinator's step lease", seconds,
                                               steps_done));
          });
      return ShareBoundary(group, boundary);
    };
    run.left_out = [&]() -> std::set<std::string> {  // lost DiLoCo workers, from the heartbeats' answers
      return step_control_.LeftOut(a.job_id);
    };
    // The coordinator names a lost site within its heartbeat timeout, and this site hears it with its
    // next heartbeat's answer.
    run.left_out_wait = std::chrono::milliseconds(
        static_cast<int64_t>(1000 * (reg_.heartbeat_timeout_seconds() + 2 * reg_.heartbeat_interval_seconds() + 1)));
    run_result = RunStage(*worker, run);
    if (const double waited = step_control_.waited_seconds(a.job_id); waited >= 0.5)
      spdlog::info(
          "{}", absl::StrFormat("attempt %s waited %.1f s in all for the coordinator's step lease", a.job_id, waited));
    // The other workers end with their stage; on a failure here they are killed (the pool's destructor).
    if (pool && run_result.status.ok()) {
      pool->Stop(std::chrono::seconds(30));
      LogOptimizerState(absl::StrCat("site '", o_.site, "' worker 0 of ", devices_.size()), *worker);
    }
    (void)uploader.Wait();  // a failed run's upload in flight ends before the scratch directory goes
    if (!run_result.status.ok()) return run_result.status;
    if (run_result.at_boundary) {
      spdlog::info("ended at the step boundary {} (checkpoint saved); waiting for the new plan", run_result.steps_done);
      return absl::OkStatus();
    }
    if (!worker->writes_shard()) return absl::OkStatus();
    if (pa.weights_to_coordinator()) {  // RUN/weights/stage-K.safetensors
      ScratchDir tmp(absl::StrCat(o_.site, "-weights"));
      if (absl::Status s = tmp.Create(); !s.ok()) return s;
      const std::string local = (tmp.path / "stage.safetensors").string();
      if (absl::Status s = SaveParameters(local, worker->Parameters()); !s.ok()) return s;
      return coordinator_->PutFile(o_.site, a.job_id, local, core::WeightsFile(a.stage));
    }
    if (!pa.output_dir().empty())
      return SaveParameters((fs::path(pa.output_dir()) / core::StageShardName(a.stage)).string(), worker->Parameters());
    return absl::OkStatus();
  });
  result.set_steps(run_result.steps_done);
  if (worker) {
    result.set_wire_bytes(worker->wire_bytes());
    result.set_raw_bytes(worker->raw_bytes());
    nan_fault_fired_ |= worker->nan_gradient_sent();
  }
  if (!run_result.status.ok()) {
    result.set_error(std::string(run_result.status.message()));
    result.set_error_code(static_cast<int>(run_result.status.code()));
    spdlog::error("{}", absl::StrCat(run_result.status.message()));
    rc_ = 1;
  }
  reporter.Flush();  // the coordinator sees every step's report before the stage's end
  SetState(run_result.status.ok() ? v1::SITE_DONE : v1::SITE_FAILED);
  // Idle again, before the coordinator hears of it (it may start the next attempt at once): any site of
  // the cluster may connect and its frames wait in the inbox, since the next attempt's neighbours may
  // start sending before this site has its assignment; that assignment's SetJob then drops every other
  // job's frames. The per-peer bounds hold meanwhile.
  peer_service_.SetAllowedPeers(cluster_sites_);
  peer_service_.SetJob(std::nullopt);
  peer_service_.SetFrameBounds({});  // the next attempt's shapes may differ (another micro-batch count)
  peer_service_.SetProbeCpuShare(cpu_share_);
  (void)coordinator_->ReportDone(result, kReportTimeout);
}

absl::StatusOr<Agent::SiteWorkers> Agent::StartSiteWorkers(const std::string& dir, const std::string& task,
                                                           const std::string& command) {
  // Worker r runs on devices[r]: worker 0 (this process) too, or two workers could share a device.
  if (device_.str() != devices_[0])
    return absl::FailedPreconditionError(absl::StrCat("site '", o_.site, "': this executor runs on ", device_.str(),
                                                      " (--device or MERIDIAN_DEVICE), but the spec's ",
                                                      "sites[].devices puts worker 0 on ", devices_[0],
                                                      "; leave --device out on a site of several devices"));
  const std::string command_file = dir + "/" + task + ".pb", store = dir + "/store";
  if (absl::Status s = core::WriteFileAtomic(command_file, command); !s.ok()) return s;
  const auto level = spdlog::level::to_string_view(spdlog::get_level());
  SiteWorkers w;
  auto pool = WorkerPool::Start({"--site", o_.site, "--site-store", store, "--site-command", command_file,
                                 "--site-task", task, "--log-level", std::string(level.data(), level.size())},
                                devices_, absl::StrCat("site '", o_.site, "'"));
  if (!pool.ok()) return pool.status();
  w.pool = std::move(*pool);
  auto group = SiteGroup::Join(store, 0, static_cast<int>(devices_.size()), kSiteGroupTimeout,
                               absl::StrCat("site '", o_.site, "'"), device_.str());
  if (!group.ok()) return group.status();  // w's pool kills the workers it started
  w.group = std::move(*group);
  return w;
}

int RunSiteWorker(const SiteWorkerOptions& w) {
  const std::string where = absl::StrCat("site '", w.site, "' worker ", w.rank, " of ", w.workers);
  auto text = core::ReadFile(w.command);
  absl::Status status = text.status();
  if (text.ok())
    status = GuardTorch(where, [&]() -> absl::Status {
      auto group =
          SiteGroup::Join(w.store, w.rank, w.workers, kSiteGroupTimeout, absl::StrCat("site '", w.site, "'"), w.device);
      if (!group.ok()) return group.status();
      const torch::Device device(w.device);
      if (w.task == "profile") {  // the site's measurement, as worker w.rank
        v1::ProfileRequest p;
        if (!p.ParseFromString(*text)) return absl::DataLossError(absl::StrCat(w.command, ": not a profile request"));
        auto setup = JobFromText(p.job_yaml(), p.job_dir());
        if (!setup.ok()) return setup.status();
        auto prof = ProfileAsWorker(group->get(), *setup, w.site, device, p.repeats() > 0 ? p.repeats() : 5);
        if (prof.ok()) spdlog::info("{}", absl::StrCat(where, ": measured"));
        return prof.status();
      }
      v1::StageAssignment pa;
      if (!pa.ParseFromString(*text)) return absl::DataLossError(absl::StrCat(w.command, ": not an assignment"));
      const StageAssignment a = FromProto(pa);
      auto setup = AssignedJob(pa, a);
      if (!setup.ok()) return setup.status();
      rpc::TensorInbox unused;  // worker 0 receives the site's tensors
      auto worker = StageWorker::Create(*setup, a, &unused, "", w.site, device, std::chrono::seconds(60));
      if (!worker.ok()) return worker.status();
      if (absl::Status s = (*worker)->JoinSite(group->get()); !s.ok()) return s;
      spdlog::info("{}", absl::StrCat(where, ": stage ", a.stage, " (ops ", a.first_op, "-", a.last_op, ") on ",
                                      w.device, ", process ", ::getpid()));
      // What worker 0 runs, with its decisions (resume step, boundary) received from it.
      StageRun run = StageRunOf(pa, *setup);
      if (pa.resume_step() != 0)
        run.resume = []() -> absl::StatusOr<Checkpoint> {
          Checkpoint c;
          c.path = "worker 0's checkpoint";
          return c;
        };
      SiteGroup* g = group->get();
      run.end_after = [g](int64_t) { return ShareBoundary(g, int64_t{0}); };
      const StageRunResult result = RunStage(**worker, run);
      if (!result.status.ok()) return result.status;
      LogOptimizerState(where, **worker);
      spdlog::info("{}", absl::StrCat(where, ": done after step ", result.steps_done));
      return absl::OkStatus();
    });
  if (status.ok()) return 0;
  spdlog::error("{}", absl::StrCat(where, ": ", status.message()));
  return 1;
}

}  // namespace meridian::executor
