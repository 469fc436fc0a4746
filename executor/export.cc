#include "executor/export.h"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "executor/torch_boundary.h"

namespace meridian::executor {
namespace fs = std::filesystem;

namespace {
constexpr char kPeftPrefix[] = "base_model.model.";
}  // namespace

std::string PeftKey(const std::string& name) { return kPeftPrefix + name; }

absl::StatusOr<std::map<std::string, torch::Tensor>> LoadStageShards(const std::string& dir) {
  return GuardTorch(
      absl::StrCat("loading the stage shards of ", dir), [&]() -> absl::StatusOr<std::map<std::string, torch::Tensor>> {
        std::error_code ec;
        if (!fs::is_directory(dir, ec))
          return absl::NotFoundError(absl::StrCat(dir, ": not a directory of stage shards"));
        std::map<std::string, torch::Tensor> all;
        std::map<std::string, std::string> from;  // tensor -> shard, for the duplicate error
        int shards = 0;
        for (const auto& e : fs::directory_iterator(dir)) {
          if (e.path().extension() != ".safetensors") continue;
          auto shard = LoadParameters(e.path().string());
          if (!shard.ok()) return shard.status();
          ++shards;
          for (auto& [name, t] : *shard) {
            if (auto [it, fresh] = from.emplace(name, e.path().filename().string()); !fresh)
              return absl::DataLossError(absl::StrCat(dir, ": tensor '", name, "' is in two stage shards (", it->second,
                                                      " and ", e.path().filename().string(), ")"));
            all[name] = t;
          }
        }
        if (shards == 0) return absl::NotFoundError(absl::StrCat(dir, ": no stage shards (*.safetensors)"));
        return all;
      });
}

absl::Status ExportHfModel(const JobSetup& setup, const std::map<std::string, torch::Tensor>& trained,
                           const std::string& out_dir) {
  return GuardTorch(absl::StrCat("exporting to ", out_dir), [&]() -> absl::Status {
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    if (ec) return absl::InternalError(absl::StrCat(out_dir, ": cannot create: ", ec.message()));
    if (!setup.job.lora.enabled) {
      if (absl::Status s = SaveParameters(out_dir + "/model.safetensors", trained); !s.ok()) return s;
    } else {
      // The base model (directory weights or seeded initialisation) with the trained adapters merged.
      auto model = BuildStageModel(setup, 0, setup.model.num_ops() - 1, torch::kCPU);
      if (!model.ok()) return model.status();
      if (absl::Status s = (*model)->Load(trained); !s.ok())
        return absl::InvalidArgumentError(absl::StrCat("LoRA export: ", s.message()));
      if (absl::Status s = SaveParameters(out_dir + "/model.safetensors", (*model)->MergedWeights()); !s.ok()) return s;
      std::map<std::string, torch::Tensor> peft;
      for (const auto& [name, t] : (*model)->parameters()) peft[PeftKey(name)] = t;
      if (absl::Status s = SaveParameters(out_dir + "/adapter/adapter_model.safetensors", peft); !s.ok()) return s;
      const core::LoraSpec& l = setup.job.lora;
      nlohmann::json config = {{"peft_type", "LORA"},
                               {"task_type", "CAUSAL_LM"},
                               {"base_model_name_or_path", fs::absolute(setup.model_dir).lexically_normal().string()},
                               {"r", l.r},
                               {"lora_alpha", l.alpha},
                               {"lora_dropout", l.dropout},
                               {"target_modules", l.target_modules},
                               {"bias", "none"},
                               {"fan_in_fan_out", false},
                               {"inference_mode", true},
                               {"init_lora_weights", true},
                               {"modules_to_save", nullptr}};
      std::ofstream out(out_dir + "/adapter/adapter_config.json");
      out << config.dump(2) << "\n";
      if (!out) return absl::InternalError(absl::StrCat(out_dir, "/adapter/adapter_config.json: cannot write"));
    }
    fs::copy_file(setup.model_dir + "/config.json", out_dir + "/config.json", fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat(setup.model_dir, "/config.json: cannot copy: ", ec.message()));
    if (setup.tokenizer) {
      fs::copy_file(setup.tokenizer_path, out_dir + "/tokenizer.model", fs::copy_options::overwrite_existing, ec);
      if (ec) return absl::InternalError(absl::StrCat(setup.tokenizer_path, ": cannot copy: ", ec.message()));
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::pair<JobSetup, std::map<std::string, torch::Tensor>>> LoadWeightsForEval(JobSetup setup,
                                                                                             const std::string& path) {
  return GuardTorch(
      absl::StrCat("loading ", path),
      [&]() -> absl::StatusOr<std::pair<JobSetup, std::map<std::string, torch::Tensor>>> {
        std::error_code ec;
        std::string file = path;
        if (fs::is_directory(path, ec)) {
          file = FindWeightsFile(path, /*adapters=*/true);
          if (file.empty())
            return absl::NotFoundError(absl::StrCat(path,
                                                    ": holds no model.safetensors, model.safetensors.index.json or "
                                                    "adapter_model.safetensors"));
        }
        auto w = LoadWeights(file, {});
        if (!w.ok()) return w.status();
        const bool adapter = !w->empty() && absl::StartsWith(w->begin()->first, kPeftPrefix);
        if (!adapter) {
          setup.job.lora.enabled = false;  // a whole (merged) model
          return std::make_pair(std::move(setup), std::move(*w));
        }
        if (!setup.job.lora.enabled)
          return absl::InvalidArgumentError(absl::StrCat(file,
                                                         " is a PEFT adapter but the job has no job.lora section "
                                                         "(the adapter's rank and target modules)"));
        std::map<std::string, torch::Tensor> adapters;
        for (auto& [key, t] : *w) {
          if (!absl::StartsWith(key, kPeftPrefix))
            return absl::InvalidArgumentError(absl::StrCat(file, ": tensor '", key, "' is not a PEFT adapter key"));
          adapters[key.substr(sizeof(kPeftPrefix) - 1)] = t;
        }
        return std::make_pair(std::move(setup), std::move(adapters));
      });
}

}  // namespace meridian::executor
