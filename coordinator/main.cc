// `meridian`: the coordinator's command-line interface. CLI parsing lives here only; each subcommand
// calls into the libraries. Exit codes: 0 success, 1 runtime failure, 2 invalid input or usage.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "coordinator/doctor.h"
#include "coordinator/inspect.h"
#include "coordinator/launch_command.h"
#include "coordinator/plan_command.h"
#include "coordinator/run.h"
#include "coordinator/simulate_command.h"
#include "core/certs.h"
#include "core/cluster_spec.h"
#include "core/log.h"
#include "core/version.h"
#include "model_tools/model_tools.h"

namespace {

using namespace meridian;

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitInvalid = 2;

int Validate(const std::vector<std::string>& files) {
  int rc = kExitOk;
  for (const auto& f : files) {
    auto r = core::LoadSpecFile(f);
    if (!r.errors.empty()) {
      for (const auto& d : r.errors) std::cerr << d.ToString() << "\n";
      rc = kExitInvalid;
      continue;
    }
    std::string what;
    if (r.spec->cluster)
      what = "cluster '" + r.spec->cluster->name + "' with " + std::to_string(r.spec->cluster->sites.size()) + " sites";
    if (r.spec->job)
      what += std::string(what.empty() ? "" : " and ") + "a job of " + std::to_string(r.spec->job->steps) + " steps";
    std::cout << f << ": ok (" << what << ")\n";
  }
  return rc;
}

int CertsInit(const std::string& spec_path, const std::string& out, bool force) {
  auto r = core::LoadSpecFile(spec_path);
  if (!r.errors.empty()) {
    for (const auto& d : r.errors) std::cerr << d.ToString() << "\n";
    return kExitInvalid;
  }
  if (!r.spec->cluster) {
    std::cerr << spec_path << ": error: not a cluster spec (no 'sites')\n";
    return kExitInvalid;
  }
  core::CertOptions o;
  o.force = force;
  std::vector<std::string> written;
  absl::Status s = core::InitClusterCerts(*r.spec->cluster, out, o, &written);
  if (!s.ok()) {
    std::cerr << "meridian certs init: " << s.message() << "\n";
    return s.code() == absl::StatusCode::kAlreadyExists ? kExitInvalid : kExitFailure;
  }
  std::cout << "wrote " << written.size() << " files to " << out << " (CA, coordinator, "
            << r.spec->cluster->sites.size() << " sites); keep ca.key secret\n";
  std::cout << "give each site only its bundle:\n";
  for (const auto& site : r.spec->cluster->sites)
    std::cout << "  " << site.name << ": " << core::SiteBundleDir(out, site.name) << "\n";
  return kExitOk;
}

int CertsIssue(const std::string& ca_dir, const std::string& site, const std::string& host, bool force) {
  core::CertOptions o;
  o.force = force;
  std::vector<std::string> written;
  absl::Status s = core::IssueSiteCert(ca_dir, site, host, o, &written);
  if (!s.ok()) {
    std::cerr << "meridian certs issue: " << s.message() << "\n";
    return s.code() == absl::StatusCode::kInternal ? kExitFailure : kExitInvalid;
  }
  for (const auto& w : written) std::cout << "wrote " << w << "\n";
  std::cout << "give site '" << site << "' only " << core::SiteBundleDir(ca_dir, site) << "\n";
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"meridian: train and fine-tune large models across sites with mixed GPUs and slow WAN links"};
  app.set_version_flag("--version", std::string("meridian ") + kVersion);
  app.require_subcommand(1);
  int rc = kExitOk;
  std::string log_level = "info";
  app.add_option("--log-level", log_level,
                 "Diagnostics on stderr from this level up: trace, debug (with `run`: every event and action of the "
                 "run machine), info, warning, error, off");
  app.parse_complete_callback([&] {
    if (absl::Status s = core::InitLogging("meridian", log_level); !s.ok())
      throw CLI::ValidationError(std::string(s.message()));
  });

  auto* validate = app.add_subcommand("validate", "Check cluster and job spec files; one line per problem");
  std::vector<std::string> files;
  validate->add_option("FILE", files, "YAML spec files")->required();
  validate->callback([&] { rc = Validate(files); });

  auto* certs = app.add_subcommand("certs", "Create the cluster's CA and certificates");
  certs->require_subcommand(1);
  auto* init = certs->add_subcommand("init", "Create a CA and a key+certificate for the coordinator and every site");
  std::string spec_path, out_dir;
  bool force = false;
  init->add_option("--spec", spec_path, "Cluster spec (YAML)")->required();
  init->add_option("--out", out_dir,
                   "Directory for ca.pem, ca.key, NAME.pem, NAME.key, and bundles/SITE/ for each site")
      ->required();
  init->add_flag("--force", force, "Replace existing keys and certificates");
  init->callback([&] { rc = CertsInit(spec_path, out_dir, force); });
  auto* issue = certs->add_subcommand("issue", "Sign a key+certificate for one more site with an existing CA");
  std::string ca_dir, site, host;
  issue->add_option("--ca-dir", ca_dir, "Directory holding ca.pem and ca.key")->required();
  issue->add_option("--site", site, "Site name (the certificate's CN)")->required();
  issue->add_option("--host", host, "DNS name or IP address peers use to reach the site")->required();
  issue->add_flag("--force", force, "Replace an existing key and certificate");
  issue->callback([&] { rc = CertsIssue(ca_dir, site, host, force); });

