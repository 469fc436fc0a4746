#include "executor/replica_sync.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/thread_name.h"

namespace meridian::executor {
namespace {

using core::Annotate;

using Clock = std::chrono::steady_clock;

}  // namespace

GradientAverager::GradientAverager(Options options, std::vector<std::pair<std::string, torch::Tensor>> params,
                                   rpc::TensorInbox* inbox, std::map<std::string, rpc::PeerClient::OutStream*> scatter,
                                   std::map<std::string, rpc::PeerClient::OutStream*> gather)
    : o_(std::move(options)),
      params_(std::move(params)),
      inbox_(inbox),
      scatter_(std::move(scatter)),
      gather_(std::move(gather)) {
  const BucketLayout layout = LayOutBuckets(params_, o_.bucket_bytes);
  bucket_of_ = layout.bucket_of;
  for (const auto& l : layout.buckets) {
    Bucket b;
    b.params = l.params;
    b.offsets = l.offsets;
    b.numel = l.numel;
    b.data.assign(l.numel, 0.0f);
    buckets_.push_back(std::move(b));
  }
  captured_.assign(params_.size(), false);
  hooks_ = std::make_unique<GradientHooks>(params_, [this](int i, const torch::Tensor& grad) { OnGradient(i, grad); });
}

GradientAverager::~GradientAverager() {
  Stop();
  hooks_.reset();  // the hooks stay on the parameters, doing nothing from here on
}

void GradientAverager::Stop() {
  {
    std::lock_guard<std::mutex> l(mu_);
    abort_ = true;
  }
  cv_.notify_all();
  if (scatter_thread_.joinable()) scatter_thread_.join();
  if (reduce_thread_.joinable()) reduce_thread_.join();
}

void GradientAverager::Cancel() {
  {
    std::lock_guard<std::mutex> l(mu_);
    abort_ = true;
  }
  cv_.notify_all();
}

void GradientAverager::Abort() {
  Stop();
  std::lock_guard<std::mutex> l(mu_);
  in_step_ = false;
  capturing_ = false;
}

void GradientAverager::BeginStep(int64_t step) {
  if (scatter_thread_.joinable() || reduce_thread_.joinable()) Abort();
  std::lock_guard<std::mutex> l(mu_);
  step_ = step;
  capturing_ = false;
  in_step_ = true;
  abort_ = false;
  error_ = absl::OkStatus();
  ready_queue_.clear();
  std::fill(captured_.begin(), captured_.end(), false);
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.ready = false;
    b.own_sent = false;
  }
  scatter_thread_ = core::NamedThread("mrd-rs-scatter", [this] { ScatterLoop(); });
  reduce_thread_ = core::NamedThread("mrd-rs-reduce", [this] { ReduceLoop(); });
}

void GradientAverager::CaptureNextBackward() {
  std::lock_guard<std::mutex> l(mu_);
  capturing_ = true;
}

void GradientAverager::OnGradient(int param, const torch::Tensor& grad) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!capturing_ || captured_[param]) return;
  }
  // The hook runs before autograd adds `grad` to .grad, so the final gradient is their sum.
  const torch::Tensor& p = params_[param].second;
  torch::Tensor full = p.grad().defined() ? p.grad() + grad : grad;
  std::lock_guard<std::mutex> l(mu_);
  if (captured_[param]) return;
  MarkLocked(param, full, true);
  cv_.notify_all();
}

void GradientAverager::MarkLocked(int param, const torch::Tensor& final_grad, bool from_backward) {
  Bucket& b = buckets_[bucket_of_[param]];
  int64_t offset = 0;
  for (size_t j = 0; j < b.params.size(); ++j)
    if (b.params[j] == param) offset = b.offsets[j];
  const int64_t n = params_[param].second.numel();
  if (final_grad.defined()) {
    torch::Tensor c = final_grad.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    std::memcpy(b.data.data() + offset, c.data_ptr<float>(), n * sizeof(float));
  } else {
    std::fill(b.data.begin() + offset, b.data.begin() + offset + n, 0.0f);
  }
  captured_[param] = true;
  if (--b.pending == 0) {
    b.ready = true;
    ready_queue_.push_back(bucket_of_[param]);
    ++buckets_synced_;
    if (from_backward) ++buckets_during_backward_;
  }
}

std::pair<int64_t, int64_t> GradientAverager::Slice(const Bucket& b, int owner) const {
  const int64_t r = static_cast<int64_t>(o_.sites.size());
  return {b.numel * owner / r, b.numel * (owner + 1) / r};
}

