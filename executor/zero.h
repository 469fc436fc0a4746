// ZeRO-1 inside a site of several devices: AdamW whose moments are sharded across the site's workers.
//
// The stage's trained parameters, flattened in order and concatenated, are N elements; worker r of K owns
// the elements [r * C, min(N, (r + 1) * C)) with C = ceil(N / K), and holds the two AdamW moments of those
// elements only: a site's optimizer state falls by K. Every worker has the site's summed gradient
// (SiteReducer: Gloo has no reduce-scatter in libtorch 1.13, so the sum is an all-reduce and each worker
// reads its shard of it); each steps its own elements exactly as executor::AdamW steps them (the same
// element-wise operations, so the result is bit-identical), then the workers all-gather the parameters.
//
// Thread-compatible; every method that takes the SiteGroup is a collective of all the site's workers.
#ifndef MERIDIAN_EXECUTOR_ZERO_H_
#define MERIDIAN_EXECUTOR_ZERO_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "core/cluster_spec.h"

namespace meridian::executor {

class SiteGroup;

class ShardedAdamW {
 public:
  using Params = std::vector<std::pair<std::string, torch::Tensor>>;
  ShardedAdamW(core::OptimizerSpec spec, const Params& params, int rank, int size);

  // Steps this worker's elements of every parameter that has a gradient.
  void Step(const Params& params, double lr);
  // Every worker's stepped elements to every worker (collective).
  absl::Status GatherParameters(SiteGroup& group, const Params& params);
  int64_t steps() const { return t_; }
  // Moment elements this worker holds (two per owned element).
  int64_t state_elements() const;
  // The whole moments, as AdamW::ExportState names them ("optim.m.<param>", "optim.v.<param>"), at worker 0;
  // an empty map at the others (collective).
  absl::StatusOr<std::map<std::string, torch::Tensor>> ExportState(SiteGroup& group, const Params& params) const;
  // Takes this worker's elements of the whole moments in `state` (AdamW::ImportState's names and checks)
  // and the step count. Not a collective: every worker passes the same state.
  absl::Status ImportState(const Params& params, const std::map<std::string, torch::Tensor>& state, int64_t steps);

 private:
  struct Piece {  // this worker's elements of one parameter
    int param = -1;
    int64_t begin = 0, count = 0;  // within the parameter's flattened elements
    int64_t flat = 0;              // where they start in the concatenation
    torch::Tensor m, v;            // [count]; undefined until first stepped
  };
  core::OptimizerSpec spec_;
  int rank_, size_;
  int64_t total_ = 0, shard_ = 0;  // N and C
  std::vector<Piece> pieces_;
  int64_t t_ = 0;
};

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_ZERO_H_
