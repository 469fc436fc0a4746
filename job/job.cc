#include "job/job.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/files.h"

namespace meridian::job {

absl::StatusOr<LlamaConfig> ParseLlamaConfigText(const std::string& text, const std::string& path) {
  auto shape = partitioner::ParseLlamaConfig(text, path);
  if (!shape.ok()) return shape.status();
  LlamaConfig c;
  c.shape = *shape;
  auto j = nlohmann::json::parse(text, nullptr, false);
  for (auto [key, out] : {std::pair<const char*, double*>{"rms_norm_eps", &c.rms_norm_eps},
                          std::pair<const char*, double*>{"rope_theta", &c.rope_theta}}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    if (!j[key].is_number() || j[key].get<double>() <= 0)
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, ": expected a positive number"));
    *out = j[key].get<double>();
  }
  if (c.head_dim() % 2) return absl::InvalidArgumentError(absl::StrCat(path, ": head dimension must be even (rotary)"));
  return c;
}

absl::StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path) {
  auto text = core::ReadFile(path);
  if (!text.ok()) return text.status();
  return ParseLlamaConfigText(*text, path);
}

std::string FindWeightsFile(const std::string& dir, bool adapters) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const char* name : {"model.safetensors.index.json", "model.safetensors", "adapter_model.safetensors",
                           "adapter/adapter_model.safetensors"}) {
    if (!adapters && std::string(name).find("adapter") != std::string::npos) break;
    if (fs::exists(fs::path(dir) / name, ec)) return (fs::path(dir) / name).string();
  }
  return "";
}

partitioner::LlamaGraphOptions ProfiledGraphOptions(int micro_batch_size, int sequence_length, bool lora) {
  partitioner::LlamaGraphOptions go;
  go.micro_batch_size = micro_batch_size;
  go.sequence_length = sequence_length;
  go.weight_bytes = 4;
  go.gradient_bytes = 4;
  go.optimizer_bytes = 8;
  if (lora) go.gradient_bytes = go.optimizer_bytes = 0;  // adapters are negligible
  go.activation_bytes = 4;
  return go;
}

absl::StatusOr<JobInputs> PrepareJobInputs(const core::JobSpec& job, const std::string& job_path) {
  JobInputs s;
  s.job = job;
  s.job_path = job_path;
  s.model_dir = core::ResolveRelative(job_path, job.model);
  auto cfg = LoadLlamaConfig(s.model_dir + "/config.json");
  if (!cfg.ok()) return absl::InvalidArgumentError(absl::StrCat(job_path, ": job.model: ", cfg.status().message()));
  s.model = *cfg;
  s.micro_batches = job.micro_batches > 0 ? job.micro_batches : std::min(job.global_batch, 4);
  if (job.global_batch % s.micro_batches != 0)
    return absl::InvalidArgumentError(absl::StrCat(job_path, ": job.micro_batches ", s.micro_batches,
                                                   " does not divide job.global_batch ", job.global_batch));
  s.micro_batch_size = job.global_batch / s.micro_batches;
  s.weights = FindWeightsFile(s.model_dir);
  if (job.data.empty() || job.data == "synthetic") return s;
  const std::string tok_path =
      job.tokenizer.empty() ? s.model_dir + "/tokenizer.model" : core::ResolveRelative(job_path, job.tokenizer);
  auto tok = data::Tokenizer::Load(tok_path);
  if (!tok.ok()) return absl::InvalidArgumentError(absl::StrCat(job_path, ": job.tokenizer: ", tok.status().message()));
  if ((*tok)->vocab_size() > s.model.shape.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat(job_path, ": job.tokenizer: ", tok_path, " has ",
                                                   (*tok)->vocab_size(), " pieces but the model's vocab_size is ",
                                                   s.model.shape.vocab_size));
  const std::string data_path = core::ResolveRelative(job_path, job.data);
  auto dataset =
      data::Dataset::Build(data_path, **tok, data::DatasetOptions{job.sequence_length, job.seed, job.eval_fraction});
  if (!dataset.ok())
    return absl::InvalidArgumentError(absl::StrCat(job_path, ": job.data: ", dataset.status().message()));
  s.tokenizer = std::shared_ptr<const data::Tokenizer>(std::move(*tok));
  s.tokenizer_path = tok_path;
  s.dataset = std::shared_ptr<const data::Dataset>(std::move(*dataset));
  return s;
}

absl::StatusOr<JobInputs> LoadJobInputs(const std::string& job_path) {
  auto spec = core::LoadSpecFile(job_path);
  if (!spec.errors.empty()) {
    std::string all;
    for (const auto& d : spec.errors) all += (all.empty() ? "" : "\n") + d.ToString();
    return absl::InvalidArgumentError(all);
  }
  if (!spec.spec->job) return absl::InvalidArgumentError(absl::StrCat(job_path, ": has no 'job' section"));
  return PrepareJobInputs(*spec.spec->job, job_path);
}

}  // namespace meridian::job