void GradientAverager::Fail(const absl::Status& s) {
  std::lock_guard<std::mutex> l(mu_);
  if (error_.ok()) error_ = s;
  abort_ = true;
  cv_.notify_all();
}

absl::Status GradientAverager::EncodeSlice(int bucket, int ef_key, const float* data, int64_t n,
                                           std::vector<uint8_t>* frame) {
  core::TensorView v{core::DType::kFloat32, {n}, const_cast<float*>(data)};
  if (!KeepsResiduals()) return compression::EncodeTo(v, o_.codec, frame);
  compression::ErrorFeedback* ef;
  {
    std::lock_guard<std::mutex> l(ef_mu_);
    auto& slot = ef_[{bucket, ef_key}];
    if (!slot) slot = std::make_unique<compression::ErrorFeedback>(o_.codec, o_.error_feedback_decay);
    ef = slot.get();
  }
  auto f = ef->Encode(v);
  if (!f.ok()) return f.status();
  *frame = std::move(*f);
  return absl::OkStatus();
}

std::pair<int64_t, int64_t> GradientAverager::ResidualRange(const Bucket& b, int ef_key) const {
  if (ef_key == kWholeBucket) return {0, b.numel};
  return Slice(b, ef_key == -1 ? o_.self : ef_key);
}

absl::StatusOr<std::map<std::string, torch::Tensor>> GradientAverager::ExportResiduals() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (in_step_)
      return absl::FailedPreconditionError(
          absl::StrCat(o_.where, ": replica gradient sync: residuals exported during a step"));
  }
  std::map<std::string, torch::Tensor> out;
  if (!KeepsResiduals()) return out;
  std::lock_guard<std::mutex> l(ef_mu_);
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    const Bucket& bucket = buckets_[b];
    torch::Tensor whole = torch::zeros({bucket.numel}, torch::kFloat32);
    float* dst = whole.data_ptr<float>();
    for (auto it = ef_.lower_bound({b, std::numeric_limits<int>::min()}); it != ef_.end() && it->first.first == b;
         ++it) {
      const auto [lo, hi] = ResidualRange(bucket, it->first.second);
      const std::vector<float>& residual = it->second->residual();
      if (hi > lo && static_cast<int64_t>(residual.size()) == hi - lo)  // empty: not sent yet
        std::memcpy(dst + lo, residual.data(), (hi - lo) * sizeof(float));
    }
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const auto& [name, p] = params_[bucket.params[k]];
      out[name] = whole.narrow(0, bucket.offsets[k], p.numel()).reshape(p.sizes()).clone();
    }
  }
  return out;
}

absl::Status GradientAverager::ImportResiduals(const std::map<std::string, torch::Tensor>& residuals) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (in_step_)
      return absl::FailedPreconditionError(
          absl::StrCat(o_.where, ": replica gradient sync: residuals imported during a step"));
  }
  if (residuals.empty() || !KeepsResiduals()) return absl::OkStatus();
  // Every bucket whole first; nothing is set unless all fit.
  std::vector<std::vector<float>> whole(buckets_.size());
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    const Bucket& bucket = buckets_[b];
    whole[b].resize(static_cast<size_t>(bucket.numel));
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const auto& [name, p] = params_[bucket.params[k]];
      auto it = residuals.find(name);
      if (it == residuals.end())
        return absl::DataLossError(absl::StrCat(o_.where, ": the error-feedback residual of ", name, " is missing"));
      if (it->second.numel() != p.numel())
        return absl::DataLossError(absl::StrCat(o_.where, ": the error-feedback residual of ", name, " has ",
                                                it->second.numel(), " values for a parameter of ", p.numel()));
      const torch::Tensor t = it->second.to(torch::kCPU, torch::kFloat32).contiguous();
      std::memcpy(whole[b].data() + bucket.offsets[k], t.data_ptr<float>(), p.numel() * sizeof(float));
    }
  }
  std::lock_guard<std::mutex> l(ef_mu_);
  ef_.clear();
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    std::vector<int> keys;
    if (o_.sparse_sum) {
      keys.push_back(kWholeBucket);
    } else {
      keys.push_back(-1);
      for (int j = 0; j < static_cast<int>(o_.sites.size()); ++j)
        if (j != o_.self) keys.push_back(j);
    }
    for (int key : keys) {
      const auto [lo, hi] = ResidualRange(buckets_[b], key);
      auto ef = std::make_unique<compression::ErrorFeedback>(o_.codec, o_.error_feedback_decay);
      if (absl::Status s = ef->Restore({hi - lo}, std::vector<float>(whole[b].begin() + lo, whole[b].begin() + hi));
          !s.ok())
        return absl::InternalError(absl::StrCat(o_.where, ": bucket ", b, ": ", s.message()));
      ef_[{b, key}] = std::move(ef);
    }
  }
  return absl::OkStatus();
}

