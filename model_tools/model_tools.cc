#include "model_tools/model_tools.h"

#include <CLI/CLI.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checkpoint_dir.h"
#include "core/cluster_spec.h"
#include "core/files.h"
#include "core/run_layout.h"
#include "data/data.h"
#include "executor/checkpoint.h"
#include "executor/evaluate.h"
#include "executor/export.h"
#include "executor/host_memory.h"
#include "executor/trainer.h"
#include "nlohmann/json.hpp"

namespace meridian::model_tools {
namespace {

// {kind: {examples, correct, accuracy}}; the key of examples without a kind is "".
nlohmann::json ByKindJson(const executor::EvalResult& r) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [kind, t] : r.ByKind())
    j[kind] = {{"examples", t.examples}, {"correct", t.correct}, {"accuracy", t.accuracy()}};
  return j;
}

nlohmann::json SamplesJson(const executor::EvalResult& r) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& s : r.samples)
    j.push_back({{"prompt", s.prompt},
                 {"expected", s.expected},
                 {"generated", s.generated},
                 {"kind", s.kind},
                 {"correct", s.correct}});
  return j;
}

// `meridian eval --json`: {examples, correct, accuracy, by_kind, samples}.
nlohmann::json EvalJson(const executor::EvalResult& r) {
  return {{"examples", r.examples},
          {"correct", r.correct},
          {"accuracy", r.accuracy()},
          {"by_kind", ByKindJson(r)},
          {"samples", SamplesJson(r)}};
}

// One line per kind when the data names kinds: "  KIND  A%  (C of N)", or with `before`
// "  KIND  B% -> A%  (N examples)".
void PrintByKind(const executor::EvalResult& r, const executor::EvalResult* before) {
  const auto kinds = r.ByKind();
  if (kinds.size() == 1 && kinds.begin()->first.empty()) return;
  const auto was = before ? before->ByKind() : std::map<std::string, executor::EvalResult::Tally>{};
  for (const auto& [kind, t] : kinds) {
    const std::string name = kind.empty() ? "(no kind)" : kind;
    if (before) {
      auto it = was.find(kind);
      std::printf("  %-12s %5.1f%% -> %5.1f%%  (%d examples)\n", name.c_str(),
                  it == was.end() ? 0.0 : 100 * it->second.accuracy(), 100 * t.accuracy(), t.examples);
    } else {
      std::printf("  %-12s %5.1f%%  (%d of %d)\n", name.c_str(), 100 * t.accuracy(), t.correct, t.examples);
    }
  }
}

absl::Status EvaluateRun(const executor::JobSetup& setup, const AfterRunOptions& o);  // defined below

}  // namespace

void AddTrainLocalOptions(CLI::App* cmd, TrainLocalOptions* o) {
  cmd->add_option("JOB", o->job_path, "Job spec (YAML with a 'job' section)")->required();
  cmd->add_option("--steps", o->steps, "Optimizer steps (default: the job's)")->check(CLI::Range(1, 100000000));
  cmd->add_option("--out", o->out_dir,
                  "HF model directory to write: model.safetensors, config.json, tokenizer.model (LoRA jobs: the "
                  "merged model, and the PEFT adapter in DIR/adapter)")
      ->required();
  cmd->add_option("--device", o->device, "cpu or cuda:N");
}

int RunTrainLocal(const TrainLocalOptions& o) {
  executor::KeepFreedHostMemoryForReuse();
  auto setup = executor::LoadJob(o.job_path);
  if (!setup.ok()) {
    std::cerr << "meridian train-local: " << setup.status().message() << "\n";
    return 2;
  }
  const int steps = o.steps > 0 ? o.steps : setup->job.steps;
  torch::Device device = o.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(o.device);
  auto r = executor::TrainLocal(*setup, steps, device, [](int step, double loss) {
    std::cout << "step " << step << " loss " << loss << std::endl;
  });
  if (!r.ok()) {
    std::cerr << "meridian train-local: " << r.status().message() << "\n";
    return 1;
  }
  // DIR becomes a complete HF model directory (under LoRA: merged model + PEFT adapter in DIR/adapter).
  if (absl::Status s = executor::ExportHfModel(*setup, r->parameters, o.out_dir); !s.ok()) {
    std::cerr << "meridian train-local: writing " << o.out_dir << ": " << s.message() << "\n";
    return 1;
  }
  return 0;
}

