#include "executor/evaluate.h"

#include "absl/strings/str_cat.h"
#include "executor/torch_boundary.h"

namespace meridian::executor {

std::map<std::string, EvalResult::Tally> EvalResult::ByKind() const {
  std::map<std::string, Tally> out;
  for (const EvalSample& s : samples) {
    Tally& t = out[s.kind];
    ++t.examples;
    t.correct += s.correct;
  }
  return out;
}

absl::StatusOr<EvalResult> EvaluateExactMatch(const JobSetup& setup,
                                              const std::map<std::string, torch::Tensor>& parameters,
                                              torch::Device device, int max_examples) {
  return GuardTorch("held-out evaluation", [&]() -> absl::StatusOr<EvalResult> {
    const data::Dataset* d = setup.data.dataset();
    if (d == nullptr || !setup.tokenizer || d->held_out().empty())
      return absl::FailedPreconditionError(
          "the job has no held-out instruction examples (job.data must be JSONL "
          "and job.eval_fraction > 0)");
    const LlamaConfig& c = setup.model;
    std::unique_ptr<StageModel> owned;
    if (parameters.empty() || setup.job.lora.enabled) {
      // The job's initial model (the directory's weights or the seeded initialisation); under LoRA the
      // base that the given adapters apply to.
      auto built = BuildStageModel(setup, 0, c.num_ops() - 1, device);
      if (!built.ok()) return built.status();
      owned = std::move(*built);
      if (!parameters.empty())
        if (absl::Status s = owned->Load(parameters); !s.ok()) return s;
    } else {  // given weights replace every parameter: no need to read the directory's
      owned = std::make_unique<StageModel>(c, 0, c.num_ops() - 1, setup.job.seed, device);
      if (absl::Status s = owned->Load(parameters); !s.ok()) return s;
    }
    StageModel& model = *owned;
    torch::NoGradGuard ng;
    const data::Tokenizer& tok = *setup.tokenizer;
    const int context = std::max(setup.job.sequence_length, 1);
    EvalResult r;
    for (const data::Example& e : d->held_out()) {
      if (max_examples > 0 && r.examples >= max_examples) break;
      std::vector<int64_t> ids;
      if (tok.bos_id() >= 0) ids.push_back(tok.bos_id());
      for (int id : tok.Encode(e.prompt)) ids.push_back(id);
      const size_t budget = tok.Encode(e.response).size() + 8;
      std::vector<int> generated;
      while (generated.size() < budget) {
        const size_t start = ids.size() > static_cast<size_t>(context) ? ids.size() - context : 0;
        auto input =
            torch::tensor(std::vector<int64_t>(ids.begin() + start, ids.end()), torch::kInt64).unsqueeze(0).to(device);
        const int64_t next = model.Forward(input).select(1, -1).argmax(-1).item<int64_t>();
        if (next == tok.eos_id()) break;
        ids.push_back(next);
        generated.push_back(static_cast<int>(next));
      }
      EvalSample s{e.prompt, e.response, tok.Decode(generated), e.kind, false};
      s.correct = data::ExactMatch(s.generated, s.expected);
      r.correct += s.correct;
      ++r.examples;
      r.samples.push_back(std::move(s));
    }
    return r;
  });
}

}  // namespace meridian::executor