absl::Status GradientAverager::SendFrame(int peer, int bucket, int phase, int64_t n,
                                         const std::vector<uint8_t>& frame) {
  raw_bytes_ += n * static_cast<int64_t>(sizeof(float));
  wire_bytes_ += static_cast<int64_t>(frame.size());
  rpc::PeerClient::OutStream* stream = (phase == 0 ? scatter_ : gather_).at(o_.sites[peer]);
  return stream->Send({o_.job_id, step_, bucket, o_.stage, v1::REPLICA_GRADIENT, phase}, frame);
}

absl::StatusOr<std::vector<uint8_t>> GradientAverager::WaitSlice(int bucket, int peer, int phase) {
  const rpc::TensorKey key{o_.job_id, step_, bucket, o_.stage, v1::REPLICA_GRADIENT, phase};
  const auto deadline = Clock::now() + o_.timeout;
  while (true) {  // in short slices, so that an abandoned step ends promptly
    const auto until = std::min(deadline, Clock::now() + std::chrono::milliseconds(250));
    auto f = inbox_->Wait(o_.sites[peer], key, until);
    if (f.ok() || f.status().code() != absl::StatusCode::kDeadlineExceeded || Clock::now() >= deadline) return f;
    std::lock_guard<std::mutex> l(mu_);
    if (abort_) return absl::CancelledError("the step was abandoned");
  }
}

void GradientAverager::ScatterLoop() {
  std::vector<uint8_t> frame;
  for (size_t sent = 0; sent < buckets_.size(); ++sent) {
    int b;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return abort_ || !ready_queue_.empty(); });
      if (abort_) return;
      b = ready_queue_.front();
      ready_queue_.pop_front();
    }
    Bucket& bucket = buckets_[b];  // ready: its data no longer changes until the reduce thread sums it
    if (o_.sparse_sum) {           // the whole bucket, sparsified once through its residual, to every replica
      absl::Status s = EncodeSlice(b, kWholeBucket, bucket.data.data(), bucket.numel, &frame);
      for (int j = 0; s.ok() && j < static_cast<int>(o_.sites.size()); ++j)
        if (j != o_.self) s = SendFrame(j, b, 0, bucket.numel, frame);
      if (!s.ok()) return Fail(Annotate(s, absl::StrCat(o_.where, ": replica gradient sync: sending bucket ", b)));
      {
        std::lock_guard<std::mutex> l(mu_);
        bucket.own = std::move(frame);
        bucket.own_sent = true;
      }
      cv_.notify_all();
      continue;
    }
    for (int j = 0; j < static_cast<int>(o_.sites.size()); ++j) {
      if (j == o_.self) continue;
      auto [lo, hi] = Slice(bucket, j);
      absl::Status s = EncodeSlice(b, j, bucket.data.data() + lo, hi - lo, &frame);
      if (s.ok()) s = SendFrame(j, b, 0, hi - lo, frame);
      if (!s.ok())
        return Fail(Annotate(s, absl::StrCat(o_.where, ": replica gradient sync: sending bucket ", b, " to replica '",
                                             o_.sites[j], "'")));
    }
  }
}

bool GradientAverager::AwaitBucket(const bool& flag) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return abort_ || flag; });
  return !abort_;
}

