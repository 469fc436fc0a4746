// Codec throughput on one core: 64 MiB of float32 Gaussian data, GB/s of input, with memcpy of the same
// buffer measured in the same run as the ceiling.
//   OPENBLAS_NUM_THREADS=1 taskset -c 0 build/bench/compression_bench
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>

#include "compression/codec.h"

namespace {

using namespace meridian;

const std::vector<float>& Data() {
  static const std::vector<float> d = [] {
    std::vector<float> v(16 << 20);  // 64 MiB
    std::mt19937 rng(1);
    std::normal_distribution<float> g(0, 1);
    for (auto& x : v) x = g(rng);
    return v;
  }();
  return d;
}

void BM_Memcpy(benchmark::State& state) {
  const auto& x = Data();
  std::vector<float> y(x.size());
  for (auto _ : state) {
    std::memcpy(y.data(), x.data(), x.size() * 4);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * x.size() * 4);
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->MinTime(1.0);

void Codec(benchmark::State& state, const char* spec_text, bool decode) {
  const auto& x = Data();
  auto spec = *compression::CodecSpec::Parse(spec_text);
  core::TensorView v{core::DType::kFloat32, {static_cast<int64_t>(x.size())}, x.data()};
  // As an executor streams: the frame buffer and the receiving tensor are reused from step to step.
  std::vector<uint8_t> frame;
  std::vector<float> out(x.size());
  for (auto _ : state) {
    if (!compression::EncodeTo(v, spec, &frame).ok()) state.SkipWithError("encode failed");
    if (decode && !compression::DecodeInto(frame.data(), frame.size(), v.dtype, v.shape, out.data()).ok())
      state.SkipWithError("decode failed");
    benchmark::ClobberMemory();
  }
  size_t frame_bytes = frame.size();
  state.SetBytesProcessed(state.iterations() * x.size() * 4);
  state.counters["ratio"] = static_cast<double>(frame_bytes) / (x.size() * 4);
}

BENCHMARK_CAPTURE(Codec, int8_encode_decode, "int8", true)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK_CAPTURE(Codec, int8_encode, "int8", false)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK_CAPTURE(Codec, int4_encode_decode, "int4", true)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK_CAPTURE(Codec, bf16_encode_decode, "bf16", true)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK_CAPTURE(Codec, topk1pct_encode, "topk:k=0.01", false)->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK_CAPTURE(Codec, topk1pct_encode_decode, "topk:k=0.01", true)->Unit(benchmark::kMillisecond)->MinTime(1.0);

}  // namespace

BENCHMARK_MAIN();
