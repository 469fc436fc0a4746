#include "executor/trainer.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "nlohmann/json.hpp"

#include "absl/strings/str_cat.h"
#include "core/files.h"
#include "core/safetensors.h"
#include "executor/torch_boundary.h"
#include "partitioner/schedule.h"

namespace meridian::executor {

torch::Tensor SyntheticData::MicroBatch(int64_t step, int micro_batch, int micro_batch_size, int seq_len) const {
  // The transition table depends on the seed only; the sequences on (seed, step, micro-batch).
  auto table_gen = at::make_generator<at::CPUGeneratorImpl>(seed * 7919 + 17);
  auto successor = torch::randperm(vocab, table_gen, torch::kInt64);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      seed ^ (static_cast<uint64_t>(step) * 1000003ull + static_cast<uint64_t>(micro_batch) * 7919ull + 1));
  auto tokens = torch::empty({micro_batch_size, seq_len + 1}, torch::kInt64);
  auto starts = torch::randint(vocab, {micro_batch_size}, gen, torch::kInt64);
  auto noise = torch::rand({micro_batch_size, seq_len + 1}, gen);
  auto randoms = torch::randint(vocab, {micro_batch_size, seq_len + 1}, gen, torch::kInt64);
  auto s = successor.accessor<int64_t, 1>();
  auto t = tokens.accessor<int64_t, 2>();
  auto nz = noise.accessor<float, 2>();
  auto rr = randoms.accessor<int64_t, 2>();
  for (int b = 0; b < micro_batch_size; ++b) {
    t[b][0] = starts[b].item<int64_t>();
    for (int i = 1; i <= seq_len; ++i) t[b][i] = nz[b][i] < 0.9f ? s[t[b][i - 1]] : rr[b][i];
  }
  return tokens;
}

TrainingData::Batch TrainingData::MicroBatch(int64_t step, int micro_batch, int mbs, int seq) const {
  if (!dataset_) {
    auto tokens = synthetic_.MicroBatch(step, micro_batch, mbs, seq);
    return {tokens.slice(1, 0, seq), tokens.slice(1, 1, seq + 1)};
  }
  auto tokens = torch::empty({mbs, seq + 1}, torch::kInt32);
  auto counted = torch::empty({mbs, seq}, torch::kUInt8);
  for (int b = 0; b < mbs; ++b) {
    // Sequence index independent of how the step is split into micro-batches.
    const int64_t index = step * global_batch_ + static_cast<int64_t>(micro_batch) * mbs + b;
    dataset_->Sequence(index, tokens[b].data_ptr<int32_t>(), counted[b].data_ptr<uint8_t>());
  }
  auto t64 = tokens.to(torch::kInt64);
  auto targets = t64.slice(1, 1, seq + 1).clone();
  targets.masked_fill_(counted.eq(0), -100);
  return {t64.slice(1, 0, seq).contiguous(), targets};
}

std::vector<int64_t> TrainingData::SequenceIds(int64_t step, int micro_batch, int mbs) const {
  std::vector<int64_t> ids(static_cast<size_t>(mbs));
  // Synthetic micro-batches are drawn per (step, micro-batch): numbered as if a step held up to 2^20 rows.
  const int64_t first = dataset_ ? step * global_batch_ + static_cast<int64_t>(micro_batch) * mbs
                                 : (step << 20) + static_cast<int64_t>(micro_batch) * mbs;
  for (int b = 0; b < mbs; ++b) ids[b] = dataset_ ? dataset_->SequenceId(first + b) : first + b;
  return ids;
}

double TrainingData::StepTargets(int64_t step, int micro_batches, int mbs, int seq) const {
  if (!dataset_) return static_cast<double>(micro_batches) * mbs * seq;
  std::vector<int32_t> tokens(seq + 1);
  std::vector<uint8_t> counted(seq);
  int64_t n = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(micro_batches) * mbs; ++i) {
    dataset_->Sequence(step * global_batch_ + i, tokens.data(), counted.data());
    for (uint8_t c : counted) n += c;
  }
  return static_cast<double>(std::max<int64_t>(n, 1));  // a step without counted targets has loss 0
}

