#include "partitioner/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace meridian::partitioner {
namespace {

using ::testing::HasSubstr;

std::string Err(const absl::Status& s) { return std::string(s.message()); }

TEST(GraphJson, ParsesAndRoundTrips) {
  auto g = ParseGraphJson(R"({"ops": [
    {"name": "a", "forward_flops": 10, "backward_flops": 20, "param_bytes": 4, "optimizer_bytes": 8, "output_bytes": 16, "inputs": []},
    {"name": "b", "forward_flops": 1, "backward_flops": 2, "output_bytes": 3, "inputs": [0]}]})",
                          "g.json");
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->ops.size(), 2u);
  EXPECT_EQ(g->ops[1].inputs, std::vector<int>{0});
  auto again = ParseGraphJson(GraphToJson(*g), "again.json");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->ops[0].optimizer_bytes, 8);
}

TEST(GraphJson, ErrorsNameTheField) {
  EXPECT_THAT(Err(ParseGraphJson("{", "g.json").status()), HasSubstr("g.json: JSON syntax"));
  EXPECT_THAT(Err(ParseGraphJson("[]", "g.json").status()), HasSubstr("top level"));
  EXPECT_THAT(Err(ParseGraphJson(R"({"ops": []})", "g.json").status()), HasSubstr("g.json: ops: expected a non-empty"));
  EXPECT_THAT(
      Err(ParseGraphJson(R"({"ops": [{"name": "a", "forward_flops": -1, "backward_flops": 0, "output_bytes": 0}]})",
                         "g.json")
              .status()),
      HasSubstr("ops[0].forward_flops: must be a non-negative"));
  EXPECT_THAT(
      Err(ParseGraphJson(
              R"({"ops": [{"name": "a", "forward_flops": 1, "backward_flops": 0, "output_bytes": 0, "inputs": [0]}]})",
              "g.json")
              .status()),
      HasSubstr("ops[0].inputs[0]: 0 is not an earlier op"));
  EXPECT_THAT(
      Err(ParseGraphJson(R"({"ops": [{"name": "a", "forward_flops": "1", "backward_flops": 0, "output_bytes": 0}]})",
                         "g.json")
              .status()),
      HasSubstr("ops[0].forward_flops: expected a number"));
  EXPECT_THAT(
      Err(ParseGraphJson(
              R"({"ops": [{"name": "a", "forward_flops": 1, "backward_flops": 0, "output_bytes": 0, "colour": 1}]})",
              "g.json")
              .status()),
      HasSubstr("ops[0].colour: unknown field"));
  EXPECT_THAT(Err(ParseGraphJson(R"({"ops": [{"name": "a", "forward_flops": 1, "backward_flops": 0, "output_bytes": 0},
                                              {"name": "a", "forward_flops": 1, "backward_flops": 0, "output_bytes": 0}]})",
                                 "g.json")
                      .status()),
              HasSubstr("duplicate op name 'a'"));
  EXPECT_THAT(Err(LoadGraphFile("/nonexistent.json").status()), HasSubstr("/nonexistent.json: cannot open"));
}

// An LM head tied to the embedding (tie_word_embeddings): the graph says so, keeps it through JSON, and no
// cut may separate the two.
TEST(GraphJson, TiedOpsAreKeptTogether) {
  LlamaShape shape;
  shape.vocab_size = 64, shape.hidden_size = 16, shape.intermediate_size = 32, shape.num_hidden_layers = 2;
  shape.num_attention_heads = shape.num_key_value_heads = 2;
  OpGraph untied = BuildLlamaGraph(shape, {});
  EXPECT_EQ(untied.ops.back().tied_to, -1);
  for (int p = 0; p + 1 < static_cast<int>(untied.ops.size()); ++p) EXPECT_EQ(CutSeparatesTiedOps(untied, p), -1);
  shape.tie_word_embeddings = true;
  OpGraph tied = BuildLlamaGraph(shape, {});
  EXPECT_EQ(tied.ops.back().tied_to, 0);
  for (int p = 0; p + 1 < static_cast<int>(tied.ops.size()); ++p) EXPECT_EQ(CutSeparatesTiedOps(tied, p), 0) << p;
  auto again = ParseGraphJson(GraphToJson(tied), "g.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->ops.back().tied_to, 0);
  EXPECT_EQ(GraphToJson(untied).find("tied_to"), std::string::npos);
  EXPECT_THAT(Err(ParseGraphJson(R"({"ops": [{"name": "a", "forward_flops": 1, "backward_flops": 0, "output_bytes": 0,
                                               "tied_to": 0}]})",
                                 "g.json")
                      .status()),
              HasSubstr("g.json: ops[0].tied_to: expected the index of an earlier op"));
}

