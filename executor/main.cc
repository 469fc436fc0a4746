// `meridian-executor`: runs at each site.
//  * Joined mode (the default): resolves its settings (flags > MERIDIAN_* env > spec), checks its
//    identity files against the cluster CA and registers with the coordinator over mutual TLS.
//  * Static mode (--assignment FILE --job JOB.yaml): runs one pipeline stage described by a JSON
//    assignment (docs/executor.md) without a coordinator, serving its peer stream on --listen, and
//    writes its slice's final weights to --out.
// Exit codes: 0 success, 1 runtime failure (peer or coordinator unreachable, training error),
// 2 invalid settings or input.
#include <grpcpp/grpcpp.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/certs.h"
#include "core/files.h"
#include "core/log.h"
#include "core/run_layout.h"
#include "core/version.h"
#include "executor/agent.h"
#include "executor/host_memory.h"
#include "executor/options.h"
#include "executor/profiler.h"
#include "executor/run_stage.h"
#include "executor/site_group.h"
#include "executor/stage.h"
#include "partitioner/model.h"
#include "proto/meridian.grpc.pb.h"
#include "rpc/coordinator_client.h"
#include "rpc/credentials.h"

namespace {

using namespace meridian;

int RunStatic(const executor::ExecutorOptions& o, const std::string& assignment_path, const std::string& job_path,
              const std::string& out_dir, int steps, int timeout_s, bool resume) {
  auto text = core::ReadFile(assignment_path);
  if (!text.ok()) {
    spdlog::error("{}", absl::StrCat(text.status().message()));
    return 2;
  }
  auto a = executor::ParseAssignmentJson(*text, assignment_path);
  if (!a.ok()) {
    spdlog::error("{}", absl::StrCat(a.status().message()));
    return 2;
  }
  auto setup = executor::LoadJob(job_path);
  if (!setup.ok()) {
    spdlog::error("{}", absl::StrCat(setup.status().message()));
    return 2;
  }
  if (auto s = executor::CheckSlice(setup->model, a->first_op, a->last_op); !s.ok()) {
    spdlog::error("{}", absl::StrCat(assignment_path, ": ", s.message()));
    return 2;
  }
  if (steps <= 0) steps = setup->job.steps;
  // Serve the peer stream: only the neighbours may send to this stage.
  rpc::TensorInbox inbox;
  const std::set<std::string> peers = executor::StagePeers(*a, o.site);
  rpc::PeerService service(o.site, peers, &inbox);
  auto started = rpc::StartMtlsServer(
      o.certs, o.site, o.listen, {&service}, nullptr,
      rpc::ServerThreadsFor(static_cast<int>(peers.size()), rpc::PeerLimits().max_streams_per_peer));
  if (!started.ok()) {
    spdlog::error("{}", absl::StrCat(started.status().message()));
    return started.status().code() == absl::StatusCode::kUnavailable ? 1 : 2;
  }
  std::unique_ptr<grpc::Server> server = std::move(*started);
  torch::Device device(o.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(o.device));
  auto fail = [&](const absl::Status& s) {
    spdlog::error("{}", absl::StrCat(s.message()));
    server->Shutdown(std::chrono::system_clock::now());
    return 1;
  };
  auto created =
      executor::StageWorker::Create(*setup, *a, &inbox, o.certs, o.site, device, std::chrono::seconds(timeout_s));
  if (!created.ok()) return fail(created.status());
  executor::StageWorker& worker = **created;
  service.SetFrameBounds(worker.ExpectedFrames());
  // Checkpoints: job.checkpoint.dir (relative to the job file) every job.checkpoint.interval steps.
  executor::StageRun run;
  run.steps = steps;
  run.total_steps = setup->job.steps;
  run.checkpoint_dir = core::ResolveRelative(job_path, setup->job.checkpoint.dir);
  run.checkpoint_interval = setup->job.checkpoint.interval;
  run.checkpoint_keep = setup->job.checkpoint.keep;
  if (run.checkpoint_interval > 0 && setup->job.checkpoint.store == core::CheckpointStore::kCoordinator)
    spdlog::warn("{}", absl::StrCat(job_path,
                                    ": job.checkpoint.store: coordinator needs `meridian run`; without a "
                                    "coordinator this stage keeps its checkpoints in ",
                                    run.checkpoint_dir));
  if (resume) {
    run.resume = [&]() -> absl::StatusOr<executor::Checkpoint> {
      std::string skipped;
      auto c = executor::LoadLatestCheckpoint(run.checkpoint_dir, &skipped);
      if (!skipped.empty()) spdlog::warn("{}", absl::StrCat("skipped ", skipped));
      if (c.ok()) std::cout << "resuming after step " << c->step << " from " << c->path << std::endl;
      return c;
    };
    run.forget_checkpoints_after_resume = true;
  }
  run.on_step = [&](const executor::StepDone& d) {
    if (d.loss) std::cout << "step " << d.step << " loss " << *d.loss << std::endl;
    std::cout << absl::StrFormat(
                     "timing step %d: %.4f s, computing %.4f s, waiting %.4f s, blocked sending %.4f s, codecs %.4f s, "
                     "CPU %.4f s (compute thread %.4f s, in its passes %.4f s), compute thread preempted %d times",
                     d.step, d.seconds, worker.last_compute_seconds(), worker.last_wait_seconds(),
                     worker.last_send_blocked_seconds(), worker.last_codec_seconds(), worker.last_cpu_seconds(),
                     worker.last_compute_thread_cpu_seconds(), worker.last_compute_cpu_seconds(),
                     worker.last_compute_thread_preemptions())
              << std::endl;
  };
  if (executor::StageRunResult r = executor::RunStage(worker, run); !r.status.ok()) return fail(r.status);
  if (!out_dir.empty() && worker.writes_shard()) {
    const std::string path = (std::filesystem::path(out_dir) / core::StageShardName(a->stage)).string();
    if (auto s = executor::SaveParameters(path, worker.Parameters()); !s.ok()) return fail(s);
  }
  std::cout << "wire bytes " << worker.wire_bytes() << " raw bytes " << worker.raw_bytes() << std::endl;
  std::cout << "replica sync wire bytes " << worker.replica_wire_bytes() << " raw bytes " << worker.replica_raw_bytes()
            << " buckets " << worker.replica_buckets() << " sent during backward "
            << worker.replica_buckets_during_backward() << std::endl;
  // Let the neighbours finish their streams to us before the server goes away.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return 0;
}

// Measures this device and the job's model per op; writes DIR/graph.json and DIR/profile-SITE.json.
int RunProfile(const executor::ExecutorOptions& o, const std::string& job_path, const std::string& out_dir) {
  auto setup = executor::LoadJob(job_path);
  if (!setup.ok()) {
    spdlog::error("{}", absl::StrCat(setup.status().message()));
    return 2;
  }
  torch::Device device(o.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(o.device));
  auto prof = executor::ProfileModel(setup->model, setup->micro_batch_size, setup->job.sequence_length, o.site, device,
                                     5, setup->job.lora);
  if (!prof.ok()) {
    spdlog::error("{}", absl::StrCat(prof.status().message()));
    return 1;
  }
  std::filesystem::create_directories(out_dir);
  partitioner::ClusterProfile cp;
  cp.sites.push_back(prof->site);
  std::ofstream(std::filesystem::path(out_dir) / core::kGraphFile) << partitioner::GraphToJson(prof->graph);
  std::ofstream(out_dir + "/profile-" + o.site + ".json") << partitioner::ProfileToJson(cp);
  std::cout << "site '" << o.site << "': " << prof->site.flops_per_second / 1e9 << " GFLOP/s GEMM, "
            << prof->graph.ops.size() << " ops profiled -> " << out_dir << "\n";
  return 0;
}

// Ends the process once its work is done and every file it wrote is closed: flushes stdio and leaves
// with _Exit. A plain exit() would run OpenSSL's atexit cleanup and static destructors while gRPC may
// still tear connections down on its own threads (when one of them drops gRPC's last reference,
// grpc_shutdown finishes on a detached thread), a race that can end in abort().
[[noreturn]] void Leave(int rc) {
  std::fflush(nullptr);
  std::_Exit(rc);
}

// Runs `body`, turning an exception that escaped it (a bug: errors are Status values) into a message and
// exit code 1 rather than std::terminate.
template <typename Body>
int Guarded(Body body) {
  try {
    return body();
  } catch (const std::exception& e) {
    spdlog::error("{}", absl::StrCat("internal error: ", e.what()));
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  executor::KeepFreedHostMemoryForReuse();  // before any thread starts
  CLI::App app{"meridian-executor: runs one site's slice of a Meridian job"};
  app.set_version_flag("--version", std::string("meridian-executor ") + kVersion);
  executor::ExecutorFlags f;
  auto opt = [&](const char* name, std::optional<std::string>* out, const char* help) {
    app.add_option_function<std::string>(
        name, [out](const std::string& v) { *out = v; }, help);
  };
  opt("--coordinator", &f.coordinator, "Coordinator address HOST:PORT (env MERIDIAN_COORDINATOR)");
  opt("--site", &f.site, "This site's name, as in the cluster spec and its certificate (env MERIDIAN_SITE)");
  opt("--certs", &f.certs,
      "The site's bundle: a directory with ca.pem, SITE.pem, SITE.key and no other key (CERTS/bundles/SITE from "
      "`meridian certs init`; env MERIDIAN_CERTS)");
  opt("--listen", &f.listen, "Address for the peer service HOST:PORT (env MERIDIAN_LISTEN)");
  opt("--device", &f.device, "cpu or cuda:N (env MERIDIAN_DEVICE)");
  opt("--spec", &f.spec, "Cluster spec to take defaults from (env MERIDIAN_SPEC)");
  std::string advertise;
  app.add_option("--advertise", advertise,
                 "Address the other sites should dial for this one, when it differs from --listen (NAT, relays)");
  double timeout = 10;
  app.add_option("--join-timeout", timeout, "Seconds to wait for the coordinator")->check(CLI::Range(0.1, 3600.0));
  std::string assignment, job, out;
  int steps = 0, step_timeout = 60;
  app.add_option("--assignment", assignment, "Static mode: run the pipeline stage this JSON describes");
  app.add_option("--job", job, "Static mode: the job spec (YAML)");
  app.add_option("--out", out, "Static mode: directory for stage-K.safetensors");
  app.add_option("--steps", steps, "Static mode: optimizer steps (default: the job's)");
  bool resume = false;
  app.add_flag("--resume", resume, "Static mode: continue from the newest intact checkpoint of job.checkpoint.dir");
  std::string profile_job;
  app.add_option("--profile", profile_job,
                 "Measure this device and JOB.yaml's model per op; write --out/graph.json "
                 "and --out/profile-SITE.json, then exit");
  app.add_option("--step-timeout", step_timeout, "Seconds to wait for a neighbour's tensor")
      ->check(CLI::Range(1, 86400));
  std::string log_level = "info";
  app.add_option("--log-level", log_level,
                 "Diagnostics on stderr from this level up: trace, debug (every command and step), info, warning, "
                 "error, off");
  std::string fault;
  app.add_option("--fault", fault,
                 "Tests only: nan-gradient:STEP sends the previous stage a NaN activation gradient at step STEP "
                 "(0-based) of the first attempt that reaches it, as a compromised site would; "
                 "late-boundary:SECONDS hands this site's stages each step boundary SECONDS late")
      ->group("");
  // A worker of a site of several devices, started by the site's executor (executor/site_group.h).
  std::string site_worker, site_device = "cpu", site_store, site_command;
  app.add_option("--site-worker", site_worker, "Internal: worker R/K of this site, started by its executor")->group("");
  app.add_option("--site-device", site_device, "Internal: the worker's device")->group("");
  app.add_option("--site-store", site_store, "Internal: the site's c10d store file")->group("");
  app.add_option("--site-command", site_command, "Internal: the worker's assignment")->group("");
  std::string site_task = "stage";
  app.add_option("--site-task", site_task, "Internal: stage or profile")
      ->group("")
      ->check(CLI::IsMember({"stage", "profile"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (absl::Status s = core::InitLogging("meridian-executor", log_level); !s.ok()) {
    std::cerr << "meridian-executor: " << s.message() << "\n";
    return 2;
  }
  if (!site_worker.empty()) {
    auto rank = executor::ParseSiteWorker(site_worker);
    if (!rank.ok() || !f.site || site_store.empty() || site_command.empty()) {
      spdlog::error("{}", rank.ok() ? "--site-worker needs --site, --site-store and --site-command"
                                    : std::string(rank.status().message()));
      return 2;
    }
    Leave(Guarded([&] {
      return executor::RunSiteWorker(
          {*f.site, site_device, site_store, site_command, site_task, rank->first, rank->second});
    }));
  }
  if ((!assignment.empty() || !profile_job.empty()) && !f.coordinator)
    f.coordinator = "127.0.0.1:1";                      // unused without a coordinator
  if (!profile_job.empty() && !f.certs) f.certs = ".";  // profiling talks to no one
  auto options = executor::ResolveOptions(f, [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  });
  if (!options.ok()) {
    spdlog::error("{}", absl::StrCat(options.status().message()));
    return 2;
  }
  if (!fault.empty()) {
    int64_t step = -1;
    double seconds = 0;
    if (fault.rfind("nan-gradient:", 0) == 0 && absl::SimpleAtoi(fault.substr(13), &step) && step >= 0) {
      options->fault_nan_gradient_step = step;
    } else if (fault.rfind("late-boundary:", 0) == 0 && absl::SimpleAtod(fault.substr(14), &seconds) && seconds > 0 &&
               seconds <= 3600) {
      options->fault_late_boundary_seconds = seconds;
    } else {
      spdlog::error("--fault '{}': expected nan-gradient:STEP or late-boundary:SECONDS (0 to 3600]", fault);
      return 2;
    }
  }
  if (!profile_job.empty()) Leave(Guarded([&] { return RunProfile(*options, profile_job, out.empty() ? "." : out); }));
  // A site holds its own identity only: never the CA's key nor another site's (docs/security.md).
  if (absl::Status s = core::CheckSiteBundle(options->certs, options->site); !s.ok()) {
    spdlog::error("{}", absl::StrCat("bad certificate directory for site '", options->site, "': ", s.message()));
    return 2;
  }
  if (!assignment.empty()) {
    if (job.empty()) {
      spdlog::error("--assignment needs --job JOB.yaml");
      return 2;
    }
    Leave(Guarded([&] { return RunStatic(*options, assignment, job, out, steps, step_timeout, resume); }));
  }
  auto client = rpc::ConnectCoordinator(options->certs, options->site, options->coordinator);
  if (!client.ok()) {
    spdlog::error("{}", absl::StrCat("bad certificate for site '", options->site, "': ", client.status().message()));
    return 2;
  }
  v1::RegisterRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_site(options->site);
  req.set_listen_address(advertise.empty() ? options->listen : advertise);
  req.set_device(options->device);
  req.set_build_version(kVersion);
  auto registered = (*client)->Register(req, std::chrono::milliseconds(static_cast<int>(timeout * 1000)));
  if (!registered.ok()) {
    std::string why = registered.status().code() == absl::StatusCode::kDeadlineExceeded
                          ? "no answer (is the coordinator running there, and do both use the same cluster CA?)"
                          : std::string(registered.status().message());
    spdlog::error("{}", absl::StrCat("cannot join the coordinator at ", options->coordinator, " as site '",
                                     options->site, "': ", why));
    return 1;
  }
  std::cout << "joined cluster '" << registered->cluster() << "' as site '" << options->site << "' (run "
            << registered->run_id() << ")" << std::endl;
  executor::InstallLeaveHandler();  // SIGTERM: leave at the next step boundary, nothing lost
  Leave(Guarded([&] { return executor::Agent(*options, *registered, client->get()).Run(); }));
}
