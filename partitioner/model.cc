#include "partitioner/model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "compression/codec.h"
#include "core/files.h"

namespace meridian::partitioner {
namespace {

using json = nlohmann::json;

absl::Status Bad(const std::string& path, const std::string& field, const std::string& msg) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", field, ": ", msg));
}

absl::StatusOr<json> ParseJson(const std::string& text, const std::string& path) {
  if (text.size() > (256u << 20)) return Bad(path, "file", "larger than 256 MiB");
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    // Parse once more with exceptions on to get the byte position of the error.
    try {
      json unused = json::parse(text);
      (void)unused;
    } catch (const json::parse_error& e) {
      return Bad(path, "JSON syntax", e.what());
    }
    return Bad(path, "JSON syntax", "not valid JSON");
  }
  if (!j.is_object()) return Bad(path, "top level", "expected a JSON object");
  return j;
}

// A non-negative finite number at obj[key]; `required` false -> default when absent.
absl::Status Number(const json& obj, const char* key, const std::string& path, const std::string& ctx, bool required,
                    double* out, bool positive = false) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) return Bad(path, absl::StrCat(ctx, ".", key), "missing");
    return absl::OkStatus();
  }
  if (!it->is_number()) return Bad(path, absl::StrCat(ctx, ".", key), "expected a number");
  double v = it->get<double>();
  if (!std::isfinite(v) || v < 0 || (positive && v == 0))
    return Bad(path, absl::StrCat(ctx, ".", key),
               positive ? "must be a positive number" : "must be a non-negative number");
  *out = v;
  return absl::OkStatus();
}

absl::Status String(const json& obj, const char* key, const std::string& path, const std::string& ctx,
                    std::string* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return Bad(path, absl::StrCat(ctx, ".", key), "missing");
  if (!it->is_string() || it->get<std::string>().empty())
    return Bad(path, absl::StrCat(ctx, ".", key), "expected a non-empty string");
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status OnlyKeys(const json& obj, const std::set<std::string>& allowed, const std::string& path,
                      const std::string& ctx) {
  for (auto it = obj.begin(); it != obj.end(); ++it)
    if (!allowed.count(it.key())) return Bad(path, absl::StrCat(ctx, ".", it.key()), "unknown field");
  return absl::OkStatus();
}

using core::ReadFile;

#define RETURN_IF(expr)       \
  do {                        \
    absl::Status s_ = (expr); \
    if (!s_.ok()) return s_;  \
  } while (0)

}  // namespace

absl::StatusOr<OpGraph> ParseGraphJson(const std::string& text, const std::string& path) {
  auto parsed = ParseJson(text, path);
  if (!parsed.ok()) return parsed.status();
  const json& j = *parsed;
  RETURN_IF(OnlyKeys(j, {"ops", "model", "micro_batch_size", "sequence_length"}, path, "graph"));
  auto ops = j.find("ops");
  if (ops == j.end()) return Bad(path, "ops", "missing");
  if (!ops->is_array() || ops->empty()) return Bad(path, "ops", "expected a non-empty array of operators");
  OpGraph g;
  std::set<std::string> names;
  for (size_t i = 0; i < ops->size(); ++i) {
    const json& o = (*ops)[i];
    std::string ctx = absl::StrCat("ops[", i, "]");
    if (!o.is_object()) return Bad(path, ctx, "expected an object");
    RETURN_IF(OnlyKeys(o,
                       {"name", "forward_flops", "backward_flops", "param_bytes", "optimizer_bytes", "output_bytes",
                        "saved_bytes", "inputs", "tied_to"},
                       path, ctx));
    Op op;
    RETURN_IF(String(o, "name", path, ctx, &op.name));
    if (!names.insert(op.name).second)
      return Bad(path, ctx + ".name", absl::StrCat("duplicate op name '", op.name, "'"));
    RETURN_IF(Number(o, "forward_flops", path, ctx, true, &op.forward_flops));
    RETURN_IF(Number(o, "backward_flops", path, ctx, true, &op.backward_flops));
    RETURN_IF(Number(o, "param_bytes", path, ctx, false, &op.param_bytes));
    RETURN_IF(Number(o, "optimizer_bytes", path, ctx, false, &op.optimizer_bytes));
    RETURN_IF(Number(o, "output_bytes", path, ctx, true, &op.output_bytes));
    RETURN_IF(Number(o, "saved_bytes", path, ctx, false, &op.saved_bytes));
    auto in = o.find("inputs");
    if (in != o.end()) {
      if (!in->is_array()) return Bad(path, ctx + ".inputs", "expected an array of op indices");
      for (size_t k = 0; k < in->size(); ++k) {
        const json& v = (*in)[k];
        std::string f = absl::StrCat(ctx, ".inputs[", k, "]");
        if (!v.is_number_integer()) return Bad(path, f, "expected an integer op index");
        long long idx = v.get<long long>();
        if (idx < 0 || idx >= static_cast<long long>(i))
          return Bad(path, f, absl::StrCat(idx, " is not an earlier op (ops must be in topological order)"));
        op.inputs.push_back(static_cast<int>(idx));
      }
    }
    if (auto t = o.find("tied_to"); t != o.end()) {
      if (!t->is_number_integer() || t->get<long long>() < 0 || t->get<long long>() >= static_cast<long long>(i))
        return Bad(path, ctx + ".tied_to", "expected the index of an earlier op (whose weights this op shares)");
      op.tied_to = static_cast<int>(t->get<long long>());
    }
    g.ops.push_back(std::move(op));
  }
  return g;
}

