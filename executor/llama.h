// A LLaMA-architecture decoder in libtorch, as a sequence of operators at sub-layer granularity so a
// pipeline may cut anywhere: op 0 "embed"; for layer i, op 1+2i "layerI.attn" (RMSNorm, grouped-query
// attention with rotary embeddings, residual add) and op 2+2i "layerI.mlp" (RMSNorm, SwiGLU, residual
// add); op 2L+1 "head" (final RMSNorm and LM head). Parameters carry Hugging Face's names
// (model.layers.3.self_attn.q_proj.weight, ...), so checkpoints load and export as HF safetensors.
// With LoRA (job.lora) the base weights are frozen and each target projection W gains a trainable
// low-rank update: y = x W^T + scale * dropout(x) A^T B^T, scale = alpha / r, A [r, in], B [out, r]
// (named <projection>.lora_A.weight / .lora_B.weight, PEFT's names without its "base_model.model." prefix).
// A StageModel is thread-compatible.
#ifndef MERIDIAN_EXECUTOR_LLAMA_H_
#define MERIDIAN_EXECUTOR_LLAMA_H_

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/cluster_spec.h"
#include "job/job.h"
#include "partitioner/model.h"

namespace meridian::executor {

// The model's config.json (job/job.h reads and checks it without torch).
using job::LlamaConfig;
using job::LoadLlamaConfig;
using job::ParseLlamaConfigText;

using job::OpName;
using job::OpParameters;

// OK when [first_op, last_op] is a slice a StageModel can hold; else InvalidArgument saying why.
absl::Status CheckSlice(const LlamaConfig& c, int first_op, int last_op);

// Which training micro-batch a forward pass computes: keys LoRA dropout masks, so they are the same in
// every process and partition (sequence first_sequence + i of step `step` gets the same mask wherever it
// runs).
struct TrainContext {
  int64_t step = 0;
  int64_t first_sequence = 0;  // index within the step of the micro-batch's first sequence
};

// The slice [first_op, last_op] of the model.
class StageModel {
 public:
  // Parameters are initialised deterministically from (seed, parameter name) -- the same values whatever
  // the partition: normal(0, 0.02) for matrices and embeddings, ones for RMSNorm weights; LoRA A as
  // PEFT (uniform(-1/sqrt(in), 1/sqrt(in))), LoRA B zeros, so training starts from the base model.
  // `lora` (when enabled) adds adapters to its target_modules and freezes every base weight.
  // REQUIRES: CheckSlice(c, first_op, last_op).ok(); lora.r >= 1 when enabled.
  StageModel(const LlamaConfig& c, int first_op, int last_op, uint64_t seed, torch::Device device,
             const core::LoraSpec& lora = {});

  // input: token ids [b, s] (int64) when the slice starts at embed, else hidden states [b, s, d].
  // Returns hidden states, or logits [b, s, vocab] when the slice ends with the head. `train` (a
  // training micro-batch) enables LoRA dropout; without it the pass is deterministic (evaluation).
  torch::Tensor Forward(const torch::Tensor& input, const TrainContext* train = nullptr);

  int first_op() const { return first_; }
  int last_op() const { return last_; }
  bool has_embed() const { return first_ == 0; }
  bool has_head() const { return last_ == config_.num_ops() - 1; }
  bool lora() const { return lora_.enabled; }
  // The trained parameters (requires_grad), name -> tensor in a fixed order: every base weight, or only
  // the LoRA adapters when LoRA is on. These are what the optimizer steps, checkpoints hold, replicas
  // average and a run's weights directory receives. May be empty (a LoRA slice without target modules).
  const std::vector<std::pair<std::string, torch::Tensor>>& parameters() const { return trainable_; }
  // The base (HF) weights of the slice, frozen under LoRA; the same list as parameters() otherwise.
  const std::vector<std::pair<std::string, torch::Tensor>>& base_parameters() const { return base_; }
  torch::Tensor& param(const std::string& name);
  // Loads the trained parameters (parameters()) from tensors by name (e.g. a checkpoint); other entries
  // are ignored. Errors name the missing or mis-shaped tensor.
  absl::Status Load(const std::map<std::string, torch::Tensor>& tensors);
  // Loads the base weights (base_parameters()) by HF name, e.g. from a model directory's safetensors.
  absl::Status LoadBase(const std::map<std::string, torch::Tensor>& tensors);
  // The base weights by HF name with every LoRA update folded in (W + scale * B A): the model to export.
  // Without LoRA, a copy of the weights. Tensors are on the CPU.
  std::map<std::string, torch::Tensor> MergedWeights() const;

  // job.step_overlap's second set of weights. Copy: a model of the same slice whose trained parameters
  // are copies of these (no gradients); under LoRA the frozen base weights are shared, not copied
  // (nothing writes them while training). CopyWeightsFrom: sets the trained parameters to `from`'s (a
  // Copy of this model or its original), recording no gradient; no autograd graph may still use them.
  // MoveGradientsInto: adds this model's gradients into `to`'s (the same slice) and clears them here.
  std::unique_ptr<StageModel> Copy() const;
  void CopyWeightsFrom(const StageModel& from);
  void MoveGradientsInto(StageModel& to);
  // Drops every trained parameter's gradient (undefined, so the next backward pass allocates it afresh
  // rather than adding into it): the start of a step, or a pass whose gradients are not wanted.
  void ClearGradients();

 private:
  torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w) const;
  torch::Tensor Attention(int layer, const torch::Tensor& x, const TrainContext* train);
  torch::Tensor Mlp(int layer, const torch::Tensor& x, const TrainContext* train);
  // x W^T for the projection `weight` (an HF weight name), plus its LoRA update when it has one.
  torch::Tensor Project(const torch::Tensor& x, const std::string& weight, const TrainContext* train);
  absl::Status LoadInto(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                        const std::map<std::string, torch::Tensor>& tensors);

  LlamaConfig config_;
  int first_, last_;
  torch::Device device_;
  core::LoraSpec lora_;
  uint64_t seed_;
  std::vector<std::pair<std::string, torch::Tensor>> base_, trainable_;
  std::map<std::string, torch::Tensor> by_name_;  // base and adapters; tensors share storage with the lists
};

// Mean cross-entropy of logits [b, s, V] against targets [b, s] (-100 = ignored), summed and divided by
// `normaliser` (the number of counted targets in the whole step), so micro-batch losses add up to the
// step's mean loss.
torch::Tensor CrossEntropySum(const torch::Tensor& logits, const torch::Tensor& targets, double normaliser);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_LLAMA_H_
