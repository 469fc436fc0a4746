// The partitioner's inputs: a model's operator graph and a cluster profile (docs/partitioner.md gives
// the JSON formats, graph.json and profile.json). Plain structs; parsing never throws and reports
// errors that name the file and the field. Thread-safe (no shared state).
#ifndef MERIDIAN_PARTITIONER_MODEL_H_
#define MERIDIAN_PARTITIONER_MODEL_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace meridian::partitioner {

// One operator, costed per micro-batch.
struct Op {
  std::string name;
  double forward_flops = 0;
  double backward_flops = 0;
  double param_bytes = 0;      // weights (and their gradients) held by the stage that runs the op
  double optimizer_bytes = 0;  // optimizer state for those weights
  double output_bytes = 0;     // the op's output tensor, per micro-batch
  std::vector<int> inputs;     // indices of earlier ops whose outputs this op consumes
  // The index of an earlier op whose weights this op uses too (an LM head tied to the embedding), or -1.
  // The two must run in one stage: no cut may fall between them (CutSeparatesTiedOps).
  int tied_to = -1;
  // What a micro-batch's forward pass through the op leaves in memory until its backward pass: the
  // tensors autograd saves plus the output, per micro-batch (a transformer block keeps several times its
  // output). Negative: not given, taken as output_bytes (SavedBytes).
  double saved_bytes = -1;
};

// Op::saved_bytes, or output_bytes when not given.
double SavedBytes(const Op& op);

// Ops in topological order (every input index is smaller than the op's own index).
struct OpGraph {
  std::vector<Op> ops;
};

struct SiteProfile {
  std::string name;
  double flops_per_second = 0;
  double memory_bytes = 0;
  std::map<std::string, double> op_seconds;  // measured forward+backward seconds; overrides FLOPs
  // Measured GEMM throughputs by path, informational ("libtorch_fp32"; on CUDA builds "cublas_fp32",
  // "cublas_tf32", "cublas_bf16"): the planner uses op_seconds and flops_per_second.
  std::map<std::string, double> gemm_flops_per_second;
  // The site's uplink, shared by all its outgoing links, in bytes per second; 0: each link has its own
  // bandwidth (the planner ignores it; `meridian simulate` queues a site's sends on it).
  double uplink_bytes_per_second = 0;
  // Float32 input bytes per second that the site's compute thread encodes (and decodes) with each codec
  // (compression/ spelling, e.g. "int8"); a codec absent here costs nothing in `meridian simulate`.
  std::map<std::string, double> codec_bytes_per_second;
  // A site of several devices (sites[].devices): its worker processes, each on its rows of every
  // micro-batch; op_seconds are then measured with all of them running together. Each worker holds the
  // stage's weights and gradients, and its optimizer state whole or (ZeRO-1, PlanOptions::zero) a 1/workers
  // share; memory_bytes is the site's total. intra_site_bytes_per_second: the workers' c10d all-reduce bus
  // bandwidth (2 (K-1)/K of the bytes per worker over the time), 0 when not measured (not charged then).
  int workers = 1;
  double intra_site_bytes_per_second = 0;
  // A CPU site's transport work: what moving one frame over a peer stream (TLS, gRPC, the kernel's TCP;
  // not its codec) takes from the site's compute, in its own seconds -- CPU time over the share of a core
  // the site gets (a cgroup quota, other load) -- per frame and per wire byte, on each side (the sender's
  // pass that produces the frame, the receiver's that consumes it). Its stage's compute thread shares the
  // CPU with the threads that do it. 0: not measured or not charged (a GPU site's transport runs beside
  // its device). TransportSeconds.
  double transport_seconds_per_frame = 0, transport_seconds_per_byte = 0;
  // What the stage's compute thread spends once per step after its passes -- the gradients' norm,
  // clipping, the optimizer step -- per byte of the optimizer state it steps (Op::optimizer_bytes).
  // 0: not measured (not charged). OptimizerSeconds.
  double optimizer_seconds_per_byte = 0;
  std::string comment;  // free text: where the figures come from (published specs, a measurement)
  // The device the figures were measured on, as the site's executor names it ("cpu", "cuda:0"); empty:
  // not recorded (a hand-written or published profile). `meridian run --profile` refuses a site that
  // registers with another.
  std::string device;
};

