// The cluster spec and the job spec: what a user writes in YAML (docs/cluster-spec.md).
//
// Loading never throws and never aborts on bad input: every problem becomes a Diagnostic that names the
// file, line, column and field. The work done on a document is bounded (size, nesting, alias expansion).
// All functions are thread-safe (they share no state).
#ifndef MERIDIAN_CORE_CLUSTER_SPEC_H_
#define MERIDIAN_CORE_CLUSTER_SPEC_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace meridian::core {

// One problem found in a spec file. Line and column are 1-based; 0 when unknown (e.g. unreadable file).
struct Diagnostic {
  std::string file;
  int line = 0;
  int column = 0;
  std::string message;
  // "FILE:LINE:COL: error: message".
  std::string ToString() const;
};

// A network endpoint "host:port". host is a DNS name, an IPv4 address or a bracketed IPv6 address.
struct Endpoint {
  std::string host;
  int port = 0;
  std::string ToString() const;  // "host:port" ("[v6]:port" for IPv6).
};

// Parses "host:port". Errors: a message saying what is malformed.
bool ParseEndpoint(const std::string& text, Endpoint* out, std::string* error);

// Settings that make a local run behave like a remote site (used by the demo and tests).
struct EmulationSpec {
  double cpu_quota = 1.0;  // fraction of one core this site's executor may use (cgroup CPU quota)
  int threads = 1;         // intra-op threads for the executor
};

// How `meridian launch` (and `meridian run --launch ssh`) starts a site's executor over OpenSSH
// (docs/launch.md). Every field is checked by the loader so that nothing reaches ssh's command line or the
// remote shell that could be read as an option or as shell syntax.
struct SshSpec {
  std::string host;  // required: a host name or address (not starting with '-')
  std::string user;  // default "": ssh's own (the local user, or ~/.ssh/config)
  int port = 22;
  std::string identity_file;  // the private key; "": ssh's defaults. Resolved against the spec's folder
  std::string known_hosts;    // "": ssh's own (~/.ssh/known_hosts). Resolved against the spec's folder
  // On the remote host: the folder for the site's certificates, the executor's log and pid (relative:
  // to the login's home), and the executor binary (a path, or a name on the remote PATH).
  std::string workdir = "meridian";
  std::string executor = "meridian-executor";
};

struct SiteSpec {
  std::string name;                         // [A-Za-z0-9_-], 1..63 chars; becomes the certificate CN
  Endpoint address;                         // where the executor listens for its peers
  std::vector<std::string> devices{"cpu"};  // "cpu" or "cuda:N"
  std::optional<EmulationSpec> emulation;
  std::optional<SshSpec> ssh;          // set: `meridian launch` starts this site's executor over SSH
  std::optional<double> memory_bytes;  // optional cap on the memory the planner may use at this site
  int line = 0;                        // position in the file, for later messages
};

// A link hint or override for one ordered pair (both directions when symmetric).
struct LinkSpec {
  std::string from, to;
  std::optional<double> bandwidth_bytes_per_second;
  std::optional<double> rtt_seconds;
  bool symmetric = true;
  bool override_measurement = false;  // true: the planner uses these figures instead of probing
};

struct OptimizerSpec {
  std::string name = "adamw";  // adamw | sgd
  double lr = 3e-4;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  int warmup_steps = 0;
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
  double grad_clip = 1.0;     // global gradient-norm clip; 0 disables
  // ZeRO stage inside a site of several devices (sites[].devices): 1 shards the AdamW moments across the
  // site's workers (each steps its shard, then the workers gather the parameters); 0 keeps them whole on
  // every worker. No effect on a site of one device.
  int zero = 0;
};