void AddEvalOptions(CLI::App* cmd, EvalOptions* o) {
  cmd->add_option("JOB", o->job_path, "Job spec whose data is JSONL instructions with a held-out split")->required();
  cmd->add_option("--weights", o->weights,
                  "model.safetensors, a PEFT adapter_model.safetensors (LoRA jobs), or a directory holding one; "
                  "default: the job's initial model");
  cmd->add_option("--max", o->max_examples, "Evaluate at most this many held-out examples (0: all)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--show", o->show, "Print this many examples with the generated answer")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", o->json_out, "Also write the result as JSON to this file");
  cmd->add_option("--device", o->device, "cpu or cuda:N");
  auto* run = cmd->add_option("--run", o->run_dir,
                              "Score a finished `meridian run` directory instead, as the run does when it ends: "
                              "the initial model, each checkpoint of the run, the trained weights (RUN/weights), "
                              "on every held-out example unless --max; writes RUN/eval.json")
                  ->excludes("--weights")
                  ->excludes("--json")
                  ->excludes("--show");
  cmd->add_option("--steps", o->steps,
                  "With --run: the run's last step (default: the last in RUN/metrics.jsonl, else the job's steps)")
      ->check(CLI::NonNegativeNumber)
      ->needs(run);
}

int RunEval(const EvalOptions& o) {
  executor::KeepFreedHostMemoryForReuse();
  auto setup = executor::LoadJob(o.job_path);
  if (!setup.ok()) {
    std::cerr << "meridian eval: " << setup.status().message() << "\n";
    return 2;
  }
  if (!o.run_dir.empty()) {
    if (o.device != "cpu") {
      std::cerr << "meridian eval: --run scores on the cpu, as the run does; drop --device\n";
      return 2;
    }
    AfterRunOptions run;
    run.job_path = o.job_path;
    run.run_dir = o.run_dir;
    run.eval_examples = o.max_examples > 0 ? o.max_examples : std::numeric_limits<int>::max();
    run.steps = o.steps;
    if (absl::Status s = EvaluateRun(*setup, run); !s.ok()) {
      std::cerr << "meridian eval: " << o.run_dir << ": " << s.message() << "\n";
      return s.code() == absl::StatusCode::kFailedPrecondition || absl::IsNotFound(s) ? 2 : 1;
    }
    return 0;
  }
  std::map<std::string, torch::Tensor> params;
  if (!o.weights.empty()) {
    auto w = executor::LoadWeightsForEval(std::move(*setup), o.weights);
    if (!w.ok()) {
      std::cerr << "meridian eval: --weights: " << w.status().message() << "\n";
      return 2;
    }
    *setup = std::move(w->first);
    params = std::move(w->second);
  }
  torch::Device device = o.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(o.device);
  auto r = executor::EvaluateExactMatch(*setup, params, device, o.max_examples);
  if (!r.ok()) {
    std::cerr << "meridian eval: " << o.job_path << ": " << r.status().message() << "\n";
    return r.status().code() == absl::StatusCode::kFailedPrecondition ? 2 : 1;
  }
  std::printf("exact match: %d/%d (%.1f%%) on held-out examples\n", r->correct, r->examples, 100 * r->accuracy());
  PrintByKind(*r, nullptr);
  for (int i = 0; i < std::min<int>(o.show, static_cast<int>(r->samples.size())); ++i) {
    const auto& s = r->samples[i];
    std::printf("  %s %s -> '%s' (expected '%s')\n", s.correct ? "ok  " : "MISS", s.prompt.c_str(), s.generated.c_str(),
                s.expected.c_str());
  }
  if (!o.json_out.empty()) {
    nlohmann::json j = EvalJson(*r);
    if (absl::Status s = core::WriteFileAtomic(o.json_out, j.dump(2) + "\n"); !s.ok()) {
      std::cerr << "meridian eval: --json: " << s.message() << "\n";
      return 1;
    }
  }
  return 0;
}

void AddExportOptions(CLI::App* cmd, ExportOptions* o) {
  cmd->add_option("JOB", o->job_path, "The job spec the run trained")->required();
  cmd->add_option("--weights", o->weights_dir, "The run's stage shards (RUN/weights)")->required();
  cmd->add_option("--out", o->out_dir, "HF model directory to write")->required();
}

int RunExport(const ExportOptions& o) {
  auto setup = executor::LoadJob(o.job_path);
  if (!setup.ok()) {
    std::cerr << "meridian export: " << setup.status().message() << "\n";
    return 2;
  }
  auto trained = executor::LoadStageShards(o.weights_dir);
  if (!trained.ok()) {
    std::cerr << "meridian export: --weights: " << trained.status().message() << "\n";
    return 2;
  }
  if (absl::Status s = executor::ExportHfModel(*setup, *trained, o.out_dir); !s.ok()) {
    std::cerr << "meridian export: " << s.message() << "\n";
    return 1;
  }
  std::printf("exported to %s\n", o.out_dir.c_str());
  return 0;
}

