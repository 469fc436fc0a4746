// A site's workers in one process, one thread each (c10d Gloo over a FileStore on loopback): the rows of
// a micro-batch, scatter and gather, the bucketed gradient sum from autograd's hooks, and ZeRO-1's AdamW
// against the whole one.
#include "executor/site_group.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <thread>

#include "executor/trainer.h"
#include "executor/zero.h"
#include "gpu/probe.h"

namespace meridian::executor {
namespace {

namespace fs = std::filesystem;

// A store path no group has used yet.
std::string FreshStore() {
  static int n = 0;
  const std::string store =
      (fs::temp_directory_path() / ("meridian_site_group_" + std::to_string(::getpid()) + "_" + std::to_string(n++)))
          .string();
  fs::remove(store);
  return store;
}

// Runs fn(group) on `k` workers, one thread each, in a fresh group, which they leave together; returns each
// worker's failure text.
std::vector<std::string> OnWorkers(int k, const std::function<void(SiteGroup&)>& fn) {
  const std::string store = FreshStore();
  std::vector<std::string> errors(k);
  std::vector<std::thread> threads;
  for (int r = 0; r < k; ++r)
    threads.emplace_back([&, r] {
      auto g = SiteGroup::Join(store, r, k, std::chrono::seconds(30), "site 'test'");
      if (!g.ok()) {
        errors[r] = std::string(g.status().message());
        return;
      }
      fn(**g);
      // Stay until every worker is done: a group closed while another worker still joins or runs fails it.
      torch::Tensor done = torch::zeros({1});
      if (absl::Status s = (*g)->AllReduce(done); !s.ok()) errors[r] = std::string(s.message());
    });
  for (auto& t : threads) t.join();
  fs::remove(store);
  return errors;
}

// Seeded values from a generator of their own: the workers' threads must not share torch's global one.
torch::Tensor Random(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn(shape, gen);
}

std::vector<std::pair<std::string, torch::Tensor>> Params(uint64_t seed) {
  std::vector<std::pair<std::string, torch::Tensor>> p;
  p.emplace_back("w1", Random({7, 5}, seed).requires_grad_(true));
  p.emplace_back("norm", Random({5}, seed + 1).requires_grad_(true));
  p.emplace_back("w2", Random({3, 7}, seed + 2).requires_grad_(true));
  return p;
}

TEST(SiteGroupTest, RowsCoverAMicroBatchOnceInWorkerOrder) {
  for (int k : {2, 3, 4}) {
    std::vector<std::string> errors = OnWorkers(k, [&](SiteGroup& g) {
      for (int64_t rows : {int64_t{4}, int64_t{5}, int64_t{7}}) {
        int64_t next = 0;
        for (int w = 0; w < k; ++w) {
          auto [first, count] = g.Rows(rows, w);
          EXPECT_EQ(first, next);
          EXPECT_GE(count, rows / k);
          EXPECT_LE(count, rows / k + 1);
          next = first + count;
        }
        EXPECT_EQ(next, rows);
      }
    });
    for (const auto& e : errors) EXPECT_EQ(e, "");
  }
}

TEST(SiteGroupTest, ScatterThenGatherGivesWorkerZeroTheWholeTensorBack) {
  const torch::Tensor whole = torch::arange(5 * 3 * 2, torch::kFloat32).view({5, 3, 2});
  std::vector<torch::Tensor> mine(3), back(3);
  auto errors = OnWorkers(3, [&](SiteGroup& g) {
    auto m = g.Scatter(g.rank() == 0 ? whole : torch::Tensor(), {5, 3, 2});
    ASSERT_TRUE(m.ok()) << m.status();
    mine[g.rank()] = *m;
    auto w = g.Gather(*m * 2, {5, 3, 2});
    ASSERT_TRUE(w.ok()) << w.status();
    back[g.rank()] = *w;
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  EXPECT_TRUE(torch::equal(mine[0], whole.narrow(0, 0, 2)));
  EXPECT_TRUE(torch::equal(mine[1], whole.narrow(0, 2, 2)));
  EXPECT_TRUE(torch::equal(mine[2], whole.narrow(0, 4, 1)));
  EXPECT_TRUE(torch::equal(back[0], whole * 2));
  EXPECT_FALSE(back[1].defined());
}

// Each worker runs two backward passes of its own data, the last one captured: every worker ends with the
// sum of all workers' gradients, and the buckets filled during the pass started there.
TEST(SiteGroupTest, TheReducerSumsEveryWorkersGradientStartingBucketsDuringBackward) {
  const int k = 2;
  std::vector<std::vector<torch::Tensor>> grads(k);
  std::vector<int> during(k);
  auto inputs = [](int worker, int pass) { return Random({4, 5}, 100 + 10 * worker + pass); };
  auto loss = [](const std::vector<std::pair<std::string, torch::Tensor>>& p, const torch::Tensor& x) {
    return (torch::matmul(x * p[1].second, p[0].second.t()).tanh().matmul(p[2].second.t())).pow(2).sum();
  };
  auto errors = OnWorkers(k, [&](SiteGroup& g) {
    auto p = Params(1);
    SiteReducer reducer(&g, p, /*bucket_bytes=*/64);  // one parameter per bucket
    loss(p, inputs(g.rank(), 0)).backward();
    reducer.CaptureNextBackward();
    loss(p, inputs(g.rank(), 1)).backward();
    auto waited = reducer.Finish();
    ASSERT_TRUE(waited.ok()) << waited.status();
    during[g.rank()] = reducer.started_during_backward();
    for (auto& [n, t] : p) grads[g.rank()].push_back(t.grad().clone());
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  auto want = Params(1);
  for (int w = 0; w < k; ++w)
    for (int pass = 0; pass < 2; ++pass) loss(want, inputs(w, pass)).backward();
  for (int w = 0; w < k; ++w) {
    EXPECT_EQ(during[w], 3);
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(torch::allclose(grads[w][i], want[i].second.grad(), 1e-5, 1e-6)) << want[i].first;
  }
}

// ZeRO-1: three workers, each holding a third of the moments (counted), step exactly as one AdamW does;
// their gathered moments are AdamW's, and restoring them shards them again.
TEST(SiteGroupTest, ShardedAdamWHoldsItsShareOfTheMomentsAndStepsAsAdamW) {
  const int k = 3;
  core::OptimizerSpec spec;
  spec.lr = 0.05;
  spec.weight_decay = 0.1;
  auto set_grads = [](const std::vector<std::pair<std::string, torch::Tensor>>& p, int step) {
    uint64_t seed = 50 + 10 * step;
    for (auto& [n, t] : p) t.mutable_grad() = Random(t.sizes().vec(), seed++);
  };
  auto reference = Params(2);
  AdamW adam(spec);
  for (int step = 0; step < 3; ++step) {
    set_grads(reference, step);
    adam.Step(reference, 0.05);
  }
  const int64_t total = 7 * 5 + 5 + 3 * 7;  // 61: shards of 21, 21, 19
  std::vector<int64_t> elements(k);
  std::vector<std::vector<torch::Tensor>> values(k);
  std::map<std::string, torch::Tensor> exported;
  std::vector<int64_t> reimported(k);
  auto errors = OnWorkers(k, [&](SiteGroup& g) {
    auto p = Params(2);
    ShardedAdamW zero(spec, p, g.rank(), k);
    EXPECT_EQ(zero.state_elements(), 0);
    for (int step = 0; step < 3; ++step) {
      set_grads(p, step);
      zero.Step(p, 0.05);
      ASSERT_TRUE(zero.GatherParameters(g, p).ok());
    }
    elements[g.rank()] = zero.state_elements();
    for (auto& [n, t] : p) values[g.rank()].push_back(t.detach().clone());
    auto state = zero.ExportState(g, p);
    ASSERT_TRUE(state.ok()) << state.status();
    if (g.rank() == 0) exported = *state;
    EXPECT_EQ(state->empty(), g.rank() != 0);
    ShardedAdamW again(spec, p, g.rank(), k);
    ASSERT_TRUE(again.ImportState(p, adam.ExportState(), 3).ok());
    reimported[g.rank()] = again.state_elements();
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  EXPECT_EQ(elements, (std::vector<int64_t>{2 * 21, 2 * 21, 2 * 19}));
  EXPECT_EQ(elements[0] + elements[1] + elements[2], 2 * total);
  EXPECT_EQ(reimported, elements);
  for (int w = 0; w < k; ++w)
    for (size_t i = 0; i < reference.size(); ++i)
      EXPECT_TRUE(torch::equal(values[w][i], reference[i].second.detach())) << reference[i].first << " worker " << w;
  const auto want = adam.ExportState();
  ASSERT_EQ(exported.size(), want.size());
  for (const auto& [name, t] : want) EXPECT_TRUE(torch::equal(exported[name], t)) << name;
}

TEST(SiteGroupTest, AWorkerFlagIsCheckedAndAMissingWorkerFailsTheJoinNamingTheSite) {
  EXPECT_TRUE(ParseSiteWorker("1/2").ok());
  for (const char* bad : {"0/2", "2/2", "1/1", "x/2", "1/2/3", "1/65"}) EXPECT_FALSE(ParseSiteWorker(bad).ok()) << bad;
  const std::string store =
      (fs::temp_directory_path() / ("meridian_site_group_alone_" + std::to_string(::getpid()))).string();
  fs::remove(store);
  auto g = SiteGroup::Join(store, 0, 2, std::chrono::milliseconds(1500), "site 'b'");
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("site 'b' worker 0 of 2"), std::string::npos) << g.status();
  fs::remove(store);
}

// Workers on CUDA devices: with NCCL in the build they join an NCCL group beside Gloo's, so on a machine
// without a GPU each fails to join, naming the site, the worker and the CUDA call; without NCCL they join
// Gloo alone and sum through host memory. (Two GPUs run NCCL itself: scripts/gpu_check.sh.)
TEST(SiteGroupTest, WorkersOnCudaDevicesJoinNcclOrSayWhyNot) {
  if (gpu::Available()) GTEST_SKIP() << "a GPU is present: gpu/nccl_group_test runs NCCL there";
  const std::string store = FreshStore();
  std::vector<absl::StatusOr<std::unique_ptr<SiteGroup>>> groups(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      groups[r] = SiteGroup::Join(store, r, 2, std::chrono::seconds(30), "site 'g'", "cuda:" + std::to_string(r));
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
#ifdef MERIDIAN_HAVE_NCCL
    ASSERT_FALSE(groups[r].ok()) << "worker " << r;
    const std::string msg(groups[r].status().message());
    EXPECT_NE(msg.find("site 'g' worker " + std::to_string(r) + " of 2: joining the site's NCCL group"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("on cuda:" + std::to_string(r) + ": cudaSetDevice"), std::string::npos) << msg;
#else
    ASSERT_TRUE(groups[r].ok()) << groups[r].status();
    EXPECT_FALSE((*groups[r])->uses_nccl());
    EXPECT_TRUE((*groups[r])->collective_device().is_cpu());
#endif
  }
  groups.clear();
  fs::remove(store);
}

TEST(SiteGroupTest, WorkersOnTheCpuUseGlooAndTheCpu) {
  auto errors = OnWorkers(2, [](SiteGroup& g) {
    EXPECT_FALSE(g.uses_nccl());
    EXPECT_TRUE(g.collective_device().is_cpu());
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

}  // namespace
}  // namespace meridian::executor
