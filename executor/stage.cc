#include "executor/stage.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint_dir.h"
#include "core/cpu_time.h"
#include "core/log.h"
#include "core/status.h"
#include "executor/torch_boundary.h"
#include "partitioner/planner.h"

namespace meridian::executor {
namespace {

using core::Annotate;

using Clock = std::chrono::steady_clock;

// A checkpoint's name for a trained parameter's early weights (job.step_overlap; SaveCheckpoint).
const std::string kEarlyPrefix = "early.";

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
  for (auto [k, out] : {std::pair<const char*, std::string*>{"job_id", &a.job_id},
                        {"prev_site", &a.prev_site},
                        {"next_site", &a.next_site},
                        {"prev_address", &a.prev_address},
                        {"next_address", &a.next_address},
                        {"forward_codec", &a.forward_codec},
                        {"backward_codec", &a.backward_codec},
                        {"prev_forward_codec", &a.prev_forward_codec}})
    if (auto s = str(k, out); !s.ok()) return s;
  for (auto [k, out] : {std::pair<const char*, int*>{"stage", &a.stage},
                        {"num_stages", &a.num_stages},
                        {"first_op", &a.first_op},
                        {"last_op", &a.last_op}})
    if (auto s = num(k, out, true); !s.ok()) return s;
  if (auto s = num("in_flight", &a.in_flight, false); !s.ok()) return s;
  for (auto [k, out] :
       {std::pair<const char*, bool*>{"recompute", &a.recompute}, {"whole_pipelines", &a.whole_pipelines}}) {
    if (!j.contains(k)) continue;
    if (!j[k].is_boolean()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", k, ": expected true or false"));
    *out = j[k].get<bool>();
  }
  if (auto s = str("gradient_codec", &a.gradient_codec); !s.ok()) return s;
  for (auto [k, out] :
       {std::pair<const char*, int64_t*>{"send_queue_bytes", &a.send_queue_bytes}, {"bucket_bytes", &a.bucket_bytes}}) {
    if (!j.contains(k)) continue;
    if (!j[k].is_number_integer() || j[k].get<int64_t>() < 1)
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", k, ": expected a positive integer"));
    *out = j[k].get<int64_t>();
  }
  // "replicas", "prev_replicas", "next_replicas": [{"site": S, "address": A, "micro_batches": N}, ...]
  for (auto [k, group] : {std::pair<const char*, StageSites*>{"replicas", &a.replicas},
                          {"prev_replicas", &a.prev_replicas},
                          {"next_replicas", &a.next_replicas}}) {
    if (!j.contains(k)) continue;
    if (!j[k].is_array() || j[k].empty())
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", k, ": expected a non-empty list of sites"));
    bool shares = j[k][0].is_object() && j[k][0].contains("micro_batches");
    for (size_t i = 0; i < j[k].size(); ++i) {
      const auto& e = j[k][i];
      const std::string where = absl::StrCat(path, ": ", k, "[", i, "]");
      if (!e.is_object() || !e.contains("site") || !e["site"].is_string())
        return absl::InvalidArgumentError(absl::StrCat(where, ": expected {\"site\": ..., \"address\": ...}"));
      group->sites.push_back(e["site"].get<std::string>());
      group->addresses.push_back(e.contains("address") && e["address"].is_string() ? e["address"].get<std::string>()
                                                                                   : "");
      if (shares != e.contains("micro_batches"))
        return absl::InvalidArgumentError(absl::StrCat(where, ": micro_batches: give it for every site or none"));
      if (shares) {
        if (!e["micro_batches"].is_number_integer() || e["micro_batches"].get<int64_t>() < 0 ||
            e["micro_batches"].get<int64_t>() > 65536)
          return absl::InvalidArgumentError(absl::StrCat(where, ": micro_batches: expected a non-negative integer"));
        group->micro_batches.push_back(e["micro_batches"].get<int>());
      }
    }
  }
  if (a.num_stages < 1 || a.stage >= a.num_stages)
    return absl::InvalidArgumentError(absl::StrCat(path, ": stage ", a.stage, " of ", a.num_stages));
  const bool has_prev = !a.prev_replicas.sites.empty() || (!a.prev_site.empty() && !a.prev_address.empty());
  const bool has_next = !a.next_replicas.sites.empty() || (!a.next_site.empty() && !a.next_address.empty());
  if ((a.stage > 0) != has_prev || (a.prev_replicas.sites.empty() && a.prev_site.empty() != a.prev_address.empty()))
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": prev_site/prev_address (or prev_replicas) are required exactly when stage > 0"));
  if ((a.stage < a.num_stages - 1) != has_next ||
      (a.next_replicas.sites.empty() && a.next_site.empty() != a.next_address.empty()))
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": next_site/next_address (or next_replicas) are required exactly when a later stage exists"));
  for (const std::string* c : {&a.forward_codec, &a.backward_codec, &a.gradient_codec, &a.prev_forward_codec}) {
    auto spec = compression::CodecSpec::Parse(*c);
    if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", spec.status().message()));
  }
  return a;
}