void AddTokenizerOptions(CLI::App* cmd, TokenizerOptions* o) {
  cmd->add_option("--input", o->inputs, "UTF-8 text files to learn the pieces from")->required();
  cmd->add_option("--vocab-size", o->vocab_size, "Pieces (at least the 256 byte-fallback pieces + specials)")
      ->check(CLI::Range(300, 1 << 20));
  cmd->add_option("--out", o->out_dir, "Directory for tokenizer.model and tokenizer.vocab")->required();
}

int RunTokenizerTrain(const TokenizerOptions& o) {
  std::error_code ec;
  std::filesystem::create_directories(o.out_dir, ec);
  if (ec) {
    std::cerr << "meridian tokenizer train: --out " << o.out_dir << ": " << ec.message() << "\n";
    return 2;
  }
  absl::Status s = data::TrainTokenizer(o.inputs, o.vocab_size, o.out_dir + "/tokenizer");
  if (!s.ok()) {
    std::cerr << "meridian tokenizer train: " << s.message() << "\n";
    return absl::IsNotFound(s) ? 2 : 1;
  }
  auto tok = data::Tokenizer::Load(o.out_dir + "/tokenizer.model");
  if (!tok.ok()) {
    std::cerr << "meridian tokenizer train: " << tok.status().message() << "\n";
    return 1;
  }
  std::printf("wrote %s/tokenizer.model (%d pieces; <unk> 0, <s> 1, </s> 2)\n", o.out_dir.c_str(),
              (*tok)->vocab_size());
  return 0;
}

namespace {

// What RUN/metrics.jsonl says of the run: its last step, and when its training began (the file's last
// write less the last line's elapsed_seconds, less a minute's slack). `known` is false without the file.
struct RunWindow {
  bool known = false;
  int64_t last_step = 0;
  std::filesystem::file_time_type began;
};

RunWindow ReadRunWindow(const std::filesystem::path& metrics) {
  RunWindow w;
  auto text = core::ReadFile(metrics.string());
  if (!text.ok()) return w;
  std::istringstream lines(*text);
  nlohmann::json last;
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer()) last = std::move(j);
  }
  std::error_code ec;
  const auto written = std::filesystem::last_write_time(metrics, ec);
  if (last.is_null() || ec) return w;
  const double elapsed = last.value("elapsed_seconds", 0.0);
  w.known = true;
  w.last_step = last["step"].get<int64_t>();
  w.began = written - std::chrono::duration_cast<std::filesystem::file_time_type::duration>(
                          std::chrono::duration<double>(std::max(elapsed, 0.0) + 60.0));
  return w;
}

