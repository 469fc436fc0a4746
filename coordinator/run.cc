#include "coordinator/run.h"

#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compression/activation_delta.h"
#include "coordinator/coordinator.h"
#include "coordinator/launch_command.h"
#include "coordinator/run_machine.h"
#include "coordinator/step_figures.h"
#include "core/certs.h"
#include "core/checkpoint_dir.h"
#include "core/files.h"
#include "core/log.h"
#include "core/run_layout.h"
#include "dashboard/dashboard.h"
#include "job/job.h"
#include "partitioner/planner.h"
#include "partitioner/schedule.h"
#include "rpc/credentials.h"

namespace meridian::coordinator {
namespace {

namespace fs = std::filesystem;

}  // namespace

void AddRunOptions(CLI::App* cmd, RunOptions* o) {
  cmd->add_option("CLUSTER", o->cluster_path, "Cluster spec (YAML)")->required();
  cmd->add_option("JOB", o->job_path, "Job spec (YAML); default: the cluster spec's job section");
  cmd->add_option("--run-dir", o->run_dir, "Directory for profile.json, plan.json and the weights");
  cmd->add_option("--steps", o->steps, "Optimizer steps (default: the job's)")->check(CLI::Range(1, 100000000));
  cmd->add_option("--join-timeout", o->join_timeout_seconds, "Seconds to wait for the sites (0: forever)");
  cmd->add_option("--micro-batches", o->micro_batches, "Micro-batches per step (default: the job's)");
  cmd->add_flag("--resume", o->resume,
                "Continue from the newest intact checkpoint (of job.checkpoint.dir, or of RUN/checkpoints with "
                "job.checkpoint.store: coordinator)");
  cmd->add_option("--eval-examples", o->eval_examples,
                  "Held-out examples scored by exact match before, at each checkpoint of the run and after training "
                  "(JSONL jobs; 0: none)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--profile-repeats", o->profile_repeats,
                  "Timed forward+backward passes per operator when the sites measure the model (at least; the mean "
                  "over at least 50 ms of them is kept)")
      ->check(CLI::Range(1, 100));
  cmd->add_option("--probe-seconds", o->probe_seconds,
                  "Seconds each link's bandwidth probe aims to take, each way, twice (default 1; a slow or noisy WAN "
                  "reads truer with more, a LAN needs less)")
      ->check(CLI::Range(0.2, 60.0));
  cmd->add_option("--split", o->split,
                  "planned: the partitioner's plan; even: the sites in the spec's order with equal op counts "
                  "(an ablation; the job's compression still applies)")
      ->check(CLI::IsMember({"planned", "even"}));
  cmd->add_option("--plan", o->plan_path,
                  "Train this layout instead of planning: a plan.json (`meridian plan --json`, a run's plan.json, "
                  "or hand-written) whose stages give their sites (the first runs the stage, the others replicate "
                  "it) and last_op; shares, codecs and the prediction come from this run's measurements")
      ->excludes(cmd->get_option("--split"));
  cmd->add_option(
      "--profile", o->profile_path,
      "Plan from the sites' figures measured before instead of measuring them: a run directory, or a "
      "profile.json with the graph.json it was measured with beside it (a run's, or what `meridian profile "
      "--out` writes), which must be this job's model (the same ops and micro-batch shape). Every site of the "
      "cluster spec must be in it, on the device it registers with, with a link each way to every other; "
      "figures older than the cluster's state plan a stale step");
  cmd->add_option("--launch", o->launch,
                  "ssh: start the executor of every site with an ssh: section over SSH (copying its certificate "
                  "bundle), follow their logs into RUN/sites, and stop them when the run ends or on Ctrl-C")
      ->check(CLI::IsMember({"ssh"}));
  cmd->add_flag("--accept-new-host-keys", o->accept_new_host_keys,
                "--launch ssh: on first contact, record an unknown host's key in known_hosts (and say which)");
  cmd->add_option(
      "--export", o->export_dir,
      "After training, write the whole model there as HF safetensors + config.json, whatever the partition");
}

namespace {

// The Prometheus text of /metrics (a stock Prometheus scrapes it): step, loss, step time, tokens, and per
// site whether it is up, its stage's compute time and the bytes it sent. Thread-safe (reads `coord`).
std::string MetricsText(Coordinator& coord) {
  auto p = coord.progress();
  std::string body;
  absl::StrAppend(
      &body, "# HELP meridian_step Last completed optimizer step.\n# TYPE meridian_step gauge\n", "meridian_step ",
      p.step + 1, "\n# HELP meridian_loss Training loss of the last step.\n",
      "# TYPE meridian_loss gauge\nmeridian_loss ", p.loss, "\n",
      "# HELP meridian_step_seconds Duration of the last step.\n# TYPE meridian_step_seconds gauge\n",
      "meridian_step_seconds ", p.step_seconds, "\n",
      "# HELP meridian_tokens_total Tokens trained on.\n# TYPE meridian_tokens_total counter\n",
      "meridian_tokens_total ", p.tokens, "\n",
      "# HELP meridian_site_up Whether a site is registered and heartbeating.\n# TYPE meridian_site_up gauge\n");
  auto silent = coord.Silent(Clock::now());
  const auto sites = coord.Snapshot();
  for (const auto& [name, st] : sites)
    absl::StrAppend(&body, "meridian_site_up{site=\"", name, "\"} ",
                    st.registered && std::find(silent.begin(), silent.end(), name) == silent.end() ? 1 : 0, "\n");
  // The step figures every view shows (step_figures.h), then a multi-device site's and a DiLoCo replica's.
  std::vector<std::tuple<std::string, std::string, double (*)(const v1::MetricsReport&)>> gauges;
  for (const StepFigure& f : kStepFigures) gauges.emplace_back(absl::StrCat("meridian_site_", f.key), f.help, f.get);
  gauges.emplace_back("meridian_site_reduce_seconds",
                      "A site of several devices: the workers' gradient sum after the last backward pass in its last "
                      "step.",
                      [](const v1::MetricsReport& m) { return m.site_reduce_seconds(); });
  gauges.emplace_back("meridian_site_outer_sync_seconds",
                      "DiLoCo: seconds the replica's last outer synchronisation took from its start to its "
                      "application.",
                      [](const v1::MetricsReport& m) { return m.outer_sync_seconds(); });
  gauges.emplace_back("meridian_site_outer_drift",
                      "DiLoCo: the norm of the replica's last pseudo-gradient (its drift).",
                      [](const v1::MetricsReport& m) { return m.outer_drift(); });
  for (const auto& [metric, help, get] : gauges) {
    absl::StrAppend(&body, "# HELP ", metric, " ", help, "\n# TYPE ", metric, " gauge\n");
    for (const auto& [name, st] : sites)
      if (st.metrics) absl::StrAppend(&body, metric, "{site=\"", name, "\"} ", get(*st.metrics), "\n");
  }
  absl::StrAppend(&body,
                  "# HELP meridian_site_sent_bytes Bytes the site's stage sent to its neighbours in this attempt.\n",
                  "# TYPE meridian_site_sent_bytes gauge\n");
  for (const auto& [name, st] : sites)
    if (st.metrics)
      absl::StrAppend(&body, "meridian_site_sent_bytes{site=\"", name, "\"} ", st.metrics->wire_bytes(), "\n");
  absl::StrAppend(&body,
                  "# HELP meridian_site_outer_sync_bytes DiLoCo: bytes the replica sent in its last outer "
                  "synchronisation.\n# TYPE meridian_site_outer_sync_bytes gauge\n");
  for (const auto& [name, st] : sites)
    if (st.metrics && st.metrics->outer_sync_step() > 0)
      absl::StrAppend(&body, "meridian_site_outer_sync_bytes{site=\"", name, "\"} ", st.metrics->outer_sync_bytes(),
                      "\n");
  absl::StrAppend(&body, "# HELP meridian_site_uncompressed_bytes What those bytes were before compression.\n",
                  "# TYPE meridian_site_uncompressed_bytes gauge\n");
  for (const auto& [name, st] : sites)
    if (st.metrics)
      absl::StrAppend(&body, "meridian_site_uncompressed_bytes{site=\"", name, "\"} ", st.metrics->raw_bytes(), "\n");
  return body;
}

// What a run reads before anything listens, validated: the specs, the pinned layout (--plan) and the job
// as the executors will load it (model config, tokenizer, data), so that bad input fails before any join.
struct RunInputs {
  core::ClusterSpec spec;
  core::JobSpec job;
  std::string job_path, job_dir, job_yaml, certs, run_dir;
  int steps = 0, micro_batches = 0;
  std::vector<partitioner::PinnedStage> pinned;        // --plan's stages; empty: plan
  std::optional<job::JobInputs> job_inputs;            // the job as the executors will load it
  partitioner::OpGraph graph;                          // the job's operator graph (job::ProfiledGraphOptions)
  std::optional<partitioner::ClusterProfile> profile;  // --profile's, checked; nullopt: measure the sites
  std::string profile_path;                            // --profile's profile.json
};

// --profile PATH: the profile.json there (PATH, or PATH/profile.json for a run directory), checked against
// the spec and the graph (CheckGivenProfile); a graph.json beside it (a run's) must describe in.graph.
absl::Status LoadGivenProfile(const std::string& path, RunInputs* in) {
  const bool dir = fs::is_directory(path);
  in->profile_path = dir ? (fs::path(path) / core::kProfileFile).string() : path;
  if (!fs::exists(in->profile_path))
    return absl::NotFoundError(absl::StrCat("--profile ", in->profile_path, ": no such file"));
  auto text = core::ReadFile(in->profile_path);
  if (!text.ok()) return text.status();
  auto profile = partitioner::ParseProfileJson(*text, in->profile_path);
  if (!profile.ok()) return profile.status();
  // Per-op times are of one model and micro-batch shape, which only the graph they were measured with
  // shows (op names are the same for any model of the same depth).
  const std::string graph_path = (fs::path(in->profile_path).parent_path() / core::kGraphFile).string();
  const bool timed =
      std::any_of(profile->sites.begin(), profile->sites.end(), [](const auto& s) { return !s.op_seconds.empty(); });
  if (timed && !fs::exists(graph_path))
    return absl::InvalidArgumentError(absl::StrCat(
        "--profile ", path, ": its sites' per-op times need the graph they were measured with beside it (", graph_path,
        ": no such file; a run directory holds both, and `meridian profile --out` writes both)"));
  if (fs::exists(graph_path)) {
    auto graph_text = core::ReadFile(graph_path);
    if (!graph_text.ok()) return graph_text.status();
    auto measured = partitioner::ParseGraphJson(*graph_text, graph_path);
    if (!measured.ok()) return measured.status();
    const auto& want = in->graph.ops;
    if (measured->ops.size() != want.size())
      return absl::InvalidArgumentError(absl::StrCat("--profile ", path, ": ", graph_path, " has ",
                                                     measured->ops.size(), " ops, the job's model ", want.size(),
                                                     ": the profile was measured for another model"));
    auto near = [](double a, double b) { return std::abs(a - b) <= 1e-6 * std::max(std::abs(a), std::abs(b)); };
    for (size_t k = 0; k < want.size(); ++k) {
      const partitioner::Op& m = measured->ops[k];
      if (m.name != want[k].name || !near(m.output_bytes, want[k].output_bytes) ||
          !near(m.forward_flops, want[k].forward_flops) || !near(m.param_bytes, want[k].param_bytes))
        return absl::InvalidArgumentError(absl::StrFormat(
            "--profile %s: op %d of %s ('%s': %.0f output bytes, %.4g forward FLOPs, %.0f parameter bytes) is not "
            "the job's ('%s': %.0f, %.4g, %.0f): the profile was measured for another model or micro-batch shape",
            path, k, graph_path, m.name, m.output_bytes, m.forward_flops, m.param_bytes, want[k].name,
            want[k].output_bytes, want[k].forward_flops, want[k].param_bytes));
    }
  }
  partitioner::ClusterProfile usable;
  if (absl::Status s = CheckGivenProfile(*profile, in->profile_path, in->spec, in->graph, &usable); !s.ok()) return s;
  in->profile = std::move(usable);
  return absl::OkStatus();
}

// Loads and checks the inputs and creates the run directory. On bad input prints every problem (naming
// the file and field) and returns nullopt: `meridian run` exits 2.
std::optional<RunInputs> LoadInputs(const RunOptions& o) {
  auto cluster = core::LoadSpecFile(o.cluster_path);
  if (!cluster.errors.empty()) {
    for (const auto& d : cluster.errors) std::cerr << d.ToString() << "\n";
    return std::nullopt;
  }
  if (!cluster.spec->cluster) {
    std::cerr << "meridian run: " << o.cluster_path << ": not a cluster spec (no 'sites')\n";
    return std::nullopt;
  }
  RunInputs in;
  in.job_path = o.job_path.empty() ? o.cluster_path : o.job_path;
  auto job_file = core::LoadSpecFile(in.job_path);
  if (!job_file.errors.empty()) {
    for (const auto& d : job_file.errors) std::cerr << d.ToString() << "\n";
    return std::nullopt;
  }
  if (!job_file.spec->job) {
    std::cerr << "meridian run: " << in.job_path << ": no 'job' section (pass a job spec)\n";
    return std::nullopt;
  }
  in.spec = *cluster.spec->cluster;
  in.job = *job_file.spec->job;
  in.steps = o.steps > 0 ? o.steps : in.job.steps;
  in.micro_batches = o.micro_batches > 0 ? o.micro_batches : core::MicroBatchesOf(in.job);
  in.certs = core::ResolveRelative(o.cluster_path, in.spec.certs_dir);
  in.job_dir = fs::absolute(fs::path(in.job_path)).parent_path().string();
  auto job_yaml = core::ReadFile(in.job_path);
  if (!job_yaml.ok()) {
    std::cerr << "meridian run: " << job_yaml.status().message() << "\n";
    return std::nullopt;
  }
  in.job_yaml = std::move(*job_yaml);
  if (!o.plan_path.empty()) {
    if (!fs::exists(o.plan_path)) {
      std::cerr << "meridian run: --plan " << o.plan_path << ": no such file\n";
      return std::nullopt;
    }
    auto plan_text = core::ReadFile(o.plan_path);
    auto layout = plan_text.ok() ? partitioner::ParsePlanLayout(*plan_text, o.plan_path)
                                 : absl::StatusOr<std::vector<partitioner::PinnedStage>>(plan_text.status());
    if (!layout.ok()) {
      std::cerr << "meridian run: " << layout.status().message() << "\n";
      return std::nullopt;
    }
    for (size_t k = 0; k < layout->size(); ++k) {
      const partitioner::PinnedStage& st = (*layout)[k];
      for (const auto& site : st.sites)
        if (std::none_of(in.spec.sites.begin(), in.spec.sites.end(), [&](const auto& s) { return s.name == site; })) {
          std::cerr << "meridian run: " << o.plan_path << ": site '" << site << "' is not in the cluster spec "
                    << o.cluster_path << "\n";
          return std::nullopt;
        }
      int sum = 0;
      for (int m : st.micro_batches) sum += m;
      if (!st.micro_batches.empty() && sum != in.micro_batches) {
        std::cerr << "meridian run: " << o.plan_path << ": stages[" << k
                  << "].micro_batches: the replicas' shares sum to " << sum << ", but this run has " << in.micro_batches
                  << " micro-batches per step (remove the field to share them by measured speed)\n";
        return std::nullopt;
      }
    }
    in.pinned = std::move(*layout);
  }
  auto job_inputs = job::LoadJobInputs(in.job_path);
  if (!job_inputs.ok()) {
    std::cerr << "meridian run: " << job_inputs.status().message() << "\n";
    return std::nullopt;
  }
  in.job_inputs = std::move(*job_inputs);
  const job::JobInputs& j = *in.job_inputs;
  in.graph = partitioner::BuildLlamaGraph(
      j.model.shape, job::ProfiledGraphOptions(j.micro_batch_size, j.job.sequence_length, j.job.lora.enabled));
  if (!o.profile_path.empty())
    if (absl::Status s = LoadGivenProfile(o.profile_path, &in); !s.ok()) {
      std::cerr << "meridian run: " << s.message() << "\n";
      return std::nullopt;
    }
  if (const data::Dataset* d = in.job_inputs->dataset.get())
    std::cout << "data: " << d->train_examples() << (d->instruction() ? " training examples" : " documents") << ", "
              << d->train_tokens() << " tokens in " << d->num_sequences() << " sequences of " << in.job.sequence_length
              << (d->held_out().empty() ? "" : absl::StrCat("; ", d->held_out().size(), " held out")) << "\n";
  fs::create_directories(o.run_dir);
  in.run_dir = fs::absolute(o.run_dir).string();
  return in;
}

std::set<std::string> SiteNames(const core::ClusterSpec& spec) {
  std::set<std::string> names;
  for (const auto& s : spec.sites) names.insert(s.name);
  return names;
}

// What an event from the handlers is, for the debug log.
std::string EventName(const EventQueue::Body& event) {
  return std::visit(
      [](const auto& e) -> std::string {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, SiteRegistered>) return absl::StrCat("site '", e.site, "' registered");
        if constexpr (std::is_same_v<T, ProfileReported>)
          return absl::StrCat("profile of site '", e.report.site(), "'");
        if constexpr (std::is_same_v<T, MetricsReported>)
          return absl::StrCat("metrics of site '", e.report.site(), "', step ", e.report.step() + 1);
        if constexpr (std::is_same_v<T, SiteLeaving>) return absl::StrCat("site '", e.site, "' leaving: ", e.why);
        if constexpr (std::is_same_v<T, StageReportedDone>)
          return absl::StrCat("site '", e.done.site(), "' done with attempt ", e.done.job_id(),
                              e.done.error().empty() ? "" : ": ", e.done.error());
        return "other";
      },
      event);
}

// One `meridian run` once its inputs are loaded: serves the coordinator service (and /metrics), then
// runs the loop that owns the run's RunMachine: it turns what the service's handlers enqueue, the sites'
// heartbeats going silent and coming back, and the passing of time into events, and performs the
// machine's actions -- outside any lock; the coordinator's state (`coord_`) is thread-safe. Driven by one
// thread (Main's caller).
class RunDriver {
 public:
  RunDriver(const RunOptions& o, RunInputs in, std::function<Clock::time_point()> clock)
      : o_(o),
        in_(std::move(in)),
        clock_(std::move(clock)),
        run_id_(absl::StrFormat("%016x", std::mt19937_64(std::random_device{}())())),
        coord_(in_.spec, run_id_, &events_),
        service_(SiteNames(in_.spec), &coord_) {
    launch::LaunchOptions lo;
    lo.accept_new_host_keys = o.accept_new_host_keys;
    launcher_ = std::make_unique<launch::SshLauncher>(
        lo,
        [this](const std::string& site, const std::string& line) {
          coord_.LogSite(site, "executor: " + line);  // the remote log's problems, in RUN/sites/<site>.log
        },
        [this](const std::string& site, const std::string& msg) {
          coord_.LogSite(site, msg);
          std::printf("launch: site '%s': %s\n", site.c_str(), msg.c_str());
          std::fflush(stdout);
        });
  }
  ~RunDriver() {  // /metrics reads coord_: stop it before the members go
    launcher_->StopAll();
    metrics_http_.stop();
    if (metrics_thread_.joinable()) metrics_thread_.join();
  }