absl::StatusOr<ClusterProfile> ParseProfileJson(const std::string& text, const std::string& path) {
  auto parsed = ParseJson(text, path);
  if (!parsed.ok()) return parsed.status();
  const json& j = *parsed;
  RETURN_IF(OnlyKeys(j, {"sites", "links", "cluster", "measured_at", "comment"}, path, "profile"));
  auto sites = j.find("sites");
  if (sites == j.end()) return Bad(path, "sites", "missing");
  if (!sites->is_array() || sites->empty()) return Bad(path, "sites", "expected a non-empty array");
  ClusterProfile p;
  std::set<std::string> names;
  for (size_t i = 0; i < sites->size(); ++i) {
    const json& s = (*sites)[i];
    std::string ctx = absl::StrCat("sites[", i, "]");
    if (!s.is_object()) return Bad(path, ctx, "expected an object");
    RETURN_IF(
        OnlyKeys(s,
                 {"name", "flops_per_second", "memory_bytes", "op_seconds", "device", "gemm_flops_per_second",
                  "uplink_bytes_per_second", "codec_bytes_per_second", "workers", "intra_site_bytes_per_second",
                  "transport_seconds_per_frame", "transport_seconds_per_byte", "optimizer_seconds_per_byte", "comment"},
                 path, ctx));
    SiteProfile sp;
    RETURN_IF(String(s, "name", path, ctx, &sp.name));
    if (!names.insert(sp.name).second) return Bad(path, ctx + ".name", absl::StrCat("duplicate site '", sp.name, "'"));
    RETURN_IF(Number(s, "flops_per_second", path, ctx, true, &sp.flops_per_second, true));
    RETURN_IF(Number(s, "memory_bytes", path, ctx, true, &sp.memory_bytes, true));
    auto os = s.find("op_seconds");
    if (os != s.end()) {
      if (!os->is_object()) return Bad(path, ctx + ".op_seconds", "expected an object of op name -> seconds");
      for (auto it = os->begin(); it != os->end(); ++it) {
        if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0)
          return Bad(path, absl::StrCat(ctx, ".op_seconds.", it.key()), "must be a non-negative number");
        sp.op_seconds[it.key()] = it->get<double>();
      }
    }
    auto gf = s.find("gemm_flops_per_second");
    if (gf != s.end()) {
      if (!gf->is_object()) return Bad(path, ctx + ".gemm_flops_per_second", "expected an object of path -> FLOP/s");
      for (auto it = gf->begin(); it != gf->end(); ++it) {
        if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0)
          return Bad(path, absl::StrCat(ctx, ".gemm_flops_per_second.", it.key()), "must be a non-negative number");
        sp.gemm_flops_per_second[it.key()] = it->get<double>();
      }
    }
    RETURN_IF(Number(s, "uplink_bytes_per_second", path, ctx, false, &sp.uplink_bytes_per_second));
    RETURN_IF(Number(s, "intra_site_bytes_per_second", path, ctx, false, &sp.intra_site_bytes_per_second));
    RETURN_IF(Number(s, "transport_seconds_per_frame", path, ctx, false, &sp.transport_seconds_per_frame));
    RETURN_IF(Number(s, "transport_seconds_per_byte", path, ctx, false, &sp.transport_seconds_per_byte));
    RETURN_IF(Number(s, "optimizer_seconds_per_byte", path, ctx, false, &sp.optimizer_seconds_per_byte));
    if (auto w = s.find("workers"); w != s.end()) {
      if (!w->is_number_integer() || w->get<int64_t>() < 1 || w->get<int64_t>() > 64)
        return Bad(path, ctx + ".workers", "expected an integer from 1 to 64");
      sp.workers = w->get<int>();
    }
    auto cb = s.find("codec_bytes_per_second");
    if (cb != s.end()) {
      if (!cb->is_object()) return Bad(path, ctx + ".codec_bytes_per_second", "expected an object of codec -> bytes/s");
      for (auto it = cb->begin(); it != cb->end(); ++it) {
        if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() <= 0)
          return Bad(path, absl::StrCat(ctx, ".codec_bytes_per_second.", it.key()), "must be a positive number");
        sp.codec_bytes_per_second[it.key()] = it->get<double>();
      }
    }
    if (auto c = s.find("comment"); c != s.end()) {
      if (!c->is_string()) return Bad(path, ctx + ".comment", "expected a string");
      sp.comment = c->get<std::string>();
    }
    if (auto d = s.find("device"); d != s.end()) {
      if (!d->is_string()) return Bad(path, ctx + ".device", "expected a string (the device measured: cpu, cuda:N)");
      sp.device = d->get<std::string>();
    }
    p.sites.push_back(std::move(sp));
  }
  auto links = j.find("links");
  if (links != j.end()) {
    if (!links->is_array()) return Bad(path, "links", "expected an array");
    std::set<std::pair<std::string, std::string>> seen;
    for (size_t i = 0; i < links->size(); ++i) {
      const json& l = (*links)[i];
      std::string ctx = absl::StrCat("links[", i, "]");
      if (!l.is_object()) return Bad(path, ctx, "expected an object");
      RETURN_IF(OnlyKeys(l, {"from", "to", "bandwidth_bytes_per_second", "latency_seconds", "receive_seconds_per_byte"},
                         path, ctx));
      LinkProfile lp;
      RETURN_IF(String(l, "from", path, ctx, &lp.from));
      RETURN_IF(String(l, "to", path, ctx, &lp.to));
      if (!names.count(lp.from)) return Bad(path, ctx + ".from", absl::StrCat("unknown site '", lp.from, "'"));
      if (!names.count(lp.to)) return Bad(path, ctx + ".to", absl::StrCat("unknown site '", lp.to, "'"));
      if (lp.from == lp.to) return Bad(path, ctx, "a link joins two different sites");
      if (!seen.insert({lp.from, lp.to}).second)
        return Bad(path, ctx, absl::StrCat("link ", lp.from, " -> ", lp.to, " appears twice"));
      RETURN_IF(Number(l, "bandwidth_bytes_per_second", path, ctx, true, &lp.bandwidth_bytes_per_second, true));
      RETURN_IF(Number(l, "latency_seconds", path, ctx, true, &lp.latency_seconds));
      RETURN_IF(Number(l, "receive_seconds_per_byte", path, ctx, false, &lp.receive_seconds_per_byte));
      if (lp.receive_seconds_per_byte > kMaxReceiveSecondsPerByte)
        return Bad(path, ctx + ".receive_seconds_per_byte",
                   absl::StrCat(lp.receive_seconds_per_byte, " s a byte is beyond the ", kMaxReceiveSecondsPerByte,
                                " a receive may cost"));
      p.links.push_back(std::move(lp));
    }
  }
  return p;
}

