#include "coordinator/train_local.h"

#include <CLI/CLI.hpp>

#include <iostream>

#include "executor/trainer.h"

namespace meridian::coordinator {

void AddTrainLocalOptions(CLI::App* cmd, TrainLocalOptions* o) {
  cmd->add_option("JOB", o->job_path, "Job spec (YAML with a 'job' section)")->required();
  cmd->add_option("--steps", o->steps, "Optimizer steps (default: the job's)")->check(CLI::Range(1, 100000000));
  cmd->add_option("--out", o->out_dir, "Directory for model.safetensors")->required();
  cmd->add_option("--device", o->device, "cpu or cuda:N");
}

int RunTrainLocal(const TrainLocalOptions& o) {
  auto setup = executor::LoadJob(o.job_path);
  if (!setup.ok()) {
    std::cerr << "meridian train-local: " << setup.status().message() << "\n";
    return 2;
  }
  const int steps = o.steps > 0 ? o.steps : setup->job.steps;
  torch::Device device = o.device == "cpu" ? torch::Device(torch::kCPU) : torch::Device(o.device);
  auto r = executor::TrainLocal(*setup, steps, device,
                                [](int step, double loss) { std::cout << "step " << step << " loss " << loss << std::endl; });
  if (!r.ok()) {
    std::cerr << "meridian train-local: " << r.status().message() << "\n";
    return 1;
  }
  if (auto s = executor::SaveParameters(o.out_dir + "/model.safetensors", r->parameters); !s.ok()) {
    std::cerr << "meridian train-local: " << s.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace meridian::coordinator