  // The run's exit code: 0 trained, 1 failed, 2 bad certificates.
  int Main() {
    RunConfig config = MachineConfig();
    if (config.job.checkpoint.store == core::CheckpointStore::kCoordinator) {
      // The store's quota must fit on the disk before any site is asked to train.
      std::error_code ec;
      const fs::space_info disk = fs::space(in_.run_dir, ec);
      const int64_t quota = StoreQuotaBytes(config);
      if (!ec && static_cast<int64_t>(disk.available) < quota) {
        std::cerr << absl::StrFormat(
            "meridian run: %s: job.checkpoint.store: coordinator keeps up to %.2f GiB (%d checkpoints kept, one being "
            "written, one arriving, and the weights), but only %.2f GiB is free there; free space, lower "
            "job.checkpoint.keep, or use store: shared\n",
            in_.run_dir, quota / double(int64_t{1} << 30), config.job.checkpoint.keep,
            disk.available / double(int64_t{1} << 30));
        return 1;
      }
    }
    if (int rc = StartServices(); rc != 0) return rc;
    ScopedInterruptHandler interrupts;  // Ctrl-C or SIGTERM: stop the sites, then exit 128 + the signal
    if (o_.launch == "ssh") {
      if (absl::Status st = LaunchSshSites(in_.spec, in_.certs, in_.spec.coordinator.ToString(), launcher_.get());
          !st.ok()) {
        std::cerr << "meridian run: --launch ssh: " << st.message() << "\n";
        if (const int sig = g_interrupted.load(); sig != 0) return 128 + sig;
        return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
      }
    }
    RunMachine machine(std::move(config));
    std::set<std::string> silent;
    std::optional<int> exit = Perform(machine.Handle({clock_(), RunStarted{}}));
    while (!exit) {
      if (const int sig = g_interrupted.load(); sig != 0) {
        std::fprintf(stderr, "meridian run: interrupted (%s); stopping the sites\n", strsignal(sig));
        coord_.RecordEvent("failed", "", absl::StrCat("interrupted (", strsignal(sig), "); the sites were stopped"));
        coord_.StopAll();
        exit = 128 + sig;
        break;
      }
      // Heartbeats: a site going silent or answering again is an event of its own.
      const Clock::time_point now = clock_();
      const std::vector<std::string> silent_now = coord_.Silent(now);
      for (const auto& site : silent_now)
        if (!silent.count(site) && !exit) {
          spdlog::debug("event: site '{}' stopped heartbeating", site);
          exit = Perform(machine.Handle({now, HeartbeatLost{site}}));
        }
      for (const auto& site : silent)
        if (std::find(silent_now.begin(), silent_now.end(), site) == silent_now.end() && !exit) {
          spdlog::debug("event: site '{}' heartbeats again", site);
          exit = Perform(machine.Handle({now, HeartbeatBack{site}}));
        }
      silent = std::set<std::string>(silent_now.begin(), silent_now.end());
      if (exit) break;
      std::optional<EventQueue::Body> event = events_.PopUntil(Clock::now() + std::chrono::milliseconds(200));
      if (event) spdlog::debug("event: {}", EventName(*event));
      exit = Perform(machine.Handle({clock_(), event ? std::move(*event) : EventQueue::Body(Tick{})}));
    }
    // Let the stop commands reach the executors, then end the service.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    launcher_->StopAll();  // executors started over SSH that are still there (they were sent stop first)
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(*exit == 0 ? 5 : 2));
    return *exit;
  }

