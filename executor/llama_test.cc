// The libtorch LLaMA against an independent Python implementation (tests/llama_oracle.py, python3-torch).
#include "executor/llama.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <filesystem>
#include <fstream>

#include "core/safetensors.h"
#include "executor/trainer.h"

namespace meridian::executor {
namespace {

namespace fs = std::filesystem;

core::Tensor ToCore(const torch::Tensor& t) {
  auto c = t.detach().contiguous();
  core::Tensor out;
  out.dtype = c.scalar_type() == torch::kInt64 ? core::DType::kInt64 : core::DType::kFloat32;
  if (out.dtype == core::DType::kFloat32) c = c.to(torch::kFloat32);
  out.shape.assign(c.sizes().begin(), c.sizes().end());
  out.bytes.resize(c.numel() * c.element_size());
  std::memcpy(out.bytes.data(), c.data_ptr(), out.bytes.size());
  return out;
}

void CheckAgainstPython(const std::string& config_json) {
  fs::path dir = fs::temp_directory_path() / ("meridian_oracle_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config_json;
  auto cfg = ParseLlamaConfigText(config_json, "config.json");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  StageModel model(*cfg, 0, cfg->num_ops() - 1, 1234, torch::kCPU);
  SyntheticData data{5, cfg->shape.vocab_size};
  auto tokens = data.MicroBatch(0, 0, 2, 12);
  auto inputs = tokens.slice(1, 0, 12).contiguous(), targets = tokens.slice(1, 1, 13).contiguous();
  auto logits = model.Forward(inputs);
  auto loss = CrossEntropySum(logits, targets, static_cast<double>(targets.numel()));
  loss.backward();
  core::SafetensorsFile weights, batch, out;
  for (const auto& [name, p] : model.parameters()) {
    weights.tensors[name] = ToCore(p);
    out.tensors["grad." + name] = ToCore(p.grad());
  }
  batch.tensors["inputs"] = ToCore(inputs);
  batch.tensors["targets"] = ToCore(targets);
  out.tensors["logits"] = ToCore(logits);
  out.tensors["loss"] = ToCore(loss.reshape({1}));
  ASSERT_TRUE(core::WriteSafetensors((dir / "w.safetensors").string(), weights).ok());
  ASSERT_TRUE(core::WriteSafetensors((dir / "b.safetensors").string(), batch).ok());
  ASSERT_TRUE(core::WriteSafetensors((dir / "o.safetensors").string(), out).ok());
  std::string cmd = "/usr/bin/python3 " + std::string(MERIDIAN_TEST_SOURCE_DIR) + "/tests/llama_oracle.py " +
                    (dir / "config.json").string() + " " + (dir / "w.safetensors").string() + " " +
                    (dir / "b.safetensors").string() + " " + (dir / "o.safetensors").string() + " 2>&1";
  std::string report;
  FILE* p = popen(cmd.c_str(), "r");
  std::array<char, 512> buf;
  while (p && fgets(buf.data(), buf.size(), p)) report += buf.data();
  int rc = p ? pclose(p) : -1;
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << report;
  EXPECT_THAT(report, ::testing::HasSubstr("logits relative error"));
  ::testing::Test::RecordProperty("oracle_report", report);
  fs::remove_all(dir);
}

TEST(LlamaOracle, LogitsAndGradientsMatchPyTorchWithGroupedQueryAttention) {
  CheckAgainstPython(R"({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": false})");
}

TEST(LlamaOracle, TiedEmbeddingsMatchPyTorch) {
  CheckAgainstPython(R"({"vocab_size": 50, "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 1,
    "num_attention_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 500.0, "tie_word_embeddings": true})");
}

TEST(Llama, SlicesComposeToTheWholeModel) {
  auto cfg = ParseLlamaConfigText(R"({"vocab_size": 40, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 2, "tie_word_embeddings": false})", "c.json");
  ASSERT_TRUE(cfg.ok());
  StageModel whole(*cfg, 0, 7, 9, torch::kCPU);
  StageModel a(*cfg, 0, 3, 9, torch::kCPU), b(*cfg, 4, 7, 9, torch::kCPU);
  auto tokens = SyntheticData{1, 40}.MicroBatch(0, 0, 2, 6).slice(1, 0, 6);
  auto direct = whole.Forward(tokens);
  auto split = b.Forward(a.Forward(tokens));
  EXPECT_TRUE(torch::allclose(direct, split, 1e-6, 1e-6));
  EXPECT_EQ(OpName(*cfg, 3), "layer1.attn");
  EXPECT_FALSE(CheckSlice(*cfg, 5, 8).ok());
}

TEST(Trainer, ScheduleAndLearningRate) {
  core::OptimizerSpec o;
  o.lr = 1.0;
  o.warmup_steps = 4;
  o.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(LearningRate(o, 0, 100), 0.25);
  EXPECT_DOUBLE_EQ(LearningRate(o, 3, 100), 1.0);
  EXPECT_NEAR(LearningRate(o, 100, 100), 0.1, 1e-12);
}

}  // namespace
}  // namespace meridian::executor
