#include "executor/gradient_hooks.h"

#include <algorithm>

namespace meridian::executor {

BucketLayout LayOutBuckets(const std::vector<std::pair<std::string, torch::Tensor>>& params, int64_t bucket_bytes) {
  BucketLayout l;
  l.bucket_of.assign(params.size(), -1);
  l.offset_of.assign(params.size(), 0);
  const int64_t cap = std::max<int64_t>(bucket_bytes / 4, 1);
  for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
    const int64_t n = params[i].second.numel();
    if (l.buckets.empty() || (l.buckets.back().numel > 0 && l.buckets.back().numel + n > cap)) l.buckets.emplace_back();
    BucketLayout::Bucket& b = l.buckets.back();
    b.params.push_back(i);
    b.offsets.push_back(b.numel);
    l.offset_of[i] = b.numel;
    b.numel += n;
    l.bucket_of[i] = static_cast<int>(l.buckets.size()) - 1;
  }
  return l;
}

GradientHooks::GradientHooks(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                             std::function<void(int, const torch::Tensor&)> on_gradient)
    : sink_(std::make_shared<Sink>()) {
  sink_->fn = std::move(on_gradient);
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    std::shared_ptr<Sink> sink = sink_;
    // The parameter is a leaf: autograd sums its uses' gradients first and calls the hook once per pass.
    torch::Tensor p = params[i].second;
    p.register_hook([sink, i](const torch::Tensor& grad) {
      std::lock_guard<std::mutex> l(sink->mu);
      if (sink->fn) sink->fn(i, grad);
    });
  }
}

GradientHooks::~GradientHooks() {
  std::lock_guard<std::mutex> l(sink_->mu);
  sink_->fn = nullptr;
}

}  // namespace meridian::executor
