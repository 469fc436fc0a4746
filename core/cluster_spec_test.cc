#include "core/cluster_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace meridian::core {
namespace {

using ::testing::HasSubstr;

std::string SourceDir() {
  const char* s = std::getenv("MERIDIAN_SOURCE_DIR");
  return s ? s : MERIDIAN_TEST_SOURCE_DIR;
}

const char kValid[] = R"(cluster: t
coordinator: {address: 127.0.0.1:7000}
sites:
  - name: a
    address: 127.0.0.1:7001
  - name: b
    address: 127.0.0.1:7002
links:
  - {from: a, to: b, bandwidth: 100Mbit, rtt: 40ms}
)";

TEST(ClusterSpec, ParsesValidSpecWithDefaults) {
  auto r = ParseSpec(kValid, "t.yaml");
  ASSERT_TRUE(r.errors.empty()) << r.errors[0].ToString();
  ASSERT_TRUE(r.spec && r.spec->cluster);
  const ClusterSpec& c = *r.spec->cluster;
  EXPECT_EQ(c.name, "t");
  EXPECT_EQ(c.coordinator.port, 7000);
  ASSERT_EQ(c.sites.size(), 2u);
  EXPECT_EQ(c.sites[1].name, "b");
  EXPECT_EQ(c.sites[1].devices, std::vector<std::string>{"cpu"});
  ASSERT_EQ(c.links.size(), 1u);
  EXPECT_DOUBLE_EQ(*c.links[0].bandwidth_bytes_per_second, 100e6 / 8);
  EXPECT_DOUBLE_EQ(*c.links[0].rtt_seconds, 0.040);
  EXPECT_TRUE(c.links[0].symmetric);
  EXPECT_EQ(c.certs_dir, "certs");
  EXPECT_FALSE(r.spec->job.has_value());
}

TEST(ClusterSpec, BundledExamplesAreValid) {
  for (const char* f : {"examples/clusters/local.yaml", "examples/clusters/geo.yaml"}) {
    auto r = LoadSpecFile(SourceDir() + "/" + f);
    ASSERT_TRUE(r.errors.empty()) << r.errors[0].ToString();
    ASSERT_TRUE(r.spec->cluster.has_value()) << f;
    EXPECT_TRUE(r.spec->job.has_value()) << f;
  }
  auto local = LoadSpecFile(SourceDir() + "/examples/clusters/local.yaml");
  EXPECT_EQ(local.spec->cluster->sites.size(), 3u);
  EXPECT_DOUBLE_EQ(local.spec->cluster->sites[2].emulation->cpu_quota, 0.4);
  auto geo = LoadSpecFile(SourceDir() + "/examples/clusters/geo.yaml");
  EXPECT_EQ(geo.spec->cluster->sites.size(), 4u);
  EXPECT_DOUBLE_EQ(*geo.spec->cluster->sites[0].memory_bytes, 320.0 * (1ull << 30));
}

TEST(ClusterSpec, SshSectionWithDefaultsAndPathsResolvedAgainstTheSpec) {
  auto r = ParseSpec(std::string(kValid).replace(std::string(kValid).find("    address: 127.0.0.1:7002\n"), 28,
                                                 "    address: 127.0.0.1:7002\n    ssh: {host: b.example.com, user: "
                                                 "train, port: 2222, identity_file: keys/id, workdir: /srv/m}\n"),
                     "/etc/meridian/t.yaml");
  ASSERT_TRUE(r.errors.empty()) << r.errors[0].ToString();
  const ClusterSpec& c = *r.spec->cluster;
  EXPECT_FALSE(c.sites[0].ssh.has_value());
  ASSERT_TRUE(c.sites[1].ssh.has_value());
  const SshSpec& ssh = *c.sites[1].ssh;
  EXPECT_EQ(ssh.host, "b.example.com");
  EXPECT_EQ(ssh.user, "train");
  EXPECT_EQ(ssh.port, 2222);
  EXPECT_EQ(ssh.identity_file, "/etc/meridian/keys/id");
  EXPECT_EQ(ssh.known_hosts, "");  // ssh's own
  EXPECT_EQ(ssh.workdir, "/srv/m");
  EXPECT_EQ(ssh.executor, "meridian-executor");
  EXPECT_TRUE(c.elastic.enabled);  // defaults
  EXPECT_DOUBLE_EQ(c.elastic.min_gain, 0.10);
  EXPECT_DOUBLE_EQ(c.elastic.drift, 0.15);
  EXPECT_EQ(c.elastic.window, 5);
  auto e =
      ParseSpec(std::string(kValid) + "elastic: {enabled: false, min_gain: 0.2, drift: 0.3, window: 8}\n", "e.yaml");
  ASSERT_TRUE(e.errors.empty()) << e.errors[0].ToString();
  EXPECT_FALSE(e.spec->cluster->elastic.enabled);
  EXPECT_DOUBLE_EQ(e.spec->cluster->elastic.min_gain, 0.2);
  EXPECT_DOUBLE_EQ(e.spec->cluster->elastic.drift, 0.3);
  EXPECT_EQ(e.spec->cluster->elastic.window, 8);
}

