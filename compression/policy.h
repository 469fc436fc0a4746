// The codec menus -- the one list of what the adaptive policy may choose, for activations between stages
// and for replica gradients -- and the rule for one link and one tensor: the least lossy codec whose
// transfer hides behind the compute it overlaps with (FusionLLM's AdaTopK: compress only slow links).
// The planner (partitioner/planner.cc) prices these menus with PayloadRatio and chooses per link by
// simulating the schedule; it leaves top-k out of the gradient menu (measured with AdamW it trails the
// exact loss early in training: docs/cost-model.md). Executors send with the codec the plan names. Pure;
// thread-safe.
#ifndef MERIDIAN_COMPRESSION_POLICY_H_
#define MERIDIAN_COMPRESSION_POLICY_H_

#include <cstdint>
#include <vector>

#include "compression/codec.h"

namespace meridian::compression {

struct LinkEstimate {
  double bandwidth_bytes_per_second = 0;
  double latency_seconds = 0;  // one-way
};

struct CodecChoice {
  CodecSpec spec;
  double ratio = 1.0;   // frame bytes / input bytes
  double seconds = 0;   // predicted transfer time of the frame
  bool hidden = false;  // seconds <= the compute budget
};

// Menus, least lossy first.
std::vector<CodecSpec> ActivationMenu();  // identity, bf16, int8, int4
std::vector<CodecSpec> GradientMenu();    // identity, bf16, int8, top-k 1% (with error feedback)

// The first codec of `menu` (least lossy first) whose transfer of `numel` elements of `dtype` over `link`
// takes at most `hide_seconds`; if none does, the one with the shortest transfer (hidden = false).
// REQUIRES: menu non-empty, link bandwidth > 0.
CodecChoice ChooseCodec(const LinkEstimate& link, core::DType dtype, int64_t numel, double hide_seconds,
                        const std::vector<CodecSpec>& menu);

}  // namespace meridian::compression

#endif  // MERIDIAN_COMPRESSION_POLICY_H_
