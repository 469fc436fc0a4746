#include "coordinator/train_local.h"

#include <CLI/CLI.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "data/data.h"
#include "executor/evaluate.h"
#include "executor/trainer.h"
#include "nlohmann/json.hpp"

namespace meridian::coordinator {

void AddTrainLocalOptions(CLI::App* cmd, TrainLocalOptions* o) {
  cmd->add_option("JOB", o->job_path, "Job spec (YAML with a 'job' section)")->required();
  cmd->add_option("--steps", o->steps, "Optimizer steps (default: the job's)")->check(CLI::Range(1, 100000000));
  cmd->add_option("--out", o->out_dir, "HF model directory to write: model.safetensors, config.json, tokenizer.model")->required();
  cmd->add_option("--device", o->device, "cpu or cuda:N");
}

int RunTrainLocal(const TrainLocalOptions& o) {
  auto setup = executor::LoadJob(o.job_path);
  if (!setup.ok()) {
    std::cerr << "meridian train-local: " << setup.status().message() << "\n";
    return 2;
  }
  const int steps = o.steps > 0 ? o.steps : setup->job.steps;
  torch::Device device = o.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(o.device);
  auto r = executor::TrainLocal(*setup, steps, device,
                                [](int step, double loss) { std::cout << "step " << step << " loss " << loss << std::endl; });
  if (!r.ok()) {
    std::cerr << "meridian train-local: " << r.status().message() << "\n";
    return 1;
  }
  if (auto s = executor::SaveParameters(o.out_dir + "/model.safetensors", r->parameters); !s.ok()) {
    std::cerr << "meridian train-local: " << s.message() << "\n";
    return 1;
  }
  // Make DIR a complete HF model directory: the config and, for text jobs, the tokenizer.
  namespace fs = std::filesystem;
  const std::string model_dir = core::ResolveRelative(o.job_path, setup->job.model);
  std::error_code ec;
  fs::copy_file(model_dir + "/config.json", o.out_dir + "/config.json", fs::copy_options::overwrite_existing, ec);
  if (!ec && setup->tokenizer)
    fs::copy_file(setup->tokenizer_path, o.out_dir + "/tokenizer.model", fs::copy_options::overwrite_existing, ec);
  if (ec) {
    std::cerr << "meridian train-local: writing " << o.out_dir << ": " << ec.message() << "\n";
    return 1;
  }
  return 0;
}

void AddEvalOptions(CLI::App* cmd, EvalOptions* o) {
  cmd->add_option("JOB", o->job_path, "Job spec whose data is JSONL instructions with a held-out split")->required();
  cmd->add_option("--weights", o->weights,
                  "model.safetensors (or a directory holding it); default: the job's initial model");
  cmd->add_option("--max", o->max_examples, "Evaluate at most this many held-out examples (0: all)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--show", o->show, "Print this many examples with the generated answer")->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", o->json_out, "Also write the result as JSON to this file");
  cmd->add_option("--device", o->device, "cpu or cuda:N");
}

int RunEval(const EvalOptions& o) {
  auto setup = executor::LoadJob(o.job_path);
  if (!setup.ok()) {
    std::cerr << "meridian eval: " << setup.status().message() << "\n";
    return 2;
  }
  std::map<std::string, torch::Tensor> params;
  if (!o.weights.empty()) {
    std::string path = o.weights;
    if (std::filesystem::is_directory(path)) path += "/model.safetensors";
    auto w = executor::LoadWeights(path, {});
    if (!w.ok()) {
      std::cerr << "meridian eval: --weights: " << w.status().message() << "\n";
      return 2;
    }
    params = std::move(*w);
  }
  torch::Device device = o.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(o.device);
  auto r = executor::EvaluateExactMatch(*setup, params, device, o.max_examples);
  if (!r.ok()) {
    std::cerr << "meridian eval: " << o.job_path << ": " << r.status().message() << "\n";
    return r.status().code() == absl::StatusCode::kFailedPrecondition ? 2 : 1;
  }
  std::printf("exact match: %d/%d (%.1f%%) on held-out examples\n", r->correct, r->examples, 100 * r->accuracy());
  for (int i = 0; i < std::min<int>(o.show, static_cast<int>(r->samples.size())); ++i) {
    const auto& s = r->samples[i];
    std::printf("  %s %s -> '%s' (expected '%s')\n", s.correct ? "ok  " : "MISS", s.prompt.c_str(),
                s.generated.c_str(), s.expected.c_str());
  }
  if (!o.json_out.empty()) {
    nlohmann::json j = {{"examples", r->examples}, {"correct", r->correct}, {"accuracy", r->accuracy()}};
    for (const auto& s : r->samples)
      j["samples"].push_back({{"prompt", s.prompt}, {"expected", s.expected}, {"generated", s.generated}, {"correct", s.correct}});
    std::ofstream(o.json_out) << j.dump(2) << "\n";
  }
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
  std::printf("wrote %s/tokenizer.model (%d pieces; <unk> 0, <s> 1, </s> 2)\n", o.out_dir.c_str(), (*tok)->vocab_size());
  return 0;
}

}  // namespace meridian::coordinator