double CodecSeconds(const SiteProfile& site, const std::string& codec, double raw_bytes) {
  const auto& m = site.codec_bytes_per_second;
  auto it = m.find(codec);
  // Parsed only for a delta codec the profile does not list (this runs for every pass of a simulation).
  if (it == m.end() && codec.find("-delta") != std::string::npos)
    if (auto spec = compression::CodecSpec::Parse(codec); spec.ok() && spec->delta) {
      spec->delta = false;
      it = m.find(spec->ShortString());
    }
  return it == m.end() ? 0.0 : raw_bytes / it->second;
}

double TransportSeconds(const SiteProfile& site, double wire_bytes, double receive_seconds_per_byte) {
  return site.transport_seconds_per_frame +
         std::max(site.transport_seconds_per_byte, receive_seconds_per_byte) * wire_bytes;
}

double ReplicaSumCpuSeconds(const SiteProfile& site, const std::string& codec, double wire_ratio, double grad_bytes,
                            int replicas, int buckets, double receive_seconds_per_byte) {
  if (replicas < 2) return 0;
  const double R = replicas;
  auto spec = compression::CodecSpec::Parse(codec);
  const double lossy = spec.ok() && !spec->lossless() ? 1 : 0;
  // Encoded: its R - 1 slices to the others and its slice's sum; decoded: the others' R - 1 slices of its
  // own, that sum again when lossy (every replica keeps what the others decode), the others' R - 1 sums.
  const double raw = grad_bytes * (1 + (2 * (R - 1) + lossy) / R);
  const double frames = 4.0 * (R - 1) * std::max(1, buckets);       // sent and received, in both halves
  const double wire = 4.0 * (R - 1) / R * grad_bytes * wire_ratio;  // half sent, half received
  return CodecSeconds(site, codec, raw) + frames * site.transport_seconds_per_frame +
         (site.transport_seconds_per_byte + std::max(site.transport_seconds_per_byte, receive_seconds_per_byte)) *
             wire / 2;
}

