// Trained models out (and back in) as Hugging Face directories, whatever the partition: the stage shards
// of a run are merged by name; under LoRA the adapters are folded into the base model and also written
// in PEFT's layout. Functions are thread-compatible (they read and write files).
#ifndef MERIDIAN_EXECUTOR_EXPORT_H_
#define MERIDIAN_EXECUTOR_EXPORT_H_

#include <torch/torch.h>

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "executor/trainer.h"

namespace meridian::executor {

// PEFT's state-dict key for a Meridian adapter name: "base_model.model." + name, e.g.
// base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight.
std::string PeftKey(const std::string& name);

// The trained parameters of a run: every *.safetensors stage shard of `dir` (RUN/weights), merged by name.
// NotFound when there is none; DataLoss naming the tensor when two shards hold it.
absl::StatusOr<std::map<std::string, torch::Tensor>> LoadStageShards(const std::string& dir);

// Writes `trained` -- the trained parameters of the whole model (TrainResult::parameters, or
// LoadStageShards of a run) -- as the HF model directory `out_dir`: model.safetensors, config.json and,
// for text jobs, tokenizer.model. Under job.lora, model.safetensors is the base model with the adapters
// merged (W + alpha/r * B A) and out_dir/adapter/ holds the adapter in PEFT's layout:
// adapter_config.json + adapter_model.safetensors (keys as PeftKey). Errors name the file.
absl::Status ExportHfModel(const JobSetup& setup, const std::map<std::string, torch::Tensor>& trained,
                           const std::string& out_dir);

// What `meridian eval --weights PATH` evaluates, for `setup`'s job:
// - a model file (model.safetensors or a sharded index) or a directory holding one: the whole model,
//   used as is (job.lora does not apply: exported models are merged);
// - a PEFT adapter (adapter_model.safetensors, or a directory holding it and no model): adapters applied
//   to the job's base model; the job must have job.lora with the same target modules and rank.
// Returns the setup to evaluate with (job.lora switched off for whole models) and the parameters.
absl::StatusOr<std::pair<JobSetup, std::map<std::string, torch::Tensor>>> LoadWeightsForEval(JobSetup setup,
                                                                                             const std::string& path);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_EXPORT_H_
