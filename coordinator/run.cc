#include "coordinator/run.h"

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>
#include <httplib.h>

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

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compression/activation_delta.h"
#include "coordinator/coordinator.h"
#include "core/safetensors.h"
#include "executor/checkpoint.h"
#include "executor/evaluate.h"
#include "executor/export.h"
#include "executor/trainer.h"
#include "partitioner/planner.h"
#include "partitioner/schedule.h"
#include "rpc/credentials.h"

namespace meridian::coordinator {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

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
                  "Held-out examples scored by exact match before and after training (JSONL jobs; 0: none)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--profile-repeats", o->profile_repeats,
                  "Timed forward+backward passes per operator when the sites measure the model (median kept)")
      ->check(CLI::Range(1, 100));
  cmd->add_option("--split", o->split,
                  "planned: the partitioner's plan; even: the sites in the spec's order with equal op counts "
                  "(an ablation; the job's compression still applies)")
      ->check(CLI::IsMember({"planned", "even"}));
  cmd->add_option("--plan", o->plan_path,
                  "Train this layout instead of planning: a plan.json (`meridian plan --json`, a run's plan.json, "
                  "or hand-written) whose stages give their sites (the first runs the stage, the others replicate "
                  "it) and last_op; shares, codecs and the prediction come from this run's measurements")
      ->excludes(cmd->get_option("--split"));
  cmd->add_option("--export", o->export_dir,
                  "After training, write the whole model there as HF safetensors + config.json, whatever the partition");
}

