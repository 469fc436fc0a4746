#include "executor/joined.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <deque>
#include <condition_variable>
#include <chrono>
#include <iostream>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/files.h"
#include "executor/profiler.h"
#include "executor/stage.h"
#include "rpc/credentials.h"
#include "rpc/peer.h"

namespace meridian::executor {
namespace {

namespace fs = std::filesystem;

using Clock = std::chrono::steady_clock;

template <typename Req, typename Fn>
grpc::Status Call(Fn fn, const Req& req, double seconds) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  v1::MetricsAck ack;
  return fn(&ctx, req, &ack);
}

// Sends the local file `local` to the coordinator's run directory as `path` (PutFile), in 1 MiB chunks
// with the file's SHA-256. The deadline allows 1 MB/s plus a minute. Errors name the file and the
// coordinator's answer.
absl::Status SendFile(v1::Coordinator::Stub* stub, const std::string& site, const std::string& job_id,
                      const std::string& local, const std::string& path) {
  std::ifstream in(local, std::ios::binary);
  std::error_code ec;
  const auto size = fs::file_size(local, ec);
  if (!in || ec) return absl::InternalError(absl::StrCat("cannot read ", local, ec ? ": " + ec.message() : ""));
  core::Sha256 sha;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60 + static_cast<int64_t>(size / 1000000)));
  v1::FileAck ack;
  auto writer = stub->PutFile(&ctx, &ack);
  std::string buf(size_t{1} << 20, '\0');
  for (bool first = true;; first = false) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const size_t n = static_cast<size_t>(in.gcount());
    if (in.bad()) {  // never send a checksum of part of the file
      ctx.TryCancel();
      (void)writer->Finish();
      return absl::InternalError(absl::StrCat("sending ", path, ": reading ", local, " failed"));
    }
    v1::FileChunk c;
    if (first) c.set_site(site), c.set_job_id(job_id), c.set_path(path);
    c.set_data(buf.data(), n);
    sha.Update(std::string_view(buf.data(), n));
    const bool last = !in;
    if (last) c.set_sha256(sha.HexDigest());
    if (!writer->Write(c) || last) break;
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok())
    return absl::UnavailableError(absl::StrCat("sending ", path, " (", size, " bytes) to the coordinator: ",
                                               s.error_message()));
  if (ack.bytes() != static_cast<int64_t>(size))
    return absl::DataLossError(absl::StrCat("the coordinator stored ", ack.bytes(), " bytes of ", path, ", not ", size));
  return absl::OkStatus();
}