// The spec's choices, as enums past the parser (their YAML spellings: ToString).
enum class CompressionPolicy { kAdaptive, kNone, kFixed };  // adaptive | none | fixed
enum class CheckpointStore { kShared, kCoordinator };       // shared | coordinator
enum class OnFailure { kReplan, kWait };                    // replan | wait
enum class SyncMode { kEveryStep, kDiloco };                // every_step | diloco
const char* ToString(CompressionPolicy policy);
const char* ToString(CheckpointStore store);
const char* ToString(OnFailure on_failure);
const char* ToString(SyncMode mode);

struct CompressionSpec {
  CompressionPolicy policy = CompressionPolicy::kAdaptive;
  // Codecs as core::CodecSpec::Parse reads them (options and "+zstd" allowed; delta codecs for activations only).
  std::string activations = "int8";  // codec for activations/gradients between stages when policy=fixed
  std::string gradients = "topk";    // codec for replica gradient sync when policy=fixed
  double topk_fraction = 0.01;
  bool error_feedback = true;
  // AQ-SGD (activations: int8-delta, int4-delta, int2-delta): each link's stored activations, per
  // training sequence, in host memory up to activation_memory, then in a spill file up to
  // activation_spill; beyond both, new sequences go as int8 without deltas.
  double activation_memory_bytes = 2.0 * (1 << 30);
  double activation_spill_bytes = 16.0 * (1 << 30);
};

// How the replicas of a stage synchronise (job.sync; docs/sync.md).
struct SyncSpec {
  SyncMode mode = SyncMode::kEveryStep;  // every_step: the gradient sum every step (exact)
  // diloco: each replica runs `inner_steps` (H) optimizer steps on its own micro-batches, then the replicas
  // average their pseudo-gradients (outer parameters - local parameters), compressed with `codec` and error
  // feedback, and the outer optimizer steps the outer parameters. With `fragments` F > 1, fragment f of the
  // stage's parameters is synchronised every H inner steps at offset f H / F (Streaming DiLoCo).
  int inner_steps = 50;
  // nesterov | sgd | sparseloco. sparseloco (Sarfi et al. 2025) keeps no outer momentum: each replica's
  // error-feedback residual, decayed by `outer_momentum` every round, stands in for it; the replicas sum
  // their top-k-sparsified pseudo-gradients exactly and the outer parameters step by `outer_lr` times the
  // sum. It needs a top-k `codec` with `error_feedback`, and its lr and momentum default to 1 and 0.95.
  std::string outer_optimizer = "nesterov";
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
  std::string codec = "int4";  // any codec but the delta ones, e.g. "int4:block=128+zstd" (core/codec_spec.h)
  bool error_feedback = true;
  int fragments = 1;
  // The exchange runs while the inner steps continue, and is applied at the next synchronisation point
  // (H / F inner steps later), keeping the local progress made meanwhile. false: the replicas wait for it.
  bool overlap = true;

  // SparseLoCo (outer_optimizer "sparseloco"): the one spelling of that test.
  bool sparseloco() const { return outer_optimizer == "sparseloco"; }
};

struct CheckpointSpec {
  std::string dir = "checkpoints";  // relative to the spec file's directory
  int interval = 50;                // steps; 0 disables
  int keep = 3;
  // "shared": every site writes and reads `dir` (storage every site reads, for recovery). "coordinator":
  // each stage sends its shards to the coordinator (RUN/checkpoints) and a resumed stage fetches the
  // checkpoint from there; `dir` is not used by joined executors.
  CheckpointStore store = CheckpointStore::kShared;
};

struct LoraSpec {
  bool enabled = false;
  int r = 8;
  double alpha = 16;
  double dropout = 0.0;
  std::vector<std::string> target_modules{"q_proj", "v_proj"};
};