namespace {

// Held-out exact match of the initial model and of the trained one (the stage shards in RUN/weights);
// prints one line and writes RUN/eval.json.
absl::Status Evaluate(const executor::JobSetup& setup, const std::string& run_dir, int max_examples) {
  auto trained = executor::LoadStageShards(run_dir + "/weights");
  if (!trained.ok()) return trained.status();
  auto before = executor::EvaluateExactMatch(setup, {}, torch::kCPU, max_examples);
  if (!before.ok()) return before.status();
  auto after = executor::EvaluateExactMatch(setup, *trained, torch::kCPU, max_examples);
  if (!after.ok()) return after.status();
  std::printf("held-out exact match: %.1f%% before -> %.1f%% after training (%d examples)\n", 100 * before->accuracy(),
              100 * after->accuracy(), after->examples);
  for (int i = 0; i < std::min<int>(3, static_cast<int>(after->samples.size())); ++i)
    std::printf("  %s -> '%s' (expected '%s')\n", after->samples[i].prompt.c_str(), after->samples[i].generated.c_str(),
                after->samples[i].expected.c_str());
  nlohmann::json j = {{"examples", after->examples},
                      {"accuracy_before", before->accuracy()},
                      {"accuracy_after", after->accuracy()}};
  for (const auto& s : after->samples)
    j["samples"].push_back({{"prompt", s.prompt}, {"expected", s.expected}, {"generated", s.generated}, {"correct", s.correct}});
  std::ofstream(run_dir + "/eval.json") << j.dump(2) << "\n";
  return absl::OkStatus();
}


// The Prometheus text of /metrics (a stock Prometheus scrapes it): step, loss, step time, tokens, and per
// site whether it is up, its stage's compute time and the bytes it sent. Thread-safe (reads `coord`).
std::string MetricsText(Coordinator& coord) {
  auto p = coord.progress();
  std::string body;
  absl::StrAppend(&body, "# HELP meridian_step Last completed optimizer step.\n# TYPE meridian_step gauge\n",
                  "meridian_step ", p.step + 1, "\n# HELP meridian_loss Training loss of the last step.\n",
                  "# TYPE meridian_loss gauge\nmeridian_loss ", p.loss, "\n",
                  "# HELP meridian_step_seconds Duration of the last step.\n# TYPE meridian_step_seconds gauge\n",
                  "meridian_step_seconds ", p.step_seconds, "\n",
                  "# HELP meridian_tokens_total Tokens trained on.\n# TYPE meridian_tokens_total counter\n",
                  "meridian_tokens_total ", p.tokens, "\n",
                  "# HELP meridian_site_up Whether a site is registered and heartbeating.\n# TYPE meridian_site_up gauge\n");
  auto silent = coord.Silent();
  const auto sites = coord.Snapshot();
  for (const auto& [name, st] : sites)
    absl::StrAppend(&body, "meridian_site_up{site=\"", name, "\"} ",
                    st.registered && std::find(silent.begin(), silent.end(), name) == silent.end() ? 1 : 0, "\n");
  for (auto [metric, help, get] :
       {std::tuple<const char*, const char*, double (v1::MetricsReport::*)() const>{
            "meridian_site_compute_seconds", "Compute time of the site's stage in its last step.",
            &v1::MetricsReport::compute_seconds},
        {"meridian_site_wait_seconds",
         "Time the site's compute thread waited for a peer (inputs, gradients, norm, replica sums) in its last step.",
         &v1::MetricsReport::wait_seconds},
        {"meridian_site_send_blocked_seconds",
         "Time the site's compute thread was blocked by a send (a full send queue) in its last step.",
         &v1::MetricsReport::send_blocked_seconds},
        {"meridian_site_codec_seconds", "Time the site's compute thread encoded and decoded frames in its last step.",
         &v1::MetricsReport::codec_seconds}}) {
    absl::StrAppend(&body, "# HELP ", metric, " ", help, "\n# TYPE ", metric, " gauge\n");
    for (const auto& [name, st] : sites)
      if (st.metrics) absl::StrAppend(&body, metric, "{site=\"", name, "\"} ", ((*st.metrics).*get)(), "\n");
  }
  absl::StrAppend(&body, "# HELP meridian_site_sent_bytes Bytes the site's stage sent to its neighbours in this attempt.\n",
                  "# TYPE meridian_site_sent_bytes gauge\n");
  for (const auto& [name, st] : sites)
    if (st.metrics) absl::StrAppend(&body, "meridian_site_sent_bytes{site=\"", name, "\"} ", st.metrics->wire_bytes(), "\n");
  absl::StrAppend(&body, "# HELP meridian_site_uncompressed_bytes What those bytes were before compression.\n",
                  "# TYPE meridian_site_uncompressed_bytes gauge\n");
  for (const auto& [name, st] : sites)
    if (st.metrics) absl::StrAppend(&body, "meridian_site_uncompressed_bytes{site=\"", name, "\"} ", st.metrics->raw_bytes(), "\n");
  return body;
}

// What a run reads before anything listens, validated: the specs, the pinned layout (--plan) and the job
// as the executors will load it (model config, tokenizer, data), so that bad input fails before any join.
struct RunInputs {
  core::ClusterSpec spec;
  core::JobSpec job;
  std::string job_path, job_dir, job_yaml, certs, run_dir;
  int steps = 0, micro_batches = 0;
  std::vector<partitioner::PinnedStage> pinned;  // --plan's stages; empty: plan
  std::optional<executor::JobSetup> setup;
};

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
  in.micro_batches = o.micro_batches > 0 ? o.micro_batches : (in.job.micro_batches > 0 ? in.job.micro_batches : 4);
  in.certs = core::ResolveRelative(o.cluster_path, in.spec.certs_dir);
  in.job_dir = fs::absolute(fs::path(in.job_path)).parent_path().string();
  in.job_yaml = ReadAll(in.job_path);
  if (!o.plan_path.empty()) {
    if (!fs::exists(o.plan_path)) {
      std::cerr << "meridian run: --plan " << o.plan_path << ": no such file\n";
      return std::nullopt;
    }
    auto layout = partitioner::ParsePlanLayout(ReadAll(o.plan_path), o.plan_path);
    if (!layout.ok()) {
      std::cerr << "meridian run: " << layout.status().message() << "\n";
      return std::nullopt;
    }
    for (const auto& st : *layout)
      for (const auto& site : st.sites)
        if (std::none_of(in.spec.sites.begin(), in.spec.sites.end(), [&](const auto& s) { return s.name == site; })) {
          std::cerr << "meridian run: " << o.plan_path << ": site '" << site << "' is not in the cluster spec "
                    << o.cluster_path << "\n";
          return std::nullopt;
        }
    in.pinned = std::move(*layout);
  }
  auto setup = executor::LoadJob(in.job_path);
  if (!setup.ok()) {
    std::cerr << "meridian run: " << setup.status().message() << "\n";
    return std::nullopt;
  }
  in.setup = std::move(*setup);
  if (const data::Dataset* d = in.setup->data.dataset())
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

// One `meridian run` once its inputs are loaded: serves the coordinator service (and /metrics), waits for
// the sites to join, has them profile, then plans, assigns and supervises attempts until the job finishes,
// re-planning (or waiting) when a site is lost. Driven by one thread (Main's caller); the coordinator's
// gRPC handler threads reach it only through `coord_`, which is thread-safe.
class RunDriver {
 public:
  RunDriver(const RunOptions& o, RunInputs in)
      : o_(o),
        in_(std::move(in)),
        run_id_(absl::StrFormat("%016x", std::mt19937_64(std::random_device{}())())),
        coord_(in_.spec, run_id_),
        service_(SiteNames(in_.spec), &coord_) {}
  ~RunDriver() {  // /metrics reads coord_: stop it before the members go
    metrics_http_.stop();
    if (metrics_thread_.joinable()) metrics_thread_.join();
  }