// Fetches `path` of the coordinator's run directory (GetFile) into the local file `local`, checking the
// SHA-256 the coordinator sends with the last chunk.
absl::Status FetchFile(v1::Coordinator::Stub* stub, const std::string& site, const std::string& path,
                       const std::string& local) {
  std::error_code ec;
  fs::create_directories(fs::path(local).parent_path(), ec);
  if (ec) return absl::InternalError(absl::StrCat("fetching ", path, ": cannot create the directory of ", local, ": ", ec.message()));
  std::ofstream out(local, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat("fetching ", path, ": cannot write ", local));
  core::Sha256 sha;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));
  v1::FileRequest req;
  req.set_site(site);
  req.set_path(path);
  auto reader = stub->GetFile(&ctx, req);
  v1::FileChunk c;
  std::string want;
  int64_t bytes = 0;
  while (reader->Read(&c)) {
    out.write(c.data().data(), static_cast<std::streamsize>(c.data().size()));
    sha.Update(c.data());
    bytes += static_cast<int64_t>(c.data().size());
    if (!c.sha256().empty()) want = c.sha256();
  }
  grpc::Status s = reader->Finish();
  out.close();
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("fetching ", path, " from the coordinator: ", s.error_message()));
  if (!out) return absl::InternalError(absl::StrCat("writing ", local, " failed"));
  if (want.empty() || sha.HexDigest() != want)
    return absl::DataLossError(absl::StrCat("fetching ", path, " from the coordinator: SHA-256 mismatch over ", bytes,
                                            " bytes"));
  return absl::OkStatus();
}

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
// crosses the coordinator's link: the shard, then its JSON (which vouches for it); then the local copy
// is removed. One step at a time: Start waits for the previous step's upload. Thread-compatible: used by
// the stage thread only; the destructor waits for the upload in flight.
class CheckpointUploader {
 public:
  CheckpointUploader(v1::Coordinator::Stub* stub, std::string site, std::string job_id)
      : stub_(stub), site_(std::move(site)), job_id_(std::move(job_id)) {}
  ~CheckpointUploader() { (void)Wait(); }
  // Waits for the previous upload and returns its error, if any (then nothing new starts); else starts
  // sending `step_dir`'s files of `stage` as checkpoints/step-S/.
  absl::Status Start(const std::string& step_dir, int64_t step, int stage) {
    if (absl::Status s = Wait(); !s.ok()) return s;
    pending_ = std::async(std::launch::async, [this, step_dir, step, stage] {
      absl::Status s;
      for (const char* ext : {".safetensors", ".json"}) {
        const std::string name = absl::StrCat("stage-", stage, ext);
        s = SendFile(stub_, site_, job_id_, step_dir + "/" + name, absl::StrCat("checkpoints/step-", step, "/", name));
        if (!s.ok()) break;
      }
      std::error_code ec;
      fs::remove_all(step_dir, ec);
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
  v1::Coordinator::Stub* stub_;
  const std::string site_, job_id_;
  std::future<absl::Status> pending_;
};

// Sends this stage's final parameters to the coordinator's run directory as weights/stage-K.safetensors.
absl::Status SendWeights(v1::Coordinator::Stub* stub, const std::string& site, const std::string& job_id, int stage,
                         const std::map<std::string, torch::Tensor>& params) {
  ScratchDir tmp(absl::StrCat(site, "-weights"));
  if (absl::Status s = tmp.Create(); !s.ok()) return s;
  const std::string local = (tmp.path / "stage.safetensors").string();
  if (absl::Status s = SaveParameters(local, params); !s.ok()) return s;
  return SendFile(stub, site, job_id, local, absl::StrCat("weights/stage-", stage, ".safetensors"));
}

// Sends metrics reports to the coordinator from its own thread, in order, so the training loop never
// waits on the coordinator (whose answer may take a poll interval). Flush() waits until every queued
// report was sent (or failed); reports are best-effort. Thread-safe.
class MetricsReporter {
 public:
  explicit MetricsReporter(v1::Coordinator::Stub* stub) : stub_(stub), thread_([this] { Loop(); }) {}
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
      (void)Call([&](auto* c, const auto& r, auto* ack) { return stub_->ReportMetrics(c, r, ack); }, m, 10);
      l.lock();
      sending_ = false;
      cv_.notify_all();
    }
  }
  v1::Coordinator::Stub* stub_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::MetricsReport> queue_;
  bool sending_ = false, stop_ = false;
  std::thread thread_;
};

absl::StatusOr<JobSetup> JobFromText(const std::string& yaml, const std::string& dir) {
  const std::string path = dir + "/job.yaml";  // relative paths in the job resolve against its directory
  auto r = core::ParseSpec(yaml, path);
  if (!r.errors.empty()) return absl::InvalidArgumentError(r.errors[0].ToString());
  if (!r.spec->job) return absl::InvalidArgumentError("the coordinator sent no job section");
  return PrepareJob(*r.spec->job, path);
}

}  // namespace