struct JobSpec {
  std::string model;           // HF model directory (config.json [+ safetensors]); relative to the spec file
  std::string tokenizer;       // SentencePiece model; default: <model>/tokenizer.model
  std::string data;            // "synthetic", JSONL (prompt/response) or plain text; relative to the spec file
  double eval_fraction = 0.1;  // JSONL: share of the examples held out for exact-match evaluation
  int steps = 100;
  int global_batch = 8;   // sequences per optimizer step
  int micro_batches = 0;  // 0: MicroBatchesOf's default
  int sequence_length = 256;
  uint64_t seed = 1234;
  bool replication = true;  // let the planner replicate stages across sites
  // Micro-batches of each step that begin on the weights of the step before (docs/executor.md, "Step
  // overlap"): the first `step_overlap` micro-batches of step t run their forward and backward passes on
  // the weights step t - 1 used, so that their forward passes can start before step t - 1's optimizer
  // step and hide the pipeline's fill and drain at the step boundary (PipeDream-2BW's weight staleness, for
  // K of the M micro-batches). Not after a checkpoint interval's step (job.checkpoint.interval) or one that
  // ends with a DiLoCo synchronisation, and not in the first step: those steps are exact (a plan switch's
  // step boundary is none of these). 0 (default): every step exact,
  // equal to single-process training. Must be below the step's micro-batches.
  int step_overlap = 0;
  OptimizerSpec optimizer;
  CompressionSpec compression;
  SyncSpec sync;
  CheckpointSpec checkpoint;
  LoraSpec lora;
  int line = 0;
};

// How the coordinator adapts a running job (docs/coordinator.md, "Stragglers"): a site whose stage computes
// at least `drift` slower or faster than planned for `window` reports in a row is re-measured from those
// reports and the job re-planned; the coordinator switches to the new plan at a step boundary when its
// predicted step is faster by more than `min_gain`. Sites leaving (`meridian drain`, SIGTERM) are handled
// whatever `enabled` says.
struct ElasticSpec {
  bool enabled = true;
  double min_gain = 0.10;  // [0, 1)
  double drift = 0.15;     // (0, 10]
  int window = 5;          // 1..10000 steps
};

struct ClusterSpec {
  std::string name;
  Endpoint coordinator;
  int metrics_port = 0;             // 0: no /metrics endpoint
  std::string metrics_address;      // the host /metrics binds to; empty: the coordinator's host
  std::string certs_dir = "certs";  // resolved against the spec file's directory
  double heartbeat_interval_seconds = 1.0;
  double heartbeat_timeout_seconds = 5.0;
  int min_sites = 0;  // 0: wait for every site
  OnFailure on_failure = OnFailure::kReplan;
  ElasticSpec elastic;
  std::vector<SiteSpec> sites;
  std::vector<LinkSpec> links;
  const SiteSpec* FindSite(const std::string& name) const;
};

// What one YAML file holds: a cluster (it has `sites`), a job (it has `job`), or both.
struct SpecFile {
  std::string path;
  std::optional<ClusterSpec> cluster;
  std::optional<JobSpec> job;
};

struct SpecLoadResult {
  std::optional<SpecFile> spec;    // set only when `errors` is empty
  std::vector<Diagnostic> errors;  // in file order
};

// Limits that bound the loader's work on hostile input.
inline constexpr size_t kMaxSpecFileBytes = 4 << 20;
inline constexpr size_t kMaxSpecNodes = 200000;  // after alias expansion
inline constexpr int kMaxSpecDepth = 64;

// Parses `text` as the content of file `path` (used in messages and to resolve relative paths).
SpecLoadResult ParseSpec(const std::string& text, const std::string& path);

// Reads and parses a file. An unreadable file yields one diagnostic at line 0.
SpecLoadResult LoadSpecFile(const std::string& path);

// Resolves `p` against the directory of `spec_path` unless absolute.
std::string ResolveRelative(const std::string& spec_path, const std::string& p);

// The micro-batches per step `job` runs: job.micro_batches, or where that is 0 the largest divisor of
// job.global_batch up to 4 (the planner does not choose the count).
int MicroBatchesOf(const JobSpec& job);

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_CLUSTER_SPEC_H_
