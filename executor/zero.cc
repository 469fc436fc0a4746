#include "executor/zero.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "executor/site_group.h"

namespace meridian::executor {

ShardedAdamW::ShardedAdamW(core::OptimizerSpec spec, const Params& params, int rank, int size)
    : spec_(std::move(spec)), rank_(rank), size_(size) {
  for (const auto& [n, p] : params) total_ += p.numel();
  shard_ = (total_ + size_ - 1) / size_;
  const int64_t lo = rank_ * shard_, hi = std::min(total_, lo + shard_);
  int64_t offset = 0;
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    const int64_t n = params[i].second.numel();
    const int64_t a = std::max(lo, offset), b = std::min(hi, offset + n);
    if (a < b) pieces_.push_back({i, a - offset, b - a, a, {}, {}});
    offset += n;
  }
}

int64_t ShardedAdamW::state_elements() const {
  int64_t n = 0;
  for (const auto& piece : pieces_)
    if (piece.m.defined()) n += piece.m.numel() + piece.v.numel();
  return n;
}

void ShardedAdamW::Step(const Params& params, double lr) {
  torch::NoGradGuard ng;
  ++t_;
  const double bc1 = 1 - std::pow(spec_.beta1, static_cast<double>(t_));
  const double bc2 = 1 - std::pow(spec_.beta2, static_cast<double>(t_));
  for (auto& piece : pieces_) {
    const torch::Tensor& param = params[piece.param].second;
    if (!param.grad().defined()) continue;
    // Views of the parameter's and gradient's own elements: in-place updates land in the parameter.
    torch::Tensor p = param.view({-1}).narrow(0, piece.begin, piece.count);
    torch::Tensor g = param.grad().reshape({-1}).narrow(0, piece.begin, piece.count);
    if (!piece.m.defined()) {
      piece.m = torch::zeros_like(p);
      piece.v = torch::zeros_like(p);
    }
    if (spec_.name == "sgd") {
      p.add_(g, -lr);
      continue;
    }
    // As AdamW::Step, element by element: decay for 2-D weights only.
    if (param.dim() >= 2 && spec_.weight_decay > 0) p.mul_(1 - lr * spec_.weight_decay);
    piece.m.mul_(spec_.beta1).add_(g, 1 - spec_.beta1);
    piece.v.mul_(spec_.beta2).addcmul_(g, g, 1 - spec_.beta2);
    auto denom = (piece.v / bc2).sqrt_().add_(spec_.eps);
    p.addcdiv_(piece.m, denom, -lr / bc1);
  }
}

absl::Status ShardedAdamW::GatherParameters(SiteGroup& group, const Params& params) {
  torch::NoGradGuard ng;
  // On the worker's device: a CUDA site's workers gather it through NCCL, device to device.
  torch::Tensor mine =
      torch::zeros({shard_}, torch::TensorOptions().device(group.collective_device()).dtype(torch::kFloat32));
  for (const auto& piece : pieces_)
    mine.narrow(0, piece.flat - rank_ * shard_, piece.count)
        .copy_(params[piece.param].second.detach().reshape({-1}).narrow(0, piece.begin, piece.count));
  auto all = group.AllGather(mine);
  if (!all.ok()) return all.status();
  int64_t offset = 0;
  for (const auto& [n, p] : params) {
    p.view({-1}).copy_(all->narrow(0, offset, p.numel()).to(p.device()));
    offset += p.numel();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, torch::Tensor>> ShardedAdamW::ExportState(SiteGroup& group,
                                                                               const Params& params) const {
  std::map<std::string, torch::Tensor> out;
  bool stepped = false;
  for (const auto& piece : pieces_) stepped |= piece.m.defined();
  // Whether each worker has moments: before the first step none has, and a checkpoint then holds none.
  torch::Tensor any = torch::full({1}, stepped ? 1.0f : 0.0f);
  if (absl::Status s = group.AllReduce(any); !s.ok()) return s;
  if (any.item<float>() == 0) return out;
  // On the host, gathered through Gloo: the whole moments on a device would undo ZeRO-1's saving there.
  torch::Tensor m = torch::zeros({shard_}, torch::kFloat32), v = torch::zeros({shard_}, torch::kFloat32);
  for (const auto& piece : pieces_)
    if (piece.m.defined()) {
      m.narrow(0, piece.flat - rank_ * shard_, piece.count).copy_(piece.m.cpu());
      v.narrow(0, piece.flat - rank_ * shard_, piece.count).copy_(piece.v.cpu());
    }
  auto all_m = group.AllGather(m);
  if (!all_m.ok()) return all_m.status();
  auto all_v = group.AllGather(v);
  if (!all_v.ok()) return all_v.status();
  if (group.rank() != 0) return out;
  int64_t offset = 0;
  for (const auto& [n, p] : params) {
    out["optim.m." + n] = all_m->narrow(0, offset, p.numel()).view(p.sizes()).clone();
    out["optim.v." + n] = all_v->narrow(0, offset, p.numel()).view(p.sizes()).clone();
    offset += p.numel();
  }
  return out;
}

absl::Status ShardedAdamW::ImportState(const Params& params, const std::map<std::string, torch::Tensor>& state,
                                       int64_t steps) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> restored(pieces_.size());
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const auto& [name, p] = params[pieces_[k].param];
    auto m = state.find("optim.m." + name), v = state.find("optim.v." + name);
    if (m == state.end() || v == state.end()) continue;  // both or neither, as AdamW
    for (auto it : {m, v})
      if (it->second.sizes() != p.sizes() || it->second.scalar_type() != p.scalar_type())
        return absl::DataLossError(absl::StrCat(it->first, " has shape ", c10::str(it->second.sizes()), " ",
                                                c10::toString(it->second.scalar_type()), " but parameter ", name,
                                                " has ", c10::str(p.sizes()), " ", c10::toString(p.scalar_type())));
    auto slice = [&](const torch::Tensor& t) {
      return t.reshape({-1}).narrow(0, pieces_[k].begin, pieces_[k].count).to(p.device()).clone();
    };
    restored[k] = {slice(m->second), slice(v->second)};
  }
  for (size_t k = 0; k < pieces_.size(); ++k) {
    pieces_[k].m = restored[k].first;
    pieces_[k].v = restored[k].second;
  }
  t_ = steps;
  return absl::OkStatus();
}

}  // namespace meridian::executor
