// A job's inputs resolved and checked without torch: the model's config.json, its weights file, the
// tokenizer and the training data, each against the others (micro-batches dividing the batch, the
// tokenizer's vocabulary within the model's). The one place a job is validated: the coordinator checks a
// job with it before any site joins, and the executors build their model and data from what it returns
// (executor::PrepareJob). Errors name the job file and the field. Functions are thread-safe; a JobInputs
// is immutable once built and may be shared.
#ifndef MERIDIAN_JOB_JOB_H_
#define MERIDIAN_JOB_JOB_H_

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/cluster_spec.h"
#include "data/data.h"
#include "partitioner/model.h"

namespace meridian::job {

// An HF LLaMA config.json: the shape the partitioner plans with, and what the forward pass needs besides.
struct LlamaConfig {
  partitioner::LlamaShape shape;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  int head_dim() const { return shape.hidden_size / shape.num_attention_heads; }
  int num_ops() const { return 2 * shape.num_hidden_layers + 2; }
};

// The partitioner's name of op `op` (partitioner::BuildLlamaGraph's spelling): "embed", "layerL.attn",
// "layerL.mlp", "head".
std::string OpName(const LlamaConfig& c, int op);

// HF names and shapes of the parameters of op `op`.
std::vector<std::pair<std::string, std::vector<int64_t>>> OpParameters(const LlamaConfig& c, int op);

// The op (OpName) a checkpoint tensor belongs to: a parameter of OpParameters, its LoRA adapters
// (".lora_A.weight", ".lora_B.weight"), its AdamW moments ("optim.m.", "optim.v.") or its DiLoCo outer state
// ("outer.param.", "outer.momentum."); nullopt for a name
// of none. Lets the coordinator tell which checkpoint shards a stage's op range needs without torch.
std::optional<std::string> OpNameOfTensor(const std::string& tensor);

// Reads an HF config.json (partitioner::ParseLlamaConfig for the shape). Errors name the file and field.
absl::StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path);
absl::StatusOr<LlamaConfig> ParseLlamaConfigText(const std::string& text, const std::string& path);

// The weights file of an HF model directory: model.safetensors.index.json (sharded) before
// model.safetensors; with `adapters`, then a PEFT adapter_model.safetensors in `dir` or `dir`/adapter.
// Empty when there is none.
std::string FindWeightsFile(const std::string& dir, bool adapters = false);

// How the executors' profiler costs the model per op (fp32 weights, gradients and activations, Adam's two
// fp32 moments; under LoRA the frozen base has no gradients or moments), for `micro_batch_size` sequences
// of `sequence_length` tokens. The coordinator builds the run's graph with the same options.
partitioner::LlamaGraphOptions ProfiledGraphOptions(int micro_batch_size, int sequence_length, bool lora);

struct JobInputs {
  core::JobSpec job;
  std::string job_path;   // the YAML file the job came from (relative paths in it resolve against it)
  std::string model_dir;  // the job's model directory (config.json, weights, tokenizer.model)
  LlamaConfig model;
  // The model directory's weights (FindWeightsFile) when it has them: training starts from them instead
  // of the seeded initialisation. Empty otherwise.
  std::string weights;
  int micro_batches = 1;     // per optimizer step: job.micro_batches, or min(global_batch, 4)
  int micro_batch_size = 1;  // sequences per micro-batch: global_batch / micro_batches
  // Text jobs: the tokenizer and the packed data set; both null for synthetic data.
  std::shared_ptr<const data::Tokenizer> tokenizer;
  std::string tokenizer_path;
  std::shared_ptr<const data::Dataset> dataset;
};

// Resolves and checks `job`, read from `job_path`.
absl::StatusOr<JobInputs> PrepareJobInputs(const core::JobSpec& job, const std::string& job_path);

// Reads a YAML file with a 'job' section and prepares it. Errors carry the file's located diagnostics
// (FILE:LINE:COL: error: ...) or name the missing section.
absl::StatusOr<JobInputs> LoadJobInputs(const std::string& job_path);

}  // namespace meridian::job

#endif  // MERIDIAN_JOB_JOB_H_