TEST(ClusterSpec, JobOnlyFile) {
  auto r = ParseSpec("job:\n  model: m\n  steps: 5\n  global_batch: 8\n  micro_batches: 4\n", "job.yaml");
  ASSERT_TRUE(r.errors.empty()) << r.errors[0].ToString();
  EXPECT_FALSE(r.spec->cluster.has_value());
  EXPECT_EQ(r.spec->job->steps, 5);
  EXPECT_EQ(r.spec->job->micro_batches, 4);
}

TEST(ClusterSpec, StepOverlapDefaultsToExactSteps) {
  auto exact = ParseSpec("job:\n  model: m\n", "job.yaml");
  ASSERT_TRUE(exact.errors.empty());
  EXPECT_EQ(exact.spec->job->step_overlap, 0);
  auto r = ParseSpec("job:\n  model: m\n  global_batch: 96\n  micro_batches: 24\n  step_overlap: 6\n", "job.yaml");
  ASSERT_TRUE(r.errors.empty()) << r.errors[0].ToString();
  EXPECT_EQ(r.spec->job->step_overlap, 6);
}

TEST(ClusterSpec, SyncDefaultsToEveryStepAndParsesDiloco) {
  auto every = ParseSpec("job:\n  model: m\n", "job.yaml");
  ASSERT_TRUE(every.errors.empty());
  EXPECT_EQ(every.spec->job->sync.mode, SyncMode::kEveryStep);
  auto r = ParseSpec(
      "job:\n  model: m\n  sync:\n    mode: diloco\n    inner_steps: 20\n    fragments: 4\n    codec: int8\n"
      "    overlap: false\n    outer_optimizer: {name: sgd, lr: 1, momentum: 0}\n",
      "job.yaml");
  ASSERT_TRUE(r.errors.empty()) << r.errors[0].ToString();
  const SyncSpec& s = r.spec->job->sync;
  EXPECT_EQ(s.mode, SyncMode::kDiloco);
  EXPECT_EQ(s.inner_steps, 20);
  EXPECT_EQ(s.fragments, 4);
  EXPECT_EQ(s.codec, "int8");
  EXPECT_FALSE(s.overlap);
  EXPECT_EQ(s.outer_optimizer, "sgd");
  EXPECT_DOUBLE_EQ(s.outer_lr, 1);
  EXPECT_DOUBLE_EQ(s.outer_momentum, 0);
  auto d = ParseSpec("job:\n  model: m\n  sync: {mode: diloco}\n", "job.yaml");
  ASSERT_TRUE(d.errors.empty());
  EXPECT_EQ(d.spec->job->sync.inner_steps, 50);
  EXPECT_EQ(d.spec->job->sync.outer_optimizer, "nesterov");
  EXPECT_DOUBLE_EQ(d.spec->job->sync.outer_lr, 0.7);
  EXPECT_DOUBLE_EQ(d.spec->job->sync.outer_momentum, 0.9);
  EXPECT_EQ(d.spec->job->sync.codec, "int4");
  EXPECT_TRUE(d.spec->job->sync.overlap);
  // Any codec of compression/ with its options, as core::CodecSpec::Parse reads it.
  auto o = ParseSpec("job:\n  model: m\n  sync: {mode: diloco, codec: 'int4:block=128+zstd'}\n", "job.yaml");
  ASSERT_TRUE(o.errors.empty()) << o.errors[0].ToString();
  EXPECT_EQ(o.spec->job->sync.codec, "int4:block=128+zstd");
  // SparseLoCo: the paper's lr 1 and decay 0.95 unless given.
  auto sl = ParseSpec(
      "job:\n  model: m\n  sync: {mode: diloco, codec: 'topk-int8:k=0.03', outer_optimizer: {name: sparseloco}}\n",
      "job.yaml");
  ASSERT_TRUE(sl.errors.empty()) << sl.errors[0].ToString();
  EXPECT_EQ(sl.spec->job->sync.outer_optimizer, "sparseloco");
  EXPECT_DOUBLE_EQ(sl.spec->job->sync.outer_lr, 1);
  EXPECT_DOUBLE_EQ(sl.spec->job->sync.outer_momentum, 0.95);
  sl = ParseSpec(
      "job:\n  model: m\n  sync: {mode: diloco, codec: topk, outer_optimizer: {name: sparseloco, momentum: 0.5}}\n",
      "job.yaml");
  ASSERT_TRUE(sl.errors.empty()) << sl.errors[0].ToString();
  EXPECT_DOUBLE_EQ(sl.spec->job->sync.outer_lr, 1);
  EXPECT_DOUBLE_EQ(sl.spec->job->sync.outer_momentum, 0.5);
}

