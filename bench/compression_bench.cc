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
  size_t frame_bytes = 0;
  for (auto _ : state) {
    auto f = compression::Encode(v, spec);
    frame_bytes = f->size();
    if (decode) {
      auto t = compression::Decode(f->data(), f->size());
      benchmark::DoNotOptimize(t);
    }
    benchmark::DoNotOptimize(f);
  }
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
