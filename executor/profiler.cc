#include "executor/profiler.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "compression/codec.h"
#include "compression/policy.h"
#include "core/log.h"
#include "executor/torch_boundary.h"
#include "executor/trainer.h"
#include "gpu/probe.h"

namespace meridian::executor {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

void Sync(torch::Device d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

}  // namespace

double MeasureGemmFlops(torch::Device device, int n, int repeats) {
  torch::NoGradGuard ng;
  auto a = torch::randn({n, n}, torch::TensorOptions().device(device));
  auto b = torch::randn({n, n}, torch::TensorOptions().device(device));
  (void)torch::mm(a, b);
  Sync(device);
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    auto t0 = Clock::now();
    auto c = torch::mm(a, b);
    Sync(device);
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return 2.0 * n * n * n / Median(t);
}

std::map<std::string, double> MeasureCodecBytesPerSecond(int64_t elements, int repeats) {
  std::vector<float> data(static_cast<size_t>(std::max<int64_t>(elements, 1024)));
  uint32_t x = 12345;  // a fixed pseudo-random signal: the codecs' speed does not depend on its values
  for (float& v : data) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<int32_t>(x >> 8) - (1 << 23)) / (1 << 23);
  }
  const core::TensorView view{core::DType::kFloat32, {static_cast<int64_t>(data.size())}, data.data()};
  const double bytes = 4.0 * data.size();
  std::map<std::string, double> out;
  for (const compression::CodecSpec& spec : compression::ActivationMenu()) {
    if (spec.kind == compression::CodecKind::kIdentity) continue;
    std::vector<double> times;
    std::vector<uint8_t> frame;
    for (int r = 0; r <= repeats; ++r) {
      const auto t0 = Clock::now();
      if (!compression::EncodeTo(view, spec, &frame).ok()) break;
      auto decoded = compression::Decode(frame.data(), frame.size());
      if (!decoded.ok()) break;
      if (r > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    if (static_cast<int>(times.size()) == repeats && Median(times) > 0)
      out[spec.ShortString()] = 2 * bytes / Median(times);
  }
  return out;
}

double AvailableMemoryBytes(torch::Device device) {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kb = 0;
  while (in >> key) {
    if (key == "MemAvailable:") {
      in >> kb;
      break;
    }
    std::getline(in, key);
  }
  return kb * 1024;
}

absl::StatusOr<OpProfile> ProfileModel(const LlamaConfig& c, int mbs, int seq, const std::string& site_name,
                                       torch::Device device, int repeats, const core::LoraSpec& lora) {
  return GuardTorch(absl::StrCat("site '", site_name, "': profiling the model"), [&]() -> absl::StatusOr<OpProfile> {
    if (repeats < 1) return absl::InvalidArgumentError("repeats must be at least 1");
    OpProfile out;
    out.graph = partitioner::BuildLlamaGraph(c.shape, job::ProfiledGraphOptions(mbs, seq, lora.enabled));
    out.site.name = site_name;
    out.site.flops_per_second = MeasureGemmFlops(device);
    out.site.gemm_flops_per_second["libtorch_fp32"] = out.site.flops_per_second;
    out.site.memory_bytes = AvailableMemoryBytes(device);
    if (device.is_cuda()) {  // cuBLAS directly, and the device's own memory
      auto g = gpu::MeasureCublasGemm(device.index() < 0 ? 0 : device.index());
      if (g.ok()) {
        out.site.gemm_flops_per_second["cublas_fp32"] = g->fp32_flops_per_second;
        if (g->tf32_flops_per_second > 0) out.site.gemm_flops_per_second["cublas_tf32"] = g->tf32_flops_per_second;
        if (g->bf16_flops_per_second > 0) out.site.gemm_flops_per_second["cublas_bf16"] = g->bf16_flops_per_second;
        out.site.memory_bytes = g->free_memory_bytes;
      } else if (g.status().code() == absl::StatusCode::kFailedPrecondition && !gpu::Available()) {
        // libtorch has CUDA but this build of Meridian was configured without the toolkit.
        spdlog::warn("{}", absl::StrCat(g.status().message(), "; the profile has libtorch's GEMM only"));
      } else {
        return absl::Status(g.status().code(),
                            absl::StrCat("measuring ", device.str(), " through cuBLAS: ", g.status().message()));
      }
    }
    // The codecs on one micro-batch's hidden states (at most 16M floats: the rate, not the size, matters).
    out.site.codec_bytes_per_second = MeasureCodecBytesPerSecond(
        std::min<int64_t>(int64_t{mbs} * seq * c.shape.hidden_size, int64_t{1} << 24), std::min(repeats, 3));
    SyntheticData data{1, c.shape.vocab_size};
    auto tokens = data.MicroBatch(0, 0, mbs, seq).to(device);
    auto inputs = tokens.slice(1, 0, seq), targets = tokens.slice(1, 1, seq + 1);
    const std::vector<int64_t> hidden = {mbs, seq, c.shape.hidden_size};
    for (int op = 0; op < c.num_ops(); ++op) {
      if (!CheckSlice(c, op, op).ok()) {  // a tied head cannot stand alone: time it with the embedding
        out.site.op_seconds[OpName(c, op)] = 0;
        continue;
      }
      StageModel m(c, op, op, 1, device, lora);
      std::vector<double> times;
      for (int r = 0; r <= repeats; ++r) {
        torch::Tensor in =
            op == 0 ? inputs : torch::randn(hidden, torch::TensorOptions().device(device)).requires_grad_(true);
        Sync(device);
        auto t0 = Clock::now();
        auto y = m.Forward(in);
        if (op == c.num_ops() - 1) {
          CrossEntropySum(y, targets, static_cast<double>(targets.numel())).backward();
        } else if (y.requires_grad()) {  // under LoRA the embedding needs no backward pass
          y.backward(torch::ones_like(y));
        }
        Sync(device);
        if (r > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        for (auto& [n, p] : m.parameters()) p.mutable_grad() = torch::Tensor();
      }
      out.site.op_seconds[OpName(c, op)] = Median(times);
    }
    return out;
  });
}

}  // namespace meridian::executor