struct BadCase {
  const char* name;
  std::string yaml;
  const char* expect;  // substring of one of the messages
  int line;            // expected line of that message (0: don't check)
};

std::string WithSites(const std::string& sites_block, const std::string& extra = "") {
  return "cluster: t\ncoordinator: {address: 127.0.0.1:7000}\nsites:\n" + sites_block + extra;
}
const std::string kTwoSites = "  - {name: a, address: 127.0.0.1:7001}\n  - {name: b, address: 127.0.0.1:7002}\n";

std::string Nested(int depth) { return "cluster: " + std::string(depth, '[') + std::string(depth, ']') + "\n"; }

std::string AliasBomb() {
  std::string s = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i <= 9; ++i) {
    s += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int k = 0; k < 10; ++k) s += (k ? ", *a" : "*a") + std::to_string(i - 1);
    s += "]\n";
  }
  return s;
}

class MalformedSpec : public ::testing::TestWithParam<BadCase> {};

TEST_P(MalformedSpec, IsRejectedWithLocatedMessage) {
  const BadCase& c = GetParam();
  auto r = ParseSpec(c.yaml, "bad.yaml");
  EXPECT_FALSE(r.spec.has_value());
  ASSERT_FALSE(r.errors.empty());
  bool found = false;
  for (const auto& d : r.errors) {
    EXPECT_EQ(d.file, "bad.yaml");
    EXPECT_THAT(d.ToString(), ::testing::StartsWith("bad.yaml:"));
    if (d.message.find(c.expect) != std::string::npos) {
      found = true;
      if (c.line) {
        EXPECT_EQ(d.line, c.line) << d.ToString();
      }
    }
  }
  std::string all;
  for (const auto& d : r.errors) all += d.ToString() + "\n";
  EXPECT_TRUE(found) << "expected '" << c.expect << "' in:\n" << all;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MalformedSpec,
    ::testing::Values(
        BadCase{"empty", "", "file is empty", 1},
        BadCase{"only_comments", "# nothing\n\n", "file is empty", 1},
        BadCase{"binary", std::string("cluster: t\n\0\x01\x02", 14), "not a text file", 2},
        BadCase{"invalid_utf8", "cluster: \xff\xfe\n", "not a text file", 1},
        BadCase{"syntax_error", "cluster: [unclosed\nsites: x\n", "YAML syntax", 0},
        BadCase{"bad_indentation", "cluster: t\n  sites:\n - a\n", "YAML syntax", 0},
        BadCase{"root_is_list", "- a\n- b\n", "expected a mapping", 1},
        BadCase{"root_is_scalar", "hello\n", "expected a mapping", 1},
        BadCase{"neither_sites_nor_job", "cluster: t\n", "neither 'sites'", 1},
        BadCase{"unknown_top_key", WithSites(kTwoSites, "colour: blue\n"), "unknown key 'colour'", 6},
        BadCase{"missing_cluster_name", "coordinator: {address: 127.0.0.1:7000}\nsites:\n" + kTwoSites,
                "missing required key 'cluster'", 0},
        BadCase{"missing_coordinator", "cluster: t\nsites:\n" + kTwoSites, "missing required key 'coordinator'", 0},
        BadCase{"coordinator_bad_port", "cluster: t\ncoordinator: {address: 127.0.0.1:99999}\nsites:\n" + kTwoSites,
                "outside 1-65535", 2},
        BadCase{"coordinator_no_port", "cluster: t\ncoordinator: {address: localhost}\nsites:\n" + kTwoSites,
                "is not host:port", 2},
        BadCase{"bad_host", WithSites("  - {name: a, address: 'bad host!:7001'}\n"), "neither a host name", 4},
        BadCase{"bad_ipv4", WithSites("  - {name: a, address: 300.1.2.3:7001}\n"), "neither a host name", 4},
        BadCase{"non_numeric_port", WithSites("  - {name: a, address: 'h:port'}\n"), "is not a number", 4},
        BadCase{"sites_not_list", "cluster: t\ncoordinator: {address: 127.0.0.1:7000}\nsites: {a: 1}\n",
                "expected a list of sites", 3},
        BadCase{"sites_empty", "cluster: t\ncoordinator: {address: 127.0.0.1:7000}\nsites: []\n", "at least one site", 3},
        BadCase{"site_not_map", WithSites("  - fast\n"), "expected a mapping", 4},
        BadCase{"site_missing_name", WithSites("  - {address: 127.0.0.1:7001}\n"), "missing required key 'name'", 4},
        BadCase{"site_missing_address", WithSites("  - {name: a}\n"), "missing required key 'address'", 4},
        BadCase{"duplicate_site", WithSites("  - {name: a, address: 127.0.0.1:7001}\n  - {name: a, address: 127.0.0.1:7002}\n"),
                "duplicate site name 'a'", 5},
        BadCase{"duplicate_address", WithSites("  - {name: a, address: 127.0.0.1:7001}\n  - {name: b, address: 127.0.0.1:7001}\n"),
                "already used by site 'a'", 5},
        BadCase{"bad_site_name", WithSites("  - {name: 'a b', address: 127.0.0.1:7001}\n"), "not a valid site name", 4},
        BadCase{"reserved_site_name", WithSites("  - {name: coordinator, address: 127.0.0.1:7001}\n"), "reserved", 4},
        BadCase{"unknown_site_key", WithSites("  - {name: a, address: 127.0.0.1:7001, gpu: h100}\n"), "unknown key 'gpu'", 4},
        BadCase{"bad_device", WithSites("  - {name: a, address: 127.0.0.1:7001, devices: [tpu]}\n"), "'tpu' is not cpu or cuda:N", 4},
        BadCase{"mixed_devices", WithSites("  - {name: a, address: 127.0.0.1:7001, devices: [cpu, cuda:0]}\n"),
                "site 'a'.devices: mixes cpu and cuda devices", 4},
        BadCase{"device_twice", WithSites("  - {name: a, address: 127.0.0.1:7001, devices: [cuda:1, cuda:1]}\n"),
                "site 'a'.devices: cuda:1 is listed twice", 4},
        BadCase{"device_leading_zero", WithSites("  - {name: a, address: 127.0.0.1:7001, devices: [cuda:1, cuda:01]}\n"),
                "site 'a'.devices: 'cuda:01' is not cpu or cuda:N (N without leading zeros)", 4},
        BadCase{"quota_zero", WithSites("  - {name: a, address: 127.0.0.1:7001, emulation: {cpu_quota: 0}}\n"),
                "must be greater than 0", 4},
        BadCase{"quota_wrong_type", WithSites("  - {name: a, address: 127.0.0.1:7001, emulation: {cpu_quota: fast}}\n"),
                "expected a number", 4},
        BadCase{"threads_not_int", WithSites("  - {name: a, address: 127.0.0.1:7001, emulation: {threads: 1.5}}\n"),
                "expected an integer", 4},
        BadCase{"bad_memory_unit", WithSites("  - {name: a, address: 127.0.0.1:7001, memory: 16GB_}\n"), "unknown size unit", 4},
        BadCase{"link_unknown_site", WithSites(kTwoSites, "links:\n  - {from: a, to: zz, bandwidth: 1Gbit}\n"),
                "unknown site 'zz'", 7},
        BadCase{"link_self", WithSites(kTwoSites, "links:\n  - {from: a, to: a, bandwidth: 1Gbit}\n"), "two different sites", 7},
        BadCase{"link_zero_bandwidth", WithSites(kTwoSites, "links:\n  - {from: a, to: b, bandwidth: 0Mbit}\n"),
                "must be positive", 7},
        BadCase{"link_negative_bandwidth", WithSites(kTwoSites, "links:\n  - {from: a, to: b, bandwidth: -5Mbit}\n"),
                "must not be negative", 7},
        BadCase{"link_bandwidth_no_unit", WithSites(kTwoSites, "links:\n  - {from: a, to: b, bandwidth: 100}\n"),
                "has no unit", 7},
        BadCase{"link_bad_unit", WithSites(kTwoSites, "links:\n  - {from: a, to: b, bandwidth: 100Mbits/fortnight}\n"),
                "unknown bandwidth unit", 7},
        BadCase{"link_bad_rtt", WithSites(kTwoSites, "links:\n  - {from: a, to: b, rtt: 40 parsecs}\n"), "unknown duration unit", 7},
        BadCase{"link_no_figures", WithSites(kTwoSites, "links:\n  - {from: a, to: b}\n"), "at least one of bandwidth, rtt", 7},
        BadCase{"link_duplicate", WithSites(kTwoSites, "links:\n  - {from: a, to: b, rtt: 1ms}\n  - {from: b, to: a, rtt: 2ms}\n"),
                "more than once", 8},
        BadCase{"links_not_list", WithSites(kTwoSites, "links: yes\n"), "expected a list of links", 6},
        BadCase{"symmetric_not_bool", WithSites(kTwoSites, "links:\n  - {from: a, to: b, rtt: 1ms, symmetric: maybe}\n"),
                "expected true or false", 7},
        BadCase{"duplicate_key", "cluster: t\ncluster: u\ncoordinator: {address: 127.0.0.1:7000}\nsites:\n" + kTwoSites,
                "duplicate key 'cluster'", 2},
        BadCase{"job_steps_negative", "job:\n  model: m\n  steps: -3\n", "must be between 1", 3},
        BadCase{"job_steps_text", "job:\n  model: m\n  steps: many\n", "expected an integer", 3},
        BadCase{"job_missing_model", "job:\n  steps: 3\n", "missing required key 'model'", 2},
        BadCase{"job_micro_not_divisor", "job:\n  model: m\n  global_batch: 10\n  micro_batches: 3\n", "does not divide", 4},
        BadCase{"job_step_overlap_all", "job:\n  model: m\n  global_batch: 8\n  micro_batches: 4\n  step_overlap: 4\n",
                "job.step_overlap: 4 must be below the step's micro-batches (4)", 5},
        BadCase{"job_step_overlap_default", "job:\n  model: m\n  global_batch: 2\n  step_overlap: 2\n",
                "job.step_overlap: 2 must be below the step's micro-batches (2, job.micro_batches' default)", 4},
        BadCase{"job_step_overlap_negative", "job:\n  model: m\n  step_overlap: -1\n", "must be between 0", 3},
        BadCase{"job_bad_optimizer", "job:\n  model: m\n  optimizer: {name: lion}\n", "'lion' is not one of adamw, sgd", 3},
        BadCase{"job_bad_checkpoint_store", "job:\n  model: m\n  checkpoint: {interval: 2, store: s3}\n",
                "'s3' is not one of shared, coordinator", 3},
        BadCase{"job_bad_codec", "job:\n  model: m\n  compression: {policy: fixed, activations: int3}\n", "job.compression.activations: unknown codec 'int3'", 3},
        BadCase{"job_bad_lora_target", "job:\n  model: m\n  lora: {r: 8, target_modules: [attn]}\n", "each entry must be one of", 3},
        BadCase{"job_lr_zero", "job:\n  model: m\n  optimizer: {lr: 0}\n", "must be greater than 0", 3},
        BadCase{"job_zero_two", "job:\n  model: m\n  optimizer: {zero: 2}\n", "job.optimizer.zero", 3},
        BadCase{"job_sync_mode", "job:\n  model: m\n  sync: {mode: gossip}\n", "'gossip' is not one of every_step, diloco", 3},
        BadCase{"job_sync_outer", "job:\n  model: m\n  sync:\n    mode: diloco\n    overlap: false\n    outer_optimizer: {name: adam}\n",
                "job.sync.outer_optimizer.name: 'adam' is not one of nesterov, sgd", 6},
        BadCase{"job_sync_sparseloco_codec", "job:\n  model: m\n  sync:\n    mode: diloco\n    codec: int4\n    outer_optimizer: {name: sparseloco}\n",
                "job.sync.codec: outer_optimizer sparseloco sums top-k-sparsified pseudo-gradients: give a top-k codec", 5},
        BadCase{"job_sync_sparseloco_default_codec", "job:\n  model: m\n  sync:\n    mode: diloco\n    outer_optimizer: {name: sparseloco}\n",
                "not 'int4'", 5},
        BadCase{"job_sync_sparseloco_feedback", "job:\n  model: m\n  sync:\n    mode: diloco\n    codec: topk\n    error_feedback: false\n    outer_optimizer: {name: sparseloco}\n",
                "job.sync.error_feedback: outer_optimizer sparseloco's momentum is its error feedback", 6},
        BadCase{"job_sync_momentum", "job:\n  model: m\n  sync:\n    outer_optimizer: {momentum: 1}\n", "momentum: must be below 1", 4},
        BadCase{"job_sync_codec", "job:\n  model: m\n  sync: {mode: diloco, overlap: false, codec: int4-delta}\n", "job.sync.codec: 'int4-delta' is an activation codec", 3},
        BadCase{"job_sync_codec_block", "job:\n  model: m\n  sync: {mode: diloco, codec: 'int4:block=3'}\n", "job.sync.codec: block size 3 must be even", 3},
        BadCase{"job_gradient_codec_option", "job:\n  model: m\n  compression: {gradients: 'int8:blocks=32'}\n", "job.compression.gradients: unknown codec option 'blocks'", 3},
        BadCase{"job_sync_fragments", "job:\n  model: m\n  sync:\n    mode: diloco\n    overlap: false\n    inner_steps: 10\n    fragments: 3\n",
                "job.sync.fragments: 3 does not divide job.sync.inner_steps 10", 7},
        BadCase{"job_unknown_key", "job:\n  model: m\n  epochs: 3\n", "unknown key 'epochs'", 3},
        BadCase{"cluster_key_in_job_file", "coordinator: {address: 127.0.0.1:7000}\njob:\n  model: m\n", "belongs to a cluster spec", 1},
        BadCase{"min_sites_too_many", WithSites(kTwoSites, "min_sites: 5\n"), "more than the 2 sites", 6},
        BadCase{"heartbeat_timeout_short", WithSites(kTwoSites, "heartbeat: {interval: 5s, timeout: 1s}\n"),
                "timeout must be longer", 6},
        BadCase{"coordinator_same_as_site", WithSites("  - {name: a, address: 127.0.0.1:7000}\n"), "is also site 'a'", 2},
        BadCase{"alias_bomb", AliasBomb(), "too large or too deep once aliases are expanded", 1},
        BadCase{"elastic_drift", WithSites(kTwoSites, "elastic: {drift: 0}\n"), "elastic.drift", 6},
        BadCase{"elastic_window", WithSites(kTwoSites, "elastic: {window: 0}\n"), "elastic.window", 6},
        BadCase{"elastic_unknown", WithSites(kTwoSites, "elastic: {gain: 0.2}\n"), "gain", 6},
        BadCase{"ssh_host_option", WithSites("  - {name: a, address: 127.0.0.1:7001, ssh: {host: -oProxyCommand=x}}\n"),
                "site 'a'.ssh.host: '-oProxyCommand=x' is not a host name", 4},
        BadCase{"ssh_no_host", WithSites("  - {name: a, address: 127.0.0.1:7001, ssh: {user: root}}\n"),
                "site 'a'.ssh: missing required key 'host'", 4},
        BadCase{"ssh_workdir_shell",
                WithSites("  - {name: a, address: 127.0.0.1:7001, ssh: {host: h, workdir: \"x; rm -rf ~\"}}\n"),
                "site 'a'.ssh.workdir: 'x; rm -rf ~' is not a plain path", 4},
        BadCase{"ssh_workdir_up", WithSites("  - {name: a, address: 127.0.0.1:7001, ssh: {host: h, workdir: ../x}}\n"),
                "must name a folder of its own", 4},
        BadCase{"ssh_port", WithSites("  - {name: a, address: 127.0.0.1:7001, ssh: {host: h, port: 70000}}\n"),
                "site 'a'.ssh.port", 4},
        BadCase{"ssh_unknown_key", WithSites("  - {name: a, address: 127.0.0.1:7001, ssh: {host: h, password: x}}\n"),
                "password", 4},
        BadCase{"deep_nesting_100k", Nested(100000), "nesting is too deep", 1},
        BadCase{"deep_dash_nesting_100k", [] {
                  std::string s;
                  for (int i = 0; i < 100000; ++i) s += "- ";
                  return s + "x\n";
                }(), "nesting is too deep", 1},
        BadCase{"deep_block_nesting", [] {
                  std::string s = "cluster:\n";
                  for (int i = 0; i < 100; ++i) s += std::string(2 * (i + 1), ' ') + "k" + std::to_string(i) + ":\n";
                  return s;
                }(), "too large or too deep", 1}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

TEST(ClusterSpec, ReportsEveryProblemNotJustTheFirst) {
  auto r = ParseSpec(WithSites("  - {name: a, address: nope}\n  - {name: a, address: 127.0.0.1:7002, colour: red}\n"),
                     "multi.yaml");
  ASSERT_GE(r.errors.size(), 3u);
  EXPECT_EQ(r.errors[0].line, 4);
  EXPECT_EQ(r.errors.back().line, 5);
}

TEST(ClusterSpec, UnreadableFile) {
  auto r = LoadSpecFile("/nonexistent/spec.yaml");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_THAT(r.errors[0].ToString(), HasSubstr("/nonexistent/spec.yaml:0:0: error: cannot open file"));
}

TEST(ClusterSpec, AcceptsAliasesWithinBudget) {
  auto r = ParseSpec(WithSites("  - {name: a, address: 127.0.0.1:7001, emulation: &slow {cpu_quota: 0.5}}\n"
                               "  - {name: b, address: 127.0.0.1:7002, emulation: *slow}\n"),
                     "alias.yaml");
  ASSERT_TRUE(r.errors.empty()) << r.errors[0].ToString();
  EXPECT_DOUBLE_EQ(r.spec->cluster->sites[1].emulation->cpu_quota, 0.5);
}

TEST(Endpoint, ParsesForms) {
  Endpoint e;
  std::string err;
  ASSERT_TRUE(ParseEndpoint("[::1]:443", &e, &err)) << err;
  EXPECT_EQ(e.host, "::1");
  EXPECT_EQ(e.ToString(), "[::1]:443");
  ASSERT_TRUE(ParseEndpoint("fra.example.com:7401", &e, &err)) << err;
  EXPECT_EQ(e.port, 7401);
  EXPECT_FALSE(ParseEndpoint("::1:443", &e, &err));
  EXPECT_FALSE(ParseEndpoint("host:", &e, &err));
  EXPECT_FALSE(ParseEndpoint("-bad.example:1", &e, &err));
}

// Unset (0), a job runs the largest divisor of its global batch up to 4 micro-batches: every global batch
// gets a count that divides it (6 sequences: 3 micro-batches, not 4).
TEST(JobSpec, MicroBatchesDefaultToADivisorOfTheGlobalBatch) {
  JobSpec job;
  for (auto [global, want] :
       std::vector<std::pair<int, int>>{{1, 1}, {2, 2}, {3, 3}, {4, 4}, {6, 3}, {7, 1}, {64, 4}}) {
    job.global_batch = global;
    EXPECT_EQ(MicroBatchesOf(job), want) << "global_batch " << global;
  }
  job.global_batch = 64;
  job.micro_batches = 16;
  EXPECT_EQ(MicroBatchesOf(job), 16);
}

}  // namespace
}  // namespace meridian::core
