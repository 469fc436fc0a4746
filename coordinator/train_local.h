// `meridian train-local JOB.yaml --steps K --out DIR`: the single-process reference trainer, which
// every distributed run must match (same model, data and seed). Writes DIR/model.safetensors.
#ifndef MERIDIAN_COORDINATOR_TRAIN_LOCAL_H_
#define MERIDIAN_COORDINATOR_TRAIN_LOCAL_H_

#include <string>

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

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_TRAIN_LOCAL_H_
