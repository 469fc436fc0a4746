#include "executor/stage.h"

#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace meridian::executor {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status Annotate(const absl::Status& s, const std::string& prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, ": ", s.message()));
}

}  // namespace

absl::StatusOr<StageAssignment> ParseAssignmentJson(const std::string& text, const std::string& path) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  StageAssignment a;
  auto str = [&](const char* k, std::string* out) -> absl::Status {
    if (!j.contains(k)) return absl::OkStatus();
    if (!j[k].is_string()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", k, ": expected a string"));
    *out = j[k].get<std::string>();
    return absl::OkStatus();
  };
  auto num = [&](const char* k, int* out, bool required) -> absl::Status {
    if (!j.contains(k))
      return required ? absl::InvalidArgumentError(absl::StrCat(path, ": ", k, ": missing")) : absl::OkStatus();
    if (!j[k].is_number_integer() || j[k].get<int64_t>() < 0 || j[k].get<int64_t>() > 1000000)
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", k, ": expected a non-negative integer"));
    *out = j[k].get<int>();
    return absl::OkStatus();
  };
  for (auto [k, out] : {std::pair<const char*, std::string*>{"job_id", &a.job_id}, {"prev_site", &a.prev_site},
                        {"next_site", &a.next_site}, {"prev_address", &a.prev_address},
                        {"next_address", &a.next_address}, {"forward_codec", &a.forward_codec},
                        {"backward_codec", &a.backward_codec}})
    if (auto s = str(k, out); !s.ok()) return s;
  for (auto [k, out] : {std::pair<const char*, int*>{"stage", &a.stage}, {"num_stages", &a.num_stages},
                        {"first_op", &a.first_op}, {"last_op", &a.last_op}})
    if (auto s = num(k, out, true); !s.ok()) return s;
  if (a.num_stages < 1 || a.stage >= a.num_stages)
    return absl::InvalidArgumentError(absl::StrCat(path, ": stage ", a.stage, " of ", a.num_stages));
  if ((a.stage > 0) != !a.prev_site.empty() || (a.stage > 0) != !a.prev_address.empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": prev_site/prev_address are required exactly when stage > 0"));
  if ((a.stage < a.num_stages - 1) != !a.next_site.empty() || (a.stage < a.num_stages - 1) != !a.next_address.empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": next_site/next_address are required exactly when a later stage exists"));
  for (const std::string* c : {&a.forward_codec, &a.backward_codec}) {
    auto spec = compression::CodecSpec::Parse(*c);
    if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", spec.status().message()));
  }
  return a;
}

std::vector<std::pair<char, int>> OneFOneBSchedule(int stage, int num_stages, int micro_batches) {
  const int warmup = std::min(num_stages - stage - 1, micro_batches);
  std::vector<std::pair<char, int>> s;
  int f = 0, b = 0;
  for (; f < warmup; ++f) s.push_back({'F', f});
  while (f < micro_batches) {
    s.push_back({'F', f++});
    s.push_back({'B', b++});
  }
  while (b < micro_batches) s.push_back({'B', b++});
  return s;
}

StageWorker::StageWorker(JobSetup setup, StageAssignment a, rpc::TensorInbox* inbox, std::string certs_dir,
                         std::string self, torch::Device device, std::chrono::seconds step_timeout)
    : setup_(std::move(setup)), a_(std::move(a)), inbox_(inbox), certs_(std::move(certs_dir)), self_(std::move(self)),
      device_(device), timeout_(step_timeout), opt_(setup_.job.optimizer),
      fwd_codec_(*compression::CodecSpec::Parse(a_.forward_codec)),
      bwd_codec_(*compression::CodecSpec::Parse(a_.backward_codec)) {
  auto built = BuildStageModel(setup_, a_.first_op, a_.last_op, device_);
  if (built.ok()) {
    model_ = std::move(*built);
  } else {  // reported by Connect(); the seeded model keeps the other methods well-defined
    init_status_ = Annotate(built.status(), Where());
    model_ = std::make_unique<StageModel>(setup_.model, a_.first_op, a_.last_op, setup_.job.seed, device_);
  }
  if (!bwd_codec_.lossless() && setup_.job.compression.error_feedback)
    bwd_ef_ = std::make_unique<compression::ErrorFeedback>(bwd_codec_);
}

std::string StageWorker::Where() const { return absl::StrCat("stage ", a_.stage, " (site '", self_, "')"); }