// One direction of a link. latency_seconds is one-way.
struct LinkProfile {
  std::string from, to;
  double bandwidth_bytes_per_second = 0;
  double latency_seconds = 0;
  // What receiving a byte over this link costs `to` (a CPU site) in its own seconds, measured in bulk at
  // the link's rate (rpc::ProbeLink). Over a slow link a frame trickles in and the receiving threads wake
  // for a few segments at a time, so it exceeds `to`'s transport_seconds_per_byte, which is measured over
  // loopback: about 3 ns a byte over loopback, 7-9 at 100 Mbit/s, 25 at 2 Mbit/s here. A received frame
  // is priced at the larger of the two (TransportSeconds). 0: not measured; at most
  // kMaxReceiveSecondsPerByte.
  double receive_seconds_per_byte = 0;
};
// The most LinkProfile::receive_seconds_per_byte may be: 1 us a byte, 40x the most measured here.
inline constexpr double kMaxReceiveSecondsPerByte = 1e-6;

struct ClusterProfile {
  std::vector<SiteProfile> sites;
  std::vector<LinkProfile> links;
};

// One op's forward+backward seconds per micro-batch at `site`: its measured op_seconds, else its FLOPs over
// the site's flops_per_second (docs/cost-model.md).
double OpSeconds(const Op& op, const SiteProfile& site);
// Compute-thread seconds for `site` to encode, or to decode, `raw_bytes` float32 bytes with `codec`
// (compression/ spelling): raw_bytes / codec_bytes_per_second[codec]. An AQ-SGD delta codec costs what its
// base quantiser does (its store's bookkeeping is not priced); identity, and a codec the profile does not
// list, cost 0. The executor runs both on the compute thread: the sender's pass that produces a tensor
// encodes it, the receiver's pass that consumes it decodes it.
double CodecSeconds(const SiteProfile& site, const std::string& codec, double raw_bytes);
// `site`'s transport work for one frame of `wire_bytes` on one side of a link:
// transport_seconds_per_frame + transport_seconds_per_byte * wire_bytes (0 when not measured). A frame
// received over a link whose receive_seconds_per_byte is given (`receive_seconds_per_byte`; 0 for a frame
// sent) costs the larger of the two per byte.
double TransportSeconds(const SiteProfile& site, double wire_bytes, double receive_seconds_per_byte = 0);
// `site`'s CPU seconds for its part in one sum of a stage's `grad_bytes` of float32 gradients over
// `replicas` replicas in `buckets` buckets, as executor/replica_sync.h does it (reduce-scatter, then
// all-gather): the codec's work on every slice it encodes or decodes (each slice it sends, the sum of its
// own, that sum again when lossy, and the others' sums) and the transport's on every frame it sends or
// receives (`wire_ratio`: wire bytes per raw byte; a received byte at the larger of the site's figure and
// `receive_seconds_per_byte`, the costliest of the links from the other replicas, as TransportSeconds).
// That work runs beside the compute thread, so on a CPU site it takes from the same quota. 0 for fewer
// than 2 replicas.
double ReplicaSumCpuSeconds(const SiteProfile& site, const std::string& codec, double wire_ratio, double grad_bytes,
                            int replicas, int buckets, double receive_seconds_per_byte = 0);
