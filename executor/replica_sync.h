// Gradient averaging among the replicas of one pipeline stage (data parallel across sites).
//
// Every replica runs a share of the step's micro-batches through the same slice of the model, so each
// holds a partial sum of the step's gradient (the loss is already normalised by the step's target
// count). Summing the partials over the replicas gives every replica the full step's gradient: the same
// one a single site running every micro-batch computes, so the optimizer steps stay identical.
//
// The sum is a reduce-scatter followed by an all-gather, bucket by bucket: the trained parameters are
// grouped into buckets of about `bucket_bytes` in reverse order (the order backward produces them);
// replica j owns slice j of each bucket. During the replica's last backward pass of the step, autograd
// hooks copy each parameter's final gradient into its bucket; a full bucket is sent right away, while the
// backward pass continues (Poseidon's wait-free backpropagation):
//   1. scatter thread: for each ready bucket, send slice j to replica j (one stream per replica);
//   2. reduce thread:  for each bucket in order, sum slice `self` over the replicas (in replica order,
//                      so the result does not depend on arrival order), send the sum to every replica
//                      (a second stream per replica);
//   3. Finish():       receive the other replicas' summed slices and set every parameter's .grad.
// With a lossy codec each send keeps its own error-feedback residual, and the owner of a slice uses the
// decoded form of what it sent, so all replicas end with bit-identical gradients. (Options::sparse_sum
// replaces both phases with an all-gather of sparse buckets: SparseLoCo's.)
//
// Thread-safety: BeginStep, CaptureNextBackward and Finish are called by the stage's thread (or, for a
// DiLoCo exchange, its exchange thread), ExportResiduals and ImportResiduals by that thread between
// steps; the hooks run on autograd's thread (the caller's on CPU); the two communication threads live from
// BeginStep to Finish.
#ifndef MERIDIAN_EXECUTOR_REPLICA_SYNC_H_
#define MERIDIAN_EXECUTOR_REPLICA_SYNC_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "absl/status/status.h"
#include "compression/codec.h"
#include "executor/gradient_hooks.h"
#include "rpc/peer.h"

namespace meridian::executor {

class GradientAverager {
 public:
  struct Options {
    std::string job_id;
    int stage = 0;
    std::vector<std::string> sites;  // the stage's replicas, in replica order
    int self = 0;                    // this site's index in `sites`
    compression::CodecSpec codec;    // for both phases (but see sparse_sum)
    bool error_feedback = true;      // residuals per (bucket, peer) when the codec is lossy
    // Each residual is scaled by this before it is added (compression::ErrorFeedback's decay).
    float error_feedback_decay = 1.0f;
    // SparseLoCo's aggregation (job.sync.outer_optimizer sparseloco, with a top-k `codec`): an all-gather
    // instead of the reduce-scatter and all-gather. Each replica sparsifies its whole bucket once through
    // its residual and sends that frame to every other replica; each adds the R sparse buckets in replica
    // order, so every replica ends with the same exact sum of the sparse contributions, sparsified once.
    // A replica sends (R - 1) sparse buckets a step, against the two phases' 2 (R - 1) / R slices.
    bool sparse_sum = false;
    int64_t bucket_bytes = 4 << 20;
    // Per received slice. A replica may wait for its peers' whole step (a replica with no micro-batch
    // starts waiting at once), so this is a step-level bound; a dead peer fails the wait at once.
    std::chrono::seconds timeout{60};
    std::string where;  // "stage K (site 'x')", for errors
  };
  // `params`: the stage's trained parameters in the model's order (hooks are registered on them).
  // `scatter` and `gather`: one open stream to each other replica (by site) per phase; not owned, and
  // used only by this object between BeginStep and the end of Finish.
  GradientAverager(Options options, std::vector<std::pair<std::string, torch::Tensor>> params, rpc::TensorInbox* inbox,
                   std::map<std::string, rpc::PeerClient::OutStream*> scatter,
                   std::map<std::string, rpc::PeerClient::OutStream*> gather);
  ~GradientAverager();  // ends a step in progress (its threads give up within a fraction of a second)

  // Starts step `step`'s exchange threads (ending a step still in progress first). `step` keys the step's
  // frames, so every replica passes the same one, and two consecutive steps never the same (the peer's
  // inbox keeps only the newest frame of a key): DiLoCo numbers its exchanges.
  void BeginStep(int64_t step);
  // Ends a step in progress without completing it (the stage's step failed): its threads give up
  // within a fraction of a second and are joined. No-op without a step in progress.
  void Abort();
  // Makes a step in progress give up (its waits end within a fraction of a second, and Finish returns
  // Cancelled) without joining anything: safe from any thread, also while another thread is in Finish.
  void Cancel();
  // The next backward pass is this replica's last in the step: its gradients are final.
  void CaptureNextBackward();
  // Completes the step: parameters that received no gradient this step contribute zeros (a replica may
  // run no micro-batch); waits for the exchange; sets every parameter's .grad to the sum over the replicas.
  // Errors name the stage, the replica site and the bucket; FailedPrecondition without BeginStep.
  // (A parameter that no replica gave a gradient gets zeros, which AdamW then steps, unlike a
  // gradient left undefined on one site; every trained parameter of the LLaMA slices gets one.)
  absl::Status Finish();