TEST(ProfileJson, ParsesAndValidates) {
  auto p = ParseProfileJson(
      R"({"sites": [{"name": "a", "flops_per_second": 1e12, "memory_bytes": 8e9, "op_seconds": {"x": 0.1}},
                                          {"name": "b", "flops_per_second": 5e11, "memory_bytes": 8e9,
                                           "gemm_flops_per_second": {"libtorch_fp32": 4e11, "cublas_bf16": 9e14}}],
                               "links": [{"from": "a", "to": "b", "bandwidth_bytes_per_second": 1.25e7, "latency_seconds": 0.02}]})",
      "p.json");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->sites[0].op_seconds.at("x"), 0.1);
  auto again = ParseProfileJson(ProfileToJson(*p), "again.json");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->links[0].latency_seconds, 0.02);
  EXPECT_EQ(again->sites[1].gemm_flops_per_second.at("cublas_bf16"), 9e14);
  // A CPU site's transport work per frame and per byte, round-tripped; negative figures refused.
  auto t = ParseProfileJson(R"({"sites": [{"name": "a", "flops_per_second": 1, "memory_bytes": 1,
                                           "transport_seconds_per_frame": 5e-5, "transport_seconds_per_byte": 2e-9,
                                           "optimizer_seconds_per_byte": 3e-10}]})",
                            "t.json");
  ASSERT_TRUE(t.ok()) << t.status();
  auto t2 = ParseProfileJson(ProfileToJson(*t), "again.json");
  ASSERT_TRUE(t2.ok()) << t2.status();
  EXPECT_EQ(t2->sites[0].transport_seconds_per_frame, 5e-5);
  EXPECT_EQ(t2->sites[0].transport_seconds_per_byte, 2e-9);
  EXPECT_DOUBLE_EQ(TransportSeconds(t2->sites[0], 1e6), 5e-5 + 2e-3);
  // A frame received over a link whose receive cost was measured costs the larger figure a byte.
  EXPECT_DOUBLE_EQ(TransportSeconds(t2->sites[0], 1e6, 5e-9), 5e-5 + 5e-3);
  EXPECT_DOUBLE_EQ(TransportSeconds(t2->sites[0], 1e6, 1e-9), 5e-5 + 2e-3);
  // So does the received half of a replica sum's wire bytes: 2 replicas of 1e6 gradient bytes send 1e6
  // and receive 1e6 (identity: no codec work).
  EXPECT_DOUBLE_EQ(ReplicaSumCpuSeconds(t2->sites[0], "identity", 1, 1e6, 2, 1, 0), 4 * 5e-5 + 2e-9 * 2e6);
  EXPECT_DOUBLE_EQ(ReplicaSumCpuSeconds(t2->sites[0], "identity", 1, 1e6, 2, 1, 5e-9),
                   4 * 5e-5 + 2e-9 * 1e6 + 5e-9 * 1e6);
  // And its optimizer's per byte of state: a step of ops holding 1e9 bytes of it costs 0.3 s.
  EXPECT_EQ(t2->sites[0].optimizer_seconds_per_byte, 3e-10);
  OpGraph g;
  g.ops = {{"x", 1, 1, 0, 6e8, 1, {}}, {"y", 1, 1, 0, 4e8, 1, {0}}};
  EXPECT_DOUBLE_EQ(OptimizerSeconds(g, t2->sites[0], 0, 1, 0), 0.3);
  EXPECT_DOUBLE_EQ(OptimizerSeconds(g, t2->sites[0], 1, 1, 0), 0.12);
  // Under ZeRO-1 each of a site's workers steps its share of the state.
  SiteProfile two = t2->sites[0];
  two.workers = 2;
  EXPECT_DOUBLE_EQ(OptimizerSeconds(g, two, 0, 1, 1), 0.15);
  EXPECT_DOUBLE_EQ(OptimizerSeconds(g, two, 0, 1, 0), 0.3);
  // A link's receive cost round-trips, optional, and bounded (a site's word about its own link).
  const std::string two_sites = R"("sites": [{"name": "a", "flops_per_second": 1, "memory_bytes": 1},
                                            {"name": "b", "flops_per_second": 1, "memory_bytes": 1}])";
  auto r = ParseProfileJson("{" + two_sites + R"(, "links": [{"from": "a", "to": "b", "bandwidth_bytes_per_second": 1,
                                   "latency_seconds": 0, "receive_seconds_per_byte": 2.5e-8},
                                  {"from": "b", "to": "a", "bandwidth_bytes_per_second": 1, "latency_seconds": 0}]})",
                            "r.json");
  ASSERT_TRUE(r.ok()) << r.status();
  auto r2 = ParseProfileJson(ProfileToJson(*r), "again.json");
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->links[0].receive_seconds_per_byte, 2.5e-8);
  EXPECT_EQ(r2->links[1].receive_seconds_per_byte, 0);
  const std::string written = ProfileToJson(*r2);  // only the measured direction carries one
  EXPECT_EQ(written.find("receive_seconds_per_byte"), written.rfind("receive_seconds_per_byte"));
  EXPECT_THAT(Err(ParseProfileJson("{" + two_sites + R"(, "links": [{"from": "a", "to": "b",
                                   "bandwidth_bytes_per_second": 1, "latency_seconds": 0,
                                   "receive_seconds_per_byte": 0.5}]})",
                                   "r.json")
                      .status()),
              HasSubstr("r.json: links[0].receive_seconds_per_byte: 0.5 s a byte is beyond the 1e-06"));
  EXPECT_THAT(Err(ParseProfileJson("{" + two_sites + R"(, "links": [{"from": "a", "to": "b",
                                   "bandwidth_bytes_per_second": 1, "latency_seconds": 0,
                                   "receive_seconds_per_byte": -1}]})",
                                   "r.json")
                      .status()),
              HasSubstr("r.json: links[0].receive_seconds_per_byte: must be a non-negative number"));
  // The device a site was measured on round-trips; optional; a string.
  auto dev = ParseProfileJson(R"({"sites": [{"name": "a", "flops_per_second": 1, "memory_bytes": 1, "device": "cuda:1"},
                                            {"name": "b", "flops_per_second": 1, "memory_bytes": 1}]})",
                              "d.json");
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto dev2 = ParseProfileJson(ProfileToJson(*dev), "again.json");
  ASSERT_TRUE(dev2.ok()) << dev2.status();
  EXPECT_EQ(dev2->sites[0].device, "cuda:1");
  EXPECT_EQ(dev2->sites[1].device, "");
  EXPECT_THAT(Err(ParseProfileJson(
                      R"({"sites": [{"name": "a", "flops_per_second": 1, "memory_bytes": 1, "device": 0}]})", "d.json")
                      .status()),
              HasSubstr("d.json: sites[0].device: expected a string"));
  EXPECT_THAT(Err(ParseProfileJson(R"({"sites": [{"name": "a", "flops_per_second": 1, "memory_bytes": 1,
                                                  "transport_seconds_per_byte": -1}]})",
                                   "t.json")
                      .status()),
              HasSubstr("t.json: sites[0].transport_seconds_per_byte: must be a non-negative number"));
  EXPECT_THAT(Err(ParseProfileJson(R"({"sites": [{"name": "a", "flops_per_second": 1, "memory_bytes": 1,
                                                  "gemm_flops_per_second": {"cublas_fp32": "fast"}}]})",
                                   "p.json")
                      .status()),
              HasSubstr("sites[0].gemm_flops_per_second.cublas_fp32: must be a non-negative number"));
  EXPECT_THAT(Err(ParseProfileJson(R"({"sites": [{"name": "a", "flops_per_second": 0, "memory_bytes": 1}]})", "p.json")
                      .status()),
              HasSubstr("sites[0].flops_per_second: must be a positive number"));
  EXPECT_THAT(Err(ParseProfileJson(R"({"sites": [{"name": "a", "flops_per_second": 1, "memory_bytes": 1}],
                                       "links": [{"from": "a", "to": "z", "bandwidth_bytes_per_second": 1, "latency_seconds": 0}]})",
                                   "p.json")
                      .status()),
              HasSubstr("links[0].to: unknown site 'z'"));
  EXPECT_THAT(Err(ParseProfileJson(R"({"sites": [{"name": "a", "flops_per_second": 1, "memory_bytes": 1},
                                                 {"name": "b", "flops_per_second": 1, "memory_bytes": 1}],
                                       "links": [{"from": "a", "to": "b", "bandwidth_bytes_per_second": 0, "latency_seconds": 0}]})",
                                   "p.json")
                      .status()),
              HasSubstr("links[0].bandwidth_bytes_per_second: must be a positive number"));
}