// `site`'s seconds per step for the norm, clipping and optimizer step of ops [first, last]: their
// optimizer_bytes x optimizer_seconds_per_byte (0 when not measured); with `zero` 1 (ZeRO-1,
// job.optimizer.zero) each of the site's workers steps a 1/workers share (the parameters' all-gather is
// priced with the site's gradient sum).
double OptimizerSeconds(const OpGraph& graph, const SiteProfile& site, int first, int last, int zero);
// The gradient bytes of ops [first, last]: `fraction` (PlanOptions::gradient_bytes_fraction) of the
// param_bytes (weights and gradients) of the ops that train, those with optimizer state. Under LoRA no
// base weight does (the graph leaves the adapters out as negligible), so a stage's gradient sum and its
// buckets are priced at nothing.
double GradientBytes(const OpGraph& graph, int first, int last, double fraction);
// Ops [first, last]'s OpSeconds at `site`, summed in order.
double RangeSeconds(const OpGraph& graph, const SiteProfile& site, int first, int last);
// The share of ops [first, last]'s time that the forward pass takes, by FLOPs (1/3 without FLOPs).
double ForwardShare(const OpGraph& graph, int first, int last);
// What a micro-batch's passes over ops [first, last] cost relative to their forward+backward time: 1, or
// with activation recomputation (StagePlan::recompute: the forward pass runs again before the backward
// pass) 1 + ForwardShare.
double ComputeFactor(const OpGraph& graph, int first, int last, bool recompute);
// Per cut p (0 <= p < ops - 1): the bytes crossing it, every output of an op at or before p that an op
// after p consumes, each tensor once.
std::vector<double> CutBytes(const OpGraph& graph);
// The op whose weights another op across cut p (0 <= p < ops - 1) also uses (Op::tied_to), or -1 when the
// cut separates no such pair; such a cut is never made.
int CutSeparatesTiedOps(const OpGraph& graph, int p);
// `micro_batches` micro-batches over every site's whole-model rate together: the step if every site's
// throughput could be used with no communication and no memory limit.
double ComputeBoundSeconds(const OpGraph& graph, const ClusterProfile& profile, int micro_batches);

// Parse and validate. `path` is used in messages ("graph.json: ops[3].inputs[0]: ...").
absl::StatusOr<OpGraph> ParseGraphJson(const std::string& text, const std::string& path);
absl::StatusOr<ClusterProfile> ParseProfileJson(const std::string& text, const std::string& path);
absl::StatusOr<OpGraph> LoadGraphFile(const std::string& path);
absl::StatusOr<ClusterProfile> LoadProfileFile(const std::string& path);

// Serialise in the same formats (pretty-printed JSON).
std::string GraphToJson(const OpGraph& graph);
std::string ProfileToJson(const ClusterProfile& profile);

// The shape of a LLaMA-architecture decoder, as in an HF config.json.
struct LlamaShape {
  int vocab_size = 32000;
  int hidden_size = 4096;
  int intermediate_size = 11008;
  int num_hidden_layers = 32;
  int num_attention_heads = 32;
  int num_key_value_heads = 32;
  bool tie_word_embeddings = false;
};

// Reads the fields above from an HF config.json text (missing num_key_value_heads = num_attention_heads).
absl::StatusOr<LlamaShape> ParseLlamaConfig(const std::string& text, const std::string& path);

struct LlamaGraphOptions {
  int micro_batch_size = 1;
  int sequence_length = 2048;
  double weight_bytes = 2;      // per parameter: bf16 weights
  double gradient_bytes = 2;    // per parameter: bf16 gradients
  double optimizer_bytes = 12;  // per parameter: fp32 master copy + Adam m and v
  double activation_bytes = 2;  // per activation element (bf16)
};

// The operator graph at sub-layer granularity: embed; for each block "layerI.attn" (norm, attention,
// residual add) and "layerI.mlp" (norm, SwiGLU MLP, residual add); "head" (final norm, LM head, loss).
OpGraph BuildLlamaGraph(const LlamaShape& shape, const LlamaGraphOptions& options);

}  // namespace meridian::partitioner

#endif  // MERIDIAN_PARTITIONER_MODEL_H_