 private:
  RunConfig MachineConfig() {
    RunConfig c;
    c.spec = in_.spec;
    c.job = in_.job;
    c.job_yaml = in_.job_yaml;
    c.job_dir = in_.job_dir;
    c.steps = in_.steps;
    c.micro_batches = in_.micro_batches;
    c.join_timeout_seconds = o_.join_timeout_seconds;
    c.profile_repeats = o_.profile_repeats;
    c.probe_seconds = o_.probe_seconds;
    c.even_split = o_.split == "even";
    c.plan_path = o_.plan_path;
    c.pinned = in_.pinned;
    c.resume = o_.resume;
    // AQ-SGD pays where sequences come back: the share of the run's sequence visits that revisit one.
    if (const data::Dataset* d = in_.job_inputs->dataset.get(); d && d->num_sequences() > 0) {
      const double visits = static_cast<double>(in_.steps) * in_.job.global_batch;
      c.revisit_fraction = std::max(0.0, 1.0 - d->num_sequences() / visits);
    }
    c.graph = in_.graph;
    c.given_profile = in_.profile;
    c.given_profile_path = in_.profile_path;
    c.run_id = run_id_;
    c.run_dir = in_.run_dir;
    c.find_checkpoint = [dir = CheckpointDir()](std::string* skipped) {
      return core::FindLatestManifested(dir, skipped);
    };
    return c;
  }