  // The run's exit code: 0 trained (and exported and evaluated as asked), 1 failed, 2 bad certificates.
  int Main() {
    if (int rc = StartServices(); rc != 0) return rc;
    if (absl::Status s = Join(); !s.ok()) return Fail(s.message());
    if (absl::Status s = Profile(); !s.ok()) return Fail(s.message());
    // Plan, assign, supervise. When a site is lost (no heartbeat for the spec's timeout), the others
    // abandon the attempt; the coordinator re-plans over the sites left (on_failure: replan) or waits for
    // the lost ones to rejoin (on_failure: wait), and every stage resumes from the newest intact
    // checkpoint: of job.checkpoint.dir, which must then be storage every site reads (e.g. a shared mount),
    // or of RUN/checkpoints with job.checkpoint.store: coordinator.
    resume_ = o_.resume;
    t0_ = Clock::now();
    for (int attempt = 0;; ++attempt) {
      if (absl::Status s = PlanAttempt(); !s.ok()) return Fail(s.message());
      // A new attempt first: from now on no file of the one before lands (FindResumePoint cleans up).
      const std::string job_id = attempt == 0 ? run_id_ : absl::StrCat(run_id_, "-", attempt);
      coord_.BeginJob(job_id);
      if (absl::Status s = FindResumePoint(); !s.ok()) return Fail(s.message());
      const std::set<std::string> used = Assign(job_id);
      const AttemptEnd end = Supervise(attempt, used);
      if (end.failure.empty()) break;  // every stage finished
      if (absl::Status s = Recover(end, used); !s.ok()) return Fail(s.message());
      resume_ = true;
    }
    return Finish();
  }

 private:
  // Why an attempt ended early: a stage's error (and its site), or "no heartbeat"; empty: it finished.
  struct AttemptEnd {
    std::string failure, failed_site;
  };