void GradientAverager::ReduceLoop() {
  if (o_.sparse_sum) return SumSparse();
  std::vector<uint8_t> frame;
  const int r = static_cast<int>(o_.sites.size());
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    Bucket& bucket = buckets_[b];
    if (!AwaitBucket(bucket.ready)) return;
    auto [lo, hi] = Slice(bucket, o_.self);
    const int64_t n = hi - lo;
    std::vector<float> sum(n, 0.0f), part(n);
    for (int j = 0; j < r; ++j) {  // in replica order: every owner adds in the same order
      const float* src = bucket.data.data() + lo;
      if (j != o_.self) {
        auto f = WaitSlice(b, j, 0);
        absl::Status s = f.status();
        if (s.ok()) s = compression::DecodeInto(f->data(), f->size(), core::DType::kFloat32, {n}, part.data());
        if (!s.ok())
          return Fail(Annotate(
              s, absl::StrCat(o_.where, ": replica gradient sync: bucket ", b, " from replica '", o_.sites[j], "'")));
        src = part.data();
      }
      for (int64_t i = 0; i < n; ++i) sum[i] += src[i];
    }
    // One frame for every replica (with error feedback, encoding twice would differ).
    if (absl::Status s = EncodeSlice(b, -1, sum.data(), n, &frame); !s.ok())
      return Fail(Annotate(s, absl::StrCat(o_.where, ": replica gradient sync: encoding the sum of bucket ", b)));
    for (int j = 0; j < r; ++j) {
      if (j == o_.self) continue;
      absl::Status s = SendFrame(j, b, 1, n, frame);
      if (!s.ok())
        return Fail(Annotate(s, absl::StrCat(o_.where, ": replica gradient sync: sending the sum of bucket ", b,
                                             " to replica '", o_.sites[j], "'")));
    }
    // Lossy: keep what the others decode, so every replica holds the same values.
    if (!o_.codec.lossless() && r > 1) {
      absl::Status s = compression::DecodeInto(frame.data(), frame.size(), core::DType::kFloat32, {n}, sum.data());
      if (!s.ok()) return Fail(Annotate(s, absl::StrCat(o_.where, ": replica gradient sync: bucket ", b)));
    }
    std::memcpy(bucket.data.data() + lo, sum.data(), n * sizeof(float));
  }
}

void GradientAverager::SumSparse() {
  const int r = static_cast<int>(o_.sites.size());
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    Bucket& bucket = buckets_[b];
    if (!AwaitBucket(bucket.own_sent)) return;
    const int64_t n = bucket.numel;
    std::vector<float> sum(n, 0.0f), part(n);
    for (int j = 0; j < r; ++j) {                   // in replica order: every replica adds in the same order
      const std::vector<uint8_t>* f = &bucket.own;  // this replica's, else the one received
      absl::StatusOr<std::vector<uint8_t>> received;
      absl::Status s;
      if (j != o_.self) {
        received = WaitSlice(b, j, 0);
        s = received.status();
        if (s.ok()) f = &*received;
      }
      if (s.ok()) s = compression::DecodeInto(f->data(), f->size(), core::DType::kFloat32, {n}, part.data());
      if (!s.ok())
        return Fail(Annotate(
            s, absl::StrCat(o_.where, ": replica gradient sync: bucket ", b, " from replica '", o_.sites[j], "'")));
      for (int64_t i = 0; i < n; ++i) sum[i] += part[i];
    }
    std::memcpy(bucket.data.data(), sum.data(), n * sizeof(float));
  }
}

absl::Status GradientAverager::Finish() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!in_step_)
      return absl::FailedPreconditionError(absl::StrCat(o_.where, ": replica gradient sync: no step begun"));
    for (int i = 0; i < static_cast<int>(params_.size()); ++i)
      if (!captured_[i]) MarkLocked(i, params_[i].second.grad(), false);
    capturing_ = false;
  }
  cv_.notify_all();
  if (scatter_thread_.joinable()) scatter_thread_.join();
  if (reduce_thread_.joinable()) reduce_thread_.join();
  {
    std::lock_guard<std::mutex> l(mu_);
    in_step_ = false;
    if (!error_.ok()) return error_;
    if (abort_) return absl::CancelledError(absl::StrCat(o_.where, ": replica gradient sync: cancelled"));
  }
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b) {
    Bucket& bucket = buckets_[b];
    for (int j = 0; j < static_cast<int>(o_.sites.size()); ++j) {
      if (j == o_.self || o_.sparse_sum) continue;  // sparse_sum: SumSparse summed the whole bucket
      auto [lo, hi] = Slice(bucket, j);
      auto f = WaitSlice(b, j, 1);
      absl::Status s = f.status();
      if (s.ok())
        s = compression::DecodeInto(f->data(), f->size(), core::DType::kFloat32, {hi - lo}, bucket.data.data() + lo);
      if (!s.ok())
        return Annotate(s, absl::StrCat(o_.where, ": replica gradient sync: the sum of bucket ", b, " from replica '",
                                        o_.sites[j], "'"));
    }
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      torch::Tensor& p = params_[bucket.params[k]].second;
      torch::Tensor g = torch::from_blob(bucket.data.data() + bucket.offsets[k], p.sizes(), torch::kFloat32)
                            .clone()
                            .to(p.device(), p.scalar_type());
      p.mutable_grad() = g;
    }
  }
  return absl::OkStatus();
}

}  // namespace meridian::executor