absl::Status StageWorker::Connect() {
  if (!init_status_.ok()) return init_status_;
  if (a_.stage > 0) {
    auto c = rpc::PeerClient::Create(certs_, self_, a_.prev_site, a_.prev_address);
    if (!c.ok()) return Annotate(c.status(), Where());
    prev_client_ = std::move(*c);
    auto s = prev_client_->OpenStream(std::chrono::hours(24 * 30), timeout_);
    if (!s.ok()) return Annotate(s.status(), Where());
    to_prev_ = std::move(*s);
  }
  if (a_.stage < a_.num_stages - 1) {
    auto c = rpc::PeerClient::Create(certs_, self_, a_.next_site, a_.next_address);
    if (!c.ok()) return Annotate(c.status(), Where());
    next_client_ = std::move(*c);
    auto s = next_client_->OpenStream(std::chrono::hours(24 * 30), timeout_);
    if (!s.ok()) return Annotate(s.status(), Where());
    to_next_ = std::move(*s);
  }
  return absl::OkStatus();
}

absl::Status StageWorker::Send(rpc::PeerClient::OutStream* stream, const std::string& peer, const rpc::TensorKey& key,
                               const torch::Tensor& t, const compression::CodecSpec& codec,
                               compression::ErrorFeedback* ef) {
  auto c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  core::TensorView v{core::DType::kFloat32, std::vector<int64_t>(c.sizes().begin(), c.sizes().end()), c.data_ptr<float>()};
  absl::StatusOr<std::vector<uint8_t>> frame = ef ? ef->Encode(v) : compression::Encode(v, codec);
  if (!frame.ok()) return Annotate(frame.status(), absl::StrCat(Where(), ": encoding ", key.ToString()));
  raw_bytes_ += static_cast<int64_t>(v.nbytes());
  wire_bytes_ += static_cast<int64_t>(frame->size());
  absl::Status s = stream->Send(key, *frame);
  if (!s.ok()) return Annotate(s, Where());
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> StageWorker::Receive(const std::string& peer, const rpc::TensorKey& key,
                                                   const std::vector<int64_t>& shape) {
  auto frame = inbox_->Wait(peer, key, Clock::now() + timeout_);
  if (!frame.ok()) return Annotate(frame.status(), Where());
  auto t = torch::empty(shape, torch::kFloat32);
  absl::Status s = compression::DecodeInto(frame->data(), frame->size(), core::DType::kFloat32, shape, t.data_ptr<float>());
  if (!s.ok())
    return Annotate(s, absl::StrCat(Where(), ": ", key.ToString(), " from peer '", peer, "'"));
  return t.to(device_);
}

absl::StatusOr<std::optional<double>> StageWorker::Step(int64_t step, int64_t total_steps) {
  const int M = setup_.micro_batches, mbs = setup_.micro_batch_size, seq = setup_.job.sequence_length;
  const int64_t d = setup_.model.shape.hidden_size;
  const std::vector<int64_t> hidden = {mbs, seq, d};
  // Only the last stage computes the loss, so only it needs the step's count of counted targets.
  const double normaliser = model_->has_head() ? setup_.data.StepTargets(step, M, mbs, seq) : 1.0;
  for (auto& [n, p] : model_->parameters())
    if (p.grad().defined()) p.mutable_grad() = torch::Tensor();
  compute_seconds_ = 0;
  auto timed = [this](auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    compute_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  };
  struct Stash {
    torch::Tensor input, output;
  };
  std::map<int, Stash> stash;
  double loss_sum = 0;
  for (auto [kind, mb] : OneFOneBSchedule(a_.stage, a_.num_stages, M)) {
    if (kind == 'F') {
      Stash s;
      TrainingData::Batch batch;
      if (model_->has_embed() || model_->has_head()) batch = setup_.data.MicroBatch(step, mb, mbs, seq);
      if (model_->has_embed()) {
        s.input = batch.inputs.to(device_);
      } else {
        auto in = Receive(a_.prev_site, {a_.job_id, step, mb, a_.stage - 1, v1::FORWARD, 0}, hidden);
        if (!in.ok()) return in.status();
        s.input = in->requires_grad_(true);
      }
      const TrainContext ctx{step, static_cast<int64_t>(mb) * mbs};
      torch::Tensor out;
      timed([&] {
        out = model_->Forward(s.input, &ctx);
        if (model_->has_head()) {
          s.output = CrossEntropySum(out, batch.targets.to(device_), normaliser);
          loss_sum += s.output.item<double>();
        }
      });
      if (!model_->has_head()) {
        s.output = out;
        if (auto st = Send(to_next_.get(), a_.next_site, {a_.job_id, step, mb, a_.stage, v1::FORWARD, 0}, out,
                           fwd_codec_, nullptr);
            !st.ok())
          return st;
      }
      stash[mb] = std::move(s);
    } else {
      Stash& s = stash[mb];
      // Under LoRA the first stages may hold no adapter before the first one: their output then needs no
      // gradient and their backward pass is only the receipt of the gradient.
      if (model_->has_head()) {
        if (s.output.requires_grad()) timed([&] { s.output.backward(); });
      } else {
        auto g = Receive(a_.next_site, {a_.job_id, step, mb, a_.stage + 1, v1::BACKWARD, 0}, hidden);
        if (!g.ok()) return g.status();
        if (s.output.requires_grad()) timed([&] { s.output.backward(*g); });
      }
      if (!model_->has_embed()) {
        if (auto st = Send(to_prev_.get(), a_.prev_site, {a_.job_id, step, mb, a_.stage, v1::BACKWARD, 0},
                           s.input.grad(), bwd_codec_, bwd_ef_.get());
            !st.ok())
          return st;
      }
      stash.erase(mb);
    }
  }
  // Global gradient norm: partial sums flow from the last stage to the first, the total back again.
  // The values travel as float64 pairs [square sum, loss] in identity frames.
  auto send_pair = [&](rpc::PeerClient::OutStream* stream, const std::string& peer, v1::Direction dir, double x,
                       double loss) {
    double v[2] = {x, loss};
    core::TensorView view{core::DType::kUInt8, {16}, v};
    auto frame = compression::Encode(view, compression::CodecSpec{});
    return stream->Send({a_.job_id, step, -1, a_.stage, dir, 0}, *frame);
  };
  auto recv_pair = [&](const std::string& peer, int from_stage, v1::Direction dir) -> absl::StatusOr<std::pair<double, double>> {
    auto f = inbox_->Wait(peer, {a_.job_id, step, -1, from_stage, dir, 0}, Clock::now() + timeout_);
    if (!f.ok()) return Annotate(f.status(), Where());
    auto t = compression::Decode(f->data(), f->size());
    if (!t.ok() || t->bytes.size() != 16)
      return absl::DataLossError(absl::StrCat(Where(), ": bad gradient-norm message from peer '", peer, "'"));
    double v[2];
    std::memcpy(v, t->bytes.data(), 16);
    return std::make_pair(v[0], v[1]);
  };
  double square = GradSquareSum(model_->parameters()), loss = loss_sum;
  if (a_.stage < a_.num_stages - 1) {
    auto r = recv_pair(a_.next_site, a_.stage + 1, v1::CONTROL);
    if (!r.ok()) return r.status();
    square += r->first;
    loss = r->second;
  }
  if (a_.stage > 0) {
    if (absl::Status s = send_pair(to_prev_.get(), a_.prev_site, v1::CONTROL, square, loss); !s.ok())
      return Annotate(s, Where());
    auto total = recv_pair(a_.prev_site, a_.stage - 1, v1::CONTROL);
    if (!total.ok()) return total.status();
    square = total->first;
  }
  if (a_.stage < a_.num_stages - 1)
    if (absl::Status s = send_pair(to_next_.get(), a_.next_site, v1::CONTROL, square, loss); !s.ok())
      return Annotate(s, Where());
  timed([&] {
    ClipByGlobalNorm(model_->parameters(), square, setup_.job.optimizer.grad_clip);
    opt_.Step(model_->parameters(), LearningRate(setup_.job.optimizer, step, total_steps));
  });
  if (model_->has_head()) return std::optional<double>(loss_sum);
  if (a_.stage == 0) return std::optional<double>(loss);  // the last stage's loss, relayed with the norm
  return std::optional<double>();
}

absl::Status StageWorker::Finish() {
  for (auto* s : {to_prev_.get(), to_next_.get()}) {
    if (!s) continue;
    auto r = s->Finish();
    if (!r.ok()) return Annotate(r.status(), Where());
  }
  return absl::OkStatus();
}

absl::Status StageWorker::SaveCheckpoint(const std::string& dir, int64_t steps_done) const {
  std::map<std::string, torch::Tensor> all = Parameters();
  for (auto& [k, v] : opt_.ExportState()) all[k] = v;
  absl::Status s = WriteCheckpoint(dir, steps_done, a_.stage, a_.num_stages, all);
  if (!s.ok()) return Annotate(s, absl::StrCat(Where(), ": checkpoint"));
  return absl::OkStatus();
}

absl::Status StageWorker::Restore(const Checkpoint& c) {
  if (absl::Status s = model_->Load(c.tensors); !s.ok())
    return Annotate(s, absl::StrCat(Where(), ": restoring from ", c.path));
  std::map<std::string, torch::Tensor> mine;
  for (const auto& [name, p] : model_->parameters())
    for (const char* kind : {"optim.m.", "optim.v."})
      if (auto it = c.tensors.find(kind + name); it != c.tensors.end()) mine[it->first] = it->second.to(device_);
  opt_.ImportState(mine, c.step);
  return absl::OkStatus();
}

std::map<std::string, torch::Tensor> StageWorker::Parameters() const {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [n, p] : model_->parameters()) out[n] = p.detach().cpu();
  return out;
}

}  // namespace meridian::executor
