#include "executor/profiler.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compression/codec.h"
#include "compression/policy.h"
#include "core/cpu_time.h"
#include "core/log.h"
#include "executor/torch_boundary.h"
#include "executor/trainer.h"
#include "gpu/probe.h"

namespace meridian::executor {
namespace {

using Clock = std::chrono::steady_clock;

using core::ThreadCpuSeconds;

// Wall and this thread's CPU seconds from a start.
struct Span {
  double wall = 0, cpu = 0;
  Span& operator+=(const Span& o) {
    wall += o.wall;
    cpu += o.cpu;
    return *this;
  }
};
class SpanTimer {
 public:
  SpanTimer() : wall0_(Clock::now()), cpu0_(ThreadCpuSeconds()) {}
  Span Elapsed() const {
    return {std::chrono::duration<double>(Clock::now() - wall0_).count(), ThreadCpuSeconds() - cpu0_};
  }

 private:
  Clock::time_point wall0_;
  double cpu0_;
};

// Seconds per call of `timed_call` (which runs one call and returns the Span of its timed part, a
// negative wall when the call fails), as the mean over at least `repeats` calls and at least
// kMinTimedSeconds of timed time, after one untimed warm-up call. A mean over a window, not a median of
// single calls: a device throttled in periods (a cgroup CPU quota, as the emulated sites have, or a GPU
// at its power cap) runs most short calls at full speed and stalls in a few, and a stage's step sees the
// average. With `by_cpu` (ChargedByCpu) the timed parts are charged the window's wall by their CPU
// time (ChargedSeconds). Returns -1 when a call fails.
constexpr double kMinTimedSeconds = 0.05;
constexpr int kOpRounds = 3;  // ProfileModel: rounds of passes through all the ops, each op's median kept
constexpr int kMaxCalls = 10000;
// Whether a measurement of `calls` timed calls, `timed` seconds in all, needs another call: fewer than
// `repeats`, or under kMinTimedSeconds (and kMaxCalls).
bool NeedsMoreCalls(int calls, double timed, int repeats) {
  return calls < repeats || (timed < kMinTimedSeconds && calls < kMaxCalls);
}
template <typename F>
double SustainedSeconds(F timed_call, int repeats, bool by_cpu) {
  if (timed_call().wall < 0) return -1;  // warm-up
  Span timed;
  int calls = 0;
  const SpanTimer window;
  while (NeedsMoreCalls(calls, timed.wall, repeats)) {
    const Span t = timed_call();
    if (t.wall < 0) return -1;
    timed += t;
    ++calls;
  }
  const Span w = window.Elapsed();
  return ChargedSeconds(timed.wall, timed.cpu, w.wall, w.cpu, by_cpu) / calls;
}

// Whether this thread's CPU time is the work of what it runs on `device`: the host CPU, with libtorch's
// intra-op threads and OpenBLAS's (OPENBLAS_NUM_THREADS; unset, it takes every core) both 1, as the
// emulated sites, the bench and the tests run them (docs/threading.md). With more threads part of an op's
// work is theirs, and its wall time is charged instead.
bool ChargedByCpu(torch::Device device) {
  const char* blas = std::getenv("OPENBLAS_NUM_THREADS");
  return device.is_cpu() && at::get_num_threads() == 1 && blas != nullptr && std::string(blas) == "1";
}

void Sync(torch::Device d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

}  // namespace

double ChargedSeconds(double part_wall, double part_cpu, double window_wall, double window_cpu, bool by_cpu) {
  if (!by_cpu || !(window_cpu > 0) || !(window_wall > 0) || !(part_cpu >= 0)) return part_wall;
  return part_cpu * window_wall / window_cpu;
}

double MeasureCpuShare(double seconds) {
  const double cpu0 = ThreadCpuSeconds();
  const auto t0 = Clock::now();
  volatile double x = 1;
  double wall = 0;
  while (wall < seconds) {
    for (int i = 0; i < 100000; ++i) x = x * 1.0000001 + 1e-9;
    wall = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return std::clamp((ThreadCpuSeconds() - cpu0) / wall, 0.01, 1.0);
}

double MeasureGemmFlops(torch::Device device, int n, int repeats) {
  torch::NoGradGuard ng;
  auto a = torch::randn({n, n}, torch::TensorOptions().device(device));
  auto b = torch::randn({n, n}, torch::TensorOptions().device(device));
  const double seconds = SustainedSeconds(
      [&] {
        const SpanTimer t;
        auto c = torch::mm(a, b);
        Sync(device);
        return t.Elapsed();
      },
      repeats, ChargedByCpu(device));
  return 2.0 * n * n * n / seconds;
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
    std::vector<uint8_t> frame;
    const double seconds = SustainedSeconds(
        [&]() -> Span {
          const SpanTimer t;
          if (!compression::EncodeTo(view, spec, &frame).ok()) return {-1, 0};
          if (!compression::Decode(frame.data(), frame.size()).ok()) return {-1, 0};
          return t.Elapsed();
        },
        repeats, /*by_cpu=*/true);  // the codecs run on this thread alone
    if (seconds > 0) out[spec.ShortString()] = 2 * bytes / seconds;
  }
  return out;
}

double MeasureOptimizerSecondsPerByte(torch::Device device, int64_t elements, int repeats) {
  // Four parameters of a quarter each: the per-tensor work is there too, as in a stage's few dozen.
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (int i = 0; i < 4; ++i) {
    torch::Tensor p = torch::randn({std::max<int64_t>(elements / 1024, 1), 256}, torch::TensorOptions().device(device));
    p.mutable_grad() = torch::randn_like(p);
    params.emplace_back(absl::StrCat("p", i), p);
  }
  core::OptimizerSpec spec;
  spec.weight_decay = 0.01;  // decoupled decay on matrices, as most jobs set it
  AdamW adamw(spec);
  adamw.Step(params, 1e-6);  // the moments exist from here, as after a stage's first step
  const double seconds = SustainedSeconds(
      [&] {
        Sync(device);
        const SpanTimer t;
        ClipByGlobalNorm(params, GradSquareSum(params), 1.0);
        adamw.Step(params, 1e-6);
        Sync(device);
        return t.Elapsed();
      },
      repeats, ChargedByCpu(device));
  int64_t total = 0;
  for (const auto& [n, p] : params) total += p.numel();
  return seconds / (8.0 * static_cast<double>(total));
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
    out.site.device = device.str();  // as the executor's --device names it: "cpu", "cuda:0"
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
    out.site.optimizer_seconds_per_byte =
        MeasureOptimizerSecondsPerByte(device, int64_t{1} << 22, std::min(repeats, 3));
    // The codecs on one micro-batch's hidden states (at most 16M floats: the rate, not the size, matters).
    out.site.codec_bytes_per_second = MeasureCodecBytesPerSecond(
        std::min<int64_t>(int64_t{mbs} * seq * c.shape.hidden_size, int64_t{1} << 24), std::min(repeats, 3));
    const TrainingData::Batch batch = TrainingData(SyntheticData{1, c.shape.vocab_size}).MicroBatch(0, 0, mbs, seq);
    const torch::Tensor inputs = batch.inputs.to(device), targets = batch.targets.to(device);
    // A head tied to the embedding cannot run without it: it is timed with weights of its own, the same
    // work (its projection, the loss, and the gradient of the shared weights).
    LlamaConfig untied = c;
    untied.shape.tie_word_embeddings = false;
    // Every op is timed in place, in passes of one micro-batch through the whole model: forward through
    // every op, each fed the previous op's output as a stage receives it (detached, requiring its
    // gradient), then backward from the loss through every op in reverse, each fed the gradient of the
    // next op's input. So an op runs as in a stage, with the other ops' weights and activations passing
    // through the caches in between. Timed alone, each op repeated with its weights hot, the ops summed to
    // 11-21% less time than whole-model training under the emulated sites' quotas (bench/RESULTS.md, the
    // end-to-end section, sessions 32-33). Each op's weight gradients are dropped once its backward pass is
    // timed, so that the profile holds the model's weights and one op's gradients, not the whole model's
    // (accumulating them, as a step's later micro-batches do, moved op times by under 3%: session 20).
    // A round is at least `repeats` passes and kMinTimedSeconds of timed time, each op's figure the mean
    // over them; kOpRounds rounds, each op's median round kept: a burst of other load on the host (another
    // site measuring, the coordinator) lands in one round of an op, not in its figure. On the host CPU
    // computing on one thread (ChargedByCpu) an op's figure is its CPU time over the round's CPU share
    // (ChargedSeconds): timed by the wall clock, the
    // ops of a site under a CPU quota missed the throttling that fell between them, the tensors' frees,
    // and read 18-27% fast (session 36), which the planner then took as a faster site.
    const int ops = c.num_ops();
    std::vector<std::unique_ptr<StageModel>> models;
    for (int op = 0; op < ops; ++op)
      models.push_back(std::make_unique<StageModel>(CheckSlice(c, op, op).ok() ? c : untied, op, op, 1, device, lora));
    std::vector<Span> pass_spans(ops);
    const bool by_cpu = ChargedByCpu(device);
    auto pass = [&] {  // one micro-batch forward and backward through every op, adding each op's Span
      std::vector<torch::Tensor> in(ops), out(ops);
      for (int op = 0; op < ops; ++op) {
        in[op] = op == 0 ? inputs : out[op - 1].detach().requires_grad_(true);
        Sync(device);
        const SpanTimer t;
        out[op] = models[op]->Forward(in[op]);
        Sync(device);
        pass_spans[op] += t.Elapsed();
      }
      for (int op = ops - 1; op >= 0; --op) {
        if (op < ops - 1 && !out[op].requires_grad()) continue;  // under LoRA the embedding needs no backward
        const SpanTimer t;
        if (op == ops - 1)
          CrossEntropySum(out[op], targets, static_cast<double>(targets.numel())).backward();
        else
          out[op].backward(in[op + 1].grad());
        Sync(device);
        pass_spans[op] += t.Elapsed();
        out[op] = torch::Tensor();  // its graph is spent: free it before the next op's backward
        models[op]->ClearGradients();
      }
    };
    pass();  // warm-up
    std::vector<std::vector<double>> rounds(ops);
    for (int round = 0; round < kOpRounds; ++round) {
      std::fill(pass_spans.begin(), pass_spans.end(), Span{});
      int passes = 0;
      double timed = 0;
      const SpanTimer window;
      while (NeedsMoreCalls(passes, timed, repeats)) {
        pass();
        ++passes;
        timed = 0;
        for (const Span& t : pass_spans) timed += t.wall;
      }
      const Span w = window.Elapsed();
      for (int op = 0; op < ops; ++op)
        rounds[op].push_back(ChargedSeconds(pass_spans[op].wall, pass_spans[op].cpu, w.wall, w.cpu, by_cpu) / passes);
    }
    for (int op = 0; op < ops; ++op) {
      std::vector<double>& r = rounds[op];
      std::sort(r.begin(), r.end());
      out.site.op_seconds[OpName(c, op)] = r[r.size() / 2];
    }
    return out;
  });
}

absl::Status KeepComputing(const LlamaConfig& c, int mbs, int seq, torch::Device device, const core::LoraSpec& lora,
                           const std::atomic<bool>* stop, double seconds, std::atomic<int64_t>* passes) {
  return GuardTorch("computing while the other sites measure", [&]() -> absl::Status {
    const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    if (stop->load() || seconds <= 0) return absl::OkStatus();
    StageModel model(c, 0, c.num_ops() - 1, 1, device, lora);
    const TrainingData::Batch batch = TrainingData(SyntheticData{1, c.shape.vocab_size}).MicroBatch(0, 0, mbs, seq);
    const torch::Tensor inputs = batch.inputs.to(device), targets = batch.targets.to(device);
    while (!stop->load() && Clock::now() < end) {
      CrossEntropySum(model.Forward(inputs), targets, static_cast<double>(targets.numel())).backward();
      model.ClearGradients();
      Sync(device);
      if (passes) ++*passes;
    }
    return absl::OkStatus();
  });
}

}  // namespace meridian::executor
