// Held-out evaluation of a whole model: greedy generation on the job's held-out instruction examples,
// scored by exact match (data::ExactMatch).
#ifndef MERIDIAN_EXECUTOR_EVALUATE_H_
#define MERIDIAN_EXECUTOR_EVALUATE_H_

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "executor/trainer.h"

namespace meridian::executor {

struct EvalSample {
  std::string prompt, expected, generated;
  std::string kind;  // the example's data::Example::kind ("" when the data names none)
  bool correct = false;
};

// Exact matches among scored examples.
struct EvalTally {
  int examples = 0;
  int correct = 0;
  double accuracy() const { return examples ? static_cast<double>(correct) / examples : 0.0; }
};

struct EvalResult : EvalTally {  // over every scored example
  using Tally = EvalTally;
  std::vector<EvalSample> samples;  // every evaluated example, in held-out order
  // Exact match per kind of example (samples' `kind`; examples without one under ""), by kind name.
  std::map<std::string, Tally> ByKind() const;
};

// Generates greedily for up to `max_examples` (0: all) held-out examples of `setup`'s JSONL data with the
// whole model: `parameters` (the trained parameters by name: every weight, or under job.lora the
// adapters, applied to the job's base model), or the job's initial model (model directory or seeded
// initialisation) when `parameters` is empty. Generation stops at EOS or after the expected response's
// token count + 8. FailedPrecondition when the job has no held-out instruction examples.
absl::StatusOr<EvalResult> EvaluateExactMatch(const JobSetup& setup,
                                              const std::map<std::string, torch::Tensor>& parameters,
                                              torch::Device device, int max_examples = 0);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_EVALUATE_H_