  // Carries out the machine's actions in order; the exit code once the machine says the run is over.
  std::optional<int> Perform(const std::vector<Action>& actions) {
    std::optional<int> exit;
    for (const Action& action : actions)
      std::visit(
          [&](const auto& a) {
            using T = std::decay_t<decltype(a)>;
            if constexpr (std::is_same_v<T, SendCommand>) {
              spdlog::debug("action: send {} to site '{}'",
                            a.command.has_assign()    ? "an assignment"
                            : a.command.has_profile() ? "a profile request"
                                                      : "a command",
                            a.site);
              coord_.Send(a.site, a.command);
            } else if constexpr (std::is_same_v<T, StopAll>) {
              coord_.StopAll();
            } else if constexpr (std::is_same_v<T, SetBoundary>) {
              coord_.SetBoundary(a.job_id, a.step, a.left_out);
            } else if constexpr (std::is_same_v<T, SetLease>) {
              coord_.SetLease(a.job_id, a.steps, a.abandoned);
            } else if constexpr (std::is_same_v<T, SetProbers>) {
              coord_.SetProbers(a.sites);
            } else if constexpr (std::is_same_v<T, BeginAttempt>) {
              coord_.BeginJob(a.job_id, a.stages);
              coord_.SetFileWriters(a.file_writers, a.max_step, a.max_file_bytes, a.checkpoint_interval, a.resume_step,
                                    a.readable, a.store_quota_bytes, a.round_writers);
            } else if constexpr (std::is_same_v<T, PublishRunInfo>) {
              coord_.SetRunInfo(a.profile_json, a.graph_json, a.plan_json);
            } else if constexpr (std::is_same_v<T, WriteRunFile>) {
              WriteRun(a);
            } else if constexpr (std::is_same_v<T, Print>) {
              std::FILE* to = a.to_stderr ? stderr : stdout;
              std::fputs(a.text.c_str(), to);
              std::fflush(to);
            } else if constexpr (std::is_same_v<T, LogSite>) {
              coord_.LogSite(a.site, a.text);
            } else if constexpr (std::is_same_v<T, PruneCheckpoints>) {
              std::string problems;
              const int removed = core::PruneManifested(CheckpointDir(), a.keep, a.newest, &problems);
              spdlog::debug("action: pruned {} checkpoint steps (keeping {} up to step {})", removed, a.keep, a.newest);
              if (!problems.empty()) spdlog::warn("checkpoints: {}", problems);
            } else if constexpr (std::is_same_v<T, RemoveCheckpointsAbove>) {
              std::string problems;
              core::RemoveCheckpointsAbove(CheckpointDir(), a.step, &problems);
              if (!problems.empty()) spdlog::warn("checkpoints: {}", problems);
            } else if constexpr (std::is_same_v<T, RecordEvent>) {
              coord_.RecordEvent(a.kind, a.site, a.text);  // the dashboard's events and RUN/events.jsonl
            } else if constexpr (std::is_same_v<T, Exit>) {
              exit = a.code;
            }
          },
          action);
    return exit;
  }

