#include "job/job.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace meridian::job {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// A job directory with a small model config and `job_yaml`.
std::string WriteJob(const std::string& name, const std::string& job_yaml, int vocab = 64) {
  const fs::path dir = fs::temp_directory_path() / ("meridian-job-test-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir / "model");
  std::ofstream(dir / "model" / "config.json")
      << "{\"vocab_size\": " << vocab
      << ", \"hidden_size\": 32, \"intermediate_size\": 64, \"num_hidden_layers\": 2, "
         "\"num_attention_heads\": 4, \"rope_theta\": 500000}";
  std::ofstream(dir / "job.yaml") << job_yaml;
  return (dir / "job.yaml").string();
}

// Every parameter, adapter and moment maps back to its op under the partitioner's op names, so the
// coordinator's shard scoping agrees with what the executors load.
TEST(OpNames, EveryCheckpointTensorMapsToItsOpInThePartitionersSpelling) {
  auto c = ParseLlamaConfigText(
      R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 12,
          "num_attention_heads": 4, "tie_word_embeddings": false})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  partitioner::OpGraph g = partitioner::BuildLlamaGraph(c->shape, ProfiledGraphOptions(1, 8, false));
  ASSERT_EQ(static_cast<int>(g.ops.size()), c->num_ops());
  for (int op = 0; op < c->num_ops(); ++op) {
    EXPECT_EQ(OpName(*c, op), g.ops[op].name);
    for (const auto& [name, shape] : OpParameters(*c, op)) {
      EXPECT_EQ(OpNameOfTensor(name), g.ops[op].name) << name;
      EXPECT_EQ(OpNameOfTensor("optim.v." + name), g.ops[op].name) << name;
      EXPECT_EQ(OpNameOfTensor("outer.momentum." + name), g.ops[op].name) << name;
      const std::string stem = name.substr(0, name.size() - 7);  // without ".weight"
      EXPECT_EQ(OpNameOfTensor(stem + ".lora_A.weight"), g.ops[op].name) << name;
      EXPECT_EQ(OpNameOfTensor("optim.m." + stem + ".lora_B.weight"), g.ops[op].name) << name;
    }
  }
  for (const char* stranger : {"", "model.layers.x.mlp.up_proj.weight", "model.layers.-1.mlp.up_proj.weight",
                               "model.layers.01.mlp.up_proj.weight", "model.layers.3.rotary.inv_freq", "evil"})
    EXPECT_EQ(OpNameOfTensor(stranger), std::nullopt) << stranger;
}

TEST(JobInputs, ASyntheticJobResolvesItsModelAndBatching) {
  const std::string path = WriteJob("synthetic",
                                    "job:\n  model: model\n  data: synthetic\n  steps: 3\n  global_batch: 8\n"
                                    "  sequence_length: 16\n");
  auto in = LoadJobInputs(path);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->model.shape.num_hidden_layers, 2);
  EXPECT_EQ(in->model.num_ops(), 6);
  EXPECT_DOUBLE_EQ(in->model.rope_theta, 500000);
  EXPECT_EQ(in->micro_batches, 4);  // min(global_batch, 4)
  EXPECT_EQ(in->micro_batch_size, 2);
  EXPECT_EQ(in->weights, "");
  EXPECT_EQ(in->dataset, nullptr);
  EXPECT_EQ(in->tokenizer, nullptr);
}

TEST(JobInputs, ErrorsNameTheJobFileAndField) {
  std::string path = WriteJob("batching", "job:\n  model: model\n  steps: 3\n  global_batch: 8\n  micro_batches: 3\n");
  auto in = LoadJobInputs(path);
  ASSERT_FALSE(in.ok());
  EXPECT_THAT(std::string(in.status().message()), HasSubstr(path + ":5:18: error: job.micro_batches"));
  // A spec built in code gets the same check here.
  core::JobSpec job;
  job.model = "model";
  job.global_batch = 8;
  job.micro_batches = 3;
  in = PrepareJobInputs(job, path);
  ASSERT_FALSE(in.ok());
  EXPECT_THAT(std::string(in.status().message()),
              HasSubstr(path + ": job.micro_batches 3 does not divide job.global_batch 8"));

  path = WriteJob("model", "job:\n  model: nowhere\n  steps: 3\n  global_batch: 8\n");
  in = LoadJobInputs(path);
  ASSERT_FALSE(in.ok());
  EXPECT_THAT(std::string(in.status().message()), HasSubstr(path + ": job.model: "));
  EXPECT_THAT(std::string(in.status().message()), HasSubstr("nowhere/config.json: cannot open"));

  path = WriteJob("tokenizer",
                  "job:\n  model: model\n  data: text.txt\n  tokenizer: missing.model\n  steps: 3\n"
                  "  global_batch: 8\n");
  in = LoadJobInputs(path);
  ASSERT_FALSE(in.ok());
  EXPECT_THAT(std::string(in.status().message()), HasSubstr(path + ": job.tokenizer: "));

  path = WriteJob("section", "sites: []\n");
  in = LoadJobInputs(path);
  ASSERT_FALSE(in.ok());
  EXPECT_THAT(std::string(in.status().message()), HasSubstr(path));
}

TEST(JobInputs, FindsTheModelDirectorysWeights) {
  const std::string path = WriteJob("weights", "job:\n  model: model\n  steps: 3\n  global_batch: 8\n");
  const fs::path model = fs::path(path).parent_path() / "model";
  std::ofstream(model / "model.safetensors") << "x";
  EXPECT_EQ(FindWeightsFile(model.string()), (model / "model.safetensors").string());
  std::ofstream(model / "model.safetensors.index.json") << "{}";
  EXPECT_EQ(FindWeightsFile(model.string()), (model / "model.safetensors.index.json").string());
  EXPECT_EQ(FindWeightsFile((model / "adapter").string(), /*adapters=*/true), "");
  auto in = LoadJobInputs(path);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->weights, (model / "model.safetensors.index.json").string());
}

}  // namespace
}  // namespace meridian::job
