// What the two gradient sums share -- across sites (replica_sync.h) and across a site's workers
// (site_group.h): the bucket layout, and autograd hooks that hand each parameter's gradient to a sum
// while the backward pass runs.
//
// Thread-safety: LayOutBuckets is pure. A GradientHooks' callback runs on autograd's thread (the caller's
// on CPU), under the hooks' own mutex; destroying the object waits for a callback in progress.
#ifndef MERIDIAN_EXECUTOR_GRADIENT_HOOKS_H_
#define MERIDIAN_EXECUTOR_GRADIENT_HOOKS_H_

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace meridian::executor {

// Buckets of about `bucket_bytes` of float32 in reverse parameter order (backward produces the last
// parameters' gradients first); a parameter larger than a bucket has one of its own.
struct BucketLayout {
  struct Bucket {
    std::vector<int> params;       // indices into the parameters
    std::vector<int64_t> offsets;  // element offset of each in the bucket
    int64_t numel = 0;
  };
  std::vector<Bucket> buckets;
  std::vector<int> bucket_of;      // per parameter
  std::vector<int64_t> offset_of;  // per parameter: its offset in its bucket
};
BucketLayout LayOutBuckets(const std::vector<std::pair<std::string, torch::Tensor>>& params, int64_t bucket_bytes);

// Registers a hook on every parameter that calls on_gradient(index, the gradient of this backward pass)
// -- before autograd adds it to .grad -- for as long as this object lives. Autograd keeps hooks for the
// parameter's life; after the destructor they do nothing.
class GradientHooks {
 public:
  GradientHooks(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                std::function<void(int, const torch::Tensor&)> on_gradient);
  ~GradientHooks();
  GradientHooks(const GradientHooks&) = delete;
  GradientHooks& operator=(const GradientHooks&) = delete;

 private:
  struct Sink {
    std::mutex mu;
    std::function<void(int, const torch::Tensor&)> fn;  // empty once the owner is gone
  };
  std::shared_ptr<Sink> sink_;
};

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_GRADIENT_HOOKS_H_
