#include "executor/llama.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/files.h"
#include "core/status.h"

namespace meridian::executor {

absl::Status CheckSlice(const LlamaConfig& c, int first_op, int last_op) {
  if (first_op < 0 || first_op > last_op || last_op >= c.num_ops())
    return absl::InvalidArgumentError(
        absl::StrCat("op range [", first_op, ", ", last_op, "] is outside the model's ", c.num_ops(), " ops"));
  if (c.shape.tie_word_embeddings && last_op == c.num_ops() - 1 && first_op != 0)
    return absl::InvalidArgumentError(
        "with tie_word_embeddings the LM head shares the embedding's weights, so "
        "'embed' and 'head' must run in the same stage");
  return absl::OkStatus();
}

namespace {

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

namespace {
uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// "model.layers.0.self_attn.q_proj.weight" -> "q_proj"; "" for names that are not projections.
std::string ModuleOf(const std::string& weight) {
  const std::string suffix = ".weight";
  if (weight.size() <= suffix.size() || weight.compare(weight.size() - suffix.size(), suffix.size(), suffix) != 0)
    return "";
  std::string stem = weight.substr(0, weight.size() - suffix.size());
  return stem.substr(stem.rfind('.') + 1);
}
std::string AdapterName(const std::string& weight, const char* which) {
  return weight.substr(0, weight.size() - 7) + ".lora_" + which + ".weight";
}
}  // namespace

StageModel::StageModel(const LlamaConfig& c, int first_op, int last_op, uint64_t seed, torch::Device device,
                       const core::LoraSpec& lora)
    : config_(c), first_(first_op), last_(last_op), device_(device), lora_(lora), seed_(seed) {
  MERIDIAN_CHECK(0 <= first_op && first_op <= last_op && last_op < c.num_ops(), "op range out of bounds");
  MERIDIAN_CHECK(CheckSlice(c, first_op, last_op).ok(), "StageModel: invalid slice (call CheckSlice first)");
  MERIDIAN_CHECK(!lora.enabled || lora.r >= 1, "StageModel: LoRA rank must be at least 1");
  for (int op = first_op; op <= last_op; ++op) {
    for (auto& [name, shape] : OpParameters(c, op)) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(seed ^ Fnv1a(name));
      torch::Tensor t;
      if (shape.size() == 1)
        t = torch::ones(shape);
      else
        t = at::normal(0.0, 0.02, shape, gen);
      t = t.to(device).set_requires_grad(!lora.enabled);
      base_.emplace_back(name, t);
      by_name_[name] = t;
      if (!lora.enabled || op == 0 || op == c.num_ops() - 1) continue;
      const std::string module = ModuleOf(name);
      if (std::find(lora.target_modules.begin(), lora.target_modules.end(), module) == lora.target_modules.end())
        continue;
      const int64_t out = shape[0], in = shape[1];
      const std::string a_name = AdapterName(name, "A"), b_name = AdapterName(name, "B");
      auto agen = at::make_generator<at::CPUGeneratorImpl>(seed ^ Fnv1a(a_name));
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      auto a = at::empty({lora.r, in}).uniform_(-bound, bound, agen).to(device).set_requires_grad(true);
      auto b = torch::zeros({out, lora.r}).to(device).set_requires_grad(true);
      trainable_.emplace_back(a_name, a);
      trainable_.emplace_back(b_name, b);
      by_name_[a_name] = a;
      by_name_[b_name] = b;
    }
  }
  if (!lora.enabled) trainable_ = base_;
}

std::unique_ptr<StageModel> StageModel::Copy() const {
  auto c = std::make_unique<StageModel>(*this);
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : c->trainable_) {
    t = t.detach().clone().set_requires_grad(true);
    c->by_name_[name] = t;
  }
  if (!lora_.enabled) c->base_ = c->trainable_;
  return c;
}

void StageModel::CopyWeightsFrom(const StageModel& from) {
  MERIDIAN_CHECK(from.trainable_.size() == trainable_.size(), "CopyWeightsFrom: another slice");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < trainable_.size(); ++i) trainable_[i].second.copy_(from.trainable_[i].second);
}