double OpSeconds(const Op& op, const SiteProfile& site) {
  auto it = site.op_seconds.find(op.name);
  return it != site.op_seconds.end() ? it->second : (op.forward_flops + op.backward_flops) / site.flops_per_second;
}

double SavedBytes(const Op& op) { return op.saved_bytes >= 0 ? op.saved_bytes : op.output_bytes; }

double OptimizerSeconds(const OpGraph& graph, const SiteProfile& site, int first, int last, int zero) {
  double bytes = 0;
  for (int i = first; i <= last; ++i) bytes += graph.ops[i].optimizer_bytes;
  return bytes * site.optimizer_seconds_per_byte / (zero == 1 ? std::max(1, site.workers) : 1);
}

double GradientBytes(const OpGraph& graph, int first, int last, double fraction) {
  double bytes = 0;
  for (int i = first; i <= last; ++i)
    if (graph.ops[i].optimizer_bytes > 0) bytes += graph.ops[i].param_bytes;
  return fraction * bytes;
}

double RangeSeconds(const OpGraph& graph, const SiteProfile& site, int first, int last) {
  double t = 0;
  for (int i = first; i <= last; ++i) t += OpSeconds(graph.ops[i], site);
  return t;
}

double ForwardShare(const OpGraph& graph, int first, int last) {
  double f = 0, all = 0;
  for (int i = first; i <= last; ++i)
    f += graph.ops[i].forward_flops, all += graph.ops[i].forward_flops + graph.ops[i].backward_flops;
  return all > 0 ? f / all : 1.0 / 3.0;
}

double ComputeFactor(const OpGraph& graph, int first, int last, bool recompute) {
  return recompute ? 1 + ForwardShare(graph, first, last) : 1.0;
}

std::vector<double> CutBytes(const OpGraph& graph) {
  const int n = static_cast<int>(graph.ops.size());
  // A tensor produced by op i and last consumed by op j crosses every cut p with i <= p < j.
  std::vector<int> last_consumer(n, -1);
  for (int j = 0; j < n; ++j)
    for (int i : graph.ops[j].inputs) last_consumer[i] = std::max(last_consumer[i], j);
  std::vector<double> diff(n + 1, 0.0);
  for (int i = 0; i < n; ++i)
    if (last_consumer[i] > i) {
      diff[i] += graph.ops[i].output_bytes;
      diff[last_consumer[i]] -= graph.ops[i].output_bytes;
    }
  std::vector<double> cut(std::max(n - 1, 0), 0.0);
  double run = 0;
  for (int p = 0; p + 1 < n; ++p) {
    run += diff[p];
    cut[p] = std::max(run, 0.0);
  }
  return cut;
}

int CutSeparatesTiedOps(const OpGraph& graph, int p) {
  for (int j = p + 1; j < static_cast<int>(graph.ops.size()); ++j)
    if (graph.ops[j].tied_to >= 0 && graph.ops[j].tied_to <= p) return graph.ops[j].tied_to;
  return -1;
}

