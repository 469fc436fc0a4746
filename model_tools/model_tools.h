// The `meridian` subcommands that run the model in this process (libtorch, through executor/); the
// coordinator links none of them:
// - `meridian train-local JOB.yaml --steps K --out DIR`: the single-process reference trainer, which every
//   distributed run must match (same model, data and seed). DIR becomes an HF model directory:
//   model.safetensors, config.json and (for text jobs) tokenizer.model; LoRA jobs also write the PEFT
//   adapter in DIR/adapter.
// - `meridian eval JOB.yaml [--weights PATH]`: held-out exact-match accuracy of a model (or of a PEFT
//   adapter on the job's base model) on the job's data.
// - `meridian export JOB.yaml --weights RUN/weights --out DIR`: a run's stage shards as an HF directory.
// - `meridian tokenizer train --input FILE... --vocab-size N --out DIR`: a SentencePiece tokenizer.
// - after `meridian run` has trained: --export and the held-out evaluation (AfterRun).
#ifndef MERIDIAN_MODEL_TOOLS_MODEL_TOOLS_H_
#define MERIDIAN_MODEL_TOOLS_MODEL_TOOLS_H_

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace meridian::model_tools {

struct TrainLocalOptions {
  std::string job_path, out_dir, device = "cpu";
  int steps = 0;
};
void AddTrainLocalOptions(CLI::App* cmd, TrainLocalOptions* options);
// Returns 0, 1 on a training failure, 2 on invalid input.
int RunTrainLocal(const TrainLocalOptions& options);

struct EvalOptions {
  std::string job_path, weights, json_out, device = "cpu";
  int max_examples = 0, show = 5;
  // --run: score a finished run directory as `meridian run` does after training (the initial model,
  // each checkpoint of the run, RUN/weights) and write RUN/eval.json; `steps` (with it only) is the
  // run's last step (0: RUN/metrics.jsonl's last, else the job's steps).
  std::string run_dir;
  int steps = 0;
};
void AddEvalOptions(CLI::App* cmd, EvalOptions* options);
int RunEval(const EvalOptions& options);

struct ExportOptions {
  std::string job_path, weights_dir, out_dir;
};
void AddExportOptions(CLI::App* cmd, ExportOptions* options);
// Returns 0, 1 when writing fails, 2 on invalid input.
int RunExport(const ExportOptions& options);

struct TokenizerOptions {
  std::vector<std::string> inputs;
  std::string out_dir;
  int vocab_size = 8000;
};
void AddTokenizerOptions(CLI::App* cmd, TokenizerOptions* options);
int RunTokenizerTrain(const TokenizerOptions& options);

// What `meridian run` does once the coordinator has finished a job: with `export_dir`, writes the run's
// stage shards (RUN/weights) as one HF model directory there; for instruction data with a held-out split
// and `eval_examples` > 0, scores held-out exact match (at most `eval_examples` examples) of the initial
// model, of each checkpoint this run wrote below its last step (complete, intact, manifested when the
// coordinator keeps them, newer than the run's training; one that cannot be scored is named and
// skipped), and of the trained model; prints the scores (per kind of example too) with a few answers
// before and after, and writes RUN/eval.json (docs/coordinator.md). Returns 0, or 1 when either fails (with a message
// on stderr).
struct AfterRunOptions {
  std::string job_path, run_dir, export_dir;
  int eval_examples = 0;
  int steps = 0;  // the run's last step (0: RUN/metrics.jsonl's last, else the job's steps)
};
int AfterRun(const AfterRunOptions& options);

}  // namespace meridian::model_tools

#endif  // MERIDIAN_MODEL_TOOLS_MODEL_TOOLS_H_
