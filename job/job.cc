#include "job/job.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
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
  s.micro_batches = core::MicroBatchesOf(job);
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

std::string OpName(const LlamaConfig& c, int op) {
  if (op == 0) return "embed";
  if (op == c.num_ops() - 1) return "head";
  return absl::StrCat("layer", (op - 1) / 2, (op - 1) % 2 == 0 ? ".attn" : ".mlp");
}

std::vector<std::pair<std::string, std::vector<int64_t>>> OpParameters(const LlamaConfig& c, int op) {
  const int64_t d = c.shape.hidden_size, h = c.shape.intermediate_size, v = c.shape.vocab_size;
  const int64_t kv = static_cast<int64_t>(c.head_dim()) * c.shape.num_key_value_heads;
  if (op == 0) return {{"model.embed_tokens.weight", {v, d}}};
  if (op == c.num_ops() - 1) {
    std::vector<std::pair<std::string, std::vector<int64_t>>> p = {{"model.norm.weight", {d}}};
    if (!c.shape.tie_word_embeddings) p.push_back({"lm_head.weight", {v, d}});
    return p;
  }
  const int layer = (op - 1) / 2;
  const std::string pre = absl::StrCat("model.layers.", layer, ".");
  if ((op - 1) % 2 == 0)
    return {{pre + "input_layernorm.weight", {d}},
            {pre + "self_attn.q_proj.weight", {d, d}},
            {pre + "self_attn.k_proj.weight", {kv, d}},
            {pre + "self_attn.v_proj.weight", {kv, d}},
            {pre + "self_attn.o_proj.weight", {d, d}}};
  return {{pre + "post_attention_layernorm.weight", {d}},
          {pre + "mlp.gate_proj.weight", {h, d}},
          {pre + "mlp.up_proj.weight", {h, d}},
          {pre + "mlp.down_proj.weight", {d, h}}};
}

std::optional<std::string> OpNameOfTensor(const std::string& tensor_name) {
  absl::string_view tensor = tensor_name;
  for (absl::string_view prefix : {"optim.m.", "optim.v.", "outer.param.", "outer.momentum."})
    if (absl::ConsumePrefix(&tensor, prefix)) break;
  std::string name(tensor);
  for (const char* lora : {".lora_A.weight", ".lora_B.weight"})
    if (absl::EndsWith(name, lora)) name = absl::StrCat(name.substr(0, name.size() - std::strlen(lora)), ".weight");
  if (name == "model.embed_tokens.weight") return "embed";
  if (name == "model.norm.weight" || name == "lm_head.weight") return "head";
  absl::string_view rest = name;
  if (!absl::ConsumePrefix(&rest, "model.layers.")) return std::nullopt;
  const size_t dot = rest.find('.');
  int layer = 0;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(0, dot), &layer) || layer < 0 ||
      rest.substr(0, dot) != absl::StrCat(layer))
    return std::nullopt;
  rest.remove_prefix(dot + 1);
  if (rest == "input_layernorm.weight" || absl::StartsWith(rest, "self_attn."))
    return absl::StrCat("layer", layer, ".attn");
  if (rest == "post_attention_layernorm.weight" || absl::StartsWith(rest, "mlp."))
    return absl::StrCat("layer", layer, ".mlp");
  return std::nullopt;
}

}  // namespace meridian::job