absl::Status ResolveReplicas(StageAssignment* a, const std::string& self, int micro_batches) {
  if (a->replicas.sites.empty()) a->replicas = {{self}, {""}, {}};
  if (a->prev_replicas.sites.empty() && a->stage > 0) a->prev_replicas = {{a->prev_site}, {a->prev_address}, {}};
  if (a->next_replicas.sites.empty() && a->stage + 1 < a->num_stages)
    a->next_replicas = {{a->next_site}, {a->next_address}, {}};
  std::set<std::string> seen;
  for (auto [name, g] : {std::pair<const char*, StageSites*>{"replicas", &a->replicas},
                         {"prev_replicas", &a->prev_replicas},
                         {"next_replicas", &a->next_replicas}}) {
    if (g->sites.empty()) continue;
    g->addresses.resize(g->sites.size());
    if (g->micro_batches.empty())
      g->micro_batches = partitioner::ShareMicroBatches(micro_batches, std::vector<double>(g->sites.size(), 0.0));
    if (g->micro_batches.size() != g->sites.size())
      return absl::InvalidArgumentError(absl::StrCat("assignment: ", name, ": ", g->micro_batches.size(),
                                                     " micro-batch shares for ", g->sites.size(), " sites"));
    int sum = 0;
    for (int m : g->micro_batches) {
      if (m < 0)
        return absl::InvalidArgumentError(absl::StrCat("assignment: ", name, ": a negative micro-batch share"));
      sum += m;
    }
    if (sum != micro_batches)
      return absl::InvalidArgumentError(absl::StrCat("assignment: ", name, ": the sites' micro-batch shares sum to ",
                                                     sum, ", but a step has ", micro_batches, " micro-batches"));
    for (size_t i = 0; i < g->sites.size(); ++i) {
      if (!seen.insert(g->sites[i]).second)
        return absl::InvalidArgumentError(absl::StrCat("assignment: ", name, ": site '", g->sites[i],
                                                       "' appears twice in the stage and its neighbours"));
      if (g->sites[i] != self && g->addresses[i].empty())
        return absl::InvalidArgumentError(
            absl::StrCat("assignment: ", name, ": site '", g->sites[i], "' has no address"));
    }
  }
  if (std::find(a->replicas.sites.begin(), a->replicas.sites.end(), self) == a->replicas.sites.end())
    return absl::InvalidArgumentError(
        absl::StrCat("assignment: replicas: this site '", self, "' is not among the stage's sites"));
  if (a->whole_pipelines) {  // pipeline r is replica r of every stage: the neighbours must pair up with this stage
    if (a->replicas.sites.size() < 2)
      return absl::InvalidArgumentError("assignment: whole_pipelines: the stage has one site, not one per pipeline");
    for (auto [name, g] : {std::pair<const char*, const StageSites*>{"prev_replicas", &a->prev_replicas},
                           {"next_replicas", &a->next_replicas}})
      if (!g->sites.empty() && g->micro_batches != a->replicas.micro_batches)
        return absl::InvalidArgumentError(absl::StrCat(
            "assignment: whole_pipelines: ", name, " has ", g->sites.size(), " sites with micro-batch shares ",
            absl::StrJoin(g->micro_batches, "/"), ", not the stage's ", absl::StrJoin(a->replicas.micro_batches, "/"),
            ": micro-batches would cross between pipelines"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StageWorker>> StageWorker::Create(JobSetup setup, StageAssignment a,
                                                                 rpc::TensorInbox* inbox, std::string certs_dir,
                                                                 std::string self, torch::Device device,
                                                                 std::chrono::seconds step_timeout) {
  const std::string what = absl::StrCat("stage ", a.stage, " at site '", self, "'");
  return GuardTorch(what, [&]() -> absl::StatusOr<std::unique_ptr<StageWorker>> {
    return std::unique_ptr<StageWorker>(new StageWorker(std::move(setup), std::move(a), inbox, std::move(certs_dir),
                                                        std::move(self), device, step_timeout));
  });
}

StageWorker::StageWorker(JobSetup setup, StageAssignment a, rpc::TensorInbox* inbox, std::string certs_dir,
                         std::string self, torch::Device device, std::chrono::seconds step_timeout)
    : setup_(std::move(setup)),
      a_(std::move(a)),
      inbox_(inbox),
      replaced_seen_(inbox->replaced()),
      certs_(std::move(certs_dir)),
      self_(std::move(self)),
      device_(device),
      timeout_(step_timeout),
      opt_(setup_.job.optimizer),
      fwd_codec_(*compression::CodecSpec::Parse(a_.forward_codec)),
      bwd_codec_(*compression::CodecSpec::Parse(a_.backward_codec)) {
  auto grad_codec = compression::CodecSpec::Parse(a_.gradient_codec);
  if (grad_codec.ok())
    grad_codec_ = *grad_codec;
  else
    init_status_ = Annotate(grad_codec.status(), absl::StrCat(Where(), ": gradient_codec"));
  if (absl::Status s = ResolveReplicas(&a_, self_, setup_.micro_batches); !s.ok() && init_status_.ok())
    init_status_ = Annotate(s, Where());
  if (init_status_.ok()) {
    replica_ = static_cast<int>(std::find(a_.replicas.sites.begin(), a_.replicas.sites.end(), self_) -
                                a_.replicas.sites.begin());
    owner_ = partitioner::MicroBatchOwners(a_.replicas.micro_batches);
    if (!a_.prev_replicas.sites.empty()) prev_owner_ = partitioner::MicroBatchOwners(a_.prev_replicas.micro_batches);
    if (!a_.next_replicas.sites.empty()) next_owner_ = partitioner::MicroBatchOwners(a_.next_replicas.micro_batches);
  }
  auto built = BuildStageModel(setup_, a_.first_op, a_.last_op, device_);
  if (built.ok()) {
    model_ = std::move(*built);
  } else {  // reported by Connect(); the seeded model keeps the other methods well-defined
    if (init_status_.ok()) init_status_ = Annotate(built.status(), Where());
    model_ = std::make_unique<StageModel>(setup_.model, a_.first_op, a_.last_op, setup_.job.seed, device_);
  }
  for (auto [field, codec] : {std::pair<const char*, const compression::CodecSpec*>{"backward_codec", &bwd_codec_},
                              {"gradient_codec", &grad_codec_}})
    if (codec->delta && init_status_.ok())
      init_status_ = absl::InvalidArgumentError(absl::StrCat(Where(), ": ", field, ": ", codec->ToString(),
                                                             " is an activation codec (AQ-SGD deltas); gradients "
                                                             "use int8 or int4"));
  // job.step_overlap: each step's early micro-batches finish their backward passes before the next step's
  // begin (partitioner::MaxInFlightForOverlap), since they share one second set of weights.
  if (const int K = setup_.job.step_overlap; K > 0 && init_status_.ok()) {
    const int depth = partitioner::InFlightOf(a_.stage, a_.num_stages, setup_.micro_batches, a_.in_flight);
    if (depth > partitioner::MaxInFlightForOverlap(setup_.micro_batches, K))
      init_status_ = absl::InvalidArgumentError(absl::StrCat(
          Where(), ": job.step_overlap ", K, " with ", setup_.micro_batches, " micro-batches a step allows at most ",
          partitioner::MaxInFlightForOverlap(setup_.micro_batches, K), " in flight, and the plan keeps ", depth,
          " here (a smaller job.step_overlap, or a plan made for it: the planner caps the depth)"));
  }
  if (auto prev = compression::CodecSpec::Parse(a_.prev_forward_codec); prev.ok()) prev_delta_ = prev->delta;
  if ((fwd_codec_.delta || prev_delta_) && !setup_.data.dataset() && init_status_.ok())
    init_status_ = absl::InvalidArgumentError(
        absl::StrCat(Where(),
                     ": AQ-SGD activation deltas need a data set whose sequences come back each epoch (job.data); "
                     "synthetic data never repeats, so every sequence would be stored and none reused"));
  if (!bwd_codec_.lossless() && setup_.job.compression.error_feedback)
    for (const auto& site : a_.prev_replicas.sites)
      bwd_ef_[site] = std::make_unique<compression::ErrorFeedback>(bwd_codec_);
  // DiLoCo (job.sync.mode: diloco) among this stage's replicas: inner steps on the own micro-batches, an
  // outer exchange every job.sync.inner_steps (executor/diloco.h).
  if (init_status_.ok() && setup_.job.sync.mode == core::SyncMode::kDiloco && a_.replicas.sites.size() > 1) {
    const int M = setup_.micro_batches;
    const int mine = static_cast<int>(std::count(owner_.begin(), owner_.end(), replica_));
    own_micro_batches_ = mine;
    diloco_ = true;
    outer_ =
        std::make_unique<OuterSync>(setup_.job.sync, M > 0 ? static_cast<double>(mine) / M : 0.0, model_->parameters());
  }
}

std::string StageWorker::Where() const {
  return a_.replicas.sites.size() > 1 ? absl::StrCat("stage ", a_.stage, " replica ", replica_, " (site '", self_, "')")
                                      : absl::StrCat("stage ", a_.stage, " (site '", self_, "')");
}

absl::Status StageWorker::JoinSite(SiteGroup* group) {
  return GuardTorch(Where(), [&]() -> absl::Status {
    if (!group || group->size() < 2) return absl::OkStatus();
    if (absl::Status s = CanSplit(group->size()); !s.ok()) return s;
    group_ = group;
    // DiLoCo: worker 0 alone holds the outer state and exchanges with the other replicas; the others
    // take the parameters it sets at each outer synchronisation (Step).
    if (group_->rank() != 0) outer_.reset();
    reducer_ = std::make_unique<SiteReducer>(group_, model_->parameters(), a_.bucket_bytes);
    if (setup_.job.optimizer.zero == 1)
      zero_ =
          std::make_unique<ShardedAdamW>(setup_.job.optimizer, model_->parameters(), group_->rank(), group_->size());
    return absl::OkStatus();
  });
}

absl::Status StageWorker::CanSplit(int workers) const {
  if (workers < 2) return absl::OkStatus();
  if (setup_.micro_batch_size < workers)
    return absl::InvalidArgumentError(absl::StrCat(Where(), ": a micro-batch of ", setup_.micro_batch_size,
                                                   " sequences cannot be split across the site's ", workers,
                                                   " workers (devices); use fewer micro-batches per step or fewer "
                                                   "devices"));
  return absl::OkStatus();
}

int64_t StageWorker::optimizer_state_elements() const {
  if (zero_) return zero_->state_elements();
  int64_t n = 0;
  for (const auto& [k, v] : opt_.ExportState()) n += v.numel();
  return n;
}

absl::StatusOr<torch::Tensor> StageWorker::ReceiveRows(const std::string* peer, const rpc::TensorKey& key,
                                                       const std::vector<int64_t>& shape) {
  if (!group_) return Receive(*peer, key);
  torch::Tensor whole;
  if (group_->rank() == 0) {
    auto t = Receive(*peer, key);
    if (!t.ok()) return t.status();
    whole = *t;
  }
  const auto t0 = Clock::now();
  auto mine = group_->Scatter(whole, shape);
  wait_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  if (!mine.ok()) return Annotate(mine.status(), absl::StrCat(Where(), ": ", key.ToString()));
  return mine->to(device_);
}

absl::StatusOr<torch::Tensor> StageWorker::GatherRows(const torch::Tensor& t, const std::vector<int64_t>& shape) {
  if (!group_) return t;
  const auto t0 = Clock::now();
  auto whole = group_->Gather(t, shape);
  wait_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  if (!whole.ok()) return Annotate(whole.status(), Where());
  return *whole;
}

absl::StatusOr<std::unique_ptr<rpc::PeerClient::OutStream>> StageWorker::OpenStream(const std::string& site,
                                                                                    const std::string& address) {
  auto& client = clients_[site];
  if (!client) {
    auto c = rpc::PeerClient::Create(certs_, self_, site, address);
    if (!c.ok()) return Annotate(c.status(), Where());
    client = std::move(*c);
  }
  auto s = client->OpenStream(std::chrono::hours(24 * 30), timeout_);
  if (!s.ok()) return Annotate(s.status(), Where());
  return s;
}

absl::Status StageWorker::Connect() {
  return GuardTorch(Where(), [&]() -> absl::Status {
    if (!init_status_.ok()) return init_status_;
    if (!talks_to_sites()) return absl::OkStatus();  // worker 0 holds the site's streams
    for (const StageSites* g : {&a_.prev_replicas, &a_.next_replicas})
      for (size_t i = 0; i < g->sites.size(); ++i) {
        auto stream = OpenStream(g->sites[i], g->addresses[i]);
        if (!stream.ok()) return stream.status();
        senders_[g->sites[i]] = std::make_unique<rpc::QueuedSender>(std::move(*stream), a_.send_queue_bytes);
      }
    const StageSites& R = a_.replicas;
    if (R.sites.size() > 1) {
      std::map<std::string, rpc::PeerClient::OutStream*> scatter, gather;
      for (size_t i = 0; i < R.sites.size(); ++i) {
        if (R.sites[i] == self_) continue;
        for (auto* into : {&streams_, &replica_streams_}) {
          auto stream = OpenStream(R.sites[i], R.addresses[i]);
          if (!stream.ok()) return stream.status();
          (*into)[R.sites[i]] = std::move(*stream);
        }
        scatter[R.sites[i]] = streams_[R.sites[i]].get();
        gather[R.sites[i]] = replica_streams_[R.sites[i]].get();
      }
      GradientAverager::Options o;
      o.job_id = a_.job_id;
      o.stage = a_.stage;
      o.sites = R.sites;
      o.self = replica_;
      o.codec = grad_codec_;
      o.error_feedback = setup_.job.compression.error_feedback;
      o.bucket_bytes = a_.bucket_bytes;
      // A replica waits for its peers' whole step: each of their receives may take up to timeout_.
      o.timeout = timeout_ * (2 * setup_.micro_batches + 2);
      o.where = Where();
      if (outer_) {  // DiLoCo: one averager per fragment, for the pseudo-gradients, with the sync's codec
        auto codec = compression::CodecSpec::Parse(setup_.job.sync.codec);
        if (!codec.ok()) return Annotate(codec.status(), absl::StrCat(Where(), ": job.sync.codec"));
        o.codec = *codec;
        o.error_feedback = setup_.job.sync.error_feedback;
        if (setup_.job.sync.sparseloco()) {  // docs/sync.md, "SparseLoCo"
          o.error_feedback_decay = static_cast<float>(setup_.job.sync.outer_momentum);
          o.sparse_sum = true;
        }
        // Streams of its own for the sums (an overlapped exchange runs beside the stage's control messages
        // on replica_streams_); the scatter streams are free, with no per-step averaging.
        std::map<std::string, rpc::PeerClient::OutStream*> sums;
        for (size_t i = 0; i < R.sites.size(); ++i) {
          if (R.sites[i] == self_) continue;
          auto stream = OpenStream(R.sites[i], R.addresses[i]);
          if (!stream.ok()) return stream.status();
          diloco_streams_[R.sites[i]] = std::move(*stream);
          sums[R.sites[i]] = diloco_streams_[R.sites[i]].get();
        }
        std::vector<std::unique_ptr<GradientAverager>> averagers;
        for (const auto& buffers : outer_->buffers())
          averagers.push_back(std::make_unique<GradientAverager>(o, buffers, inbox_, scatter, sums));
        if (absl::Status s = outer_->Attach(std::move(averagers)); !s.ok()) return Annotate(s, Where());
      } else {
        averager_ = std::make_unique<GradientAverager>(o, model_->parameters(), inbox_, scatter, gather);
      }
    }
    return absl::OkStatus();
  });
}

compression::ActivationStore::Options StageWorker::DeltaStore(const std::string& peer, const char* side) const {
  compression::ActivationStore::Options o;
  o.memory_bytes = static_cast<int64_t>(setup_.job.compression.activation_memory_bytes);
  o.spill_bytes = static_cast<int64_t>(setup_.job.compression.activation_spill_bytes);
  std::error_code ec;
  const std::string dir = !scratch_dir_.empty() ? scratch_dir_ : std::filesystem::temp_directory_path(ec).string();
  if (dir.empty()) {  // no spill file: beyond memory, sequences go direct
    o.spill_bytes = 0;
    return o;
  }
  o.spill_path =
      absl::StrCat(dir, "/meridian-", self_, "-", ::getpid(), "-stage", a_.stage, "-", side, "-", peer, ".activations");
  return o;
}

absl::Status StageWorker::Send(const std::string& peer, const rpc::TensorKey& key, const torch::Tensor& t,
                               const compression::CodecSpec& codec, compression::ErrorFeedback* ef,
                               const std::vector<int64_t>* ids) {
  const auto t0 = Clock::now();
  auto c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  core::TensorView v{core::DType::kFloat32, std::vector<int64_t>(c.sizes().begin(), c.sizes().end()),
                     c.data_ptr<float>()};
  absl::StatusOr<std::vector<uint8_t>> frame;
  if (codec.delta) {
    auto& enc = delta_out_[peer];
    if (!enc) enc = std::make_unique<compression::DeltaEncoder>(codec, DeltaStore(peer, "to"));
    frame = ids ? enc->Encode(v, *ids) : absl::InvalidArgumentError("a delta codec on a tensor without sequences");
    if (enc->fell_back() && !said_delta_fallback_) {
      said_delta_fallback_ = true;
      spdlog::warn("{}", absl::StrCat(Where(), ": the activation store for site '", peer,
                                      "' is full (job.compression.activation_memory and activation_spill): sequences "
                                      "not yet stored now go as int8, without deltas"));
    }
  } else {
    frame = ef ? ef->Encode(v) : compression::Encode(v, codec);
  }
  codec_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  if (!frame.ok()) return Annotate(frame.status(), absl::StrCat(Where(), ": encoding ", key.ToString()));
  raw_bytes_ += static_cast<int64_t>(v.nbytes());
  wire_bytes_ += static_cast<int64_t>(frame->size());
  absl::Status s = senders_.at(peer)->Send(key, std::move(*frame), &send_blocked_seconds_);
  if (!s.ok()) return Annotate(s, Where());
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> StageWorker::Decode(const ExpectedTensor& e, const std::vector<uint8_t>& frame) {
  auto t = torch::empty(e.shape, torch::kFloat32);
  absl::Status s;
  if (prev_delta_ && e.key.direction == v1::FORWARD) {  // AQ-SGD deltas (activations only)
    auto& dec = delta_in_[e.peer];
    if (!dec) dec = std::make_unique<compression::DeltaDecoder>(DeltaStore(e.peer, "from"));
    s = dec->DecodeInto(frame.data(), frame.size(), e.ids, e.shape, t.data_ptr<float>());
  } else {
    s = compression::DecodeInto(frame.data(), frame.size(), core::DType::kFloat32, e.shape, t.data_ptr<float>());
  }
  if (!s.ok()) return Annotate(s, absl::StrCat(e.key.ToString(), " from peer '", e.peer, "'"));  // Receive adds Where()
  return t.to(device_);
}

absl::StatusOr<torch::Tensor> StageWorker::Receive(const std::string& peer, const rpc::TensorKey& key) {
  if (!ahead_) return absl::InternalError(absl::StrCat(Where(), ": a receive outside a step (a bug)"));
  const auto t0 = Clock::now();
  auto t = ahead_->Take(peer, key, timeout_);
  wait_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  Trace(key.direction == v1::FORWARD ? "wait_F" : "wait_B", key.micro_batch, t0);
  if (!t.ok()) return Annotate(t.status(), Where());
  return t;
}

absl::StatusOr<std::optional<double>> StageWorker::Step(int64_t step, int64_t total_steps) {
  return GuardTorch(absl::StrCat(Where(), ": step ", step + 1), [&]() -> absl::StatusOr<std::optional<double>> {
    // Frames lost to a replacement in the inbox are reported whether the step succeeds or fails.
    struct ReportAtEnd {
      StageWorker* worker;
      int64_t step;
      ~ReportAtEnd() { worker->ReportReplacedFrames(step); }
    } report_at_end{this, step};
    const int M = setup_.micro_batches, mbs = setup_.micro_batch_size, seq = setup_.job.sequence_length;
    const int64_t d = setup_.model.shape.hidden_size;
    const std::vector<int64_t> hidden = {mbs, seq, d};
    // The step's CPU, from its first instruction (StepTargets below reads every sequence at the last stage).
    cpu_seconds_ = compute_cpu_seconds_ = compute_thread_cpu_seconds_ = 0;
    compute_thread_preemptions_ = 0;
    const double cpu_start = core::ProcessCpuSeconds(), thread_cpu_start = core::ThreadCpuSeconds();
    const int64_t preemptions_start = core::ThreadPreemptions();
    // This worker's rows of every micro-batch (all of them on a site of one device).
    const auto [first_row, rows] = group_ ? group_->Rows(mbs, group_->rank()) : std::pair<int64_t, int64_t>{0, mbs};
    // Only the last stage computes the loss, so only it needs the step's count of counted targets.
    const double normaliser = model_->has_head() ? setup_.data.StepTargets(step, M, mbs, seq) : 1.0;
    model_->ClearGradients();
    // job.step_overlap (docs/executor.md, "Step overlap"): this step's early micro-batches that the last
    // Step began (none at an attempt's first step, which runs them all here), and the next step's begun
    // here, in its drain, on early_model_: this step's weights.
    const int k_next = EarlyMicroBatches(setup_.job, step + 1, total_steps);
    std::map<std::pair<int64_t, int>, MicroBatchState> stash;  // by (step, micro-batch)
    int k_done = 0;
    double loss_sum = 0, next_loss_sum = 0;
    if (carried_step_ == step) {
      k_done = EarlyMicroBatches(setup_.job, step, total_steps);
      for (auto& [mb, st] : carried_) stash[{step, mb}] = std::move(st);
      loss_sum = carried_loss_;
    }
    // Resumed at a switch's step boundary whose checkpoint kept the early weights (Restore): this step's
    // early micro-batches run here, on them, as the step before would have begun them in its drain.
    // `early_left`: those of this replica whose backward pass is still to come.
    int k_resumed = 0, early_left = 0;
    if (resumed_early_step_ == step) {  // (a Restore leaves nothing carried)
      k_resumed = EarlyMicroBatches(setup_.job, step, total_steps);
      for (int mb = 0; mb < k_resumed; ++mb) early_left += owner_[mb] == replica_;
    }
    resumed_early_step_ = -1;
    carried_.clear();
    carried_step_ = -1;
    carried_loss_ = 0;
    const double next_normaliser =
        model_->has_head() && k_next > 0 ? setup_.data.StepTargets(step + 1, M, mbs, seq) : 1.0;
    compute_seconds_ = wait_seconds_ = send_blocked_seconds_ = codec_seconds_ = site_reduce_seconds_ = 0;
    const auto step_start = Clock::now();
    if (!trace_epoch_) {
      trace_epoch_ = step_start;
      const char* dir = std::getenv("MERIDIAN_TRACE_DIR");
      if (dir && *dir && (!group_ || group_->rank() == 0)) {
        const std::string path = absl::StrCat(dir, "/trace-", self_, "-stage", a_.stage, ".jsonl");
        trace_file_.reset(std::fopen(path.c_str(), "a"));
        if (!trace_file_) spdlog::warn("{}: cannot write the step timeline to {}", Where(), path);
      }
    }
    trace_.clear();
    auto timed = [this](const char* what, int mb, auto&& fn) {
      const auto t0 = Clock::now();
      const double cpu0 = core::ThreadCpuSeconds();
      fn();
      compute_cpu_seconds_ += core::ThreadCpuSeconds() - cpu0;  // before the wait below, which may spin
      // On a GPU the kernels run asynchronously: wait for them, or their time would show up in whatever
      // next waits for the device (a send's copy to the host, counted as codec time).
      if (device_.is_cuda()) torch::cuda::synchronize();
      compute_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
      Trace(what, mb, t0);
    };
    // Which training rows micro-batch `mb` of step `of` holds: keys its LoRA dropout masks, the same for a
    // recomputation.
    auto context = [&](int64_t of, int mb) { return TrainContext{of, static_cast<int64_t>(mb) * mbs + first_row}; };
    // This replica's part of the stage's 1F1B order (with job.step_overlap, its part of the step: the
    // early micro-batches begun by the last step left out, the next step's begun in the drain): the
    // entries of the micro-batches it owns.
    std::vector<partitioner::StepEntry> schedule;
    for (auto e : partitioner::OverlappedStepSchedule(a_.stage, a_.num_stages, M, a_.in_flight, k_done, k_next))
      if (owner_[e.micro_batch] == replica_) schedule.push_back(e);
    int last_backward = -1;  // this step's last backward pass: the step's gradients are complete after it
    for (int i = 0; i < static_cast<int>(schedule.size()); ++i)
      if (schedule[i].kind == 'B' && !schedule[i].next) last_backward = i;
    // The tensors this step receives from the neighbouring sites, in the order the schedule asks for
    // them, received and decoded ahead of it on a thread of their own (receive_ahead.h).
    std::vector<ExpectedTensor> expected;
    if (talks_to_sites())
      for (const auto& e : schedule) {
        const int mb = e.micro_batch;
        const int64_t of = step + (e.next ? 1 : 0);
        if (e.kind == 'F' && !model_->has_embed())
          expected.push_back({a_.prev_replicas.sites[prev_owner_[mb]],
                              {a_.job_id, of, mb, a_.stage - 1, v1::FORWARD, 0},
                              hidden,
                              prev_delta_ ? setup_.data.SequenceIds(of, mb, mbs) : std::vector<int64_t>{}});
        if (e.kind == 'B' && !model_->has_head())
          expected.push_back({a_.next_replicas.sites[next_owner_[mb]],
                              {a_.job_id, of, mb, a_.stage + 1, v1::BACKWARD, 0},
                              hidden,
                              {}});
      }
    ReceiveAhead ahead(inbox_, std::move(expected),
                       [this](const ExpectedTensor& e, const std::vector<uint8_t>& frame) { return Decode(e, frame); });
    ahead_ = &ahead;
    struct ClearOnExit {
      ReceiveAhead** ahead;
      ~ClearOnExit() { *ahead = nullptr; }
    } clear_on_exit{&ahead_};
    const std::string* prev = nullptr;  // the previous / next stage's site of the current micro-batch
    const std::string* next = nullptr;
    // The averager sends from the backward pass on: count its bytes from here.
    const int64_t sync_wire0 = averager_ ? averager_->wire_bytes() : 0,
                  sync_raw0 = averager_ ? averager_->raw_bytes() : 0;
    if (averager_) averager_->BeginStep(step);
    // A step that fails before the gradient sum completes ends the averager's step too.
    struct AbortOnExit {
      GradientAverager* averager;
      ~AbortOnExit() {
        if (averager) averager->Abort();
      }
    } abort_on_exit{averager_.get()};
    // Global gradient norm and the step's loss. Replica 0 of each stage takes part for its stage: partial
    // sums flow from the last stage to the first, the total back again to every replica. The values
    // travel as float64 pairs [square sum, loss] in identity frames, with micro_batch -1 along the
    // pipeline, -2 for a last-stage replica's loss to its replica 0, -3 from stage 0's replica 0 to its
    // replicas.
    // To a neighbour through its queue (behind the activations and gradients already queued for it), to a
    // replica directly on its stream (the averager has finished with it).
    auto send_pair = [&](const std::string& site, bool replica, int tag, double x, double loss) {
      double v[2] = {x, loss};
      core::TensorView view{core::DType::kUInt8, {16}, v};
      auto frame = compression::Encode(view, compression::CodecSpec{});
      const rpc::TensorKey key{a_.job_id, step, tag, a_.stage, v1::CONTROL, 0};
      absl::Status s;
      if (replica) {
        const auto t0 = Clock::now();
        s = replica_streams_.at(site)->Send(key, *frame);
        send_blocked_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
      } else {
        s = senders_.at(site)->Send(key, std::move(*frame), &send_blocked_seconds_);
      }
      return s.ok() ? s : Annotate(s, Where());
    };
    auto recv_pair = [&](const std::string& peer, int from_stage, int tag,
                         std::optional<Clock::time_point> until = {}) -> absl::StatusOr<std::pair<double, double>> {
      const auto t0 = Clock::now();
      auto f = inbox_->Wait(peer, {a_.job_id, step, tag, from_stage, v1::CONTROL, 0}, until ? *until : t0 + timeout_);
      wait_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
      Trace("wait_norm", tag, t0);
      if (!f.ok()) return Annotate(f.status(), Where());
      // Its fixed shape: 16 bytes, two float64, both finite (a NaN norm would switch clipping off).
      auto t = compression::Decode(f->data(), f->size(), compression::DecodeLimits{16});
      if (!t.ok() || t->dtype != core::DType::kUInt8 || t->shape != std::vector<int64_t>{16})
        return absl::DataLossError(absl::StrCat(Where(), ": bad gradient-norm message from peer '", peer, "'"));
      double v[2];
      std::memcpy(v, t->bytes.data(), 16);
      if (!std::isfinite(v[0]) || v[0] < 0 || !std::isfinite(v[1]))
        return absl::DataLossError(absl::StrCat(Where(), ": peer '", peer,
                                                "' sent a non-finite gradient norm or loss (", v[0], ", ", v[1],
                                                ") in step ", step + 1));
      return std::make_pair(v[0], v[1]);
    };
    const bool independent = IndependentWorkers(), pipelines = PipelineWorkers();
    const auto& R = a_.replicas.sites;
    const bool first = a_.stage == 0, last = a_.stage == a_.num_stages - 1;
    double square = 0, loss = 0;
    // The step's gradients complete (after its last backward pass): the sums over the site's workers and
    // the replicas, then the first half of the gradient norm's exchange. With job.step_overlap the stage
    // then goes on with the next step's early micro-batches before the second half and its optimizer step.
    auto begin_norm = [&]() -> absl::Status {
      if (reducer_) {  // the site's workers' sum first
        const auto t0 = Clock::now();
        auto waited = reducer_->Finish();
        Trace("wait_site", -1, t0);
        if (!waited.ok()) return Annotate(waited.status(), absl::StrCat(Where(), ": step ", step + 1));
        site_reduce_seconds_ = *waited;
        wait_seconds_ += *waited;
      }
      if (averager_) {
        const auto t0 = Clock::now();
        absl::Status finished = averager_->Finish();
        wait_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
        Trace("wait_sync", -1, t0);
        abort_on_exit.averager = nullptr;  // Finish joined the threads, successful or not
        if (!finished.ok()) return finished;
        replica_wire_bytes_ += averager_->wire_bytes() - sync_wire0;
        replica_raw_bytes_ += averager_->raw_bytes() - sync_raw0;
        wire_bytes_ += averager_->wire_bytes() - sync_wire0;
        raw_bytes_ += averager_->raw_bytes() - sync_raw0;
        replica_buckets_ = averager_->buckets_synced();
        replica_buckets_during_backward_ = averager_->buckets_during_backward();
      }
      if (group_ && a_.replicas.sites.size() > 1) {  // worker 0 summed over the replicas: to every worker
        std::vector<torch::Tensor> grads;
        for (auto& [n, p] : model_->parameters()) grads.push_back(p.grad());  // every one set by reducer_
        if (absl::Status s = group_->BroadcastInPlace(grads); !s.ok()) return Annotate(s, Where());
      }
      if (group_) {  // the site's loss: every worker's rows
        torch::Tensor l = torch::full({1}, loss_sum, torch::kFloat64);
        if (absl::Status s = group_->AllReduce(l); !s.ok()) return Annotate(s, Where());
        loss_sum = l.item<double>();
      }
      // DiLoCo: this replica's gradient covers its own micro-batches only; scaled by M / m_i, the inner step
      // is a full step on them.
      if (diloco_ && own_micro_batches_ > 0 && own_micro_batches_ < M) {
        torch::NoGradGuard no_grad;
        const double scale = static_cast<double>(M) / own_micro_batches_;
        for (auto& [n, p] : model_->parameters())
          if (p.grad().defined()) p.mutable_grad().mul_(scale);
      }
      // Each DiLoCo replica steps on its own gradient: each checks it (replica 0 also does below, for the norm).
      if (outer_ && replica_ != 0 && !independent && !pipelines && !std::isfinite(GradSquareSum(model_->parameters())))
        return absl::DataLossError(absl::StrCat(Where(), ": non-finite gradients in step ", step + 1,
                                                " (the inputs from the previous stage, or the data)"));
      square = 0, loss = loss_sum;
      // The first half of the norm's exchange along pipeline r (replica r of every stage): this stage's
      // square sum plus the later stages' partial from stage + 1's replica r, passed on to stage - 1's.
      auto partial_norm = [&](int r) -> absl::Status {
        square = GradSquareSum(model_->parameters());
        if (!std::isfinite(square) || !std::isfinite(loss))
          return absl::DataLossError(absl::StrCat(Where(), ": non-finite gradients or loss in step ", step + 1,
                                                  " (the inputs from the previous stage, or the data)"));
        if (!last) {
          auto partial = recv_pair(a_.next_replicas.sites[r], a_.stage + 1, -1);
          if (!partial.ok()) return partial.status();
          square += partial->first;
          loss = partial->second;
        }
        return first ? absl::OkStatus() : send_pair(a_.prev_replicas.sites[r], false, -1, square, loss);
      };
      if (!talks_to_sites()) {
        // Worker 0 of the site takes part in the exchange and hands on its outcome.
      } else if (independent) {
        // DiLoCo workers of the whole model are independent between outer syncs: each clips by its own
        // gradient's norm. Replica 0 reports the step's loss: the others send it their shares and wait for
        // nothing; it awaits them after its own inner step, so it keeps pace with the slowest of them.
        square = GradSquareSum(model_->parameters());
        if (!std::isfinite(square) || !std::isfinite(loss))
          return absl::DataLossError(
              absl::StrCat(Where(), ": non-finite gradients or loss in step ", step + 1, " (the data)"));
        if (replica_ != 0)
          if (absl::Status s = send_pair(R[0], true, -2, 0, loss_sum); !s.ok()) return s;
      } else if (pipelines) {
        // Pipeline r (replica r of every stage) alone: its partial sums from its last stage to its first, the
        // total back again (the second half, after the step's part), as replica 0 does below for the whole
        // plan. Stage 0 then sends the pipeline's loss to its replica 0, which awaits the other pipelines'
        // shares after its own inner step.
        if (absl::Status s = partial_norm(replica_); !s.ok() || !first) return s;
        if (!last)
          if (absl::Status s = send_pair(a_.next_replicas.sites[replica_], false, -1, square, loss); !s.ok()) return s;
        if (replica_ != 0)
          if (absl::Status s = send_pair(R[0], true, -2, 0, loss); !s.ok()) return s;
      } else if (replica_ == 0) {
        if (last)  // the other replicas' losses, in replica order
          for (size_t j = 1; j < R.size(); ++j) {
            auto r = recv_pair(R[j], a_.stage, -2);
            if (!r.ok()) return r.status();
            loss += r->second;
          }
        if (absl::Status s = partial_norm(0); !s.ok() || !first) return s;
        if (!last)
          for (const auto& site : a_.next_replicas.sites)
            if (absl::Status s = send_pair(site, false, -1, square, loss); !s.ok()) return s;
        for (size_t j = 1; j < R.size(); ++j)
          if (absl::Status s = send_pair(R[j], true, -3, square, loss); !s.ok()) return s;
      } else if (last) {
        return send_pair(R[0], true, -2, 0, loss_sum);
      }
      return absl::OkStatus();
    };
    // job.step_overlap: once this step's early micro-batches are all back, their gradients (on
    // early_model_) join the step's, and early_model_ takes this step's weights for the next step's early
    // ones (OverlappedStepSchedule keeps the next step's first forward pass after that point).
    bool settled = false;
    auto settle = [&] {
      if (settled) return;
      if (early_model_) {
        if (early_left > 0) return;
        for (const auto& [key, st] : stash)
          if (key.first == step && st.model == early_model_.get()) return;
        if (k_done > 0 || k_resumed > 0) {
          early_model_->MoveGradientsInto(*model_);
        } else {  // an abandoned step's, if any
          early_model_->ClearGradients();
        }
      }
      if (k_next > 0) {
        if (!early_model_)
          early_model_ = model_->Copy();
        else
          early_model_->CopyWeightsFrom(*model_);
      }
      settled = true;
    };
    settle();
    for (int i = 0; i < static_cast<int>(schedule.size()); ++i) {
      const auto& e = schedule[i];
      const char kind = e.kind;
      const int mb = e.micro_batch;
      const int64_t of = step + (e.next ? 1 : 0);  // the micro-batch's step
      const int tmb = e.next ? M + mb : mb;        // in the timeline, the next step's after this step's
      if (!model_->has_embed()) prev = &a_.prev_replicas.sites[prev_owner_[mb]];
      if (!model_->has_head()) next = &a_.next_replicas.sites[next_owner_[mb]];
      if (kind == 'F') {
        if (e.next && !settled)
          return absl::InternalError(absl::StrCat(Where(), ": job.step_overlap: an early micro-batch of step ",
                                                  step + 1, " is still in flight at step ", step + 2, "'s first"));
        MicroBatchState s;
        s.model = e.next || mb < k_resumed ? early_model_.get() : model_.get();
        TrainingData::Batch batch;
        std::vector<int64_t> ids;  // the micro-batch's training sequences (the keys of AQ-SGD's deltas sent)
        if (model_->has_embed() || model_->has_head()) {
          const auto t0 = Clock::now();
          batch = setup_.data.MicroBatch(of, mb, mbs, seq);
          if (group_) batch = {batch.inputs.narrow(0, first_row, rows), batch.targets.narrow(0, first_row, rows)};
          Trace("data", tmb, t0);
        }
        if (model_->has_embed()) {
          s.input = batch.inputs.to(device_);
        } else {
          auto in = ReceiveRows(prev, {a_.job_id, of, mb, a_.stage - 1, v1::FORWARD, 0}, hidden);
          if (!in.ok()) return in.status();
          s.input = in->requires_grad_(true);
        }
        const TrainContext ctx = context(of, mb);
        torch::Tensor out;
        timed("F", tmb, [&] {
          // Recomputation: no autograd graph now; the backward pass builds it again from the input.
          std::optional<torch::NoGradGuard> no_graph;
          if (a_.recompute) no_graph.emplace();
          out = s.model->Forward(s.input, &ctx);
          if (model_->has_head()) {
            torch::Tensor loss = CrossEntropySum(out, batch.targets.to(device_), e.next ? next_normaliser : normaliser);
            (e.next ? next_loss_sum : loss_sum) += loss.item<double>();
            if (a_.recompute)
              s.targets = batch.targets;
            else
              s.output = loss;
          }
        });
        if (!model_->has_head()) {
          if (!a_.recompute) s.output = out;
          auto whole = GatherRows(out, hidden);
          if (!whole.ok()) return whole.status();
          if (talks_to_sites()) {
            const auto t0 = Clock::now();
            if (fwd_codec_.delta && ids.empty()) ids = setup_.data.SequenceIds(of, mb, mbs);
            if (auto st = Send(*next, {a_.job_id, of, mb, a_.stage, v1::FORWARD, 0}, *whole, fwd_codec_, nullptr, &ids);
                !st.ok())
              return st;
            Trace("send", tmb, t0);
          }
        }
        stash[{of, mb}] = std::move(s);
      } else {
        MicroBatchState& s = stash[{of, mb}];
        if (!s.model)
          return absl::InternalError(absl::StrCat(Where(), ": step ", of + 1, ": a backward pass of micro-batch ",
                                                  mb + 1, " without its forward pass"));
        // The replica's last backward pass produces the step's final gradients: the averager's hooks send
        // them bucket by bucket while the pass goes on.
        // On a site of several workers the site's sum comes first (reducer_), and worker 0 then gives the
        // averager the summed gradients.
        if (averager_ && !group_ && i == last_backward) averager_->CaptureNextBackward();
        if (reducer_ && i == last_backward) reducer_->CaptureNextBackward();
        if (a_.recompute)  // the forward pass again, with the same inputs and dropout masks: the same graph
          timed("R", tmb, [&] {
            const TrainContext ctx = context(of, mb);
            torch::Tensor out = s.model->Forward(s.input, &ctx);
            s.output = model_->has_head()
                           ? CrossEntropySum(out, s.targets.to(device_), e.next ? next_normaliser : normaliser)
                           : out;
          });
        // Under LoRA the first stages may hold no adapter before the first one: their output then needs no
        // gradient and their backward pass is only the receipt of the gradient.
        if (model_->has_head()) {
          if (s.output.requires_grad()) timed("B", tmb, [&] { s.output.backward(); });
        } else {
          auto g = ReceiveRows(next, {a_.job_id, of, mb, a_.stage + 1, v1::BACKWARD, 0}, hidden);
          if (!g.ok()) return g.status();
          if (s.output.requires_grad()) timed("B", tmb, [&] { s.output.backward(*g); });
        }
        bool send_gradient = !model_->has_embed();
        torch::Tensor grad;
        if (send_gradient) {
          grad = s.input.grad();
          if (group_) {
            // Under LoRA a worker's input may get no gradient; the neighbour still expects the tensor.
            if (!grad.defined()) grad = torch::zeros({rows, seq, d});
            auto whole = GatherRows(grad, hidden);
            if (!whole.ok()) return whole.status();
            send_gradient = talks_to_sites();
            grad = *whole;
          }
        }
        if (send_gradient) {
          if (of == nan_gradient_step_ && !nan_gradient_sent_) {  // fault injection (tests)
            grad = torch::full_like(grad, std::numeric_limits<float>::quiet_NaN());
            nan_gradient_sent_ = true;
            spdlog::warn("{}", absl::StrCat(Where(), ": fault injection: a NaN activation gradient to '", *prev,
                                            "' at step ", of + 1));
          }
          const auto t0 = Clock::now();
          if (auto st = Send(*prev, {a_.job_id, of, mb, a_.stage, v1::BACKWARD, 0}, grad, bwd_codec_,
                             bwd_ef_.count(*prev) ? bwd_ef_[*prev].get() : nullptr);
              !st.ok())
            return st;
          Trace("send", tmb, t0);
        }
        stash.erase({of, mb});
        if (!e.next && mb < k_resumed) --early_left;
        settle();
      }
      if (i == last_backward) {  // the step's gradients are complete: the sums and the norm's first half
        if (!settled)
          return absl::InternalError(absl::StrCat(Where(), ": job.step_overlap: an early micro-batch of step ",
                                                  step + 1, " is still in flight at the step's last backward pass"));
        if (absl::Status st = begin_norm(); !st.ok()) return st;
      }
    }
    if (last_backward < 0)  // a replica that owns no micro-batch
      if (absl::Status st = begin_norm(); !st.ok()) return st;
    // What is still in flight belongs to the next step (its early micro-batches, with job.step_overlap).
    for (auto& [key, st] : stash) {
      if (key.first != step + 1)
        return absl::InternalError(absl::StrCat(Where(), ": step ", step + 1, " ended with micro-batch ",
                                                key.second + 1, " of step ", key.first + 1, " in flight"));
      carried_[key.second] = std::move(st);
    }
    if (k_next > 0) {
      carried_step_ = step + 1;
      carried_loss_ = next_loss_sum;
    }
    codec_seconds_ += ahead.decode_seconds();  // every tensor expected was taken, so decoded
    // The norm's second half: the total from the previous stage, on to the next.
    if (talks_to_sites() && !independent && !first) {
      if (pipelines || replica_ == 0) {
        const std::string& from = a_.prev_replicas.sites[pipelines ? replica_ : 0];
        auto total = recv_pair(from, a_.stage - 1, -1);
        if (!total.ok()) return total.status();
        square = total->first;
        loss = total->second;
        if (!last) {
          if (pipelines) {
            if (absl::Status s = send_pair(a_.next_replicas.sites[replica_], false, -1, square, loss); !s.ok())
              return s;
          } else {
            for (const auto& site : a_.next_replicas.sites)
              if (absl::Status s = send_pair(site, false, -1, square, loss); !s.ok()) return s;
          }
        }
      } else {
        auto total = recv_pair(a_.prev_replicas.sites[0], a_.stage - 1, -1);
        if (!total.ok()) return total.status();
        square = total->first;
        loss = total->second;
      }
    } else if (talks_to_sites() && !independent && !pipelines && replica_ != 0) {  // stage 0: from its replica 0
      auto total = recv_pair(R[0], a_.stage, -3);
      if (!total.ok()) return total.status();
      square = total->first;
      loss = total->second;
    }
    if (group_) {
      torch::Tensor v = torch::tensor({square, loss}, torch::kFloat64);
      if (absl::Status s = group_->Broadcast(v); !s.ok()) return Annotate(s, Where());
      square = v[0].item<double>();
      loss = v[1].item<double>();
    }
    timed("opt", -1, [&] {
      ClipByGlobalNorm(model_->parameters(), square, setup_.job.optimizer.grad_clip);
      if (zero_)
        zero_->Step(model_->parameters(), LearningRate(setup_.job.optimizer, step, total_steps));
      else
        opt_.Step(model_->parameters(), LearningRate(setup_.job.optimizer, step, total_steps));
    });
    if (zero_) {
      const auto t0 = Clock::now();
      if (absl::Status s = zero_->GatherParameters(*group_, model_->parameters()); !s.ok()) return Annotate(s, Where());
      const double gathered = std::chrono::duration<double>(Clock::now() - t0).count();
      site_reduce_seconds_ += gathered;
      wait_seconds_ += gathered;
    }
    if (absl::Status s = SynchroniseOuter(
            step, step + 1 == total_steps || step == final_step_ ? OuterPoint::kLastStep : OuterPoint::kAfterStep);
        !s.ok())
      return s;
    if ((independent || (pipelines && first)) && replica_ == 0 && talks_to_sites())  // the other workers' losses
      for (size_t j = 1; j < R.size(); ++j) {
        if (left_out_.count(R[j])) continue;
        // In slices: a worker gone without closing its connection (a partition) is left out by the
        // coordinator while this waits.
        const auto deadline = Clock::now() + timeout_;
        absl::StatusOr<std::pair<double, double>> r;
        for (;;) {
          r = recv_pair(R[j], a_.stage, -2, std::min(deadline, Clock::now() + std::chrono::milliseconds(500)));
          if (!absl::IsDeadlineExceeded(r.status()) || Clock::now() >= deadline) break;
          if (left_out_source_ && left_out_source_().count(R[j])) break;
        }
        if (!r.ok() && AwaitLeftOut(R[j], r.status())) continue;
        if (!r.ok()) return r.status();
        loss += r->second;
      }
    // A write that failed after its frame was queued fails this step, not a neighbour's wait later.
    for (const auto& [site, sender] : senders_)
      if (absl::Status s = sender->error(); !s.ok()) return Annotate(s, Where());
    compute_thread_cpu_seconds_ = core::ThreadCpuSeconds() - thread_cpu_start;
    compute_thread_preemptions_ = core::ThreadPreemptions() - preemptions_start;
    cpu_seconds_ = core::ProcessCpuSeconds() - cpu_start;
    WriteTrace(step, step_start);
    if (first || last) return std::optional<double>(loss);
    return std::optional<double>();
  });
}

void StageWorker::WriteTrace(int64_t step, Clock::time_point start) {
  if (!trace_file_) return;
  auto rel = [&](Clock::time_point t) { return std::chrono::duration<double>(t - start).count(); };
  std::string line = absl::StrFormat("{\"step\": %d, \"start\": %.6f, \"end\": %.6f, \"intervals\": [", step + 1,
                                     std::chrono::duration<double>(start - *trace_epoch_).count(), rel(Clock::now()));
  for (size_t i = 0; i < trace_.size(); ++i)
    absl::StrAppendFormat(&line, "%s[\"%s\", %d, %.6f, %.6f]", i ? ", " : "", trace_[i].what, trace_[i].micro_batch,
                          rel(trace_[i].start), rel(trace_[i].end));
  line += "]}\n";
  std::fputs(line.c_str(), trace_file_.get());
  std::fflush(trace_file_.get());
}

absl::Status StageWorker::SynchroniseOuter(int64_t step, OuterPoint point) {
  const bool leaves_out = LeavesOutLostReplicas();
  const bool last = point == OuterPoint::kLastStep;
  if (outer_) {  // DiLoCo: the fragment due after this inner step, if any; after the last, all of them
    const int64_t wire0 = outer_->wire_bytes(), raw0 = outer_->raw_bytes(), applied0 = outer_->applied();
    // A replica the coordinator left out: no more outer syncs (every worker stops them as it hears).
    if (leaves_out && !last && !outer_->suspended() && OtherReplicaLeftOut())
      AwaitLeftOut("", absl::UnavailableError("the coordinator left a replica out"));
    absl::Status synced = last                             ? outer_->Finish(step)
                          : point == OuterPoint::kBoundary ? outer_->FinishAtBoundary(step)
                                                           : outer_->AfterInnerStep(step);
    // A replica lost mid-exchange: go on without it if the coordinator leaves it out.
    if (!synced.ok() && leaves_out && !last && AwaitLeftOut("", synced)) {
      synced = absl::OkStatus();
      outer_gave_up_ = true;  // an exchange given up may have changed some parameters: to every worker
    }
    if (!synced.ok())
      return Annotate(synced, absl::StrCat(Where(), ": outer synchronisation after step ", step + 1,
                                           point == OuterPoint::kBoundary ? " (the step boundary)" : ""));
    wait_seconds_ += outer_->last_wait_seconds();
    if (outer_->applied() != applied0) {
      replica_wire_bytes_ += outer_->wire_bytes() - wire0;
      replica_raw_bytes_ += outer_->raw_bytes() - raw0;
      wire_bytes_ += outer_->wire_bytes() - wire0;
      raw_bytes_ += outer_->raw_bytes() - raw0;
      const auto& l = outer_->last_sync();
      if (point == OuterPoint::kBoundary)
        spdlog::info("{}", absl::StrFormat("%s: every fragment synchronised at the step boundary %d: %d bytes on the "
                                           "wire (%d as float32), %.3f s; every replica leaves it with the outer "
                                           "parameters, which hold what each sent of its progress in the round",
                                           Where(), step + 1, outer_->wire_bytes() - wire0, outer_->raw_bytes() - raw0,
                                           outer_->last_wait_seconds()));
      else
        spdlog::info("{}",
                     absl::StrFormat("%s: outer sync of fragment %d after step %d: %d bytes on the wire (%d "
                                     "as float32), %.3f s, drift %.4g",
                                     Where(), l.fragment, l.step + 1, l.wire_bytes, l.raw_bytes, l.seconds, l.drift));
    } else if (point == OuterPoint::kBoundary && outer_->suspended()) {
      spdlog::info("{}", absl::StrCat(Where(), ": no outer synchronisation at the step boundary ", step + 1,
                                      " (a replica was left out): this replica keeps its own progress"));
    }
  }
  if (diloco_ && group_) {  // worker 0's parameters after an outer synchronisation, to every worker
    torch::Tensor synced = torch::zeros({1}, torch::kFloat64);
    if (outer_ && (outer_->applied() != outer_applied_seen_ || outer_gave_up_)) synced[0] = 1.0;
    outer_gave_up_ = false;
    if (outer_) outer_applied_seen_ = outer_->applied();
    const auto t0 = Clock::now();
    absl::Status s = group_->Broadcast(synced);
    if (s.ok() && synced[0].item<double>() != 0) {
      std::vector<torch::Tensor> values;
      for (auto& [n, p] : model_->parameters()) values.push_back(p);
      s = group_->BroadcastInPlace(values);
    }
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    site_reduce_seconds_ += waited;
    wait_seconds_ += waited;
    if (!s.ok()) return Annotate(s, absl::StrCat(Where(), ": the outer parameters to the site's workers"));
  }
  return absl::OkStatus();
}

absl::Status StageWorker::SynchroniseAtBoundary(int64_t step) {
  return GuardTorch(absl::StrCat(Where(), ": outer synchronisation at the step boundary ", step + 1),
                    [&] { return SynchroniseOuter(step, OuterPoint::kBoundary); });
}

absl::Status StageWorker::Finish() {
  return GuardTorch(Where(), [&]() -> absl::Status {
    averager_.reset();  // its streams close below
    const bool leaves_out = LeavesOutLostReplicas();
    outer_.reset();
    std::set<std::string> gone = left_out_;  // a lost replica's streams may fail
    if (leaves_out && left_out_source_) gone.merge(left_out_source_());
    for (auto& [site, sender] : senders_) {  // what is still queued goes out first
      auto r = sender->Finish();
      if (!r.ok() && !gone.count(site)) return Annotate(r.status(), Where());
    }
    for (auto* streams : {&streams_, &replica_streams_, &diloco_streams_})
      for (auto& [site, s] : *streams) {
        auto r = s->Finish();
        if (!r.ok() && !gone.count(site)) return Annotate(r.status(), Where());
      }
    return absl::OkStatus();
  });
}

void StageWorker::set_left_out(std::function<std::set<std::string>()> left_out, std::chrono::milliseconds wait) {
  left_out_source_ = std::move(left_out);
  left_out_wait_ = wait;
  if (LeavesOutLostReplicas()) outer_->set_cancel_check([this] { return OtherReplicaLeftOut(); });
}

std::vector<std::string> StageWorker::OtherReplicasIn(const std::set<std::string>& sites) const {
  std::vector<std::string> out;
  for (size_t j = 0; j < a_.replicas.sites.size(); ++j)
    if (static_cast<int>(j) != replica_ && sites.count(a_.replicas.sites[j])) out.push_back(a_.replicas.sites[j]);
  return out;
}

bool StageWorker::OtherReplicaLeftOut() const {
  return left_out_source_ && !OtherReplicasIn(left_out_source_()).empty();
}

bool StageWorker::AwaitLeftOut(const std::string& peer, const absl::Status& cause) {
  if (!LeavesOutLostReplicas() || !left_out_source_) return false;
  const auto deadline = Clock::now() + left_out_wait_;
  spdlog::warn("{}", absl::StrCat(Where(), ": ", cause.message(), "; asking the coordinator whether ",
                                  peer.empty() ? "a replica" : absl::StrCat("'", peer, "'"),
                                  " was lost (waiting at most ", left_out_wait_.count() / 1000.0, " s)"));
  for (;;) {
    const std::vector<std::string> out = OtherReplicasIn(left_out_source_());
    if (peer.empty() ? !out.empty() : std::find(out.begin(), out.end(), peer) != out.end()) {
      for (const auto& site : out)
        if (left_out_.insert(site).second)
          spdlog::warn("{}", absl::StrCat(Where(), ": replica '", site,
                                          "' was lost and is left out of the outer average; no outer "
                                          "synchronisation until the switch that re-plans without it"));
      outer_->Suspend();
      return true;
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

absl::Status StageWorker::SaveCheckpoint(const std::string& dir, int64_t steps_done, int keep, bool boundary) {
  return GuardTorch(absl::StrCat(Where(), ": checkpoint of step ", steps_done), [&]() -> absl::Status {
    std::map<std::string, torch::Tensor> all = Parameters();
    // job.step_overlap: at a switch's step boundary, the weights the next step's early micro-batches began
    // on in this step's drain, so that the next plan begins them on the same (Restore).
    if (boundary && KeepsEarlyWeights() && early_model_ && carried_step_ == steps_done)
      for (const auto& [n, p] : early_model_->parameters()) all[kEarlyPrefix + n] = p.detach().cpu();
    if (zero_) {  // the workers' shards of the moments, gathered at worker 0
      auto moments = zero_->ExportState(*group_, model_->parameters());
      if (!moments.ok()) return Annotate(moments.status(), Where());
      for (auto& [k, v] : *moments) all[k] = v;
    } else {
      for (auto& [k, v] : opt_.ExportState()) all[k] = v;
    }
    if (!talks_to_sites()) return absl::OkStatus();  // worker 0 writes the site's files
    auto finite = [&](const std::map<std::string, torch::Tensor>& tensors) -> absl::Status {
      for (const auto& [name, t] : tensors)  // a checkpoint holds finite values only: recovery resumes from it
        if (t.is_floating_point() && !torch::isfinite(t).all().item<bool>())
          return absl::DataLossError(absl::StrCat(Where(), ": ", name, " is not finite after step ", steps_done,
                                                  "; the checkpoint is not written"));
      return absl::OkStatus();
    };
    // DiLoCo: this replica's round state (replica 0's parameters and moments are in the stage's shard).
    if (outer_) {
      auto round = outer_->ExportRoundState(/*await_exchange=*/boundary);
      // A replica lost mid-exchange: go on without it if the coordinator leaves it out (as Step does).
      if (!round.ok() && LeavesOutLostReplicas() && AwaitLeftOut("", round.status())) {
        outer_gave_up_ = true;
        round = outer_->ExportRoundState(boundary);  // suspended: nothing in flight
      }
      if (!round.ok()) return Annotate(round.status(), absl::StrCat(Where(), ": checkpoint of step ", steps_done));
      if (replica_ != 0)
        for (const auto& [k, v] : all) (*round)[k] = v;
      if (absl::Status s = finite(*round); !s.ok()) return s;
      const core::ReplicaLayout layout = RoundLayout();
      core::ReplicaMeta meta;
      meta.step = steps_done;
      meta.stage = layout.stage;
      meta.num_stages = layout.num_stages;
      meta.replica = replica_;
      meta.first_op = layout.first_op;
      meta.last_op = layout.last_op;
      meta.micro_batches = layout.micro_batches;
      meta.run = core::RunIdOfJob(a_.job_id);
      meta.synchronised = outer_->synchronised_after() == steps_done - 1;
      if (absl::Status s = WriteRoundState(dir, meta, *round); !s.ok())
        return Annotate(s, absl::StrCat(Where(), ": checkpoint"));
      for (auto& [k, v] : outer_->ExportState()) all[k] = v;
    }
    if (!writes_shard()) return absl::OkStatus();
    if (absl::Status s = finite(all); !s.ok()) return s;
    absl::Status s = WriteCheckpoint(dir, steps_done, a_.stage, a_.num_stages, all, core::RunIdOfJob(a_.job_id));
    if (!s.ok()) return Annotate(s, absl::StrCat(Where(), ": checkpoint"));
    if (keep > 0 && a_.stage == 0 && writes_shard()) {
      std::string problems;
      core::PruneCheckpoints(dir, keep, steps_done, &problems);
      if (!problems.empty()) spdlog::warn("{}", absl::StrCat(Where(), ": checkpoints: ", problems));
    }
    return absl::OkStatus();
  });
}

void StageWorker::ReportReplacedFrames(int64_t step) {
  const int64_t replaced = inbox_->replaced();
  if (replaced == replaced_seen_) return;
  spdlog::warn("{}", absl::StrCat(Where(), ": by step ", step + 1, ", ", replaced - replaced_seen_,
                                  " frame(s) arrived for a key whose frame had not been taken yet and replaced it "
                                  "(the last: ",
                                  inbox_->last_replaced(), "); a peer sent a key twice, and a frame was lost"));
  replaced_seen_ = replaced;
}

core::ReplicaLayout StageWorker::RoundLayout() const {
  core::ReplicaLayout layout;
  layout.stage = a_.stage;
  layout.num_stages = a_.num_stages;
  layout.first_op = a_.first_op;
  layout.last_op = a_.last_op;
  for (size_t r = 0; r < a_.replicas.sites.size(); ++r)
    layout.micro_batches.push_back(static_cast<int>(std::count(owner_.begin(), owner_.end(), static_cast<int>(r))));
  return layout;
}

void StageWorker::ForgetCheckpointsAfter(const std::string& dir, int64_t step) const {
  if (a_.stage != 0 || !writes_shard() || !talks_to_sites()) return;
  std::string problems;
  core::RemoveCheckpointsAbove(dir, step, &problems);
  if (!problems.empty()) spdlog::warn("{}", absl::StrCat(Where(), ": checkpoints: ", problems));
}

bool StageWorker::ParametersEqualTheirOuterValues(const std::map<std::string, torch::Tensor>& tensors) const {
  bool compared = false;
  for (const auto& [name, p] : model_->parameters()) {
    auto value = tensors.find(name);
    auto outer = tensors.find(OuterSync::StateNames(name)[0]);
    if (value == tensors.end() || outer == tensors.end()) continue;
    if (!torch::equal(value->second, outer->second)) return false;
    compared = true;
  }
  return compared;
}

bool StageWorker::KeepsEarlyWeights() const {
  // Not under DiLoCo: a switch's boundary synchronises the replicas there, which an uninterrupted run
  // does not, so the step after it runs exact, as after any synchronisation (EarlyMicroBatches).
  return setup_.job.step_overlap > 0 && setup_.job.sync.mode != core::SyncMode::kDiloco;
}

absl::StatusOr<bool> StageWorker::LoadEarlyWeights(const std::map<std::string, torch::Tensor>& tensors,
                                                   const std::string& path) {
  if (!KeepsEarlyWeights()) return false;
  std::map<std::string, torch::Tensor> early;
  std::string missing;
  for (const auto& [n, p] : model_->parameters()) {
    auto it = tensors.find(kEarlyPrefix + n);
    if (it != tensors.end())
      early[n] = it->second;
    else if (missing.empty())
      missing = kEarlyPrefix + n;
  }
  // None kept (no switch's boundary), or a stage with no trained parameter (a LoRA slice without
  // adapters), whose passes are the same on either set of weights.
  if (early.empty()) return false;
  if (!missing.empty())
    return absl::DataLossError(absl::StrCat(Where(), ": restoring from ", path,
                                            ": the checkpoint holds the early "
                                            "weights (job.step_overlap) of some of the stage's parameters but not ",
                                            missing));
  early_model_ = model_->Copy();
  if (absl::Status s = early_model_->Load(early); !s.ok())
    return Annotate(s, absl::StrCat(Where(), ": restoring the early weights from ", path));
  return true;
}

void StageWorker::ResumeEarlyMicroBatches(int64_t step) {
  resumed_early_step_ = step;
  spdlog::info("{}", absl::StrCat(Where(), ": step ", step + 1,
                                  "'s early micro-batches (job.step_overlap) run on "
                                  "the weights of step ",
                                  step,
                                  " kept at the switch's boundary, as an "
                                  "uninterrupted run begins them"));
}

absl::Status StageWorker::Restore(const Checkpoint& c) {
  return GuardTorch(absl::StrCat(Where(), ": restoring ", c.path), [&]() -> absl::Status {
    carried_.clear();  // job.step_overlap: nothing begun carries over a restore
    carried_step_ = -1;
    carried_loss_ = 0;
    resumed_early_step_ = -1;
    // DiLoCo: this replica's own round state, when its stage's replicas resume theirs (worker 0 reads it).
    std::optional<std::map<std::string, torch::Tensor>> round;
    if (diloco_ && talks_to_sites()) {
      std::string why;
      auto loaded = LoadRoundState(c.path, RoundLayout(), replica_, !c.chosen_by_coordinator, &why);
      if (!loaded.ok()) return Annotate(loaded.status(), absl::StrCat(Where(), ": restoring from ", c.path));
      round = std::move(*loaded);
      if (round)
        spdlog::info("{}", absl::StrCat(Where(), ": resumes its own DiLoCo round state of step ", c.step));
      else if (ParametersEqualTheirOuterValues(c.tensors))
        spdlog::info("{}", absl::StrCat(Where(), ": resumes from the outer parameters of step ", c.step, " (", why,
                                        "every replica synchronised every fragment there, so they hold what each "
                                        "sent of its progress in the round; its inner optimizer moments are "
                                        "replica 0's, and its error-feedback residuals, what a lossy codec still "
                                        "held back, start empty)"));
      else
        spdlog::warn("{}", absl::StrCat(Where(), ": resumes from replica 0's state of step ", c.step, " (", why,
                                        "what this replica learnt since the last outer synchronisation, and its "
                                        "error-feedback residuals, are lost)"));
    }
    Checkpoint own;  // replica r > 0: its parameters and moments in place of replica 0's
    const Checkpoint* from = &c;
    if (round && replica_ != 0) {
      own = c;
      for (const auto& [k, v] : *round)
        if (k.rfind("outer.", 0) != 0) own.tensors[k] = v;
      from = &own;
    }
    if (group_) {
      if (absl::Status s = RestoreSite(*from); !s.ok()) return s;
    } else {
      restored_step_ = from->step;
      if (absl::Status s = model_->Load(from->tensors); !s.ok())
        return Annotate(s, absl::StrCat(Where(), ": restoring from ", c.path));
      auto early = LoadEarlyWeights(from->tensors, c.path);
      if (!early.ok()) return early.status();
      if (*early) ResumeEarlyMicroBatches(from->step);
      if (absl::Status s = opt_.ImportState(model_->parameters(), from->tensors, from->step, device_); !s.ok())
        return Annotate(s, absl::StrCat(Where(), ": restoring from ", c.path));
      if (outer_)
        if (absl::Status s = outer_->ImportState(from->tensors); !s.ok())
          return Annotate(s, absl::StrCat(Where(), ": restoring from ", c.path));
    }
    if (round && outer_) {
      if (absl::Status s = outer_->ImportRoundState(*round); !s.ok())
        return Annotate(s, absl::StrCat(Where(), ": restoring the round state of ", c.path));
      if (auto again = outer_->exchange_to_run_again())
        spdlog::info("{}",
                     absl::StrCat(Where(), ": the outer exchange of fragment ", again->first, " begun after step ",
                                  again->second + 1, " was in flight at the checkpoint; it runs again"));
    }
    return absl::OkStatus();
  });
}

// Worker 0 reads the checkpoint; the step, the parameters and the moments then go to every worker.
absl::Status StageWorker::RestoreSite(const Checkpoint& c) {
  const auto params = model_->parameters();
  const bool root = group_->rank() == 0;
  // [step, then per parameter 1 where the checkpoint has both its moments, then 1 where it kept the
  // early weights of job.step_overlap]
  torch::Tensor header = torch::zeros({2 + static_cast<int64_t>(params.size())}, torch::kFloat64);
  if (root) {
    if (absl::Status s = model_->Load(c.tensors); !s.ok())
      return Annotate(s, absl::StrCat(Where(), ": restoring from ", c.path));
    // Loaded before any collective, so that a bad tensor fails here, not mid-broadcast.
    auto early = LoadEarlyWeights(c.tensors, c.path);
    if (!early.ok()) return early.status();
    header[1 + static_cast<int64_t>(params.size())] = *early ? 1.0 : 0.0;
    AdamW check(setup_.job.optimizer);  // the moments' shapes, as a site of one device checks them
    if (absl::Status s = check.ImportState(params, c.tensors, c.step, torch::kCPU); !s.ok())
      return Annotate(s, absl::StrCat(Where(), ": restoring from ", c.path));
    header[0] = static_cast<double>(c.step);
    for (size_t i = 0; i < params.size(); ++i)
      header[1 + i] = c.tensors.count("optim.m." + params[i].first) && c.tensors.count("optim.v." + params[i].first);
  }
  if (root && outer_)  // the outer state stays with worker 0, which alone synchronises
    if (absl::Status s = outer_->ImportState(c.tensors); !s.ok())
      return Annotate(s, absl::StrCat(Where(), ": restoring from ", c.path));
  if (absl::Status s = group_->Broadcast(header); !s.ok()) return Annotate(s, Where());
  // The parameters in place; the moments into tensors of their shapes (zeros where the checkpoint has none).
  std::vector<torch::Tensor> values, m, v;
  for (const auto& [n, p] : params) {
    values.push_back(p);
    for (auto [prefix, into] :
         {std::pair<const char*, std::vector<torch::Tensor>*>{"optim.m.", &m}, {"optim.v.", &v}}) {
      auto it = c.tensors.find(prefix + n);
      into->push_back(root && it != c.tensors.end() ? it->second.to(torch::kFloat32).clone() : torch::zeros(p.sizes()));
    }
  }
  for (const auto* tensors : {&values, &m, &v})
    if (absl::Status s = group_->BroadcastInPlace(*tensors); !s.ok()) return Annotate(s, Where());
  std::map<std::string, torch::Tensor> state;
  for (size_t i = 0; i < params.size(); ++i)
    if (header[1 + i].item<double>() != 0) {
      state["optim.m." + params[i].first] = m[i];
      state["optim.v." + params[i].first] = v[i];
    }
  restored_step_ = static_cast<int64_t>(header[0].item<double>());
  if (header[1 + static_cast<int64_t>(params.size())].item<double>() != 0) {  // every worker holds them
    if (!root) early_model_ = model_->Copy();                                 // worker 0 loaded its own above
    std::vector<torch::Tensor> early_values;
    for (const auto& [n, p] : early_model_->parameters()) early_values.push_back(p);
    if (absl::Status s = group_->BroadcastInPlace(early_values); !s.ok()) return Annotate(s, Where());
    ResumeEarlyMicroBatches(restored_step_);
  }
  absl::Status s = zero_ ? zero_->ImportState(params, state, restored_step_)
                         : opt_.ImportState(params, state, restored_step_, device_);
  return s.ok() ? s : Annotate(s, Where());
}

std::optional<OuterSyncReport> StageWorker::last_outer_sync() const {
  if (!outer_ || outer_->last_sync().step < 0) return std::nullopt;
  const auto& l = outer_->last_sync();
  return OuterSyncReport{l.step + 1, l.wire_bytes, l.seconds, l.drift};
}

rpc::FrameBounds StageWorker::ExpectedFrames() const {
  rpc::FrameBounds b;
  b.activations = compression::MaxEncodedBytes(int64_t{setup_.micro_batch_size} * setup_.job.sequence_length *
                                               setup_.model.shape.hidden_size);
  int64_t largest = a_.bucket_bytes / 4;
  for (const auto& [n, p] : model_->parameters()) largest = std::max<int64_t>(largest, p.numel());
  b.replica_gradients = compression::MaxEncodedBytes(largest);
  b.control = compression::MaxEncodedBytes(16);  // two doubles (send_pair)
  return b;
}

std::set<std::string> StageWorker::CheckpointTensorNames() const {
  std::set<std::string> names;
  for (const auto& [n, p] : model_->parameters()) {
    names.insert({n, "optim.m." + n, "optim.v." + n});
    if (KeepsEarlyWeights()) names.insert(kEarlyPrefix + n);
    if (outer_)
      for (const auto& s : OuterSync::StateNames(n)) names.insert(s);
  }
  return names;
}

std::map<std::string, torch::Tensor> StageWorker::Parameters() const {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [n, p] : model_->parameters()) out[n] = p.detach().cpu();
  return out;
}

}  // namespace meridian::executor