double LearningRate(const core::OptimizerSpec& o, int64_t step, int64_t total_steps) {
  if (o.warmup_steps > 0 && step < o.warmup_steps) return o.lr * static_cast<double>(step + 1) / o.warmup_steps;
  const int64_t decay = std::max<int64_t>(1, total_steps - o.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup_steps) / static_cast<double>(decay));
  const double cosine = 0.5 * (1 + std::cos(M_PI * progress));
  return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * cosine);
}

void AdamW::Step(const std::vector<std::pair<std::string, torch::Tensor>>& params, double lr) {
  torch::NoGradGuard ng;
  ++t_;
  const double bc1 = 1 - std::pow(spec_.beta1, static_cast<double>(t_));
  const double bc2 = 1 - std::pow(spec_.beta2, static_cast<double>(t_));
  for (const auto& [name, p] : params) {
    if (!p.grad().defined()) continue;
    const auto& g = p.grad();
    auto& [m, v] = state_[name];
    if (!m.defined()) {
      m = torch::zeros_like(p);
      v = torch::zeros_like(p);
    }
    if (spec_.name == "sgd") {
      p.add_(g, -lr);
      continue;
    }
    if (p.dim() >= 2 && spec_.weight_decay > 0) p.mul_(1 - lr * spec_.weight_decay);
    m.mul_(spec_.beta1).add_(g, 1 - spec_.beta1);
    v.mul_(spec_.beta2).addcmul_(g, g, 1 - spec_.beta2);
    auto denom = (v / bc2).sqrt_().add_(spec_.eps);
    p.addcdiv_(m, denom, -lr / bc1);
  }
}

std::map<std::string, torch::Tensor> AdamW::ExportState() const {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, mv] : state_) {
    out["optim.m." + name] = mv.first.detach().cpu();
    out["optim.v." + name] = mv.second.detach().cpu();
  }
  return out;
}

absl::Status AdamW::ImportState(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                const std::map<std::string, torch::Tensor>& state, int64_t steps,
                                torch::Device device) {
  std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> restored;
  for (const auto& [name, p] : params) {
    torch::Tensor moments[2];
    for (int i = 0; i < 2; ++i) {
      const std::string key = (i == 0 ? "optim.m." : "optim.v.") + name;
      auto it = state.find(key);
      if (it == state.end()) continue;
      // A moment must match its parameter: a wrong shape would broadcast silently or fail mid-step.
      if (it->second.sizes() != p.sizes() || it->second.scalar_type() != p.scalar_type())
        return absl::DataLossError(absl::StrCat(key, " has shape ", c10::str(it->second.sizes()), " ",
                                                c10::toString(it->second.scalar_type()), " but parameter ", name,
                                                " has ", c10::str(p.sizes()), " ", c10::toString(p.scalar_type())));
      moments[i] = it->second.to(device).clone();
    }
    if (moments[0].defined() && moments[1].defined()) restored[name] = {moments[0], moments[1]};  // both or neither
  }
  state_ = std::move(restored);
  t_ = steps;
  return absl::OkStatus();
}

double GradSquareSum(const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  double s = 0;
  for (const auto& [name, p] : params)
    if (p.grad().defined()) s += p.grad().to(torch::kFloat64).pow(2).sum().item<double>();
  return s;
}

double ClipByGlobalNorm(const std::vector<std::pair<std::string, torch::Tensor>>& params, double total_square,
                        double clip) {
  const double norm = std::sqrt(total_square);
  if (clip > 0 && norm > clip) {
    torch::NoGradGuard ng;
    const double scale = clip / (norm + 1e-6);
    for (const auto& [name, p] : params)
      if (p.grad().defined()) p.grad().mul_(scale);
  }
  return norm;
}

namespace {

JobSetup SetupOf(const job::JobInputs& in) {
  JobSetup s;
  s.job = in.job;
  s.model = in.model;
  s.model_dir = in.model_dir;
  s.weights = in.weights;
  s.micro_batches = in.micro_batches;
  s.micro_batch_size = in.micro_batch_size;
  s.tokenizer = in.tokenizer;
  s.tokenizer_path = in.tokenizer_path;
  s.data = in.dataset ? TrainingData(in.dataset, in.job.global_batch)
                      : TrainingData(SyntheticData{in.job.seed, in.model.shape.vocab_size});
  return s;
}

}  // namespace

