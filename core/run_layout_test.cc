#include "core/run_layout.h"

#include <gtest/gtest.h>

namespace meridian::core {
namespace {

TEST(RunLayout, BuildsThePathsItParses) {
  EXPECT_EQ(WeightsFile(3), "weights/stage-3.safetensors");
  EXPECT_EQ(CheckpointFile(12, StageShardName(0)), "checkpoints/step-12/stage-0.safetensors");
  EXPECT_EQ(CheckpointFile(12, StageMetaName(4)), "checkpoints/step-12/stage-4.json");
  EXPECT_EQ(SiteLogFile("paris"), "sites/paris.log");

  auto w = ParseSiteFile(WeightsFile(3));
  ASSERT_TRUE(w);
  EXPECT_EQ(w->kind, SiteFile::Kind::kWeights);
  EXPECT_EQ(w->stage, 3);
  auto shard = ParseSiteFile(CheckpointFile(12, StageShardName(7)));
  ASSERT_TRUE(shard);
  EXPECT_EQ(shard->kind, SiteFile::Kind::kCheckpointShard);
  EXPECT_EQ(shard->step, 12);
  EXPECT_EQ(shard->stage, 7);
  auto meta = ParseSiteFile(CheckpointFile(999999999, StageMetaName(999999)));
  ASSERT_TRUE(meta);
  EXPECT_EQ(meta->kind, SiteFile::Kind::kCheckpointMeta);
  EXPECT_EQ(meta->replica, -1);

  // A DiLoCo replica's round state.
  EXPECT_EQ(CheckpointFile(12, ReplicaShardName(1, 2)), "checkpoints/step-12/stage-1.replica-2.safetensors");
  EXPECT_EQ(CheckpointFile(12, ReplicaMetaName(1, 0)), "checkpoints/step-12/stage-1.replica-0.json");
  auto round = ParseSiteFile(CheckpointFile(12, ReplicaShardName(1, 2)));
  ASSERT_TRUE(round);
  EXPECT_EQ(round->kind, SiteFile::Kind::kCheckpointShard);
  EXPECT_EQ(round->stage, 1);
  EXPECT_EQ(round->replica, 2);
  auto round_meta = ParseSiteFile(CheckpointFile(12, ReplicaMetaName(1, 0)));
  ASSERT_TRUE(round_meta);
  EXPECT_EQ(round_meta->kind, SiteFile::Kind::kCheckpointMeta);
  EXPECT_EQ(round_meta->replica, 0);
}

TEST(RunLayout, RefusesEveryOtherPath) {
  for (const char* bad : {"",
                          "weights/stage-1.json",
                          "weights/stage-01.safetensors",
                          "weights/stage-.safetensors",
                          "weights/stage-1.safetensors/x",
                          "weights//stage-1.safetensors",
                          "../weights/stage-1.safetensors",
                          "checkpoints/step-0/stage-1.json",
                          "checkpoints/step-01/stage-1.json",
                          "checkpoints/step-1000000000/stage-1.json",
                          "checkpoints/step-1/stage-1000000.json",
                          "checkpoints/step-1/stage-1.txt",
                          "checkpoints/step-1/../stage-1.json",
                          "checkpoints/step-1/stage--1.json",
                          "checkpoints/step-+1/stage-1.json",
                          "plan.json",
                          "checkpoints/step-1/sub/stage-1.json",
                          "/weights/stage-1.safetensors",
                          "weights/stage--0.safetensors",
                          "checkpoints/step-10/stage--0.json",
                          "weights/stage-+1.safetensors",
                          "checkpoints/step-10/stage- 1.json",
                          "weights/stage-1.replica-0.safetensors",
                          "checkpoints/step-1/stage-1.replica-01.json",
                          "checkpoints/step-1/stage-1.replica-.json",
                          "checkpoints/step-1/stage-1.replica-1",
                          "checkpoints/step-1/stage-1.replica--1.json",
                          "checkpoints/step-1/stage-1.replica-1000000.json",
                          "checkpoints/step-1/stage-1.replica-1.txt"})
    EXPECT_FALSE(ParseSiteFile(bad)) << bad;
}

TEST(RunLayout, StepDirectoriesHaveOneCanonicalName) {
  EXPECT_EQ(StepDirName(7), "step-7");
  EXPECT_EQ(ParseStepDirName("step-7"), 7);
  EXPECT_EQ(ParseStepDirName("step-123456789012"), 123456789012);
  for (const char* bad : {"step-007", "step-0", "step-", "step-7x", "step--7", "Step-7", "step-7.tmp"})
    EXPECT_FALSE(ParseStepDirName(bad)) << bad;
}

}  // namespace
}  // namespace meridian::core