  // Starts the coordinator's gRPC service, prints the join commands and serves /metrics. 0, or the exit
  // code: 2 for certificates that do not load, 1 when an address or port is taken.
  int StartServices() {
    coord_.SetLogDir(in_.run_dir + "/sites");  // one log per site: RUN/sites/<site>.log
    coord_.SetFileDir(in_.run_dir);            // the stages' final weights arrive in RUN/weights
    const core::ClusterSpec& spec = in_.spec;
    auto started = rpc::StartMtlsServer(in_.certs, "coordinator", spec.coordinator.ToString(), {&service_});
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
      std::cout << "  meridian-executor --coordinator " << spec.coordinator.ToString() << " --site " << s.name
                << " --certs " << in_.certs << " --listen " << s.address.ToString() << " --device "
                << s.devices.front() << "\n";
    std::cout << std::flush;
    if (spec.metrics_port > 0) {
      metrics_http_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
        res.set_content(MetricsText(coord_), "text/plain; version=0.0.4");
      });
      if (!metrics_http_.bind_to_port("0.0.0.0", spec.metrics_port)) {
        std::cerr << "meridian run: cannot serve /metrics on port " << spec.metrics_port << "\n";
        return 1;
      }
      metrics_thread_ = std::thread([this] { metrics_http_.listen_after_bind(); });
    }
    jsonl_.open(in_.run_dir + "/metrics.jsonl", std::ios::app);  // a JSONL log of every step
    return 0;
  }

  // Prints `msg`, stops every executor and the service; returns the exit code 1.
  int Fail(absl::string_view msg) {
    std::cerr << "meridian run: " << msg << "\n";
    coord_.StopAll();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    return 1;
  }

  // 1. Waits (up to --join-timeout) for min_sites (default: all) sites to register.
  absl::Status Join() {
    const size_t need = in_.spec.min_sites > 0 ? static_cast<size_t>(in_.spec.min_sites) : in_.spec.sites.size();
    const auto deadline =
        o_.join_timeout_seconds > 0
            ? Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.join_timeout_seconds * 1000))
            : Clock::time_point::max();
    auto registered = [](const std::map<std::string, Coordinator::Site>& s) {
      size_t n = 0;
      for (const auto& [k, v] : s) n += v.registered;
      return n;
    };
    if (!coord_.WaitFor([&](const auto& s, const auto&) { return registered(s) >= need; }, deadline)) {
      std::string missing;
      for (const auto& [k, v] : coord_.Snapshot())
        if (!v.registered) missing += " " + k;
      return absl::UnavailableError(absl::StrCat("sites did not join in time:", missing));
    }
    for (const auto& [k, v] : coord_.Snapshot())
      if (v.registered) joined_.push_back(k);
    std::cout << joined_.size() << " sites joined; measuring devices, the model and the links\n" << std::flush;
    return absl::OkStatus();
  }

  // 2. Every joined site measures its device, the model per op and its links to the others; the spec's
  // link overrides replace measurements. Writes RUN/profile.json and RUN/graph.json.
  absl::Status Profile() {
    snap_ = coord_.Snapshot();
    for (const auto& site : joined_) {
      v1::Command c;
      auto* p = c.mutable_profile();
      p->set_job_yaml(in_.job_yaml);
      p->set_job_dir(in_.job_dir);
      p->set_probe_seconds(1.0);
      p->set_repeats(o_.profile_repeats);
      for (const auto& other : joined_)
        if (other > site) {  // each pair once: the lexicographically smaller site probes both directions
          auto* peer = p->add_peers();
          peer->set_site(other);
          peer->set_address(snap_[other].listen);
        }
      coord_.Send(site, c);
    }
    auto all_profiled = [&](const auto& s, const auto&) {
      for (const auto& k : joined_)
        if (!s.at(k).profile) return false;
      return true;
    };
    while (!coord_.WaitFor(all_profiled, Clock::now() + std::chrono::seconds(1))) {
      if (auto silent = coord_.Silent(); !silent.empty())
        return absl::UnavailableError(absl::StrCat("site '", silent[0], "' stopped answering"));
    }
    for (const auto& [name, s] : coord_.Snapshot()) {
      if (!s.profile) continue;
      if (!s.profile->error().empty())
        return absl::InternalError(absl::StrCat("site '", name, "' could not profile: ", s.profile->error()));
      auto one = partitioner::ParseProfileJson(absl::StrCat("{\"sites\": [", s.profile->site_profile_json(), "]}"),
                                               absl::StrCat("profile of site '", name, "'"));
      if (!one.ok()) return one.status();
      profile_.sites.push_back(one->sites[0]);
      graph_json_ = s.profile->graph_json();
      auto links = nlohmann::json::parse(s.profile->links_json(), nullptr, false);
      if (links.is_array())
        for (const auto& l : links)
          profile_.links.push_back({l["from"], l["to"], l["bandwidth_bytes_per_second"], l["latency_seconds"]});
    }
    for (const auto& l : in_.spec.links) {
      if (!l.override_measurement) continue;
      for (auto& pl : profile_.links)
        if ((pl.from == l.from && pl.to == l.to) || (l.symmetric && pl.from == l.to && pl.to == l.from)) {
          if (l.bandwidth_bytes_per_second) pl.bandwidth_bytes_per_second = *l.bandwidth_bytes_per_second;
          if (l.rtt_seconds) pl.latency_seconds = *l.rtt_seconds / 2;
        }
    }
    for (const auto& site : profile_.sites) {
      double model = 0;
      for (const auto& [op, secs] : site.op_seconds) model += secs;
      std::printf("  site %-10s %8.1f GFLOP/s GEMM, model forward+backward %8.1f ms per micro-batch\n",
                  site.name.c_str(), site.flops_per_second / 1e9, model * 1e3);
    }
    for (const auto& l : profile_.links)
      std::printf("  link %-10s -> %-10s %8.1f Mbit/s, %6.1f ms one way\n", l.from.c_str(), l.to.c_str(),
                  l.bandwidth_bytes_per_second * 8 / 1e6, l.latency_seconds * 1e3);
    std::fflush(stdout);
    std::ofstream(in_.run_dir + "/profile.json") << partitioner::ProfileToJson(profile_);
    std::ofstream(in_.run_dir + "/graph.json") << graph_json_;
    auto graph = partitioner::ParseGraphJson(graph_json_, "graph.json from the executors");
    if (!graph.ok()) return graph.status();
    graph_ = std::move(*graph);
    // A file a site sends holds at most the model's training state (weights and AdamW moments, within
    // param_bytes + optimizer_bytes of the graph) plus its header: twice that bounds it.
    double state_bytes = 0;
    for (const auto& op : graph_.ops) state_bytes += op.param_bytes + op.optimizer_bytes;
    max_file_bytes_ = static_cast<int64_t>(2 * state_bytes) + (int64_t{64} << 20);
    return absl::OkStatus();
  }

  // 3. Plans over the sites not lost: the partitioner's plan, the --split even ablation, or --plan's pinned
  // layout (dropped, with a message, once it names a lost site). Prints the table, writes RUN/plan.json.
  absl::Status PlanAttempt() {
    const core::JobSpec& job = in_.job;
    const int ops = static_cast<int>(graph_.ops.size());
    partitioner::ClusterProfile live;
    for (const auto& site : profile_.sites)
      if (!lost_.count(site.name)) live.sites.push_back(site);
    for (const auto& l : profile_.links)
      if (!lost_.count(l.from) && !lost_.count(l.to)) live.links.push_back(l);
    partitioner::PlanOptions po;
    po.micro_batches = in_.micro_batches;
    po.adaptive_compression = job.compression.policy == "adaptive";
    po.deep_pipeline = true;
    // AQ-SGD pays where sequences come back: the share of the run's sequence visits that revisit one.
    if (const data::Dataset* d = in_.setup->data.dataset(); d && d->num_sequences() > 0) {
      const double visits = static_cast<double>(in_.steps) * job.global_batch;
      po.link_codecs = partitioner::DefaultLinkCodecs(std::max(0.0, 1.0 - d->num_sequences() / visits));
    }
    po.replication = job.replication && o_.split != "even";
    if (o_.split == "even") {
      const int n = std::min<int>(static_cast<int>(live.sites.size()), ops);
      for (const auto& site : in_.spec.sites)
        for (size_t i = 0; i < live.sites.size(); ++i)
          if (live.sites[i].name == site.name && static_cast<int>(po.fixed_sites.size()) < n)
            po.fixed_sites.push_back(static_cast<int>(i));
      po.fixed_last_ops = partitioner::EvenCuts(ops, static_cast<int>(po.fixed_sites.size()));
    }
    std::vector<partitioner::PinnedStage>& pinned = in_.pinned;
    if (!pinned.empty()) {
      auto index = [&](const std::string& name) {
        for (size_t i = 0; i < live.sites.size(); ++i)
          if (live.sites[i].name == name) return static_cast<int>(i);
        return -1;
      };
      std::string missing;
      for (const auto& st : pinned)
        for (const auto& site : st.sites)
          if (index(site) < 0 && missing.empty()) missing = site;
      if (!missing.empty()) {
        std::cout << "plan: the pinned plan (" << o_.plan_path << ") uses site '" << missing
                  << "', which is lost; planning over the sites left\n";
        pinned.clear();
      } else {
        if (pinned.back().last_op != ops - 1)
          return absl::InvalidArgumentError(absl::StrCat(o_.plan_path, ": the last stage ends at op ",
                                                         pinned.back().last_op, ", but the job's model has ", ops,
                                                         " ops (0-", ops - 1, ")"));
        po.replication = false;
        for (const auto& st : pinned) {
          po.fixed_sites.push_back(index(st.sites[0]));
          po.fixed_last_ops.push_back(st.last_op);
          po.fixed_replicas.emplace_back();
          for (size_t r = 1; r < st.sites.size(); ++r) po.fixed_replicas.back().push_back(index(st.sites[r]));
        }
      }
    }
    auto planned = partitioner::PlanPipeline(graph_, live, po);
    if (!planned.ok()) return planned.status();
    std::vector<int> depth;  // the executors' schedules deadlock if a later stage keeps more in flight
    for (const auto& s : planned->stages) depth.push_back(s.in_flight);
    if (!partitioner::InFlightIsDeadlockFree(depth))
      return absl::InternalError("the plan's in-flight depths increase along the pipeline (a planner bug)");
    plan_ = std::move(*planned);
    std::cout << partitioner::PlanTable(*plan_, graph_, live) << std::flush;
    const std::string plan_json = partitioner::PlanJson(*plan_, graph_);
    std::ofstream(in_.run_dir + "/plan.json") << plan_json;
    coord_.SetRunInfo(partitioner::ProfileToJson(live), graph_json_, plan_json);
    return absl::OkStatus();
  }

  // Where the stages resume, when they do: with job.checkpoint.store: shared each loads the newest intact
  // checkpoint of the shared directory itself (step -1); with store: coordinator the coordinator picks the
  // newest complete, intact step of RUN/checkpoints and names its files, which the stages fetch.
  absl::Status FindResumePoint() {
    resume_step_ = resume_ ? -1 : 0;
    resume_files_.clear();
    if (!resume_ || in_.job.checkpoint.store != "coordinator") return absl::OkStatus();
    std::string skipped;
    auto found = executor::FindLatestCheckpoint(in_.run_dir + "/checkpoints", &skipped);
    if (!found.ok())
      return absl::NotFoundError(absl::StrCat("cannot resume: ", found.status().message(),
                                              " (job.checkpoint.store: coordinator keeps checkpoints in RUN/checkpoints)"));
    if (!skipped.empty()) std::cout << "checkpoints skipped: " << skipped << "\n";
    resume_step_ = found->step;
    const std::string step_dir = fs::path(found->path).filename().string();  // "step-S"
    for (const auto& f : found->files) resume_files_.push_back(absl::StrCat("checkpoints/", step_dir, "/", f));
    std::string problems;
    executor::RemoveCheckpointsAbove(in_.run_dir + "/checkpoints", found->step, &problems);
    if (!problems.empty()) std::cout << "checkpoints: " << problems << "\n";
    std::cout << "resuming from step " << found->step << " of the coordinator's checkpoints (" << found->path << ")\n"
              << std::flush;
    return absl::OkStatus();
  }

  // 4. Sends every site of the plan (every replica of every stage) its assignment for attempt `job_id`
  // (begun with BeginJob); returns those sites.
  std::set<std::string> Assign(const std::string& job_id) {
    const core::JobSpec& job = in_.job;
    const auto& st = plan_->stages;
    std::set<std::string> used;
    // Codecs: the plan's (adaptive), the job's (fixed), or none.
    auto fixed = [&](const std::string& codec) {  // the job's top-k fraction goes with a top-k codec
      return codec.rfind("topk", 0) == 0 ? absl::StrCat(codec, ":k=", job.compression.topk_fraction) : codec;
    };
    auto link_codec = [&](size_t link) {
      if (job.compression.policy == "fixed") return fixed(job.compression.activations);
      if (job.compression.policy == "none") return std::string("identity");
      return plan_->links[link].codec;
    };
    // Gradients to the previous stage: the link's codec, but AQ-SGD's deltas are for activations only:
    // behind int8-delta the gradients go as int8, behind int4-delta and int2-delta as int4.
    auto gradient_link_codec = [&](size_t link) { return compression::GradientCodecBehind(link_codec(link)); };
    auto gradient_codec = [&](size_t k) {
      if (job.compression.policy == "fixed") return fixed(job.compression.gradients);
      if (job.compression.policy == "none" || st[k].gradient_codec.empty()) return std::string("identity");
      return st[k].gradient_codec;
    };
    auto group = [&](size_t k, v1::StageSites* g) {
      for (size_t i = 0; i < st[k].site_names.size(); ++i) {
        auto* p = g->add_sites();
        p->set_site(st[k].site_names[i]);
        p->set_address(snap_[st[k].site_names[i]].listen);
        g->add_micro_batches(st[k].micro_batches[i]);
      }
    };
    // Replica 0 of each stage sends its weights and checkpoint shards.
    std::map<std::string, int> writers;
    for (size_t k = 0; k < st.size(); ++k) writers[st[k].site_names[0]] = static_cast<int>(k);
    coord_.SetFileWriters(std::move(writers), in_.steps, max_file_bytes_);
    for (size_t k = 0; k < st.size(); ++k) {
      for (const auto& site : st[k].site_names) {  // every replica of the stage gets the same assignment
        v1::Command c;
        auto* a = c.mutable_assign();
        a->set_job_id(job_id);
        a->set_stage(static_cast<int>(k));
        a->set_num_stages(static_cast<int>(st.size()));
        a->set_first_op(st[k].first_op);
        a->set_last_op(st[k].last_op);
        used.insert(site);
        for (const auto& r : st[k].site_names) a->add_replicas(r);
        group(k, a->mutable_this_stage());
        a->set_gradient_codec(gradient_codec(k));
        if (k > 0) {
          a->set_prev_site(st[k - 1].site_names[0]);
          a->set_prev_address(snap_[st[k - 1].site_names[0]].listen);
          a->set_backward_codec(gradient_link_codec(k - 1));
          a->set_prev_forward_codec(link_codec(k - 1));
          group(k - 1, a->mutable_prev_stage());
        }
        if (k + 1 < st.size()) {
          a->set_next_site(st[k + 1].site_names[0]);
          a->set_next_address(snap_[st[k + 1].site_names[0]].listen);
          a->set_forward_codec(link_codec(k));
          group(k + 1, a->mutable_next_stage());
        }
        a->set_micro_batches(in_.micro_batches);
        a->set_in_flight(st[k].in_flight);
        a->set_job_yaml(in_.job_yaml);
        a->set_job_dir(in_.job_dir);
        a->set_steps(in_.steps);
        a->set_weights_to_coordinator(true);  // RUN/weights/stage-K.safetensors, through PutFile
        a->set_checkpoints_to_coordinator(job.checkpoint.store == "coordinator");
        a->set_resume_step(resume_step_);  // 0 afresh; -1 each stage loads the newest intact checkpoint; S
        for (const auto& f : resume_files_) a->add_resume_files(f);
        coord_.Send(site, c);
      }
    }
    std::cout << "training: " << st.size() << " stages, " << in_.steps << " steps"
              << (!resume_ ? ""
                  : resume_step_ > 0 ? absl::StrCat(", resuming from step ", resume_step_, " (the coordinator's checkpoints)")
                                     : ", resuming from the newest intact checkpoint")
              << "\n" << std::flush;
    return used;
  }

  // 5. Reports each step (progress line and RUN/metrics.jsonl) until every site in `used` is done, a stage
  // reports an error, or a site in `used` stops heartbeating.
  AttemptEnd Supervise(int attempt, const std::set<std::string>& used) {
    int64_t shown = -1;
    AttemptEnd end;
    while (true) {
      bool finished = coord_.WaitFor(
          [&](const auto& s, const auto&) {
            for (const auto& u : used)
              if (!s.at(u).done) return false;
            return true;
          },
          Clock::now() + std::chrono::milliseconds(500));
      auto p = coord_.progress();
      if (p.step > shown) {
        shown = p.step;
        ReportStep(attempt, used, p);
        // The coordinator's checkpoint store keeps job.checkpoint.keep complete steps (the stages prune a
        // shared directory themselves).
        if (in_.job.checkpoint.store == "coordinator" && in_.job.checkpoint.interval > 0) {
          const int64_t newest = (p.step + 1) / in_.job.checkpoint.interval * in_.job.checkpoint.interval;
          if (newest > pruned_at_) {  // steps seen every 500 ms: some multiples of the interval pass unseen
            pruned_at_ = newest;
            std::string problems;
            executor::PruneCheckpoints(in_.run_dir + "/checkpoints", in_.job.checkpoint.keep, newest, &problems);
            if (!problems.empty()) std::cout << "checkpoints: " << problems << "\n";
          }
        }
      }
      for (const auto& [name, s] : coord_.Snapshot())
        if (s.done && !s.done->error().empty() && end.failure.empty()) {
          end.failure = s.done->error();
          end.failed_site = name;
        }
      if (!end.failure.empty()) {
        // A stage fails when a neighbour dies; give heartbeats the time to name the site that died.
        const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(in_.spec.heartbeat_timeout_seconds + 1));
        while (Clock::now() < until && coord_.Silent().empty())
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
        return end;
      }
      if (finished) return end;
      for (const auto& n : coord_.Silent())
        if (used.count(n)) {  // a silent spare site does not interrupt the attempt
          end.failure = "no heartbeat";
          return end;
        }
    }
  }

  // The progress line: the slowest site (most compute in its latest step), the bytes the stages sent in
  // this attempt, how long the slowest site waited for its peers and the longest any stage was blocked by
  // a send; RUN/metrics.jsonl has the same and each stage's breakdown ("stages").
  void ReportStep(int attempt, const std::set<std::string>& used, const Coordinator::Progress& p) {
    const double el = std::chrono::duration<double>(Clock::now() - t0_).count();
    std::string slowest;
    double slowest_seconds = 0, slowest_wait = 0, most_blocked = 0;
    int64_t wire = 0, raw = 0;
    // Each stage's latest step, broken down: compute, waiting for peers, blocked by sends, codecs.
    nlohmann::json stages = nlohmann::json::array();
    for (const auto& [name, s] : coord_.Snapshot()) {
      if (!s.metrics || !used.count(name)) continue;
      const v1::MetricsReport& m = *s.metrics;
      wire += m.wire_bytes();
      raw += m.raw_bytes();
      if (m.compute_seconds() > slowest_seconds) slowest = name, slowest_seconds = m.compute_seconds(), slowest_wait = m.wait_seconds();
      most_blocked = std::max(most_blocked, m.send_blocked_seconds());
      stages.push_back({{"site", name},
                        {"stage", m.stage()},
                        {"step", m.step() + 1},
                        {"step_seconds", m.step_seconds()},
                        {"compute_seconds", m.compute_seconds()},
                        {"wait_seconds", m.wait_seconds()},
                        {"send_blocked_seconds", m.send_blocked_seconds()},
                        {"codec_seconds", m.codec_seconds()}});
    }
    std::printf("step %lld/%d  loss %.4f  %.0f tokens/s  %.2f s/step  ETA %.0f s  slowest %s (%.2f s compute)  "
                "WAN %.1f MB (%.0f%% of uncompressed)  waiting %.2f s  send-blocked %.3f s\n",
                static_cast<long long>(p.step + 1), in_.steps, p.loss, p.tokens / el, p.step_seconds,
                p.step_seconds * (in_.steps - p.step - 1), slowest.empty() ? "-" : slowest.c_str(), slowest_seconds,
                wire / 1e6, raw ? 100.0 * wire / raw : 100.0, slowest_wait, most_blocked);
    std::fflush(stdout);
    jsonl_ << nlohmann::json{{"step", p.step + 1},        {"loss", p.loss},
                             {"step_seconds", p.step_seconds}, {"tokens", p.tokens},
                             {"elapsed_seconds", el},       {"attempt", attempt},
                             {"slowest_site", slowest},     {"slowest_compute_seconds", slowest_seconds},
                             {"wire_bytes", wire},          {"raw_bytes", raw},
                             {"stages", stages}}
                  .dump()
           << std::endl;
  }

  // After an attempt that ended early: names the lost sites, lets the survivors abandon the attempt, then
  // waits for the lost sites (on_failure: wait) or drops them (replan). An error when no site was lost
  // (a stage failed on its own), the job has no checkpoints, or no site is left.
  absl::Status Recover(const AttemptEnd& end, const std::set<std::string>& used) {
    const core::ClusterSpec& spec = in_.spec;
    auto silent = coord_.Silent();
    if (silent.empty()) return absl::InternalError(absl::StrCat("site '", end.failed_site, "' failed: ", end.failure));
    std::string names_lost;
    for (const auto& n : silent) names_lost += (names_lost.empty() ? "'" : ", '") + n + "'";
    const std::string what =
        absl::StrCat("site ", names_lost, " stopped answering (no heartbeat for ", spec.heartbeat_timeout_seconds,
                     " s)",
                     end.failed_site.empty() ? "" : absl::StrCat("; then site '", end.failed_site, "' failed: ", end.failure));
    std::cout << "lost: " << what << "\n" << std::flush;
    for (const auto& n : silent)
      coord_.LogSite(n, absl::StrCat("lost: no heartbeat for ", spec.heartbeat_timeout_seconds, " s; ",
                                     spec.on_failure == "wait" ? "waiting for it" : "re-planning without it"));
    if (in_.job.checkpoint.interval <= 0)
      return absl::FailedPreconditionError(absl::StrCat(
          what, ". The job has no checkpoints (job.checkpoint.interval), so nothing to resume from; set one to "
                "survive lost sites"));
    // The survivors abandon the attempt when their neighbours' streams break (or at the step timeout).
    const auto drain = Clock::now() + std::chrono::seconds(75);
    coord_.WaitFor(
        [&](const auto& s, const auto&) {
          for (const auto& u : used)
            if (!s.at(u).done && std::find(silent.begin(), silent.end(), u) == silent.end()) return false;
          return true;
        },
        drain);
    if (spec.on_failure == "wait") {
      std::cout << "recovery: waiting for " << names_lost << " to rejoin (on_failure: wait)\n" << std::flush;
      while (!coord_.Silent().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(500));
      std::cout << "recovery: " << names_lost << " answering again; resuming from the newest intact checkpoint\n"
                << std::flush;
      snap_ = coord_.Snapshot();  // a restarted executor may listen elsewhere
    } else {
      for (const auto& n : silent) lost_.insert(n);
      if (lost_.size() >= profile_.sites.size()) return absl::UnavailableError(absl::StrCat(what, "; no site left"));
      std::cout << "recovery: re-planning over the " << profile_.sites.size() - lost_.size()
                << " sites left and resuming from the newest intact checkpoint\n"
                << std::flush;
    }
    return absl::OkStatus();
  }

  // After training: the summary line, stops the executors, --export, held-out evaluation; the exit code.
  int Finish() {
    int64_t wire = 0, raw = 0;
    for (const auto& [name, s] : coord_.Snapshot())
      if (s.done) wire += s.done->wire_bytes(), raw += s.done->raw_bytes();
    const double el = std::chrono::duration<double>(Clock::now() - t0_).count();
    std::printf(
        "done: %d steps in %.1f s (%.2f s/step, predicted %.2f); %.1f MB on the links, %.0f%% of uncompressed; "
        "final loss %.4f; weights in %s/weights\n",
        in_.steps, el, el / in_.steps, plan_->predicted_step_seconds, wire / 1e6, raw ? 100.0 * wire / raw : 100.0,
        coord_.progress().loss, in_.run_dir.c_str());
    coord_.StopAll();
    int rc = 0;
    const executor::JobSetup& setup = *in_.setup;
    if (!o_.export_dir.empty()) {
      auto trained = executor::LoadStageShards(in_.run_dir + "/weights");
      absl::Status s = trained.ok() ? executor::ExportHfModel(setup, *trained, o_.export_dir) : trained.status();
      if (!s.ok()) {
        std::cerr << "meridian run: export failed: " << s.message() << "\n";
        rc = 1;
      } else {
        std::printf("exported the model to %s (model.safetensors + config.json%s%s)\n", o_.export_dir.c_str(),
                    setup.tokenizer ? " + tokenizer.model" : "",
                    setup.job.lora.enabled ? "; LoRA merged, PEFT adapter in adapter/" : "");
      }
    }
    if (const data::Dataset* d = setup.data.dataset(); d && !d->held_out().empty() && o_.eval_examples > 0) {
      if (absl::Status s = Evaluate(setup, in_.run_dir, o_.eval_examples); !s.ok()) {
        std::cerr << "meridian run: evaluation failed: " << s.message() << "\n";
        rc = 1;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return rc;
  }

  const RunOptions& o_;
  RunInputs in_;
  const std::string run_id_;
  Coordinator coord_;
  rpc::CoordinatorService service_;
  std::unique_ptr<grpc::Server> server_;
  httplib::Server metrics_http_;
  std::thread metrics_thread_;
  std::ofstream jsonl_;

  std::vector<std::string> joined_;                 // registered sites, by name
  std::map<std::string, Coordinator::Site> snap_;   // the sites' listen addresses (refreshed after a wait)
  partitioner::ClusterProfile profile_;             // every joined site's measurements
  std::string graph_json_;
  partitioner::OpGraph graph_;
  int64_t max_file_bytes_ = 0;                      // the largest file a site may send (from graph_)
  std::set<std::string> lost_;                      // sites re-planned around (on_failure: replan)
  std::optional<partitioner::Plan> plan_;           // the current attempt's
  bool resume_ = false;                             // stages start from a checkpoint
  int64_t resume_step_ = 0;                         // FindResumePoint's: -1 newest in the shared directory
  std::vector<std::string> resume_files_;           // store: coordinator: the files of resume_step_
  int64_t pruned_at_ = 0;                           // the newest step the store was last pruned after
  Clock::time_point t0_;                            // training's start (first attempt)
};

}  // namespace

int Run(const RunOptions& o) {
  std::optional<RunInputs> in = LoadInputs(o);
  if (!in) return 2;
  RunDriver driver(o, std::move(*in));
  return driver.Main();
}

}  // namespace meridian::coordinator