void StageModel::MoveGradientsInto(StageModel& to) {
  MERIDIAN_CHECK(to.trainable_.size() == trainable_.size(), "MoveGradientsInto: another slice");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < trainable_.size(); ++i) {
    torch::Tensor& g = trainable_[i].second.mutable_grad();
    if (!g.defined()) continue;
    torch::Tensor& into = to.trainable_[i].second.mutable_grad();
    if (into.defined())
      into.add_(g);
    else
      into = g;
    g = torch::Tensor();
  }
}

void StageModel::ClearGradients() {
  for (auto& [name, p] : trainable_) p.mutable_grad() = torch::Tensor();
}

torch::Tensor& StageModel::param(const std::string& name) {
  auto it = by_name_.find(name);
  MERIDIAN_CHECK(it != by_name_.end(), name.c_str());
  return it->second;
}

absl::Status StageModel::LoadInto(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                  const std::map<std::string, torch::Tensor>& tensors) {
  torch::NoGradGuard ng;
  for (const auto& [name, p] : params) {
    auto it = tensors.find(name);
    if (it == tensors.end()) return absl::NotFoundError(absl::StrCat("tensor '", name, "' is missing"));
    if (it->second.sizes() != p.sizes())
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has shape ", c10::str(it->second.sizes()),
                                                     ", the model needs ", c10::str(p.sizes())));
    p.copy_(it->second.to(p.dtype()));
  }
  return absl::OkStatus();
}

absl::Status StageModel::Load(const std::map<std::string, torch::Tensor>& tensors) {
  return LoadInto(trainable_, tensors);
}

absl::Status StageModel::LoadBase(const std::map<std::string, torch::Tensor>& tensors) {
  return LoadInto(base_, tensors);
}

std::map<std::string, torch::Tensor> StageModel::MergedWeights() const {
  torch::NoGradGuard ng;
  std::map<std::string, torch::Tensor> out;
  const double scale = lora_.enabled ? lora_.alpha / lora_.r : 0.0;
  for (const auto& [name, w] : base_) {
    torch::Tensor merged = w.detach().to(torch::kCPU, torch::kFloat32).clone();
    if (lora_.enabled) {
      auto a = by_name_.find(AdapterName(name, "A"));
      if (a != by_name_.end()) {
        const torch::Tensor& b = by_name_.at(AdapterName(name, "B"));
        merged += scale * torch::matmul(b.detach().to(torch::kCPU, torch::kFloat32),
                                        a->second.detach().to(torch::kCPU, torch::kFloat32));
      }
    }
    out[name] = merged;
  }
  return out;
}

torch::Tensor StageModel::Project(const torch::Tensor& x, const std::string& weight, const TrainContext* train) {
  torch::Tensor y = torch::matmul(x, param(weight).t());
  if (!lora_.enabled) return y;
  auto a = by_name_.find(AdapterName(weight, "A"));
  if (a == by_name_.end()) return y;
  torch::Tensor in = x;
  if (train != nullptr && lora_.dropout > 0) {
    // One mask per sequence, from (seed, adapter, step, sequence): the same wherever the sequence runs.
    std::vector<torch::Tensor> masks;
    for (int64_t i = 0; i < x.size(0); ++i) {
      const uint64_t key = SplitMix64(seed_ ^ Fnv1a(a->first) ^
                                      SplitMix64(static_cast<uint64_t>(train->step) * 0x100000001b3ull +
                                                 static_cast<uint64_t>(train->first_sequence + i)));
      auto gen = at::make_generator<at::CPUGeneratorImpl>(key);
      masks.push_back(at::bernoulli(torch::full({x.size(1), x.size(2)}, 1.0 - lora_.dropout), gen));
    }
    in = x * (torch::stack(masks).to(x.device(), x.dtype()) / (1.0 - lora_.dropout));
  }
  const torch::Tensor& b = by_name_.at(AdapterName(weight, "B"));
  return y + torch::matmul(torch::matmul(in, a->second.t()), b.t()) * (lora_.alpha / lora_.r);
}