double ComputeBoundSeconds(const OpGraph& graph, const ClusterProfile& profile, int micro_batches) {
  double rate = 0;
  for (const auto& site : profile.sites)
    rate += 1.0 / RangeSeconds(graph, site, 0, static_cast<int>(graph.ops.size()) - 1);
  return micro_batches / rate;
}

absl::StatusOr<OpGraph> LoadGraphFile(const std::string& path) {
  auto t = ReadFile(path);
  if (!t.ok()) return t.status();
  return ParseGraphJson(*t, path);
}

absl::StatusOr<ClusterProfile> LoadProfileFile(const std::string& path) {
  auto t = ReadFile(path);
  if (!t.ok()) return t.status();
  return ParseProfileJson(*t, path);
}

std::string GraphToJson(const OpGraph& g) {
  json ops = json::array();
  for (const auto& o : g.ops) {
    ops.push_back({{"name", o.name},
                   {"forward_flops", o.forward_flops},
                   {"backward_flops", o.backward_flops},
                   {"param_bytes", o.param_bytes},
                   {"optimizer_bytes", o.optimizer_bytes},
                   {"output_bytes", o.output_bytes},
                   {"inputs", o.inputs}});
    if (o.tied_to >= 0) ops.back()["tied_to"] = o.tied_to;
    if (o.saved_bytes >= 0) ops.back()["saved_bytes"] = o.saved_bytes;
  }
  return json{{"ops", ops}}.dump(1) + "\n";
}

std::string ProfileToJson(const ClusterProfile& p) {
  json sites = json::array(), links = json::array();
  for (const auto& s : p.sites) {
    json js = {{"name", s.name}, {"flops_per_second", s.flops_per_second}, {"memory_bytes", s.memory_bytes}};
    if (!s.op_seconds.empty()) js["op_seconds"] = s.op_seconds;
    if (!s.gemm_flops_per_second.empty()) js["gemm_flops_per_second"] = s.gemm_flops_per_second;
    if (s.uplink_bytes_per_second > 0) js["uplink_bytes_per_second"] = s.uplink_bytes_per_second;
    if (!s.codec_bytes_per_second.empty()) js["codec_bytes_per_second"] = s.codec_bytes_per_second;
    if (s.workers > 1) js["workers"] = s.workers;
    if (s.intra_site_bytes_per_second > 0) js["intra_site_bytes_per_second"] = s.intra_site_bytes_per_second;
    if (s.transport_seconds_per_frame > 0) js["transport_seconds_per_frame"] = s.transport_seconds_per_frame;
    if (s.transport_seconds_per_byte > 0) js["transport_seconds_per_byte"] = s.transport_seconds_per_byte;
    if (s.optimizer_seconds_per_byte > 0) js["optimizer_seconds_per_byte"] = s.optimizer_seconds_per_byte;
    if (!s.comment.empty()) js["comment"] = s.comment;
    if (!s.device.empty()) js["device"] = s.device;
    sites.push_back(js);
  }
  for (const auto& l : p.links) {
    json jl = {{"from", l.from},
               {"to", l.to},
               {"bandwidth_bytes_per_second", l.bandwidth_bytes_per_second},
               {"latency_seconds", l.latency_seconds}};
    if (l.receive_seconds_per_byte > 0) jl["receive_seconds_per_byte"] = l.receive_seconds_per_byte;
    links.push_back(jl);
  }
  return json{{"sites", sites}, {"links", links}}.dump(2) + "\n";
}

