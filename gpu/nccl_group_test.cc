// NCCL among a site's workers, one rank per CUDA device (scripts/gpu_check.sh runs it on a GPU machine):
// two ranks, one thread each, sum, broadcast, gather and exchange rows as a site's group does.
#include "gpu/nccl_group.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <thread>
#include <vector>

namespace meridian::gpu {
namespace {

int Devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// Runs body(group, rank, &error) on two ranks, one thread each on its own device, in a fresh group;
// returns each rank's error ("" when none). A rank that cannot join records why and runs nothing.
std::vector<std::string> OnTwoRanks(const std::string& name,
                                    const std::function<void(NcclGroup&, int, std::string*)>& body) {
  const std::string id = (std::filesystem::temp_directory_path() / (name + std::to_string(::getpid()))).string();
  std::filesystem::remove(id);
  std::vector<std::string> errors(2);
  auto rank = [&](int r) {
    auto g = NcclGroup::Join(id, r, 2, r, std::chrono::seconds(60));
    if (!g.ok()) {
      errors[r] = std::string(g.status().message());
      return;
    }
    body(**g, r, &errors[r]);
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  std::filesystem::remove(id);
  return errors;
}

TEST(NcclGroup, TwoRanksSumBroadcastGatherAndExchangeRows) {
  const int devices = Devices();
  if (devices < 2)
    GTEST_SKIP() << "NCCL runs one rank per device and this machine has " << devices
                 << " CUDA device(s) (a site lists each CUDA device once)";
  const int64_t n = 1 << 20;
  std::vector<std::vector<float>> sum(2), bcast(2), gathered(2), got(2);
  auto errors = OnTwoRanks("meridian_nccl_", [&](NcclGroup& group, int r, std::string* error) {
    float *a = nullptr, *b = nullptr;
    cudaMalloc(&a, n * sizeof(float));
    cudaMalloc(&b, 2 * n * sizeof(float));
    std::vector<float> host(n, static_cast<float>(r + 1));
    cudaMemcpy(a, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    auto check = [&](const absl::Status& s) {
      if (!s.ok() && error->empty()) *error = std::string(s.message());
    };
    check(group.AllReduceSum(a, n));
    sum[r].resize(n);
    cudaMemcpy(sum[r].data(), a, n * sizeof(float), cudaMemcpyDeviceToHost);
    std::vector<float> mine(n, static_cast<float>(10 * (r + 1)));
    cudaMemcpy(a, mine.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    check(group.AllGather(a, b, n));
    gathered[r].resize(2 * n);
    cudaMemcpy(gathered[r].data(), b, 2 * n * sizeof(float), cudaMemcpyDeviceToHost);
    check(group.Broadcast(a, n));
    bcast[r].resize(n);
    cudaMemcpy(bcast[r].data(), a, n * sizeof(float), cudaMemcpyDeviceToHost);
    // Rows from rank 0 to rank 1, as worker 0 scatters a micro-batch.
    if (r == 0) {
      check(group.Send(a, n / 2, 1));
    } else {
      check(group.Recv(b, n / 2, 0));
      got[r].resize(n / 2);
      cudaMemcpy(got[r].data(), b, n / 2 * sizeof(float), cudaMemcpyDeviceToHost);
    }
    cudaFree(a);
    cudaFree(b);
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(sum[r].front(), 3.0f);
    EXPECT_EQ(sum[r].back(), 3.0f);
    EXPECT_EQ(gathered[r][0], 10.0f);
    EXPECT_EQ(gathered[r][2 * n - 1], 20.0f);
    EXPECT_EQ(bcast[r][n - 1], 10.0f);
  }
  EXPECT_EQ(got[1].front(), 10.0f);
}

// Data written on the default stream (as libtorch computes) and marked is what the group's own stream sums.
// From pinned host memory the 64 MiB copy is asynchronous (milliseconds), so a missing mark would show.
TEST(NcclGroup, ASumAfterAStreamMarkSeesTheDefaultStreamsWork) {
  const int devices = Devices();
  if (devices < 2) GTEST_SKIP() << "NCCL runs one rank per device and this machine has " << devices;
  const int64_t n = 16 << 20;
  std::vector<float> first(2), last(2);
  auto errors = OnTwoRanks("meridian_nccl_mark_", [&](NcclGroup& group, int r, std::string* error) {
    float *a = nullptr, *host = nullptr;
    if (cudaMalloc(&a, n * sizeof(float)) != cudaSuccess || cudaMallocHost(&host, n * sizeof(float)) != cudaSuccess) {
      *error = "out of memory";
      group.Abort();  // the peer's sum then times out rather than waits
      return;
    }
    for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>(r + 1);
    cudaMemcpyAsync(a, host, n * sizeof(float), cudaMemcpyHostToDevice, cudaStreamLegacy);  // the default stream
    auto mark = StreamMark::Record(r);
    absl::Status s = mark.ok() ? group.AllReduceSum(a, n, mark->get()) : mark.status();
    if (!s.ok()) *error = std::string(s.message());
    cudaMemcpy(&first[r], a, sizeof(float), cudaMemcpyDeviceToHost);
    cudaMemcpy(&last[r], a + n - 1, sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(a);
    cudaFreeHost(host);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(first[r], 3.0f);
    EXPECT_EQ(last[r], 3.0f);
  }
}

// A rank that never enters the collective: the other's call ends at the group's timeout, naming itself,
// and the group is aborted (every later call fails at once).
TEST(NcclGroup, ACollectiveWithoutItsPeerTimesOutAndAbortsTheGroup) {
  const int devices = Devices();
  if (devices < 2) GTEST_SKIP() << "NCCL runs one rank per device and this machine has " << devices;
  const std::string id =
      (std::filesystem::temp_directory_path() / ("meridian_nccl_late_" + std::to_string(::getpid()))).string();
  std::vector<absl::Status> sum(2), after(2);
  std::atomic<bool> done{false};
  auto rank = [&](int r) {
    auto g = NcclGroup::Join(id, r, 2, r, std::chrono::seconds(3));
    if (!g.ok()) {
      sum[r] = g.status();
      return;
    }
    float* a = nullptr;
    cudaMalloc(&a, 1024 * sizeof(float));
    // One sum together first: its connections made, the next call's wait is for the peer's part alone.
    if (absl::Status s = (*g)->AllReduceSum(a, 1024); !s.ok()) {
      sum[r] = s;
      done = true;
    } else if (r == 0) {
      sum[r] = (*g)->AllReduceSum(a, 1024);
      after[r] = (*g)->AllReduceSum(a, 1024);
      done = true;
    } else {
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // alive, never taking part
      (*g)->Abort();  // its peer is gone: destroying would wait for it
    }
    cudaFree(a);
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  std::filesystem::remove(id);
  EXPECT_EQ(sum[0].code(), absl::StatusCode::kDeadlineExceeded) << sum[0];
  EXPECT_NE(sum[0].message().find("NCCL rank 0 of 2 on cuda:0: ncclAllReduce"), std::string::npos) << sum[0];
  EXPECT_EQ(after[0].code(), absl::StatusCode::kFailedPrecondition) << after[0];
}

// Without a device (cudaSetDevice fails) or without rank 0 (no id comes): an error naming the rank and device.
TEST(NcclGroup, ARankWithoutItsPeerOrDeviceFailsNamingItself) {
  const std::string id =
      (std::filesystem::temp_directory_path() / ("meridian_nccl_alone_" + std::to_string(::getpid()))).string();
  std::filesystem::remove(id);
  auto g = NcclGroup::Join(id, 1, 2, 0, std::chrono::milliseconds(300));  // rank 0 never comes
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("NCCL rank 1 of 2 on cuda:0"), std::string::npos) << g.status();
}

}  // namespace
}  // namespace meridian::gpu
