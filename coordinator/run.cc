#include "coordinator/run.h"

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/coordinator.h"
#include "core/safetensors.h"
#include "executor/evaluate.h"
#include "executor/export.h"
#include "executor/trainer.h"
#include "partitioner/planner.h"
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
  cmd->add_flag("--resume", o->resume, "Continue from the newest intact checkpoint of job.checkpoint.dir");
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

}  // namespace

int Run(const RunOptions& o) {
  auto cluster = core::LoadSpecFile(o.cluster_path);
  if (!cluster.errors.empty()) {
    for (const auto& d : cluster.errors) std::cerr << d.ToString() << "\n";
    return 2;
  }
  if (!cluster.spec->cluster) {
    std::cerr << "meridian run: " << o.cluster_path << ": not a cluster spec (no 'sites')\n";
    return 2;
  }
  std::string job_path = o.job_path.empty() ? o.cluster_path : o.job_path;
  auto job_file = core::LoadSpecFile(job_path);
  if (!job_file.errors.empty()) {
    for (const auto& d : job_file.errors) std::cerr << d.ToString() << "\n";
    return 2;
  }
  if (!job_file.spec->job) {
    std::cerr << "meridian run: " << job_path << ": no 'job' section (pass a job spec)\n";
    return 2;
  }
  const core::ClusterSpec& spec = *cluster.spec->cluster;
  const core::JobSpec& job = *job_file.spec->job;
  const int steps = o.steps > 0 ? o.steps : job.steps;
  const int micro_batches = o.micro_batches > 0 ? o.micro_batches : (job.micro_batches > 0 ? job.micro_batches : 4);
  const std::string certs = core::ResolveRelative(o.cluster_path, spec.certs_dir);
  const std::string job_dir = fs::absolute(fs::path(job_path)).parent_path().string();
  const std::string job_yaml = ReadAll(job_path);
  std::vector<partitioner::PinnedStage> pinned;  // --plan: read now, so a bad file fails before any join
  if (!o.plan_path.empty()) {
    if (!fs::exists(o.plan_path)) {
      std::cerr << "meridian run: --plan " << o.plan_path << ": no such file\n";
      return 2;
    }
    auto layout = partitioner::ParsePlanLayout(ReadAll(o.plan_path), o.plan_path);
    if (!layout.ok()) {
      std::cerr << "meridian run: " << layout.status().message() << "\n";
      return 2;
    }
    for (const auto& st : *layout)
      for (const auto& site : st.sites)
        if (std::none_of(spec.sites.begin(), spec.sites.end(), [&](const auto& s) { return s.name == site; })) {
          std::cerr << "meridian run: " << o.plan_path << ": site '" << site << "' is not in the cluster spec "
                    << o.cluster_path << "\n";
          return 2;
        }
    pinned = std::move(*layout);
  }
  // The job as the executors will read it: model config, tokenizer and data must load here too, so a bad
  // path fails now rather than after every site has joined.
  auto setup = executor::LoadJob(job_path);
  if (!setup.ok()) {
    std::cerr << "meridian run: " << setup.status().message() << "\n";
    return 2;
  }
  if (const data::Dataset* d = setup->data.dataset())
    std::cout << "data: " << d->train_examples() << (d->instruction() ? " training examples" : " documents") << ", "
              << d->train_tokens() << " tokens in " << d->num_sequences() << " sequences of " << job.sequence_length
              << (d->held_out().empty() ? "" : absl::StrCat("; ", d->held_out().size(), " held out")) << "\n";
  fs::create_directories(o.run_dir);
  const std::string run_dir = fs::absolute(o.run_dir).string();

  std::mt19937_64 rng(std::random_device{}());
  const std::string run_id = absl::StrFormat("%016x", rng());
  Coordinator coord(spec, run_id);
  coord.SetLogDir(run_dir + "/sites");  // one log per site: RUN/sites/<site>.log
  std::set<std::string> names;
  for (const auto& s : spec.sites) names.insert(s.name);
  rpc::CoordinatorService service(names, &coord);
  auto started = rpc::StartMtlsServer(certs, "coordinator", spec.coordinator.ToString(), {&service});
  if (!started.ok()) {
    const bool bad_certs = started.status().code() != absl::StatusCode::kUnavailable;
    std::cerr << "meridian run: " << started.status().message()
              << (bad_certs ? " (create the certificates with `meridian certs init`)" : "") << "\n";
    return bad_certs ? 2 : 1;
  }
  std::unique_ptr<grpc::Server> server = std::move(*started);
  std::cout << "coordinator for cluster '" << spec.name << "' listening on " << spec.coordinator.ToString()
            << " (run " << run_id << ")\njoin each site with:\n";
  for (const auto& s : spec.sites)
    std::cout << "  meridian-executor --coordinator " << spec.coordinator.ToString() << " --site " << s.name
              << " --certs " << certs << " --listen " << s.address.ToString() << " --device " << s.devices.front()
              << "\n";
  std::cout << std::flush;
  // Prometheus text metrics (a stock Prometheus scrapes /metrics) and a JSONL log of every step.
  httplib::Server metrics_http;
  std::thread metrics_thread;
  if (spec.metrics_port > 0) {
    metrics_http.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
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
      absl::StrAppend(&body, "# HELP meridian_site_compute_seconds Compute time of the site's stage in its last step.\n",
                      "# TYPE meridian_site_compute_seconds gauge\n");
      for (const auto& [name, st] : sites)
        if (st.metrics) absl::StrAppend(&body, "meridian_site_compute_seconds{site=\"", name, "\"} ", st.metrics->compute_seconds(), "\n");
      absl::StrAppend(&body, "# HELP meridian_site_sent_bytes Bytes the site's stage sent to its neighbours in this attempt.\n",
                      "# TYPE meridian_site_sent_bytes gauge\n");
      for (const auto& [name, st] : sites)
        if (st.metrics) absl::StrAppend(&body, "meridian_site_sent_bytes{site=\"", name, "\"} ", st.metrics->wire_bytes(), "\n");
      absl::StrAppend(&body, "# HELP meridian_site_uncompressed_bytes What those bytes were before compression.\n",
                      "# TYPE meridian_site_uncompressed_bytes gauge\n");
      for (const auto& [name, st] : sites)
        if (st.metrics) absl::StrAppend(&body, "meridian_site_uncompressed_bytes{site=\"", name, "\"} ", st.metrics->raw_bytes(), "\n");
      res.set_content(body, "text/plain; version=0.0.4");
    });
    if (!metrics_http.bind_to_port("0.0.0.0", spec.metrics_port)) {
      std::cerr << "meridian run: cannot serve /metrics on port " << spec.metrics_port << "\n";
      return 1;
    }
    metrics_thread = std::thread([&] { metrics_http.listen_after_bind(); });
  }
  struct MetricsStop {
    httplib::Server* http;
    std::thread* t;
    ~MetricsStop() {
      http->stop();
      if (t->joinable()) t->join();
    }
  } metrics_stop{&metrics_http, &metrics_thread};
  std::ofstream jsonl(run_dir + "/metrics.jsonl", std::ios::app);

  auto fail = [&](const std::string& msg) {
    std::cerr << "meridian run: " << msg << "\n";
    coord.StopAll();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    return 1;
  };

  // 1. Join.
  const size_t need = spec.min_sites > 0 ? static_cast<size_t>(spec.min_sites) : spec.sites.size();
  const auto join_deadline = o.join_timeout_seconds > 0
                                 ? Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.join_timeout_seconds * 1000))
                                 : Clock::time_point::max();
  auto registered = [](const std::map<std::string, Coordinator::Site>& s) {
    size_t n = 0;
    for (const auto& [k, v] : s) n += v.registered;
    return n;
  };
  if (!coord.WaitFor([&](const auto& s, const auto&) { return registered(s) >= need; }, join_deadline)) {
    std::string missing;
    for (const auto& [k, v] : coord.Snapshot())
      if (!v.registered) missing += " " + k;
    return fail(absl::StrCat("sites did not join in time:", missing));
  }
  std::vector<std::string> joined;
  for (const auto& [k, v] : coord.Snapshot())
    if (v.registered) joined.push_back(k);
  std::cout << joined.size() << " sites joined; measuring devices, the model and the links\n" << std::flush;

  // 2. Profile: every site measures its device, the model per op and its links to the others.
  auto snap = coord.Snapshot();
  for (const auto& site : joined) {
    v1::Command c;
    auto* p = c.mutable_profile();
    p->set_job_yaml(job_yaml);
    p->set_job_dir(job_dir);
    p->set_probe_seconds(1.0);
    p->set_repeats(o.profile_repeats);
    for (const auto& other : joined)
      if (other > site) {  // each pair once: the lexicographically smaller site probes both directions
        auto* peer = p->add_peers();
        peer->set_site(other);
        peer->set_address(snap[other].listen);
      }
    coord.Send(site, c);
  }
  auto all_profiled = [&](const auto& s, const auto&) {
    for (const auto& k : joined)
      if (!s.at(k).profile) return false;
    return true;
  };
  while (!coord.WaitFor(all_profiled, Clock::now() + std::chrono::seconds(1))) {
    if (auto silent = coord.Silent(); !silent.empty()) return fail(absl::StrCat("site '", silent[0], "' stopped answering"));
  }
  partitioner::ClusterProfile profile;
  std::string graph_json;
  for (const auto& [name, s] : coord.Snapshot()) {
    if (!s.profile) continue;
    if (!s.profile->error().empty()) return fail(absl::StrCat("site '", name, "' could not profile: ", s.profile->error()));
    auto one = partitioner::ParseProfileJson(absl::StrCat("{\"sites\": [", s.profile->site_profile_json(), "]}"),
                                             absl::StrCat("profile of site '", name, "'"));
    if (!one.ok()) return fail(std::string(one.status().message()));
    profile.sites.push_back(one->sites[0]);
    graph_json = s.profile->graph_json();
    auto links = nlohmann::json::parse(s.profile->links_json(), nullptr, false);
    if (links.is_array())
      for (const auto& l : links)
        profile.links.push_back({l["from"], l["to"], l["bandwidth_bytes_per_second"], l["latency_seconds"]});
  }
  // Link overrides from the spec replace measurements.
  for (const auto& l : spec.links) {
    if (!l.override_measurement) continue;
    for (auto& pl : profile.links)
      if ((pl.from == l.from && pl.to == l.to) || (l.symmetric && pl.from == l.to && pl.to == l.from)) {
        if (l.bandwidth_bytes_per_second) pl.bandwidth_bytes_per_second = *l.bandwidth_bytes_per_second;
        if (l.rtt_seconds) pl.latency_seconds = *l.rtt_seconds / 2;
      }
  }
  for (const auto& site : profile.sites) {
    double model = 0;
    for (const auto& [op, secs] : site.op_seconds) model += secs;
    std::printf("  site %-10s %8.1f GFLOP/s GEMM, model forward+backward %8.1f ms per micro-batch\n", site.name.c_str(),
                site.flops_per_second / 1e9, model * 1e3);
  }
  for (const auto& l : profile.links)
    std::printf("  link %-10s -> %-10s %8.1f Mbit/s, %6.1f ms one way\n", l.from.c_str(), l.to.c_str(),
                l.bandwidth_bytes_per_second * 8 / 1e6, l.latency_seconds * 1e3);
  std::fflush(stdout);
  std::ofstream(run_dir + "/profile.json") << partitioner::ProfileToJson(profile);
  std::ofstream(run_dir + "/graph.json") << graph_json;
  auto graph = partitioner::ParseGraphJson(graph_json, "graph.json from the executors");
  if (!graph.ok()) return fail(std::string(graph.status().message()));

  // 3-5. Plan, assign, supervise. When a site is lost (no heartbeat for the spec's timeout), the others
  // abandon the attempt; the coordinator re-plans over the sites left (on_failure: replan) or waits for
  // the lost ones to rejoin (on_failure: wait), and every stage resumes from the newest intact
  // checkpoint (job.checkpoint.dir must be storage every site reads, e.g. a shared mount).
  std::set<std::string> lost;
  std::optional<partitioner::Plan> plan;
  bool resume = o.resume;
  const auto t0 = Clock::now();
  for (int attempt = 0;; ++attempt) {
    partitioner::ClusterProfile live;
    for (const auto& site : profile.sites)
      if (!lost.count(site.name)) live.sites.push_back(site);
    for (const auto& l : profile.links)
      if (!lost.count(l.from) && !lost.count(l.to)) live.links.push_back(l);
    partitioner::PlanOptions po;
    po.micro_batches = micro_batches;
    po.adaptive_compression = job.compression.policy == "adaptive";
    po.replication = job.replication && o.split != "even";
    if (o.split == "even") {
      const int n = std::min<int>(static_cast<int>(live.sites.size()), static_cast<int>(graph->ops.size()));
      for (const auto& site : spec.sites)
        for (size_t i = 0; i < live.sites.size(); ++i)
          if (live.sites[i].name == site.name && static_cast<int>(po.fixed_sites.size()) < n)
            po.fixed_sites.push_back(static_cast<int>(i));
      po.fixed_last_ops =
          partitioner::EvenCuts(static_cast<int>(graph->ops.size()), static_cast<int>(po.fixed_sites.size()));
    }
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
        std::cout << "plan: the pinned plan (" << o.plan_path << ") uses site '" << missing
                  << "', which is lost; planning over the sites left\n";
        pinned.clear();
      } else {
        if (pinned.back().last_op != static_cast<int>(graph->ops.size()) - 1)
          return fail(absl::StrCat(o.plan_path, ": the last stage ends at op ", pinned.back().last_op,
                                   ", but the job's model has ", graph->ops.size(), " ops (0-",
                                   graph->ops.size() - 1, ")"));
        po.replication = false;
        for (const auto& st : pinned) {
          po.fixed_sites.push_back(index(st.sites[0]));
          po.fixed_last_ops.push_back(st.last_op);
          po.fixed_replicas.emplace_back();
          for (size_t r = 1; r < st.sites.size(); ++r) po.fixed_replicas.back().push_back(index(st.sites[r]));
        }
      }
    }
    auto planned = partitioner::PlanPipeline(*graph, live, po);
    if (!planned.ok()) return fail(std::string(planned.status().message()));
    plan = std::move(*planned);
    std::cout << partitioner::PlanTable(*plan, *graph, live) << std::flush;
    const std::string plan_json = partitioner::PlanJson(*plan, *graph);
    std::ofstream(run_dir + "/plan.json") << plan_json;
    coord.SetRunInfo(partitioner::ProfileToJson(live), graph_json, plan_json);

    // 4. Assign.
    const std::string job_id = attempt == 0 ? run_id : absl::StrCat(run_id, "-", attempt);
    coord.BeginJob(job_id);
    const auto& st = plan->stages;
    std::set<std::string> used;
    // Codecs: the plan's (adaptive), the job's (fixed), or none.
    auto fixed = [&](const std::string& codec) {  // the job's top-k fraction goes with a top-k codec
      return codec.rfind("topk", 0) == 0 ? absl::StrCat(codec, ":k=", job.compression.topk_fraction) : codec;
    };
    auto link_codec = [&](size_t link) {
      if (job.compression.policy == "fixed") return fixed(job.compression.activations);
      if (job.compression.policy == "none") return std::string("identity");
      return plan->links[link].codec;
    };
    auto gradient_codec = [&](size_t k) {
      if (job.compression.policy == "fixed") return fixed(job.compression.gradients);
      if (job.compression.policy == "none" || st[k].gradient_codec.empty()) return std::string("identity");
      return st[k].gradient_codec;
    };
    auto group = [&](size_t k, v1::StageSites* g) {
      for (size_t i = 0; i < st[k].site_names.size(); ++i) {
        auto* p = g->add_sites();
        p->set_site(st[k].site_names[i]);
        p->set_address(snap[st[k].site_names[i]].listen);
        g->add_micro_batches(st[k].micro_batches[i]);
      }
    };
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
          a->set_prev_address(snap[st[k - 1].site_names[0]].listen);
          a->set_backward_codec(link_codec(k - 1));
          group(k - 1, a->mutable_prev_stage());
        }
        if (k + 1 < st.size()) {
          a->set_next_site(st[k + 1].site_names[0]);
          a->set_next_address(snap[st[k + 1].site_names[0]].listen);
          a->set_forward_codec(link_codec(k));
          group(k + 1, a->mutable_next_stage());
        }
        a->set_micro_batches(micro_batches);
        a->set_job_yaml(job_yaml);
        a->set_job_dir(job_dir);
        a->set_steps(steps);
        a->set_output_dir(run_dir + "/weights");
        if (resume) a->set_resume_step(-1);  // each stage loads the newest intact checkpoint
        coord.Send(site, c);
      }
    }
    std::cout << "training: " << st.size() << " stages, " << steps << " steps"
              << (resume ? ", resuming from the newest intact checkpoint" : "") << "\n" << std::flush;

    // 5. Supervise.
    int64_t shown = -1;
    std::string failure;  // why this attempt ended early
    std::string failed_site;
    while (true) {
      bool finished = coord.WaitFor(
          [&](const auto& s, const auto&) {
            for (const auto& u : used)
              if (!s.at(u).done) return false;
            return true;
          },
          Clock::now() + std::chrono::milliseconds(500));
      auto p = coord.progress();
      if (p.step > shown) {
        shown = p.step;
        double el = std::chrono::duration<double>(Clock::now() - t0).count();
        // The slowest site (most compute in its latest step) and the bytes the stages sent this attempt.
        std::string slowest;
        double slowest_seconds = 0;
        int64_t wire = 0, raw = 0;
        for (const auto& [name, s] : coord.Snapshot()) {
          if (!s.metrics || !used.count(name)) continue;
          wire += s.metrics->wire_bytes();
          raw += s.metrics->raw_bytes();
          if (s.metrics->compute_seconds() > slowest_seconds) slowest = name, slowest_seconds = s.metrics->compute_seconds();
        }
        std::printf("step %lld/%d  loss %.4f  %.0f tokens/s  %.2f s/step  ETA %.0f s  slowest %s (%.2f s compute)  "
                    "WAN %.1f MB (%.0f%% of uncompressed)\n",
                    static_cast<long long>(p.step + 1), steps, p.loss, p.tokens / el, p.step_seconds,
                    p.step_seconds * (steps - p.step - 1), slowest.empty() ? "-" : slowest.c_str(), slowest_seconds,
                    wire / 1e6, raw ? 100.0 * wire / raw : 100.0);
        std::fflush(stdout);
        jsonl << nlohmann::json{{"step", p.step + 1},        {"loss", p.loss},
                                {"step_seconds", p.step_seconds}, {"tokens", p.tokens},
                                {"elapsed_seconds", el},       {"attempt", attempt},
                                {"slowest_site", slowest},     {"slowest_compute_seconds", slowest_seconds},
                                {"wire_bytes", wire},          {"raw_bytes", raw}}
                     .dump()
              << std::endl;
      }
      for (const auto& [name, s] : coord.Snapshot())
        if (s.done && !s.done->error().empty() && failure.empty()) {
          failure = s.done->error();
          failed_site = name;
        }
      if (!failure.empty()) {
        // A stage fails when a neighbour dies; give heartbeats the time to name the site that died.
        const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(spec.heartbeat_timeout_seconds + 1));
        while (Clock::now() < until && coord.Silent().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(200));
        break;
      }
      if (finished) break;
      bool stage_silent = false;  // a silent spare site does not interrupt the attempt
      for (const auto& n : coord.Silent()) stage_silent |= used.count(n) > 0;
      if (stage_silent) {
        failure = "no heartbeat";
        break;
      }
    }
    if (failure.empty()) break;  // every stage finished

    auto silent = coord.Silent();
    if (silent.empty()) return fail(absl::StrCat("site '", failed_site, "' failed: ", failure));
    std::string names_lost;
    for (const auto& n : silent) names_lost += (names_lost.empty() ? "'" : ", '") + n + "'";
    const std::string what = absl::StrCat("site ", names_lost, " stopped answering (no heartbeat for ",
                                          spec.heartbeat_timeout_seconds, " s)",
                                          failed_site.empty() ? "" : absl::StrCat("; then site '", failed_site,
                                                                                  "' failed: ", failure));
    std::cout << "lost: " << what << "\n" << std::flush;
    for (const auto& n : silent)
      coord.LogSite(n, absl::StrCat("lost: no heartbeat for ", spec.heartbeat_timeout_seconds, " s; ",
                                    spec.on_failure == "wait" ? "waiting for it" : "re-planning without it"));
    if (job.checkpoint.interval <= 0)
      return fail(absl::StrCat(what, ". The job has no checkpoints (job.checkpoint.interval), so nothing to "
                               "resume from; set one to survive lost sites"));
    // The survivors abandon the attempt when their neighbours' streams break (or at the step timeout).
    const auto drain = Clock::now() + std::chrono::seconds(75);
    coord.WaitFor(
        [&](const auto& s, const auto&) {
          for (const auto& u : used)
            if (!s.at(u).done && std::find(silent.begin(), silent.end(), u) == silent.end()) return false;
          return true;
        },
        drain);
    if (spec.on_failure == "wait") {
      std::cout << "recovery: waiting for " << names_lost << " to rejoin (on_failure: wait)\n" << std::flush;
      while (!coord.Silent().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(500));
      std::cout << "recovery: " << names_lost << " answering again; resuming from the newest intact checkpoint\n"
                << std::flush;
      snap = coord.Snapshot();  // a restarted executor may listen elsewhere
    } else {
      for (const auto& n : silent) lost.insert(n);
      if (lost.size() >= profile.sites.size()) return fail(absl::StrCat(what, "; no site left"));
      std::cout << "recovery: re-planning over the " << profile.sites.size() - lost.size()
                << " sites left and resuming from the newest intact checkpoint\n"
                << std::flush;
    }
    resume = true;
  }
  int64_t wire = 0, raw = 0;
  for (const auto& [name, s] : coord.Snapshot())
    if (s.done) wire += s.done->wire_bytes(), raw += s.done->raw_bytes();
  double el = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("done: %d steps in %.1f s (%.2f s/step, predicted %.2f); %.1f MB on the links, %.0f%% of uncompressed; "
              "final loss %.4f; weights in %s/weights\n",
              steps, el, el / steps, plan->predicted_step_seconds, wire / 1e6, raw ? 100.0 * wire / raw : 100.0,
              coord.progress().loss, run_dir.c_str());
  coord.StopAll();
  int rc = 0;
  if (!o.export_dir.empty()) {
    auto trained = executor::LoadStageShards(run_dir + "/weights");
    absl::Status s = trained.ok() ? executor::ExportHfModel(*setup, *trained, o.export_dir) : trained.status();
    if (!s.ok()) {
      std::cerr << "meridian run: export failed: " << s.message() << "\n";
      rc = 1;
    } else {
      std::printf("exported the model to %s (model.safetensors + config.json%s%s)\n", o.export_dir.c_str(),
                  setup->tokenizer ? " + tokenizer.model" : "",
                  setup->job.lora.enabled ? "; LoRA merged, PEFT adapter in adapter/" : "");
    }
  }
  if (const data::Dataset* d = setup->data.dataset(); d && !d->held_out().empty() && o.eval_examples > 0) {
    if (absl::Status s = Evaluate(*setup, run_dir, o.eval_examples); !s.ok()) {
      std::cerr << "meridian run: evaluation failed: " << s.message() << "\n";
      rc = 1;
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return rc;
}

}  // namespace meridian::coordinator