  // RUN/metrics.jsonl grows by a line per step (kept open); the other run files are written whole.
  void WriteRun(const WriteRunFile& f) {
    if (f.name == core::kMetricsFile)  // a step: the dashboard's charts and `meridian status --json` show it
      coord_.RecordStep(nlohmann::json::parse(f.content, nullptr, false));
    if (f.append) {
      std::ofstream& out = appended_[f.name];
      if (!out.is_open()) out.open(RunFile(f.name.c_str()), std::ios::app);
      out << f.content << std::flush;
      if (!out) spdlog::error("cannot write {}", RunFile(f.name.c_str()));
      return;
    }
    if (absl::Status s = core::WriteFileAtomic(RunFile(f.name.c_str()), f.content); !s.ok())
      spdlog::error("{}", std::string(s.message()));
  }

  // Starts the coordinator's gRPC service, prints the join commands and serves /metrics. 0, or the exit
  // code: 2 for certificates that do not load, 1 when an address or port is taken.
  int StartServices() {
    coord_.SetLogDir(RunFile(core::kSiteLogDir));  // one log per site: RUN/sites/<site>.log
    coord_.SetFileDir(in_.run_dir);                // the stages' final weights arrive in RUN/weights
    coord_.SetEventLog(RunFile(core::kEventsFile));
    coord_.SetRunFacts(in_.steps, static_cast<int64_t>(in_.job.global_batch) * in_.job.sequence_length);
    const core::ClusterSpec& spec = in_.spec;
    auto started = rpc::StartMtlsServer(
        in_.certs, "coordinator", spec.coordinator.ToString(), {&service_}, nullptr,
        rpc::ServerThreadsFor(static_cast<int>(spec.sites.size()), rpc::CoordinatorService::kStreamsPerSite));
    if (!started.ok()) {
      const bool bad_certs = started.status().code() != absl::StatusCode::kUnavailable;
      std::cerr << "meridian run: " << started.status().message()
                << (bad_certs ? " (create the certificates with `meridian certs init`)" : "") << "\n";
      return bad_certs ? 2 : 1;
    }
    server_ = std::move(*started);
    std::cout << "coordinator for cluster '" << spec.name << "' listening on " << spec.coordinator.ToString()
              << " (run " << run_id_ << ")\njoin each site with:\n";
    for (const auto& s : spec.sites)
      if (o_.launch == "ssh" && s.ssh)
        std::cout << "  site '" << s.name << "': to be started over SSH at " << s.ssh->host << " (--launch ssh)\n";
      else
        std::cout << "  " << JoinCommand(s, in_.certs, spec.coordinator.ToString()) << "\n";
    std::cout << std::flush;
    if (spec.metrics_port > 0) {
      metrics_http_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
        res.set_content(MetricsText(coord_), "text/plain; version=0.0.4");
      });
      // The dashboard (dashboard/dashboard.h): its page and the run as JSON, which it polls.
      metrics_http_.Get("/api/run", [this](const httplib::Request& req, httplib::Response& res) {
        int64_t after = 0;
        if (req.has_param("after")) {
          const std::string v = req.get_param_value("after");
          if (v.empty() || v.size() > 18 || v.find_first_not_of("0123456789") != std::string::npos) {
            res.status = 400;
            res.set_content("after: expected a step sequence number (a non-negative integer)\n", "text/plain");
            return;
          }
          after = std::stoll(v);
        }
        res.set_header("Cache-Control", "no-store");
        res.set_content(coord_.RunJson(after), "application/json");
      });
      for (const dashboard::Asset& asset : dashboard::Assets()) {
        auto serve = [asset](const httplib::Request&, httplib::Response& res) {
          res.set_header("Content-Security-Policy", dashboard::kContentSecurityPolicy);
          res.set_header("X-Content-Type-Options", "nosniff");
          res.set_content(asset.body.data(), asset.body.size(), std::string(asset.mime).c_str());
        };
        metrics_http_.Get(std::string(asset.path), serve);
        if (asset.path == "/") metrics_http_.Get("/index.html", serve);
      }
      // Unauthenticated and read-only: on the coordinator's own host unless the spec says otherwise, and
      // served by four threads at most.
      const std::string host = spec.metrics_address.empty() ? spec.coordinator.host : spec.metrics_address;
      // (4: a dashboard tab holds a worker between its polls; Prometheus still gets one.)
      metrics_http_.new_task_queue = [] { return new httplib::ThreadPool(4); };
      if (!metrics_http_.bind_to_port(host, spec.metrics_port)) {
        std::cerr << "meridian run: cannot serve /metrics and the dashboard on " << host << ":" << spec.metrics_port
                  << "\n";
        return 1;
      }
      metrics_thread_ = std::thread([this] { metrics_http_.listen_after_bind(); });
      std::cout << "dashboard: http://" << host << ":" << spec.metrics_port << "/ (and /metrics, /api/run)\n"
                << std::flush;
    }
    return 0;
  }

  // A file of the run directory (core/run_layout.h names them).
  std::string RunFile(const char* name) const { return (fs::path(in_.run_dir) / name).string(); }
  std::string CheckpointDir() const { return RunFile(core::kCheckpointsDir); }

  const RunOptions& o_;
  RunInputs in_;
  const std::function<Clock::time_point()> clock_;
  const std::string run_id_;
  EventQueue events_;
  Coordinator coord_;
  rpc::CoordinatorService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<launch::SshLauncher> launcher_;  // --launch ssh
  httplib::Server metrics_http_;
  std::thread metrics_thread_;
  std::map<std::string, std::ofstream> appended_;  // run files written a line at a time
};

}  // namespace

int Run(const RunOptions& o) {
  std::optional<RunInputs> in = LoadInputs(o);
  if (!in) return 2;
  RunDriver driver(o, std::move(*in), [] { return Clock::now(); });
  return driver.Main();
}

}  // namespace meridian::coordinator
