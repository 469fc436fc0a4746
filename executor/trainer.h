// Training: the single-process reference trainer and one pipeline stage of a distributed run.
// Both do exactly the same arithmetic (same initialisation, data, micro-batch order, loss scaling,
// global-norm clipping and AdamW), so with the identity codec a distributed run reproduces the
// reference to floating-point reordering. Confined to the calling thread (see docs/executor.md).
#ifndef MERIDIAN_EXECUTOR_TRAINER_H_
#define MERIDIAN_EXECUTOR_TRAINER_H_

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/cluster_spec.h"
#include "data/data.h"
#include "executor/llama.h"

namespace meridian::executor {

// Deterministic synthetic language data: token sequences from a fixed random transition table
// (each token is followed by its successor with probability 0.9), so a model can learn it.
// Micro-batch (step, m) is the same in every process.
struct SyntheticData {
  uint64_t seed;
  int vocab;
  // tokens [micro_batch_size, seq_len + 1] (int64): inputs are [:, :-1], targets [:, 1:].
  torch::Tensor MicroBatch(int64_t step, int micro_batch, int micro_batch_size, int seq_len) const;
};

// The training data of a job: Meridian's synthetic language (job.data "synthetic" or empty) or a
// tokenised data::Dataset (JSONL instructions or plain text). Micro-batch (step, m) is the same in every
// process; with a Dataset it is also independent of the number of micro-batches (sequence
// step * global_batch + m * micro_batch_size + b). Thread-safe.
class TrainingData {
 public:
  TrainingData() = default;
  explicit TrainingData(SyntheticData synthetic) : synthetic_(synthetic) {}
  // `global_batch`: sequences per optimizer step.
  TrainingData(std::shared_ptr<const data::Dataset> dataset, int global_batch)
      : dataset_(std::move(dataset)), global_batch_(global_batch) {}

  struct Batch {
    torch::Tensor inputs;   // [micro_batch_size, seq_len] int64
    torch::Tensor targets;  // [micro_batch_size, seq_len] int64; -100 where the target does not count
  };
  Batch MicroBatch(int64_t step, int micro_batch, int micro_batch_size, int seq_len) const;
  // The number of counted targets in the whole step: the loss normaliser, so the step's loss is the mean
  // over its counted targets whatever the micro-batching.
  double StepTargets(int64_t step, int micro_batches, int micro_batch_size, int seq_len) const;
  // The training sequence of each row of micro-batch (step, micro_batch): a Dataset's packed sequence
  // number, the same in every epoch; synthetic data never repeats, so its rows get numbers of their own.
  std::vector<int64_t> SequenceIds(int64_t step, int micro_batch, int micro_batch_size) const;
  const data::Dataset* dataset() const { return dataset_.get(); }

 private:
  SyntheticData synthetic_{0, 1};
  std::shared_ptr<const data::Dataset> dataset_;
  int64_t global_batch_ = 0;
};

// Learning rate at `step` (0-based): linear warm-up over warmup_steps, then cosine decay to
// lr * min_lr_ratio at `total_steps`.
double LearningRate(const core::OptimizerSpec& o, int64_t step, int64_t total_steps);

// AdamW as torch.optim.AdamW (decoupled weight decay), applied to 2-D weights only; 1-D (norm) weights
// get no decay. Thread-compatible.
class AdamW {
 public:
  explicit AdamW(core::OptimizerSpec spec) : spec_(spec) {}
  void Step(const std::vector<std::pair<std::string, torch::Tensor>>& params, double lr);
  int64_t steps() const { return t_; }
  // State for checkpoints: "optim.m.<param>", "optim.v.<param>" tensors and the step count.
  std::map<std::string, torch::Tensor> ExportState() const;
  // Restores, for each of `params`, the moments "optim.m.<name>" and "optim.v.<name>" of `state` (other
  // entries are ignored; a parameter missing either moment starts from zero) onto `device`, and the step
  // count. A moment whose shape or dtype differs from its parameter's is DataLoss naming both, and nothing
  // is restored then.
  absl::Status ImportState(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                           const std::map<std::string, torch::Tensor>& state, int64_t steps, torch::Device device);