absl::StatusOr<JobSetup> PrepareJob(const core::JobSpec& job, const std::string& job_path) {
  auto in = job::PrepareJobInputs(job, job_path);
  if (!in.ok()) return in.status();
  return SetupOf(*in);
}

absl::StatusOr<JobSetup> LoadJob(const std::string& job_path) {
  auto in = job::LoadJobInputs(job_path);
  if (!in.ok()) return in.status();
  return SetupOf(*in);
}

int EarlyMicroBatches(const core::JobSpec& job, int64_t step, int64_t total_steps) {
  const int sync_period = job.sync.mode == core::SyncMode::kDiloco
                              ? partitioner::DilocoSyncPeriod(job.sync.inner_steps, job.sync.fragments)
                              : 0;
  return partitioner::EarlyMicroBatches(job.step_overlap, step, total_steps, job.checkpoint.interval, sync_period);
}

absl::StatusOr<TrainResult> TrainLocal(const JobSetup& setup, int steps, torch::Device device,
                                       const std::function<void(int, double)>& on_step) {
  return GuardTorch("training", [&]() -> absl::StatusOr<TrainResult> {
    const LlamaConfig& c = setup.model;
    auto built = BuildStageModel(setup, 0, c.num_ops() - 1, device);  // checks the slice
    if (!built.ok()) return built.status();
    StageModel& model = **built;
    AdamW opt(setup.job.optimizer);
    TrainResult r;
    const int seq = setup.job.sequence_length;
    // job.step_overlap: the weights of the step before, for the early micro-batches.
    std::unique_ptr<StageModel> previous;
    for (int step = 0; step < steps; ++step) {
      const double normaliser = setup.data.StepTargets(step, setup.micro_batches, setup.micro_batch_size, seq);
      model.ClearGradients();
      const int early = EarlyMicroBatches(setup.job, step, setup.job.steps);
      double loss_sum = 0;
      for (int m = 0; m < setup.micro_batches; ++m) {
        StageModel& on = m < early ? *previous : model;
        auto batch = setup.data.MicroBatch(step, m, setup.micro_batch_size, seq);
        const TrainContext ctx{step, static_cast<int64_t>(m) * setup.micro_batch_size};
        auto loss = CrossEntropySum(on.Forward(batch.inputs.to(device), &ctx), batch.targets.to(device), normaliser);
        if (!loss.requires_grad())
          return absl::InvalidArgumentError("job.lora.target_modules: no projection of the model has an adapter");
        loss.backward();
        loss_sum += loss.item<double>();
        // The early micro-batches' gradients join the step's before any other's, as in the executors (each
        // stage moves them once they are back, and a stage's first backward passes are theirs): the same
        // summation order, so the two agree over long runs too, not only within rounding of one step.
        if (m + 1 == early) previous->MoveGradientsInto(model);
      }
      if (setup.job.step_overlap > 0) {  // this step's weights, for the next step's early micro-batches
        if (!previous)
          previous = model.Copy();
        else
          previous->CopyWeightsFrom(model);
      }
      ClipByGlobalNorm(model.parameters(), GradSquareSum(model.parameters()), setup.job.optimizer.grad_clip);
      opt.Step(model.parameters(), LearningRate(setup.job.optimizer, step, setup.job.steps));
      r.losses.push_back(loss_sum);
      if (on_step) on_step(step, loss_sum);
    }
    for (const auto& [n, p] : model.parameters()) r.parameters[n] = p.detach().cpu();
    return r;
  });
}

absl::StatusOr<std::unique_ptr<StageModel>> BuildStageModel(const JobSetup& setup, int first_op, int last_op,
                                                            torch::Device device) {
  return GuardTorch(absl::StrCat("building ops ", first_op, "-", last_op, " of the model"),
                    [&]() -> absl::StatusOr<std::unique_ptr<StageModel>> {
                      if (absl::Status s = CheckSlice(setup.model, first_op, last_op); !s.ok()) return s;
                      auto model = std::make_unique<StageModel>(setup.model, first_op, last_op, setup.job.seed, device,
                                                                setup.job.lora);
                      if (setup.weights.empty()) return model;
                      std::vector<std::string> names;
                      for (const auto& [name, p] : model->base_parameters()) names.push_back(name);
                      auto w = LoadWeights(setup.weights, names);
                      if (!w.ok()) return w.status();
                      if (absl::Status s = model->LoadBase(*w); !s.ok())
                        return absl::InvalidArgumentError(absl::StrCat(setup.weights, ": ", s.message()));
                      return model;
                    });
}