// Held-out exact match of the initial model, of each checkpoint this run wrote below its last step, and
// of the trained model (the stage shards in RUN/weights). Prints the scores (per kind when the data names
// kinds) and a few held-out prompts answered before and after, and writes RUN/eval.json.
absl::Status EvaluateRun(const executor::JobSetup& setup, const AfterRunOptions& o) {
  const std::filesystem::path run(o.run_dir);
  auto trained = executor::LoadStageShards((run / core::kWeightsDir).string());
  if (!trained.ok()) return trained.status();
  auto before = executor::EvaluateExactMatch(setup, {}, torch::kCPU, o.eval_examples);
  if (!before.ok()) return before.status();
  const RunWindow window = ReadRunWindow(run / core::kMetricsFile);
  const int64_t last_step = o.steps > 0 ? o.steps : window.known ? window.last_step : setup.job.steps;
  nlohmann::json curve = nlohmann::json::array();
  curve.push_back({{"step", 0}, {"accuracy", before->accuracy()}, {"by_kind", ByKindJson(*before)}});
  // The checkpoints this run wrote: steps below the last at the job's interval, complete (with the
  // coordinator's store: manifested, every file matching the manifest), written since this run's training
  // began (a shared directory may hold another run's), and intact (LoadCheckpointFor checks each shard
  // against its SHA-256). One that cannot be scored is named and skipped.
  const bool coordinator_store = setup.job.checkpoint.store == core::CheckpointStore::kCoordinator;
  const std::string checkpoints = coordinator_store ? (run / core::kCheckpointsDir).string()
                                                    : core::ResolveRelative(o.job_path, setup.job.checkpoint.dir);
  const int interval = setup.job.checkpoint.interval;
  std::set<std::string> wanted;  // what the trained weights hold: every parameter, or the LoRA adapters
  for (const auto& [name, t] : *trained) wanted.insert(name);
  std::vector<std::string> skipped;
  std::vector<std::pair<int64_t, std::string>> step_dirs;  // newest first
  if (interval > 0)
    if (auto listed = core::StepDirs(checkpoints); listed.ok()) step_dirs = std::move(*listed);
  for (auto it = step_dirs.rbegin(); it != step_dirs.rend(); ++it) {  // oldest first
    const auto& [step, dir] = *it;
    if (step >= last_step || step % interval != 0) continue;
    std::string why;
    const bool complete = coordinator_store ? core::ManifestedCheckpoint(dir, step, &why).has_value()
                                            : core::CompleteStages(dir, &why, /*verify_hashes=*/false).has_value();
    if (!complete) {
      skipped.push_back(absl::StrCat(dir, ": ", why));
      continue;
    }
    if (window.known) {
      std::error_code ec;
      const auto written = std::filesystem::last_write_time(std::filesystem::path(dir) / core::StageMetaName(0), ec);
      if (ec || written < window.began) {
        skipped.push_back(absl::StrCat(dir, ": written before this run's training began"));
        continue;
      }
    }
    auto ck = executor::LoadCheckpointFor(dir, wanted);
    if (!ck.ok()) {
      skipped.push_back(absl::StrCat(dir, ": ", ck.status().message()));
      continue;
    }
    for (auto t = ck->tensors.begin(); t != ck->tensors.end();)  // optimizer state is not scored
      t = wanted.count(t->first) ? std::next(t) : ck->tensors.erase(t);
    auto at = executor::EvaluateExactMatch(setup, ck->tensors, torch::kCPU, o.eval_examples);
    if (!at.ok()) {
      skipped.push_back(absl::StrCat(dir, ": ", at.status().message()));
      continue;
    }
    curve.push_back({{"step", step}, {"accuracy", at->accuracy()}, {"by_kind", ByKindJson(*at)}});
  }
  auto after = executor::EvaluateExactMatch(setup, *trained, torch::kCPU, o.eval_examples);
  if (!after.ok()) return after.status();
  curve.push_back({{"step", last_step}, {"accuracy", after->accuracy()}, {"by_kind", ByKindJson(*after)}});

  std::printf("held-out exact match: %.1f%% before -> %.1f%% after training (%d examples never trained on)\n",
              100 * before->accuracy(), 100 * after->accuracy(), after->examples);
  PrintByKind(*after, &*before);
  if (curve.size() > 2) {
    std::string points;
    for (const auto& c : curve)
      points += absl::StrFormat("%sstep %d %.1f%%", points.empty() ? "" : ", ", c["step"].get<int64_t>(),
                                100 * c["accuracy"].get<double>());
    std::printf("  during training: %s\n", points.c_str());
  }
  for (const std::string& why : skipped) std::printf("  checkpoint not scored: %s\n", why.c_str());
  // A few held-out prompts with both answers: the first of each kind (up to 5), then the first ones until
  // there are 3.
  std::vector<size_t> shown;
  std::set<std::string> kinds;
  for (size_t i = 0; i < after->samples.size() && shown.size() < 5; ++i)
    if (kinds.insert(after->samples[i].kind).second) shown.push_back(i);
  for (size_t i = 0; i < after->samples.size() && shown.size() < 3; ++i)
    if (std::find(shown.begin(), shown.end(), i) == shown.end()) shown.push_back(i);
  for (size_t i : shown) {
    const auto& a = after->samples[i];
    std::printf("  %-32s before '%s' -> after '%s' %s\n", a.prompt.c_str(), before->samples[i].generated.c_str(),
                a.generated.c_str(), a.correct ? "(right)" : absl::StrCat("(expected '", a.expected, "')").c_str());
  }
  nlohmann::json j = {{"examples", after->examples},
                      {"accuracy_before", before->accuracy()},
                      {"accuracy_after", after->accuracy()},
                      {"by_kind_before", ByKindJson(*before)},
                      {"by_kind_after", ByKindJson(*after)},
                      {"curve", curve},
                      {"samples_before", SamplesJson(*before)},
                      {"samples", SamplesJson(*after)}};
  return core::WriteFileAtomic((run / core::kEvalFile).string(), j.dump(2) + "\n");
}

}  // namespace

int AfterRun(const AfterRunOptions& o) {
  const bool evaluate = o.eval_examples > 0;
  if (o.export_dir.empty() && !evaluate) return 0;
  auto setup = executor::LoadJob(o.job_path);
  if (!setup.ok()) {  // the coordinator validated it before training: it changed since
    std::cerr << "meridian run: " << setup.status().message() << "\n";
    return 1;
  }
  int rc = 0;
  if (!o.export_dir.empty()) {
    auto trained = executor::LoadStageShards((std::filesystem::path(o.run_dir) / core::kWeightsDir).string());
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
  if (const data::Dataset* d = setup->data.dataset(); d && !d->held_out().empty() && evaluate) {
    if (absl::Status s = EvaluateRun(*setup, o); !s.ok()) {
      std::cerr << "meridian run: evaluation failed: " << s.message() << "\n";
      rc = 1;
    }
  }
  std::fflush(stdout);
  return rc;
}

}  // namespace meridian::model_tools