int RunJoined(const ExecutorOptions& o, const v1::RegisterResponse& reg, v1::Coordinator::Stub* stub) {
  const double interval = reg.heartbeat_interval_seconds() > 0 ? reg.heartbeat_interval_seconds() : 1.0;
  const double timeout = reg.heartbeat_timeout_seconds() > interval ? reg.heartbeat_timeout_seconds() : 5 * interval;
  // The peer stream: any site of the cluster may be a neighbour or probe this one.
  rpc::TensorInbox inbox;
  std::set<std::string> allowed(reg.sites().begin(), reg.sites().end());
  allowed.erase(o.site);
  rpc::PeerService peer_service(o.site, allowed, &inbox);
  auto started = rpc::StartMtlsServer(o.certs, o.site, o.listen, {&peer_service});
  if (!started.ok()) {
    std::cerr << "meridian-executor: " << started.status().message() << "\n";
    return started.status().code() == absl::StatusCode::kUnavailable ? 1 : 2;
  }
  std::unique_ptr<grpc::Server> server = std::move(*started);
  std::atomic<int64_t> step{-1};
  std::atomic<bool> done{false};
  std::string state = "idle";
  std::mutex state_mu;
  // Heartbeats; the coordinator not answering for `timeout` of trying ends the process. The clock starts
  // at the first failed attempt, not at the last success: a process that was itself stopped (SIGSTOP, a
  // suspended VM) gets a full timeout to reach the coordinator again when it resumes.
  std::thread heart([&] {
    bool failing = false;
    Clock::time_point failing_since;
    while (!done) {
      v1::HeartbeatRequest req;
      req.set_site(o.site);
      req.set_step(step);
      {
        std::lock_guard<std::mutex> l(state_mu);
        req.set_state(state);
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(interval * 1000)));
      v1::HeartbeatResponse resp;
      grpc::Status hs = stub->Heartbeat(&ctx, req, &resp);
      if (hs.ok()) {
        if (failing) std::cerr << "meridian-executor: the coordinator answers heartbeats again\n";
        failing = false;
      } else if (!failing) {
        failing = true;
        failing_since = Clock::now();
        std::cerr << "meridian-executor: heartbeat failed (" << hs.error_message() << "); retrying for " << timeout
                  << " s\n";
      } else if (Clock::now() - failing_since > std::chrono::duration<double>(timeout)) {
        std::cerr << "meridian-executor: lost the coordinator (no heartbeat answered for " << timeout
                  << " s); stopping\n";
        std::_Exit(1);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(interval * 1000)));
    }
  });
  auto set_state = [&](const std::string& s) {
    std::lock_guard<std::mutex> l(state_mu);
    state = s;
  };
  torch::Device device(o.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(o.device));
  int rc = 0;
  MetricsReporter reporter(stub);
  bool stopped = false;
  while (!stopped) {
    grpc::ClientContext cctx;
    v1::CommandStreamRequest creq;
    creq.set_site(o.site);
    auto reader = stub->Commands(&cctx, creq);
    v1::Command cmd;
    while (reader->Read(&cmd)) {
      if (cmd.has_stop()) {
        stopped = true;
        break;
      }
      if (cmd.has_profile()) {
        set_state("profiling");
        const auto& p = cmd.profile();
        v1::ProfileReport rep;
        rep.set_site(o.site);
        auto setup = JobFromText(p.job_yaml(), p.job_dir());
        if (!setup.ok()) {
          rep.set_error(std::string(setup.status().message()));
        } else {
          auto prof = ProfileModel(setup->model, setup->micro_batch_size, setup->job.sequence_length, o.site, device,
                                   p.repeats() > 0 ? p.repeats() : 5,
                                    setup->job.lora);
          if (!prof.ok()) {
            rep.set_error(std::string(prof.status().message()));
          } else {
            partitioner::ClusterProfile one;
            one.sites.push_back(prof->site);
            rep.set_site_profile_json(nlohmann::json::parse(partitioner::ProfileToJson(one))["sites"][0].dump());
            rep.set_graph_json(partitioner::GraphToJson(prof->graph));
            nlohmann::json links = nlohmann::json::array();
            for (const auto& peer : p.peers()) {
              auto client = rpc::PeerClient::Create(o.certs, o.site, peer.site(), peer.address());
              if (!client.ok()) {
                rep.set_error(std::string(client.status().message()));
                break;
              }
              rpc::ProbeOptions po;
              po.bulk_bytes = 1 << 20;
              auto first = rpc::ProbeLink(**client, po);
              if (first.ok()) {
                po.bulk_bytes = std::clamp<int64_t>(
                    static_cast<int64_t>(first->forward_bytes_per_second * std::max(0.2, p.probe_seconds())), 1 << 20,
                    256 << 20);
                po.both_ways = true;
                first = rpc::ProbeLink(**client, po);
              }
              if (!first.ok()) {
                rep.set_error(absl::StrCat("probing the link to '", peer.site(), "': ", first.status().message()));
                break;
              }
              // A pipeline link carries both directions at once: its bandwidth is what each direction
              // gets then (never more than alone).
              auto loaded = [](double alone, double both) { return both > 0 ? std::min(alone, both) : alone; };
              links.push_back({{"from", o.site}, {"to", peer.site()},
                               {"bandwidth_bytes_per_second",
                                loaded(first->forward_bytes_per_second, first->forward_loaded_bytes_per_second)},
                               {"latency_seconds", first->rtt_seconds / 2}});
              links.push_back({{"from", peer.site()}, {"to", o.site},
                               {"bandwidth_bytes_per_second",
                                loaded(first->reverse_bytes_per_second, first->reverse_loaded_bytes_per_second)},
                               {"latency_seconds", first->rtt_seconds / 2}});
            }
            rep.set_links_json(links.dump());
          }
        }
        grpc::Status s = Call([&](auto* c, const auto& r, auto* a) { return stub->ReportProfile(c, r, a); }, rep, 30);
        if (!s.ok()) std::cerr << "meridian-executor: cannot report the profile: " << s.error_message() << "\n";
        set_state("idle");
        continue;
      }
      if (cmd.has_assign()) {
        set_state("training");
        const auto& pa = cmd.assign();
        v1::StageDone result;
        result.set_site(o.site);
        result.set_job_id(pa.job_id());
        auto setup = JobFromText(pa.job_yaml(), pa.job_dir());
        absl::Status failure;
        if (!setup.ok()) failure = setup.status();
        if (failure.ok() && pa.micro_batches() > 0) {
          if (setup->job.global_batch % pa.micro_batches() != 0)
            failure = absl::InvalidArgumentError("micro-batches do not divide the global batch");
          setup->micro_batches = pa.micro_batches();
          setup->micro_batch_size = setup->job.global_batch / pa.micro_batches();
        }
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
        for (auto [from, to] : {std::pair<const v1::StageSites*, StageSites*>{&pa.prev_stage(), &a.prev_replicas},
                                {&pa.this_stage(), &a.replicas},
                                {&pa.next_stage(), &a.next_replicas}}) {
          for (const auto& site : from->sites()) {
            to->sites.push_back(site.site());
            to->addresses.push_back(site.address());
          }
          to->micro_batches.assign(from->micro_batches().begin(), from->micro_batches().end());
        }
        if (failure.ok() && !compression::CodecSpec::Parse(a.gradient_codec).ok())
          failure = absl::InvalidArgumentError(absl::StrCat("gradient_codec '", a.gradient_codec, "' is not a codec"));
        if (failure.ok()) failure = CheckSlice(setup->model, a.first_op, a.last_op);
        if (failure.ok()) {
          StageWorker worker(*setup, a, &inbox, o.certs, o.site, device, std::chrono::seconds(60));
          // Checkpoints: job.checkpoint.dir (store: shared), or a scratch directory whose shards go to the
          // coordinator (store: coordinator), from which a resumed stage fetches the step it is given.
          const bool via_coordinator = pa.checkpoints_to_coordinator();
          ScratchDir scratch(absl::StrCat(o.site, "-checkpoints"));
          if (via_coordinator) failure = scratch.Create();
          const std::string ckpt_dir =
              via_coordinator ? (scratch.path / "out").string()
                              : core::ResolveRelative(pa.job_dir() + "/job.yaml", setup->job.checkpoint.dir);
          const int interval = setup->job.checkpoint.interval;
          CheckpointUploader uploader(stub, o.site, a.job_id);
          int start = 0;
          if (failure.ok() && pa.resume_step() != 0) {  // -1: the newest intact checkpoint; S > 0: step S
            absl::StatusOr<Checkpoint> c = absl::UnknownError("not loaded");
            if (via_coordinator) {
              // The step's JSONs first, then only the shards holding this stage's tensors.
              const std::string kStore = "checkpoints/";
              const fs::path in = scratch.path / "in";
              std::string step_dir;
              std::map<std::string, std::string> shard_paths;  // shard file name -> path in the store
              for (const auto& f : pa.resume_files()) {
                if (f.rfind(kStore, 0) != 0 || f.find("..") != std::string::npos) {
                  failure = absl::InvalidArgumentError(absl::StrCat("resume file '", f, "' is not under checkpoints/"));
                  break;
                }
                const fs::path local = in / f.substr(kStore.size());
                step_dir = local.parent_path().string();
                if (local.extension() == ".json") failure = FetchFile(stub, o.site, f, local.string());
                else shard_paths[local.filename().string()] = f;
                if (!failure.ok()) break;
              }
              const std::set<std::string> wanted = worker.CheckpointTensorNames();
              absl::StatusOr<std::vector<std::string>> shards = absl::NotFoundError("no resume files");
              if (failure.ok() && !step_dir.empty()) shards = ShardsHolding(step_dir, wanted);
              if (failure.ok() && !shards.ok()) failure = shards.status();
              for (size_t k = 0; failure.ok() && k < shards->size(); ++k) {
                auto it = shard_paths.find((*shards)[k]);
                if (it == shard_paths.end())
                  failure = absl::InvalidArgumentError(absl::StrCat("the resume files name no ", (*shards)[k]));
                else
                  failure = FetchFile(stub, o.site, it->second, (fs::path(step_dir) / it->first).string());
              }
              if (failure.ok()) c = LoadCheckpointFor(step_dir, wanted);
            } else {
              c = LoadLatestCheckpoint(ckpt_dir);
            }
            if (failure.ok()) {
              if (!c.ok()) failure = c.status();
              else if (pa.resume_step() > 0 && c->step != pa.resume_step())
                failure = absl::DataLossError(absl::StrCat("the checkpoint loaded (", c->path, ") is step ", c->step,
                                                           ", not the step ", pa.resume_step(), " assigned"));
              else if (failure = worker.Restore(*c); failure.ok()) start = static_cast<int>(c->step);
            }
            if (failure.ok() && !via_coordinator) worker.ForgetCheckpointsAfter(ckpt_dir, start);
          }
          if (failure.ok()) failure = worker.Connect();
          const int steps = pa.steps() > 0 ? pa.steps() : setup->job.steps;
          for (int i = start; failure.ok() && i < steps; ++i) {
            auto t0 = Clock::now();
            auto loss = worker.Step(i, setup->job.steps);  // the schedule spans the job, whatever this run covers
            if (!loss.ok()) {
              failure = loss.status();
              break;
            }
            step = i;
            {  // every stage reports its compute time and bytes; stage 0 also the loss
              v1::MetricsReport m;
              m.set_site(o.site);
              m.set_job_id(a.job_id);
              m.set_step(i);
              m.set_loss(loss->value_or(0));
              m.set_step_seconds(std::chrono::duration<double>(Clock::now() - t0).count());
              m.set_tokens(static_cast<int64_t>(setup->job.global_batch) * setup->job.sequence_length);
              m.set_wire_bytes(worker.wire_bytes());
              m.set_raw_bytes(worker.raw_bytes());
              m.set_compute_seconds(worker.last_compute_seconds());
              m.set_wait_seconds(worker.last_wait_seconds());
              m.set_send_blocked_seconds(worker.last_send_blocked_seconds());
              m.set_codec_seconds(worker.last_codec_seconds());
              m.set_stage(a.stage);
              reporter.Post(std::move(m));
            }
            if (interval > 0 && (i + 1) % interval == 0 && worker.writes_shard()) {
              // The coordinator prunes its store; a shared directory is pruned by stage 0's writer.
              failure = worker.SaveCheckpoint(ckpt_dir, i + 1, via_coordinator ? 0 : setup->job.checkpoint.keep);
              if (failure.ok() && via_coordinator)
                failure = uploader.Start(absl::StrCat(ckpt_dir, "/step-", i + 1), i + 1, a.stage);
            }
          }
          if (absl::Status s = uploader.Wait(); failure.ok()) failure = s;
          if (failure.ok()) failure = worker.Finish();
          if (failure.ok() && worker.writes_shard()) {
            if (pa.weights_to_coordinator())
              failure = SendWeights(stub, o.site, a.job_id, a.stage, worker.Parameters());
            else if (!pa.output_dir().empty())
              failure = SaveParameters(absl::StrCat(pa.output_dir(), "/stage-", a.stage, ".safetensors"),
                                       worker.Parameters());
          }
          result.set_steps(step + 1);
          result.set_wire_bytes(worker.wire_bytes());
          result.set_raw_bytes(worker.raw_bytes());
        }
        if (!failure.ok()) {
          result.set_error(std::string(failure.message()));
          std::cerr << "meridian-executor: " << failure.message() << "\n";
          rc = 1;
        }
        reporter.Flush();  // the coordinator sees every step's report before the stage's end
        set_state(failure.ok() ? "done" : "failed");
        (void)Call([&](auto* c, const auto& r, auto* ack) { return stub->ReportDone(c, r, ack); }, result, 10);
        continue;
      }
    }
    cctx.TryCancel();
    grpc::Status ended = reader->Finish();
    if (stopped) break;
    // The stream broke without a stop (this process was suspended, a network blip): open it again. When the
    // coordinator is really gone, the heartbeat thread ends the process.
    std::cerr << "meridian-executor: the command stream ended (" << ended.error_message() << "); reconnecting\n";
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(interval * 1000)));
  }
  done = true;
  heart.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return rc;
}

}  // namespace meridian::executor
