// The coordinator's state machine without a network: who may send and fetch the run's files.
#include "coordinator/coordinator.h"

#include <gtest/gtest.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace meridian::coordinator {
namespace {

namespace fs = std::filesystem;

// The layering rule: the coordinator links no torch. What CMake links into meridian_coordinator
// (coordinator/link_closure.txt, written at configure time), and what this test binary, which links the
// coordinator library alone, has loaded.
TEST(CoordinatorLayering, TheCoordinatorLibraryLinksNoTorch) {
  std::ifstream in(fs::path(MERIDIAN_TEST_BINARY_DIR) / "coordinator" / "link_closure.txt");
  ASSERT_TRUE(in) << "link_closure.txt missing: re-run cmake";
  std::vector<std::string> libs;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) libs.push_back(line);
  for (const char* needed : {"meridian::core", "meridian::partitioner", "meridian::rpc", "meridian::proto"})
    EXPECT_NE(std::find(libs.begin(), libs.end(), needed), libs.end()) << needed;
  for (const auto& lib : libs)
    for (const char* banned : {"torch", "c10", "caffe2", "meridian::executor", "meridian::model_tools"})
      EXPECT_EQ(lib.find(banned), std::string::npos) << "the coordinator links " << lib;

  std::vector<std::string> loaded;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        static_cast<std::vector<std::string>*>(out)->push_back(info->dlpi_name ? info->dlpi_name : "");
        return 0;
      },
      &loaded);
  EXPECT_GT(loaded.size(), 3u);  // the binary, libc, libstdc++, gRPC, ...
  for (const auto& so : loaded)
    for (const char* banned : {"libtorch", "libc10"})
      EXPECT_EQ(so.find(banned), std::string::npos) << "the coordinator's test binary loaded " << so;
}

TEST(CoordinatorFiles, OnlyEachStagesWriterSendsItsOwnFilesOfTheRunningAttempt) {
  const fs::path dir = fs::temp_directory_path() / ("meridian_coordfiles_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  core::ClusterSpec spec;
  spec.name = "t";
  spec.sites = {{"a", {"127.0.0.1", 2}}, {"b", {"127.0.0.1", 3}}, {"c", {"127.0.0.1", 4}}};
  Coordinator c(spec, "run");
  EXPECT_EQ(c.FileDestination("a", "j1", "weights/stage-0.safetensors").status().code(),
            absl::StatusCode::kFailedPrecondition);  // no run directory yet
  c.SetFileDir(dir.string());
  c.BeginJob("j1");
  c.SetFileWriters({{"a", 0}, {"b", 1}}, 100, 1000);
  auto ok = c.FileDestination("a", "j1", "weights/stage-0.safetensors");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->path, (dir / "weights" / "stage-0.safetensors").string());
  EXPECT_EQ(ok->max_bytes, 1000);
  EXPECT_TRUE(fs::is_directory(dir / "weights"));
  auto ckpt = c.FileDestination("b", "j1", "checkpoints/step-100/stage-1.json");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(c.FileDestination("a", "j1", "weights/stage-1.safetensors").status().code(),
            absl::StatusCode::kPermissionDenied);  // b's stage
  EXPECT_EQ(c.FileDestination("c", "j1", "weights/stage-0.safetensors").status().code(),
            absl::StatusCode::kPermissionDenied);  // a spare site
  EXPECT_EQ(c.FileDestination("a", "j0", "weights/stage-0.safetensors").status().code(),
            absl::StatusCode::kFailedPrecondition);  // another attempt
  EXPECT_EQ(c.FileDestination("a", "j1", "checkpoints/step-101/stage-0.json").status().code(),
            absl::StatusCode::kInvalidArgument);  // beyond the job's steps
  std::ofstream((dir / "part").string()) << "x";
  EXPECT_TRUE(c.FileCommit("a", "j1", "weights/stage-0.safetensors", (dir / "part").string(), ok->path, 1).ok());
  EXPECT_TRUE(fs::exists(ok->path));
  EXPECT_FALSE(fs::exists(dir / "part"));
  // A new attempt: the old one's uploads are refused, and nobody writes until told.
  c.BeginJob("j2");
  std::ofstream((dir / "part").string()) << "y";
  EXPECT_EQ(c.FileCommit("a", "j1", "weights/stage-0.safetensors", (dir / "part").string(), ok->path, 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fs::exists(dir / "part"));  // the service deletes it
  EXPECT_EQ(c.FileDestination("a", "j2", "weights/stage-0.safetensors").status().code(),
            absl::StatusCode::kPermissionDenied);
  // Fetching: only what the coordinator has.
  EXPECT_EQ(c.FileSource("c", "checkpoints/step-100/stage-1.json").status().code(), absl::StatusCode::kNotFound);
  std::ofstream(dir / "checkpoints" / "step-100" / "stage-1.json") << "{}";
  auto src = c.FileSource("c", "checkpoints/step-100/stage-1.json");
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ(*src, (dir / "checkpoints" / "step-100" / "stage-1.json").string());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace meridian::coordinator