 private:
  core::OptimizerSpec spec_;
  int64_t t_ = 0;
  std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> state_;
};

// Sum of squared gradient elements of `params`, accumulated in double in parameter order.
double GradSquareSum(const std::vector<std::pair<std::string, torch::Tensor>>& params);
// Scales gradients so their global norm is at most `clip` (0: no clipping); returns the norm.
double ClipByGlobalNorm(const std::vector<std::pair<std::string, torch::Tensor>>& params, double total_square,
                        double clip);

struct JobSetup {
  LlamaConfig model;
  std::string model_dir;  // the job's model directory (config.json, weights, tokenizer.model)
  core::JobSpec job;
  TrainingData data;
  // The tokenizer when the job trains on text (null for synthetic data).
  std::shared_ptr<const data::Tokenizer> tokenizer;
  std::string tokenizer_path;  // where `tokenizer` was read from
  // The model directory's weights (model.safetensors or model.safetensors.index.json) when it has them:
  // training starts from them instead of the seeded initialisation.
  std::string weights;
  int micro_batch_size = 1;
  int micro_batches = 1;
};

// Validates a job for training (job::PrepareJobInputs: model config readable, micro-batches dividing the
// batch, the data and tokenizer readable and the tokenizer's vocabulary within the model's) and builds its
// training data. Errors name the file and field.
absl::StatusOr<JobSetup> PrepareJob(const core::JobSpec& job, const std::string& job_path);

using job::FindWeightsFile;

// Reads a YAML file with a 'job' section and prepares it (PrepareJob). Errors carry the file's
// located diagnostics (FILE:LINE:COL: error: ...) or name the missing section.
absl::StatusOr<JobSetup> LoadJob(const std::string& job_path);

struct TrainResult {
  std::vector<double> losses;  // mean loss of each step
  // The trained parameters (StageModel::parameters()): every weight, or the LoRA adapters.
  std::map<std::string, torch::Tensor> parameters;
};

// job.step_overlap: how many of step `step`'s first micro-batches run on the weights of step - 1 (their
// passes begin before that step's optimizer step; docs/executor.md, "Step overlap"). 0, an exact step: the
// first step, a step after one that writes a checkpoint (job.checkpoint.interval) or ends with a DiLoCo
// synchronisation (job.sync), a step past the run; otherwise job.step_overlap. Every stage of a run and
// TrainLocal compute it alike.
int EarlyMicroBatches(const core::JobSpec& job, int64_t step, int64_t total_steps);

// The reference: trains the whole model in this process for `steps` steps. The learning-rate schedule
// always spans job.steps, so a shorter run is a prefix of the full one (and resumable). With
// job.step_overlap each step's early micro-batches (EarlyMicroBatches) run on a copy of the previous step's
// weights, as a pipeline runs them.
absl::StatusOr<TrainResult> TrainLocal(const JobSetup& setup, int steps, torch::Device device,
                                       const std::function<void(int, double)>& on_step = nullptr);

// Builds the slice [first_op, last_op] of the job's model: seeded initialisation, then the model
// directory's weights when it has them (only the tensors of the slice are read); with job.lora, adapters
// on the target modules and frozen base weights.
absl::StatusOr<std::unique_ptr<StageModel>> BuildStageModel(const JobSetup& setup, int first_op, int last_op,
                                                            torch::Device device);

// Reads the tensors `names` (all when empty) of an HF weights file: model.safetensors, or the sharded
// model.safetensors.index.json (only the shards holding `names` are read). Converted to float32.
absl::StatusOr<std::map<std::string, torch::Tensor>> LoadWeights(const std::string& path,
                                                                 const std::vector<std::string>& names);

// Writes parameters as an HF-style safetensors file (float32).
absl::Status SaveParameters(const std::string& path, const std::map<std::string, torch::Tensor>& params);
absl::StatusOr<std::map<std::string, torch::Tensor>> LoadParameters(const std::string& path);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_TRAINER_H_
