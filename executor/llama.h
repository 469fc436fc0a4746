// A LLaMA-architecture decoder in libtorch, as a sequence of operators at sub-layer granularity so a
// pipeline may cut anywhere: op 0 "embed"; for layer i, op 1+2i "layerI.attn" (RMSNorm, grouped-query
// attention with rotary embeddings, residual add) and op 2+2i "layerI.mlp" (RMSNorm, SwiGLU, residual
// add); op 2L+1 "head" (final RMSNorm and LM head). Parameters carry Hugging Face's names
// (model.layers.3.self_attn.q_proj.weight, ...), so checkpoints load and export as HF safetensors.
// A StageModel is thread-compatible.
#ifndef MERIDIAN_EXECUTOR_LLAMA_H_
#define MERIDIAN_EXECUTOR_LLAMA_H_

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "partitioner/model.h"

namespace meridian::executor {

struct LlamaConfig {
  partitioner::LlamaShape shape;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  int head_dim() const { return shape.hidden_size / shape.num_attention_heads; }
  int num_ops() const { return 2 * shape.num_hidden_layers + 2; }
};

// Reads an HF config.json. Errors name the file and field.
absl::StatusOr<LlamaConfig> LoadLlamaConfig(const std::string& path);
absl::StatusOr<LlamaConfig> ParseLlamaConfigText(const std::string& text, const std::string& path);

std::string OpName(const LlamaConfig& c, int op);

// HF names and shapes of the parameters of op `op`.
std::vector<std::pair<std::string, std::vector<int64_t>>> OpParameters(const LlamaConfig& c, int op);

// OK when [first_op, last_op] is a slice a StageModel can hold; else InvalidArgument saying why.
absl::Status CheckSlice(const LlamaConfig& c, int first_op, int last_op);

// The slice [first_op, last_op] of the model.
class StageModel {
 public:
  // Parameters are initialised deterministically from (seed, parameter name) -- the same values whatever
  // the partition: normal(0, 0.02) for matrices and embeddings, ones for RMSNorm weights.
  // REQUIRES: CheckSlice(c, first_op, last_op).ok().
  StageModel(const LlamaConfig& c, int first_op, int last_op, uint64_t seed, torch::Device device);

  // input: token ids [b, s] (int64) when the slice starts at embed, else hidden states [b, s, d].
  // Returns hidden states, or logits [b, s, vocab] when the slice ends with the head.
  torch::Tensor Forward(const torch::Tensor& input);

  int first_op() const { return first_; }
  int last_op() const { return last_; }
  bool has_embed() const { return first_ == 0; }
  bool has_head() const { return last_ == config_.num_ops() - 1; }
  // Name -> parameter (requires_grad), in a fixed order.
  const std::vector<std::pair<std::string, torch::Tensor>>& parameters() const { return params_; }
  torch::Tensor& param(const std::string& name);
  // Loads the slice's parameters from tensors by HF name (e.g. a safetensors file). Errors name the
  // missing or mis-shaped tensor.
  absl::Status Load(const std::map<std::string, torch::Tensor>& tensors);

 private:
  torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w) const;
  torch::Tensor Attention(int layer, const torch::Tensor& x);
  torch::Tensor Mlp(int layer, const torch::Tensor& x);

  LlamaConfig config_;
  int first_, last_;
  torch::Device device_;
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  std::map<std::string, size_t> index_;
};

// Mean cross-entropy of logits [b, s, V] against targets [b, s] (-100 = ignored), summed and divided by
// `normaliser` (the number of counted targets in the whole step), so micro-batch losses add up to the
// step's mean loss.
torch::Tensor CrossEntropySum(const torch::Tensor& logits, const torch::Tensor& targets, double normaliser);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_LLAMA_H_