torch::Tensor StageModel::RmsNorm(const torch::Tensor& x, const torch::Tensor& w) const {
  auto var = x.pow(2).mean(-1, /*keepdim=*/true);
  return w * (x * torch::rsqrt(var + config_.rms_norm_eps));
}

torch::Tensor StageModel::Attention(int layer, const torch::Tensor& x, const TrainContext* train) {
  const std::string pre = absl::StrCat("model.layers.", layer, ".");
  const int64_t b = x.size(0), s = x.size(1);
  const int64_t nh = config_.shape.num_attention_heads, nkv = config_.shape.num_key_value_heads,
                hd = config_.head_dim();
  auto h = RmsNorm(x, param(pre + "input_layernorm.weight"));
  auto q = Project(h, pre + "self_attn.q_proj.weight", train).view({b, s, nh, hd}).transpose(1, 2);
  auto k = Project(h, pre + "self_attn.k_proj.weight", train).view({b, s, nkv, hd}).transpose(1, 2);
  auto v = Project(h, pre + "self_attn.v_proj.weight", train).view({b, s, nkv, hd}).transpose(1, 2);
  // Rotary embeddings as in HF: cos/sin of position * inv_freq, halves rotated.
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device_);
  auto inv_freq = 1.0 / torch::pow(config_.rope_theta, torch::arange(0, hd, 2, opts) / static_cast<double>(hd));
  auto freqs = torch::outer(torch::arange(s, opts), inv_freq);
  auto emb = torch::cat({freqs, freqs}, -1);
  auto cos = emb.cos().to(x.dtype()), sin = emb.sin().to(x.dtype());
  auto rotate = [&](const torch::Tensor& t) {
    auto halves = t.chunk(2, -1);
    return torch::cat({-halves[1], halves[0]}, -1);
  };
  q = q * cos + rotate(q) * sin;
  k = k * cos + rotate(k) * sin;
  if (nkv != nh) {  // grouped-query attention: each key/value head serves nh / nkv query heads
    k = k.repeat_interleave(nh / nkv, 1);
    v = v.repeat_interleave(nh / nkv, 1);
  }
  auto scores = torch::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(hd));
  auto mask = torch::ones({s, s}, torch::TensorOptions().dtype(torch::kBool).device(device_)).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  auto attn = torch::softmax(scores.to(torch::kFloat32), -1).to(q.dtype());
  auto out = torch::matmul(attn, v).transpose(1, 2).reshape({b, s, nh * hd});
  return x + Project(out, pre + "self_attn.o_proj.weight", train);
}

torch::Tensor StageModel::Mlp(int layer, const torch::Tensor& x, const TrainContext* train) {
  const std::string pre = absl::StrCat("model.layers.", layer, ".");
  auto h = RmsNorm(x, param(pre + "post_attention_layernorm.weight"));
  auto gate = Project(h, pre + "mlp.gate_proj.weight", train);
  auto up = Project(h, pre + "mlp.up_proj.weight", train);
  return x + Project(torch::silu(gate) * up, pre + "mlp.down_proj.weight", train);
}

torch::Tensor StageModel::Forward(const torch::Tensor& input, const TrainContext* train) {
  torch::Tensor x = input;
  for (int op = first_; op <= last_; ++op) {
    if (op == 0) {
      x = torch::embedding(param("model.embed_tokens.weight"), x);
    } else if (op == config_.num_ops() - 1) {
      x = RmsNorm(x, param("model.norm.weight"));
      const std::string head = config_.shape.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
      x = torch::matmul(x, param(head).t());
    } else if ((op - 1) % 2 == 0) {
      x = Attention((op - 1) / 2, x, train);
    } else {
      x = Mlp((op - 1) / 2, x, train);
    }
  }
  return x;
}

torch::Tensor CrossEntropySum(const torch::Tensor& logits, const torch::Tensor& targets, double normaliser) {
  auto flat = logits.reshape({-1, logits.size(-1)});
  auto loss = torch::nn::functional::cross_entropy(
      flat, targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
  return loss / normaliser;
}

}  // namespace meridian::executor