absl::StatusOr<LlamaShape> ParseLlamaConfig(const std::string& text, const std::string& path) {
  auto parsed = ParseJson(text, path);
  if (!parsed.ok()) return parsed.status();
  const json& j = *parsed;
  LlamaShape s;
  auto get_int = [&](const char* key, int* out, bool required) -> absl::Status {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return required ? Bad(path, key, "missing") : absl::OkStatus();
    if (!it->is_number_integer() || it->get<long long>() <= 0 || it->get<long long>() > (1LL << 31) - 1)
      return Bad(path, key, "expected a positive integer");
    *out = static_cast<int>(it->get<long long>());
    return absl::OkStatus();
  };
  RETURN_IF(get_int("vocab_size", &s.vocab_size, true));
  RETURN_IF(get_int("hidden_size", &s.hidden_size, true));
  RETURN_IF(get_int("intermediate_size", &s.intermediate_size, true));
  RETURN_IF(get_int("num_hidden_layers", &s.num_hidden_layers, true));
  RETURN_IF(get_int("num_attention_heads", &s.num_attention_heads, true));
  s.num_key_value_heads = s.num_attention_heads;
  RETURN_IF(get_int("num_key_value_heads", &s.num_key_value_heads, false));
  if (s.hidden_size % s.num_attention_heads != 0) return Bad(path, "num_attention_heads", "must divide hidden_size");
  if (s.num_attention_heads % s.num_key_value_heads != 0)
    return Bad(path, "num_key_value_heads", "must divide num_attention_heads");
  if (auto it = j.find("tie_word_embeddings"); it != j.end()) {
    if (!it->is_boolean()) return Bad(path, "tie_word_embeddings", "expected true or false");
    s.tie_word_embeddings = it->get<bool>();
  }
  return s;
}

OpGraph BuildLlamaGraph(const LlamaShape& m, const LlamaGraphOptions& o) {
  const double b = o.micro_batch_size, s = o.sequence_length, d = m.hidden_size, h = m.intermediate_size;
  const double v = m.vocab_size;
  const double kv = d / m.num_attention_heads * m.num_key_value_heads;
  const double tokens = b * s;
  const double state_per_param = o.weight_bytes + o.gradient_bytes;
  const double hidden_out = tokens * d * o.activation_bytes;
  OpGraph g;
  // `saved`: elements the forward pass leaves for the backward pass, output included (SavedBytes), as
  // executor/llama.cc's eager autograd keeps them (measured: executor/llama_test.cc).
  auto add = [&](std::string name, double params, double fwd, double bwd, double out, double saved,
                 std::vector<int> inputs) {
    Op op{std::move(name), fwd, bwd, params * state_per_param, params * o.optimizer_bytes, out, std::move(inputs)};
    op.saved_bytes = saved * o.activation_bytes;
    g.ops.push_back(std::move(op));
  };
  // Embedding lookup: negligible FLOPs; its backward is a scatter-add of the same size as its output.
  add("embed", v * d, tokens * d, tokens * d, hidden_out, tokens * d, {});
  const double heads = m.num_attention_heads;
  for (int l = 0; l < m.num_hidden_layers; ++l) {
    // RMSNorm (d weights), Q/K/V/O projections, causal attention scores and weighted sum, residual add.
    // Kept: the norm's input and intermediates, the projections' input, q and k before and after RoPE,
    // k and v at every query head, the attention output, the output (8 x d per token); and the softmax's
    // probabilities, heads x s x s per sequence.
    double attn_params = d + d * d + 2 * d * kv + d * d;
    double attn_fwd = 2 * tokens * (d * d + 2 * d * kv + d * d) + 2 * 2 * b * s * s * d;
    int prev = static_cast<int>(g.ops.size()) - 1;
    add("layer" + std::to_string(l) + ".attn", attn_params, attn_fwd, 2 * attn_fwd, hidden_out,
        8 * tokens * d + b * heads * s * s, {prev});
    // Kept: the norm's input and intermediates, the projections' input, the output (4 x d per token); the
    // gate and up projections, the gate's SiLU and the product (4 x intermediate per token).
    double mlp_params = d + 3 * d * h;
    double mlp_fwd = 2 * tokens * 3 * d * h;
    add("layer" + std::to_string(l) + ".mlp", mlp_params, mlp_fwd, 2 * mlp_fwd, hidden_out, tokens * (4 * d + 4 * h),
        {static_cast<int>(g.ops.size()) - 1});
  }
  // Final RMSNorm, LM head (its weights shared with the embedding when tied) and the loss. Kept: the
  // norm's (3 x d per token) and the loss's log-softmax (vocabulary per token; the logits are freed).
  double head_params = d + (m.tie_word_embeddings ? 0 : v * d);
  double head_fwd = 2 * tokens * d * v;
  add("head", head_params, head_fwd, 2 * head_fwd, /*output: the loss*/ 4, tokens * (3 * d + v),
      {static_cast<int>(g.ops.size()) - 1});
  if (m.tie_word_embeddings) g.ops.back().tied_to = 0;  // the embedding's weights: one stage runs both
  return g;
}

}  // namespace meridian::partitioner
