// Measures what the partitioner needs on this executor's own device: GEMM throughput, and for every op of
// the job's model the forward+backward seconds per micro-batch and the parameter and output bytes.
// Results are in the partitioner's formats (graph.json ops, profile.json site). Confined to the caller's
// thread; results vary run to run by the device's noise. Every time measured here (not gpu/probe.h's
// cuBLAS figures, medians of their own) is a mean over at least `repeats`
// calls and 50 ms of timed calls (after a warm-up), so that a device throttled in periods (a CPU quota,
// a power cap) is measured at its sustained speed, not at the full speed most short calls get. On the
// host CPU, when the process computes on one thread (libtorch's intra-op threads and OPENBLAS_NUM_THREADS
// both 1, as docs/threading.md sets them for sites sharing a machine), the timed calls are charged the
// whole measurement's wall time by their CPU time (ChargedSeconds), so throttling that falls between them
// is not lost; the codecs, which run on the calling thread, always are.
#ifndef MERIDIAN_EXECUTOR_PROFILER_H_
#define MERIDIAN_EXECUTOR_PROFILER_H_

#include <torch/torch.h>

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"
#include "executor/llama.h"
#include "partitioner/model.h"

namespace meridian::executor {

struct OpProfile {
  partitioner::OpGraph graph;     // analytic FLOPs, measured bytes (fp32 training: weights+grads, Adam m+v)
  partitioner::SiteProfile site;  // name, measured flops_per_second, memory_bytes, op_seconds
};

// Every op is timed in place, in passes of one micro-batch forward through all the ops and backward
// through them in reverse (each op a model of its own, fed the previous one's output as a stage receives
// it): at least `repeats` passes (and 50 ms of timed time) after one warm-up pass, each op's mean over
// them, in each of three rounds; each op's median round is kept. On the host CPU computing on one thread
// each op is charged its CPU time over the round's CPU share (ChargedSeconds). With `lora`
// enabled the ops are timed as LoRA trains them (frozen weights: no weight gradients) and the graph's
// memory counts no gradients or optimizer state for the base weights. On a CUDA device the profile also
// holds cuBLAS's GEMM throughputs (FP32, TF32, BF16), measured directly (gpu/probe.h), and the device's
// free memory; an error of that probe fails the profile, naming the device.
absl::StatusOr<OpProfile> ProfileModel(const LlamaConfig& config, int micro_batch_size, int sequence_length,
                                       const std::string& site_name, torch::Device device, int repeats = 5,
                                       const core::LoraSpec& lora = {});

// Computes forward and backward passes of one micro-batch through the whole model (as ProfileModel's, on
// synthetic tokens, nothing timed or kept) on the calling thread until `*stop` is set or `seconds` have
// passed. Keeps a site computing while the others sharing its host still measure (ProfileRequest's
// keep_busy_seconds). Counts each pass done in `*passes` when given. Errors: the model's construction or
// passes (GuardTorch's).
absl::Status KeepComputing(const LlamaConfig& config, int micro_batch_size, int sequence_length, torch::Device device,
                           const core::LoraSpec& lora, const std::atomic<bool>* stop, double seconds,
                           std::atomic<int64_t>* passes = nullptr);

// The seconds to charge a timed part of a measurement on the host CPU: its CPU seconds (this thread's)
// over the CPU share of the whole measurement window (`window_cpu` / `window_wall`, its untimed parts
// included), so that the window's wall time is shared among its timed parts by the work they did. A cgroup
// CPU quota throttles a thread where the kernel enforces it, mostly at system calls, which a measurement's
// untimed parts (freeing a pass's tensors) are full of: under a quota of 0.45 of a core the op intervals of
// ProfileModel held 99% of the thread's CPU time but 73% of the wall time (0.51 of 0.70 s a round), so
// wall-timed ops summed 27% short of the sustained speed; unthrottled they held 99% of both. Returns
// `part_wall` where this thread's CPU time is not the part's work (`by_cpu` false: a GPU's kernels, or
// an op that other threads share) or when the CPU times are not positive.
double ChargedSeconds(double part_wall, double part_cpu, double window_wall, double window_cpu, bool by_cpu);

// Float32 input bytes per second that this process encodes and decodes with each codec of the activation
// menu (compression::ActivationMenu, identity left out), on `elements` floats of a micro-batch's hidden
// states: 2 x bytes / (encode + decode seconds), the mean of at least `repeats` (and 50 ms), so that charging the
// encoding at the sender and the decoding at the receiver at this rate adds up to the measured round trip. On the host
// CPU, as the executor's codecs run there. In SiteProfile::codec_bytes_per_second.
std::map<std::string, double> MeasureCodecBytesPerSecond(int64_t elements, int repeats = 3);

// Seconds per byte of optimizer state for what a stage does after its passes: the gradients' square sum
// (float64), clipping, and an AdamW step (default hyper-parameters), over `elements` float32 parameters on
// `device` whose state is their two moments (8 bytes a parameter); the mean of at least `repeats` (and
// 50 ms). In SiteProfile::optimizer_seconds_per_byte.
double MeasureOptimizerSecondsPerByte(torch::Device device, int64_t elements = int64_t{1} << 22, int repeats = 3);

// fp32 matrix-multiply throughput of the device (FLOP/s), over at least `repeats` n x n products and 50 ms.
double MeasureGemmFlops(torch::Device device, int n = 512, int repeats = 5);

// The share of a core this thread gets: its CPU time over the wall time of a busy loop of `seconds` (about
// 1 on an idle core; a cgroup CPU quota's fraction, or less, when the site is throttled or shares its
// cores). Converts CPU seconds of the site's other threads into seconds of its compute thread.
double MeasureCpuShare(double seconds = 0.3);

// Memory available to a stage on this device: MemAvailable on CPU. (On CUDA, ProfileModel replaces it
// by the device's free memory from the cuBLAS probe, gpu/probe.h.)
double AvailableMemoryBytes(torch::Device device);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_PROFILER_H_