TEST(LlamaGraph, SevenBillionParameters) {
  auto shape = ParseLlamaConfig(R"({"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
      "num_hidden_layers": 32, "num_attention_heads": 32, "tie_word_embeddings": false})",
                                "config.json");
  ASSERT_TRUE(shape.ok()) << shape.status();
  LlamaGraphOptions o;
  OpGraph g = BuildLlamaGraph(*shape, o);
  ASSERT_EQ(g.ops.size(), 2u + 2 * 32);
  EXPECT_EQ(g.ops[1].name, "layer0.attn");
  EXPECT_EQ(g.ops.back().name, "head");
  double params = 0;
  for (const auto& op : g.ops) params += op.param_bytes / (o.weight_bytes + o.gradient_bytes);
  EXPECT_NEAR(params, 6.74e9, 0.01e9);  // LLaMA-7B has 6.74 billion parameters
  // Forward FLOPs per token are about 2 * parameters (plus attention over the sequence).
  double fwd = 0;
  for (const auto& op : g.ops) fwd += op.forward_flops;
  EXPECT_GT(fwd / o.sequence_length, 2 * 6.5e9);
  EXPECT_LT(fwd / o.sequence_length, 2 * 6.74e9 * 1.3);
  EXPECT_THAT(Err(ParseLlamaConfig(R"({"vocab_size": 10})", "c.json").status()),
              HasSubstr("c.json: hidden_size: missing"));
}

}  // namespace
}  // namespace meridian::partitioner