  // The error-feedback residuals, for checkpoints: one float32 CPU tensor per parameter (by name, of its
  // shape) holding the residual of every send that covers it. The sends of a bucket tile it: phase 0's
  // slices to each other replica and phase 1's slice of this replica's sum (or, with sparse_sum, the
  // whole bucket), so one tensor a parameter holds them all; a part not sent yet holds zeros. Empty when
  // the codec is lossless or error feedback is off. FailedPrecondition during a step (between BeginStep
  // and the end of Finish or Abort): the exchange threads change the residuals then.
  absl::StatusOr<std::map<std::string, torch::Tensor>> ExportResiduals();
  // Restores what ExportResiduals wrote for the same replicas in the same order (the residuals are per
  // peer: the caller checks the layout, as the replica round state's does). Empty `residuals`: nothing
  // to restore (no-op). Otherwise every parameter's tensor of its numel, else DataLoss naming the tensor
  // and nothing restored; FailedPrecondition during a step. No-op when ExportResiduals would be empty.
  // With another `bucket_bytes` than the export's, an element's residual may go with the send to another
  // peer than before; it still corrects that element's part of the sum.
  absl::Status ImportResiduals(const std::map<std::string, torch::Tensor>& residuals);

  int64_t wire_bytes() const { return wire_bytes_.load(); }  // sent so far, compressed
  int64_t raw_bytes() const { return raw_bytes_.load(); }    // the same, as float32
  int buckets() const { return static_cast<int>(buckets_.size()); }
  // Buckets synchronised so far, and how many of them were complete while the backward pass was still
  // running (their exchange overlapped the rest of it); the others completed in Finish.
  int64_t buckets_synced() const { return buckets_synced_.load(); }
  int64_t buckets_during_backward() const { return buckets_during_backward_.load(); }

 private:
  struct Bucket {
    std::vector<int> params;       // indices into params_
    std::vector<int64_t> offsets;  // element offset of each in `data`
    int64_t numel = 0;
    std::vector<float> data;
    int pending = 0;  // parameters not captured yet this step
    bool ready = false;
    std::vector<uint8_t> own;  // sparse_sum: this replica's frame of the bucket, once sent (own_sent)
    bool own_sent = false;
  };
  static constexpr int kWholeBucket = -2;  // the error-feedback key of a whole bucket (sparse_sum)

  void OnGradient(int param, const torch::Tensor& grad);  // from a hook
  void MarkLocked(int param, const torch::Tensor& final_grad, bool from_backward);
  std::pair<int64_t, int64_t> Slice(const Bucket& b, int owner) const;
  // Encodes n floats for one send; `ef_key` selects the error-feedback residual (the peer in phase 0,
  // -1 for the phase-1 sum, which is encoded once for all peers, kWholeBucket for a sparse_sum bucket).
  absl::Status EncodeSlice(int bucket, int ef_key, const float* data, int64_t n, std::vector<uint8_t>* frame);
  // The element range of bucket b that error-feedback key `ef_key` covers.
  std::pair<int64_t, int64_t> ResidualRange(const Bucket& b, int ef_key) const;
  bool KeepsResiduals() const { return !o_.codec.lossless() && o_.error_feedback; }
  absl::Status SendFrame(int peer, int bucket, int phase, int64_t n, const std::vector<uint8_t>& frame);
  absl::StatusOr<std::vector<uint8_t>> WaitSlice(int bucket, int peer, int phase);
  // Waits until `flag` (a bucket's ready or own_sent, set under mu_) holds or the step is aborted: false
  // when aborted.
  bool AwaitBucket(const bool& flag);
  void ScatterLoop();
  void ReduceLoop();
  void SumSparse();  // ReduceLoop's sparse_sum: adds the replicas' sparse buckets in replica order
  void Fail(const absl::Status& s);
  void Stop();

  Options o_;
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  rpc::TensorInbox* inbox_;
  std::map<std::string, rpc::PeerClient::OutStream*> scatter_, gather_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;                                                     // per parameter
  std::map<std::pair<int, int>, std::unique_ptr<compression::ErrorFeedback>> ef_;  // (bucket, peer or -1)
  std::mutex ef_mu_;

  std::mutex mu_;  // guards everything below and the buckets' data/pending/ready/own/own_sent
  std::condition_variable cv_;
  int64_t step_ = 0;
  bool capturing_ = false, in_step_ = false, abort_ = false;
  std::vector<bool> captured_;
  std::deque<int> ready_queue_;
  absl::Status error_;
  std::thread scatter_thread_, reduce_thread_;
  std::unique_ptr<GradientHooks> hooks_;  // last: its callbacks use everything above
  std::atomic<int64_t> wire_bytes_{0}, raw_bytes_{0}, buckets_synced_{0}, buckets_during_backward_{0};
};

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_REPLICA_SYNC_H_