  coordinator::PlanCommandOptions plan_options;
  auto* plan = app.add_subcommand("plan", "Partition a model's operator graph over a cluster profile");
  coordinator::AddPlanOptions(plan, &plan_options);
  plan->callback([&] { rc = coordinator::RunPlanCommand(plan_options); });

  coordinator::SimulateCommandOptions simulate_options;
  auto* simulate =
      app.add_subcommand("simulate", "Simulate a plan event by event: step time, bubble, link and stage times");
  coordinator::AddSimulateOptions(simulate, &simulate_options);
  simulate->callback([&] { rc = coordinator::RunSimulateCommand(simulate_options); });

  auto* doctor = app.add_subcommand("doctor", "Check the spec, the CA and every site's identity before a run");
  std::string doctor_spec;
  doctor->add_option("CLUSTER", doctor_spec, "Cluster spec (YAML)")->required();
  doctor->callback([&] { rc = coordinator::Doctor(doctor_spec); });

  coordinator::RunOptions run_options;
  auto* run = app.add_subcommand("run", "Start the coordinator: join the sites, profile, plan, train");
  coordinator::AddRunOptions(run, &run_options);
  run->callback([&] {
    rc = coordinator::Run(run_options);
    // The coordinator links no torch: the model tools export and evaluate what it trained.
    if (rc == kExitOk)
      rc = model_tools::AfterRun({run_options.job_path.empty() ? run_options.cluster_path : run_options.job_path,
                                  run_options.run_dir, run_options.export_dir, run_options.eval_examples,
                                  run_options.steps});
  });

  model_tools::TrainLocalOptions train_options;
  auto* train = app.add_subcommand("train-local", "Train the job's whole model in this process (the reference run)");
  model_tools::AddTrainLocalOptions(train, &train_options);
  train->callback([&] { rc = model_tools::RunTrainLocal(train_options); });

  model_tools::EvalOptions eval_options;
  auto* eval = app.add_subcommand("eval", "Held-out exact-match accuracy of a model on a job's instruction data");
  model_tools::AddEvalOptions(eval, &eval_options);
  eval->callback([&] { rc = model_tools::RunEval(eval_options); });

  coordinator::LaunchCommandOptions launch_options;
  auto* launch = app.add_subcommand(
      "launch", "Start the executors of the sites with ssh: sections over SSH, and stop them on Ctrl-C");
  coordinator::AddLaunchOptions(launch, &launch_options);
  launch->callback([&] { rc = coordinator::RunLaunch(launch_options); });

  coordinator::InspectOptions drain_options;
  auto* drain = app.add_subcommand("drain", "Re-plan a running job without a site, at the next step boundary");
  coordinator::AddDrainOptions(drain, &drain_options);
  drain->callback([&] { rc = coordinator::RunDrain(drain_options); });

  coordinator::InspectOptions status_options;
  auto* status = app.add_subcommand("status", "Progress and every site's state of a running job");
  coordinator::AddStatusOptions(status, &status_options);
  status->callback([&] { rc = coordinator::RunStatus(status_options); });

  coordinator::InspectOptions profile_options;
  auto* profile = app.add_subcommand("profile", "The measured profile (profile.json) of a running job's cluster");
  coordinator::AddProfileOptions(profile, &profile_options);
  profile->callback([&] { rc = coordinator::RunProfile(profile_options); });

  model_tools::ExportOptions export_options;
  auto* exp = app.add_subcommand("export", "Write a run's trained stage shards as one HF model directory");
  model_tools::AddExportOptions(exp, &export_options);
  exp->callback([&] { rc = model_tools::RunExport(export_options); });

  auto* tokenizer = app.add_subcommand("tokenizer", "SentencePiece tokenizers");
  tokenizer->require_subcommand(1);
  model_tools::TokenizerOptions tokenizer_options;
  auto* tok_train =
      tokenizer->add_subcommand("train", "Train a SentencePiece (unigram, byte fallback) tokenizer on text");
  model_tools::AddTokenizerOptions(tok_train, &tokenizer_options);
  tok_train->callback([&] { rc = model_tools::RunTokenizerTrain(tokenizer_options); });

  coordinator::GraphCommandOptions graph_options;
  auto* graph =
      app.add_subcommand("graph", "Write the operator graph (graph.json) of a LLaMA-architecture config.json");
  coordinator::AddGraphOptions(graph, &graph_options);
  graph->callback([&] { rc = coordinator::RunGraphCommand(graph_options); });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? kExitOk : kExitInvalid;
  }
  // The command is done and its files are closed. Leave without exit()'s OpenSSL atexit cleanup and static
  // destructors, which can race gRPC's own threads still tearing connections down (`meridian run`,
  // `status`, `plan --live`) and abort.
  std::fflush(nullptr);
  std::_Exit(rc);
}
