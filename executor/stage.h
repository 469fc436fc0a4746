// One pipeline stage of a distributed run: runs its slice of the model under a 1F1B schedule,
// receiving activations from the previous stage and gradients from the next over the peer streams
// (rpc/peer.h), compressed with the link's codec (gradients with error feedback when lossy), then joins
// the global gradient-norm reduction along the pipeline and steps AdamW. Confined to one thread;
// the PeerService that feeds its inbox runs on gRPC's threads.
#ifndef MERIDIAN_EXECUTOR_STAGE_H_
#define MERIDIAN_EXECUTOR_STAGE_H_

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "compression/codec.h"
#include "executor/checkpoint.h"
#include "executor/trainer.h"
#include "rpc/peer.h"

namespace meridian::executor {

// What a stage needs to know about its place in the plan (the coordinator's StageAssignment, or a JSON
// file in static mode: docs/executor.md).
struct StageAssignment {
  std::string job_id = "job";
  int stage = 0, num_stages = 1;
  int first_op = 0, last_op = 0;
  std::string prev_site, next_site, prev_address, next_address;
  std::string forward_codec = "identity";   // activations to the next stage
  std::string backward_codec = "identity";  // gradients to the previous stage
};
absl::StatusOr<StageAssignment> ParseAssignmentJson(const std::string& text, const std::string& path);

// 1F1B order for stage k of S with M micro-batches: ('F', m) and ('B', m) entries.
std::vector<std::pair<char, int>> OneFOneBSchedule(int stage, int num_stages, int micro_batches);

class StageWorker {
 public:
  StageWorker(JobSetup setup, StageAssignment assignment, rpc::TensorInbox* inbox, std::string certs_dir,
              std::string self, torch::Device device, std::chrono::seconds step_timeout);
  // Opens the streams to the neighbours (they may still be starting: waited for up to the timeout).
  // First reports a failure to load the model directory's weights for this slice, if there was one.
  absl::Status Connect();
  // Runs optimizer step `step` of `total_steps`. Returns the step's mean loss on the last stage, nullopt
  // elsewhere. Every error names the stage, the peer and the tensor involved.
  absl::StatusOr<std::optional<double>> Step(int64_t step, int64_t total_steps);
  // Closes the outgoing streams (waits for the neighbours' acknowledgements).
  absl::Status Finish();
  std::map<std::string, torch::Tensor> Parameters() const;
  // Writes this stage's shard of the checkpoint after `steps_done` steps (parameters and AdamW moments).
  // The error-feedback residual is not saved: a resumed lossy link starts with an empty one.
  absl::Status SaveCheckpoint(const std::string& dir, int64_t steps_done) const;
  // Loads this stage's parameters and moments by name from a checkpoint of any partition.
  absl::Status Restore(const Checkpoint& checkpoint);
  int64_t wire_bytes() const { return wire_bytes_; }
  // Seconds the last Step spent computing (forward, loss, backward, clipping, optimizer): the step's time
  // without waiting for neighbours or encoding and sending.
  double last_compute_seconds() const { return compute_seconds_; }
  int64_t raw_bytes() const { return raw_bytes_; }

 private:
  absl::Status Send(rpc::PeerClient::OutStream* stream, const std::string& peer, const rpc::TensorKey& key,
                    const torch::Tensor& t, const compression::CodecSpec& codec, compression::ErrorFeedback* ef);
  absl::StatusOr<torch::Tensor> Receive(const std::string& peer, const rpc::TensorKey& key,
                                        const std::vector<int64_t>& shape);
  std::string Where() const;

  JobSetup setup_;
  StageAssignment a_;
  rpc::TensorInbox* inbox_;
  std::string certs_, self_;
  torch::Device device_;
  std::chrono::seconds timeout_;
  std::unique_ptr<StageModel> model_;
  absl::Status init_status_;
  AdamW opt_;
  compression::CodecSpec fwd_codec_, bwd_codec_;
  std::unique_ptr<compression::ErrorFeedback> bwd_ef_;
  std::unique_ptr<rpc::PeerClient> prev_client_, next_client_;
  std::unique_ptr<rpc::PeerClient::OutStream> to_prev_, to_next_;
  int64_t wire_bytes_ = 0, raw_bytes_ = 0;
  double compute_seconds_ = 0;
};

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_STAGE_H_