absl::StatusOr<std::map<std::string, torch::Tensor>> LoadWeights(const std::string& path,
                                                                 const std::vector<std::string>& names) {
  return GuardTorch(absl::StrCat("loading ", path), [&]() -> absl::StatusOr<std::map<std::string, torch::Tensor>> {
    const std::string index_suffix = ".index.json";
    if (path.size() <= index_suffix.size() ||
        path.compare(path.size() - index_suffix.size(), index_suffix.size(), index_suffix) != 0) {
      auto all = LoadParameters(path);
      if (!all.ok() || names.empty()) return all;
      std::map<std::string, torch::Tensor> out;
      for (const auto& n : names)
        if (auto it = all->find(n); it != all->end()) out[n] = it->second;
      return out;
    }
    // Sharded: {"weight_map": {"tensor name": "shard file", ...}}.
    auto index = core::ReadFile(path);
    if (!index.ok()) return index.status();
    nlohmann::json j = nlohmann::json::parse(*index, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      return absl::InvalidArgumentError(absl::StrCat(path, ": expected a JSON object with a 'weight_map' object"));
    std::map<std::string, std::vector<std::string>> by_shard;
    for (auto& [name, shard] : j["weight_map"].items()) {
      if (!shard.is_string())
        return absl::InvalidArgumentError(absl::StrCat(path, ": weight_map['", name, "'] is not a file name"));
      const std::string file = shard.get<std::string>();
      if (file.find('/') != std::string::npos || file.find("..") != std::string::npos)
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": weight_map['", name, "']: shard '", file, "' is not a plain file name"));
      if (names.empty() || std::find(names.begin(), names.end(), name) != names.end()) by_shard[file].push_back(name);
    }
    std::map<std::string, torch::Tensor> out;
    const std::string dir = std::filesystem::path(path).parent_path().string();
    for (const auto& [file, wanted] : by_shard) {
      auto shard = LoadParameters(dir + "/" + file);
      if (!shard.ok()) return shard.status();
      for (const auto& n : wanted) {
        auto it = shard->find(n);
        if (it == shard->end())
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": '", n, "' is mapped to ", file, ", which does not hold it"));
        out[n] = it->second;
      }
    }
    return out;
  });
}

absl::Status SaveParameters(const std::string& path, const std::map<std::string, torch::Tensor>& params) {
  return GuardTorch(absl::StrCat("writing ", path), [&]() -> absl::Status {
    core::SafetensorsFile f;
    for (const auto& [name, t] : params) {
      auto c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
      core::Tensor ct;
      ct.dtype = core::DType::kFloat32;
      ct.shape.assign(c.sizes().begin(), c.sizes().end());
      ct.bytes.resize(c.numel() * 4);
      std::memcpy(ct.bytes.data(), c.data_ptr<float>(), ct.bytes.size());
      f.tensors[name] = std::move(ct);
    }
    f.metadata["format"] = "pt";
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
    return core::WriteSafetensors(path, f);
  });
}

absl::StatusOr<std::map<std::string, torch::Tensor>> LoadParameters(const std::string& path) {
  return GuardTorch(absl::StrCat("loading ", path), [&]() -> absl::StatusOr<std::map<std::string, torch::Tensor>> {
    auto f = core::ReadSafetensors(path);
    if (!f.ok()) return f.status();
    std::map<std::string, torch::Tensor> out;
    for (auto& [name, t] : f->tensors) {
      if (t.dtype != core::DType::kFloat32 && t.dtype != core::DType::kBFloat16 && t.dtype != core::DType::kFloat16)
        return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "' is not a float tensor"));
      auto dtype = t.dtype == core::DType::kFloat32    ? torch::kFloat32
                   : t.dtype == core::DType::kBFloat16 ? torch::kBFloat16
                                                       : torch::kFloat16;
      out[name] = torch::from_blob(t.bytes.data(), t.shape, dtype).to(torch::kFloat32).clone();
    }
    return out;
  });
}

}  // namespace meridian::executor
