// Model tools that run in this process:
// - `meridian train-local JOB.yaml --steps K --out DIR`: the single-process reference trainer, which every
//   distributed run must match (same model, data and seed). DIR becomes an HF model directory:
//   model.safetensors, config.json and (for text jobs) tokenizer.model; LoRA jobs also write the PEFT
//   adapter in DIR/adapter.
// - `meridian eval JOB.yaml [--weights PATH]`: held-out exact-match accuracy of a model (or of a PEFT
//   adapter on the job's base model) on the job's data.
// - `meridian export JOB.yaml --weights RUN/weights --out DIR`: a run's stage shards as an HF directory.
// - `meridian tokenizer train --input FILE... --vocab-size N --out DIR`: a SentencePiece tokenizer.
#ifndef MERIDIAN_COORDINATOR_TRAIN_LOCAL_H_
#define MERIDIAN_COORDINATOR_TRAIN_LOCAL_H_

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace meridian::coordinator {

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

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_TRAIN_LOCAL_H_
