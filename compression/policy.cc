#include "compression/policy.h"

#include "core/status.h"

namespace meridian::compression {

std::vector<CodecSpec> ActivationMenu() {
  return {*CodecSpec::Parse("identity"), *CodecSpec::Parse("bf16"), *CodecSpec::Parse("int8"),
          *CodecSpec::Parse("int4")};
}

std::vector<CodecSpec> GradientMenu() {
  return {*CodecSpec::Parse("identity"), *CodecSpec::Parse("bf16"), *CodecSpec::Parse("int8"),
          *CodecSpec::Parse("topk:k=0.01")};
}

CodecChoice ChooseCodec(const LinkEstimate& link, core::DType dtype, int64_t numel, double hide_seconds,
                        const std::vector<CodecSpec>& menu) {
  MERIDIAN_CHECK(!menu.empty(), "ChooseCodec needs a non-empty menu");
  MERIDIAN_CHECK(link.bandwidth_bytes_per_second > 0, "ChooseCodec needs a positive bandwidth");
  const double bytes = static_cast<double>(numel) * static_cast<double>(core::DTypeSize(dtype));
  CodecChoice best;
  best.seconds = -1;
  for (const CodecSpec& spec : menu) {
    CodecChoice c;
    c.spec = spec;
    c.ratio = CompressionRatio(spec, dtype, numel);
    c.seconds = link.latency_seconds + c.ratio * bytes / link.bandwidth_bytes_per_second;
    c.hidden = c.seconds <= hide_seconds;
    if (c.hidden) return c;
    if (best.seconds < 0 || c.seconds < best.seconds) best = c;
  }
  return best;
}

}  // namespace meridian::compression
