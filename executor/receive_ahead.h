// Receives a step's activations and activation gradients ahead of the compute thread (issue #16): a
// thread of its own takes each frame the stage will ask for from the inbox, in the order it will ask,
// and decodes it, so the compute thread finds the tensor ready instead of decoding it between passes.
#ifndef MERIDIAN_EXECUTOR_RECEIVE_AHEAD_H_
#define MERIDIAN_EXECUTOR_RECEIVE_AHEAD_H_

#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "rpc/peer.h"

namespace meridian::executor {

// One tensor a stage expects from a neighbour during a step.
struct ExpectedTensor {
  std::string peer;
  rpc::TensorKey key;
  std::vector<int64_t> shape;
  // The micro-batch's training sequences (an AQ-SGD delta message is decoded against them), or empty.
  std::vector<int64_t> ids;
};

// Waits for `expected` in order and decodes each with `decode` on a thread of its own, keeping at most
// `lookahead` decoded tensors that Take has not yet taken (a bound on the memory it holds beyond the
// inbox's frames). Take hands them over in the same order. `decode` runs only on that thread, one call at
// a time, in order (a delta decoder's state may live in it); the thread is joined by the destructor,
// which also stops a wait for a frame that never comes.
//
// Errors: a frame that fails to decode, or an inbox error (a failed peer), is returned by the Take that
// asks for that tensor, and ends the receiving (later Takes return it too). Take returns
// DeadlineExceeded naming the peer and the key when the tensor is not ready within `timeout` of the
// call, and InvalidArgument when asked for a tensor other than the next expected one (a caller's bug).
//
// Thread-safety: Take and decode_seconds from one thread (the compute thread); the rest is internal.
class ReceiveAhead {
 public:
  using Decode = std::function<absl::StatusOr<torch::Tensor>(const ExpectedTensor&, const std::vector<uint8_t>&)>;
  // REQUIRES: lookahead >= 1; `inbox` outlives this object.
  ReceiveAhead(rpc::TensorInbox* inbox, std::vector<ExpectedTensor> expected, Decode decode, int lookahead = 2);
  ~ReceiveAhead();
  ReceiveAhead(const ReceiveAhead&) = delete;
  ReceiveAhead& operator=(const ReceiveAhead&) = delete;

  absl::StatusOr<torch::Tensor> Take(const std::string& peer, const rpc::TensorKey& key,
                                     std::chrono::steady_clock::duration timeout);
  // Seconds the receiving thread spent decoding, so far.
  double decode_seconds() const;
  // Tensors decoded so far (taken or waiting).
  int decoded() const;

 private:
  void Loop();

  rpc::TensorInbox* const inbox_;
  const std::vector<ExpectedTensor> expected_;
  const Decode decode_;
  const int lookahead_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<torch::Tensor> ready_;  // decoded, in order, not yet taken
  absl::Status error_;               // the first failure; receiving stopped there
  size_t taken_ = 0;                 // tensors handed out by Take
  double decode_seconds_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest is built
};

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_RECEIVE_AHEAD_H_
