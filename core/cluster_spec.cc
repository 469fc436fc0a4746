#include "core/cluster_spec.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/codec_spec.h"
#include "core/files.h"
#include "core/units.h"

namespace meridian::core {

std::string Diagnostic::ToString() const { return absl::StrCat(file, ":", line, ":", column, ": error: ", message); }

std::string Endpoint::ToString() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

const char* ToString(CompressionPolicy policy) {
  switch (policy) {
    case CompressionPolicy::kAdaptive:
      return "adaptive";
    case CompressionPolicy::kNone:
      return "none";
    case CompressionPolicy::kFixed:
      return "fixed";
  }
  return "?";
}

const char* ToString(CheckpointStore store) {
  return store == CheckpointStore::kCoordinator ? "coordinator" : "shared";
}

const char* ToString(OnFailure on_failure) { return on_failure == OnFailure::kWait ? "wait" : "replan"; }
const char* ToString(SyncMode mode) { return mode == SyncMode::kDiloco ? "diloco" : "every_step"; }

const SiteSpec* ClusterSpec::FindSite(const std::string& name) const {
  for (const auto& s : sites)
    if (s.name == name) return &s;
  return nullptr;
}

namespace {

bool IsDnsName(const std::string& h) {
  if (h.empty() || h.size() > 253) return false;
  size_t label = 0;
  for (size_t i = 0; i < h.size(); ++i) {
    char c = h[i];
    if (c == '.') {
      if (label == 0 || h[i - 1] == '-') return false;
      label = 0;
      continue;
    }
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-')) return false;
    if (c == '-' && label == 0) return false;
    if (++label > 63) return false;
  }
  return label > 0 && h.back() != '-';
}

bool IsIpv4(const std::string& h) {
  int parts = 0;
  size_t i = 0;
  while (i <= h.size()) {
    size_t j = i;
    while (j < h.size() && std::isdigit(static_cast<unsigned char>(h[j]))) ++j;
    if (j == i || j - i > 3) return false;
    if (std::stoi(h.substr(i, j - i)) > 255) return false;
    ++parts;
    if (j == h.size()) break;
    if (h[j] != '.') return false;
    i = j + 1;
  }
  return parts == 4;
}

bool AllDigitsAndDots(const std::string& h) {
  for (char c : h)
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '.') return false;
  return true;
}

bool IsIpv6(const std::string& h) {
  if (h.size() < 2) return false;
  int colons = 0;
  for (char c : h) {
    if (c == ':')
      ++colons;
    else if (!std::isxdigit(static_cast<unsigned char>(c)) && c != '.')
      return false;
  }
  return colons >= 2;
}

bool IsSiteName(const std::string& n) {
  if (n.empty() || n.size() > 63) return false;
  for (char c : n)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_')) return false;
  return true;
}

// Walks the document once, counting nodes as they would be after alias expansion, so that a
// "billion laughs" document is rejected after a bounded amount of work.
bool WithinNodeBudget(const YAML::Node& n, size_t* count, int depth) {
  if (++*count > kMaxSpecNodes || depth > kMaxSpecDepth) return false;
  if (n.IsSequence()) {
    for (const auto& c : n)
      if (!WithinNodeBudget(c, count, depth + 1)) return false;
  } else if (n.IsMap()) {
    for (const auto& kv : n) {
      if (!WithinNodeBudget(kv.first, count, depth + 1)) return false;
      if (!WithinNodeBudget(kv.second, count, depth + 1)) return false;
    }
  }
  return true;
}

const char* KindName(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Scalar:
      return "a scalar";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    default:
      return "nothing";
  }
}

// Collects diagnostics while reading typed fields out of YAML nodes.
class Checker {
 public:
  explicit Checker(std::string file) : file_(std::move(file)) {}

  void Error(const YAML::Mark& m, std::string msg) {
    int line = m.is_null() ? 0 : m.line + 1;
    int col = m.is_null() ? 0 : m.column + 1;
    errors_.push_back({file_, line, col, std::move(msg)});
  }
  std::vector<Diagnostic>& errors() { return errors_; }

  // True when `n` is a mapping whose keys are all scalars from `allowed`, each at most once.
  bool Map(const YAML::Node& n, const std::string& ctx, const std::vector<const char*>& allowed) {
    if (!n.IsMap()) {
      Error(n.Mark(), absl::StrCat(ctx, ": expected a mapping, found ", KindName(n)));
      return false;
    }
    std::set<std::string> seen;
    for (const auto& kv : n) {
      if (!kv.first.IsScalar()) {
        Error(kv.first.Mark(), absl::StrCat(ctx, ": keys must be plain names"));
        continue;
      }
      const std::string key = kv.first.Scalar();
      bool known = false;
      for (const char* a : allowed) known |= key == a;
      if (!known) {
        Error(kv.first.Mark(),
              absl::StrCat(ctx, ": unknown key '", key, "'; expected one of ", absl::StrJoin(allowed, ", ")));
      } else if (!seen.insert(key).second) {
        Error(kv.first.Mark(), absl::StrCat(ctx, ": duplicate key '", key, "'"));
      }
    }
    return true;
  }

  // The scalar at map[key]; reports a missing required key at the map, a wrong type at the value.
  std::optional<std::string> Scalar(const YAML::Node& map, const char* key, const std::string& ctx, bool required) {
    YAML::Node v = map[key];
    if (!v.IsDefined() || v.IsNull()) {
      if (required) Error(map.Mark(), absl::StrCat(ctx, ": missing required key '", key, "'"));
      return std::nullopt;
    }
    if (!v.IsScalar()) {
      Error(v.Mark(), absl::StrCat(ctx, ".", key, ": expected a scalar, found ", KindName(v)));
      return std::nullopt;
    }
    return v.Scalar();
  }

  template <typename F>
  void Field(const YAML::Node& map, const char* key, const std::string& ctx, bool required, F&& parse) {
    auto s = Scalar(map, key, ctx, required);
    if (!s) return;
    std::string err = parse(*s);
    if (!err.empty()) Error(map[key].Mark(), absl::StrCat(ctx, ".", key, ": ", err));
  }

  void String(const YAML::Node& map, const char* key, const std::string& ctx, bool required, std::string* out) {
    Field(map, key, ctx, required, [&](const std::string& s) -> std::string {
      if (s.empty()) return "must not be empty";
      *out = s;
      return "";
    });
  }

  void Int(const YAML::Node& map, const char* key, const std::string& ctx, bool required, long long lo, long long hi,
           long long* out) {
    Field(map, key, ctx, required, [&](const std::string& s) -> std::string {
      char* end = nullptr;
      errno = 0;
      long long v = std::strtoll(s.c_str(), &end, 10);
      if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE)
        return absl::StrCat("expected an integer, found '", s, "'");
      if (v < lo || v > hi) return absl::StrCat("must be between ", lo, " and ", hi, ", found ", v);
      *out = v;
      return "";
    });
  }
  template <typename T>
  void IntAs(const YAML::Node& map, const char* key, const std::string& ctx, bool required, long long lo, long long hi,
             T* out) {
    long long v = *out;
    Int(map, key, ctx, required, lo, hi, &v);
    *out = static_cast<T>(v);
  }

  void Double(const YAML::Node& map, const char* key, const std::string& ctx, bool required, double lo, double hi,
              bool lo_open, double* out) {
    Field(map, key, ctx, required, [&](const std::string& s) -> std::string {
      char* end = nullptr;
      double v = std::strtod(s.c_str(), &end);
      if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
        return absl::StrCat("expected a number, found '", s, "'");
      if ((lo_open ? v <= lo : v < lo) || v > hi)
        return absl::StrCat("must be ", lo_open ? "greater than " : "at least ", lo, " and at most ", hi, ", found ",
                            s);
      *out = v;
      return "";
    });
  }

  void Bool(const YAML::Node& map, const char* key, const std::string& ctx, bool* out) {
    Field(map, key, ctx, false, [&](const std::string& s) -> std::string {
      if (s == "true" || s == "yes" || s == "on")
        *out = true;
      else if (s == "false" || s == "no" || s == "off")
        *out = false;
      else
        return absl::StrCat("expected true or false, found '", s, "'");
      return "";
    });
  }

  void Choice(const YAML::Node& map, const char* key, const std::string& ctx, const std::vector<const char*>& choices,
              std::string* out) {
    Field(map, key, ctx, false, [&](const std::string& s) -> std::string {
      for (const char* c : choices)
        if (s == c) {
          *out = s;
          return "";
        }
      return absl::StrCat("'", s, "' is not one of ", absl::StrJoin(choices, ", "));
    });
  }

  // One of an enum's `choices`, spelled as ToString spells them.
  template <typename E>
  void Choice(const YAML::Node& map, const char* key, const std::string& ctx, const std::vector<E>& choices, E* out) {
    std::vector<const char*> names;
    for (E e : choices) names.push_back(ToString(e));
    std::string name;
    Choice(map, key, ctx, names, &name);
    for (E e : choices)
      if (name == ToString(e)) *out = e;
  }

  // A codec as core::CodecSpec::Parse reads it ("int8", "int4:block=128+zstd", ...); the AQ-SGD delta
  // codecs only where `delta_allowed` (activations: a delta needs the same sequence's previous tensor).
  void Codec(const YAML::Node& map, const char* key, const std::string& ctx, bool delta_allowed, std::string* out) {
    Field(map, key, ctx, false, [&](const std::string& s) -> std::string {
      auto spec = CodecSpec::Parse(s);
      if (!spec.ok()) return std::string(spec.status().message());
      if (spec->delta && !delta_allowed)
        return absl::StrCat("'", s, "' is an activation codec (a delta against the same sequence's previous ",
                            "activation); use int8, int4 or int2 here");
      *out = s;
      return "";
    });
  }

  // A quantity with a unit, parsed by `parse`; must be strictly positive.
  void Quantity(const YAML::Node& map, const char* key, const std::string& ctx, bool required,
                absl::StatusOr<double> (*parse)(const std::string&), std::optional<double>* out) {
    Field(map, key, ctx, required, [&](const std::string& s) -> std::string {
      auto v = parse(s);
      if (!v.ok()) return std::string(v.status().message());
      if (*v <= 0) return absl::StrCat("must be positive, found '", s, "'");
      *out = *v;
      return "";
    });
  }

  void Address(const YAML::Node& map, const char* key, const std::string& ctx, bool required, Endpoint* out) {
    Field(map, key, ctx, required, [&](const std::string& s) -> std::string {
      std::string err;
      if (!ParseEndpoint(s, out, &err)) return err;
      return "";
    });
  }

 private:
  std::string file_;
  std::vector<Diagnostic> errors_;
};

void ParseEmulation(Checker& c, const YAML::Node& n, const std::string& ctx, EmulationSpec* e) {
  if (!c.Map(n, ctx, {"cpu_quota", "threads"})) return;
  c.Double(n, "cpu_quota", ctx, false, 0.0, 64.0, true, &e->cpu_quota);
  if (n["cpu_quota"].IsDefined() && e->cpu_quota < 0.01)
    c.Error(n["cpu_quota"].Mark(), absl::StrCat(ctx, ".cpu_quota: must be at least 0.01 of a core"));
  c.IntAs(n, "threads", ctx, false, 1, 256, &e->threads);
}

// A word that goes on ssh's command line or into the remote shell's: no option look-alike, no shell syntax.
bool IsSafeSshWord(const std::string& v, bool path) {
  if (v.empty() || v.size() > 1024 || v[0] == '-') return false;
  for (char ch : v) {
    const bool ok = std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-' || ch == ':' ||
                    (path && (ch == '/' || ch == '+' || ch == '@' || ch == ','));
    if (!ok) return false;
  }
  return true;
}

void ParseSsh(Checker& c, const YAML::Node& n, const std::string& ctx, const std::string& spec_path, SshSpec* ssh) {
  if (!c.Map(n, ctx, {"host", "user", "port", "identity_file", "known_hosts", "workdir", "executor"})) return;
  c.Field(n, "host", ctx, true, [&](const std::string& v) -> std::string {
    if (!IsSafeSshWord(v, false) || v.find(':') != std::string::npos)
      return absl::StrCat("'", v, "' is not a host name or IPv4 address (letters, digits, '.', '-', '_')");
    ssh->host = v;
    return "";
  });
  c.Field(n, "user", ctx, false, [&](const std::string& v) -> std::string {
    if (!IsSafeSshWord(v, false) || v.find(':') != std::string::npos)
      return absl::StrCat("'", v, "' is not a user name (letters, digits, '.', '-', '_'; not starting with '-')");
    ssh->user = v;
    return "";
  });
  c.IntAs(n, "port", ctx, false, 1, 65535, &ssh->port);
  for (auto [key, out, remote] :
       {std::tuple<const char*, std::string*, bool>{"identity_file", &ssh->identity_file, false},
        {"known_hosts", &ssh->known_hosts, false},
        {"workdir", &ssh->workdir, true},
        {"executor", &ssh->executor, true}}) {
    c.Field(n, key, ctx, false, [&, key = key, out = out, remote = remote](const std::string& v) -> std::string {
      if (!IsSafeSshWord(v, true))
        return absl::StrCat("'", v,
                            "' is not a plain path (letters, digits and . _ - / + @ , :; no spaces, quotes, '~' "
                            "or leading '-')");
      if (remote && std::string(key) == "workdir" && (v == "/" || v.find("..") != std::string::npos))
        return absl::StrCat("'", v, "' must name a folder of its own (not '/', no '..')");
      *out = remote ? v : ResolveRelative(spec_path, v);
      return "";
    });
  }
}

void ParseSites(Checker& c, const YAML::Node& n, ClusterSpec* cs, const std::string& spec_path) {
  if (!n.IsSequence()) {
    c.Error(n.Mark(), absl::StrCat("sites: expected a list of sites, found ", KindName(n)));
    return;
  }
  if (n.size() == 0) c.Error(n.Mark(), "sites: the cluster needs at least one site");
  std::map<std::string, int> names;
  std::map<std::string, std::string> addresses;
  size_t i = 0;
  for (const auto& sn : n) {
    std::string ctx = absl::StrCat("sites[", i++, "]");
    if (!c.Map(sn, ctx, {"name", "address", "devices", "emulation", "memory", "ssh"})) continue;
    SiteSpec s;
    s.line = sn.Mark().line + 1;
    c.Field(sn, "name", ctx, true, [&](const std::string& v) -> std::string {
      if (!IsSiteName(v)) return absl::StrCat("'", v, "' is not a valid site name (1-63 of A-Z a-z 0-9 - _)");
      if (v == "coordinator") return "'coordinator' is reserved for the coordinator's certificate";
      s.name = v;
      return "";
    });
    if (!s.name.empty()) {
      ctx = absl::StrCat("site '", s.name, "'");
      auto [it, fresh] = names.emplace(s.name, s.line);
      if (!fresh)
        c.Error(sn["name"].Mark(),
                absl::StrCat("sites: duplicate site name '", s.name, "' (first defined on line ", it->second, ")"));
    }
    c.Address(sn, "address", ctx, true, &s.address);
    if (s.address.port != 0) {
      auto [it, fresh] = addresses.emplace(s.address.ToString(), s.name);
      if (!fresh)
        c.Error(sn["address"].Mark(),
                absl::StrCat(ctx, ".address: ", s.address.ToString(), " is already used by site '", it->second, "'"));
    }
    YAML::Node dev = sn["devices"];
    if (dev.IsDefined() && !dev.IsNull()) {
      std::vector<std::string> devices;
      if (dev.IsScalar())
        devices.push_back(dev.Scalar());
      else if (dev.IsSequence()) {
        for (const auto& d : dev) {
          if (!d.IsScalar()) {
            c.Error(d.Mark(), absl::StrCat(ctx, ".devices: each device must be a string like cpu or cuda:0"));
            continue;
          }
          devices.push_back(d.Scalar());
        }
      } else {
        c.Error(dev.Mark(), absl::StrCat(ctx, ".devices: expected a device or a list of devices"));
      }
      for (const auto& d : devices) {
        bool ok = d == "cpu";
        if (d.rfind("cuda:", 0) == 0 && d.size() > 5) {
          ok = true;
          for (size_t k = 5; k < d.size(); ++k) ok &= std::isdigit(static_cast<unsigned char>(d[k])) != 0;
          // One spelling per device, so that "listed twice" below sees every repeat (cuda:01 is cuda:1).
          ok &= d.size() <= 9 && (d.size() == 6 || d[5] != '0');
        }
        if (!ok)
          c.Error(dev.Mark(), absl::StrCat(ctx, ".devices: '", d, "' is not cpu or cuda:N (N without leading zeros)"));
      }
      if (dev.IsSequence() && devices.empty()) c.Error(dev.Mark(), absl::StrCat(ctx, ".devices: list is empty"));
      // One worker process per device (docs/executor.md): all of one kind, each CUDA device once.
      std::set<std::string> seen_devices;
      for (const auto& d : devices) {
        if ((d == "cpu") != (devices.front() == "cpu"))
          c.Error(dev.Mark(), absl::StrCat(ctx,
                                           ".devices: mixes cpu and cuda devices; a site's workers are all "
                                           "of one kind"));
        if (d != "cpu" && !seen_devices.insert(d).second)
          c.Error(dev.Mark(), absl::StrCat(ctx, ".devices: ", d, " is listed twice"));
      }
      if (devices.size() > 64)
        c.Error(dev.Mark(), absl::StrCat(ctx, ".devices: ", devices.size(), " devices; at most 64 workers per site"));
      if (!devices.empty()) s.devices = devices;
    }
    if (sn["emulation"].IsDefined() && !sn["emulation"].IsNull()) {
      EmulationSpec e;
      ParseEmulation(c, sn["emulation"], ctx + ".emulation", &e);
      s.emulation = e;
    }
    c.Quantity(sn, "memory", ctx, false, ParseBytes, &s.memory_bytes);
    if (sn["ssh"].IsDefined() && !sn["ssh"].IsNull()) {
      SshSpec ssh;
      ParseSsh(c, sn["ssh"], ctx + ".ssh", spec_path, &ssh);
      s.ssh = ssh;
    }
    cs->sites.push_back(std::move(s));
  }
}

void ParseLinks(Checker& c, const YAML::Node& n, ClusterSpec* cs) {
  if (!n.IsSequence()) {
    c.Error(n.Mark(), absl::StrCat("links: expected a list of links, found ", KindName(n)));
    return;
  }
  std::set<std::pair<std::string, std::string>> pairs;
  size_t i = 0;
  for (const auto& ln : n) {
    std::string ctx = absl::StrCat("links[", i++, "]");
    if (!c.Map(ln, ctx, {"from", "to", "bandwidth", "rtt", "symmetric", "override"})) continue;
    LinkSpec l;
    c.String(ln, "from", ctx, true, &l.from);
    c.String(ln, "to", ctx, true, &l.to);
    c.Quantity(ln, "bandwidth", ctx, false, ParseBandwidth, &l.bandwidth_bytes_per_second);
    c.Field(ln, "rtt", ctx, false, [&](const std::string& s) -> std::string {
      auto v = ParseDuration(s);
      if (!v.ok()) return std::string(v.status().message());
      l.rtt_seconds = *v;  // zero RTT is allowed (same rack)
      return "";
    });
    c.Bool(ln, "symmetric", ctx, &l.symmetric);
    c.Bool(ln, "override", ctx, &l.override_measurement);
    if (!l.bandwidth_bytes_per_second && !l.rtt_seconds && ln.IsMap())
      c.Error(ln.Mark(), absl::StrCat(ctx, ": a link needs at least one of bandwidth, rtt"));
    for (const std::string* end : {&l.from, &l.to}) {
      if (!end->empty() && !cs->FindSite(*end)) {
        const char* key = end == &l.from ? "from" : "to";
        c.Error(ln[key].Mark(), absl::StrCat(ctx, ".", key, ": unknown site '", *end, "'"));
      }
    }
    if (!l.from.empty() && l.from == l.to)
      c.Error(ln["to"].Mark(), absl::StrCat(ctx, ": a link must join two different sites"));
    if (!l.from.empty() && !l.to.empty()) {
      bool dup = !pairs.insert({l.from, l.to}).second;
      if (l.symmetric) dup |= !pairs.insert({l.to, l.from}).second;
      if (dup) c.Error(ln.Mark(), absl::StrCat(ctx, ": link ", l.from, " -> ", l.to, " is given more than once"));
    }
    cs->links.push_back(std::move(l));
  }
}

void ParseJob(Checker& c, const YAML::Node& n, JobSpec* j) {
  const std::string ctx = "job";
  if (!c.Map(
          n, ctx,
          {"model", "tokenizer", "data", "steps", "global_batch", "micro_batches", "sequence_length", "seed",
           "replication", "optimizer", "compression", "sync", "checkpoint", "lora", "eval_fraction", "step_overlap"}))
    return;
  j->line = n.Mark().line + 1;
  c.String(n, "model", ctx, true, &j->model);
  c.String(n, "tokenizer", ctx, false, &j->tokenizer);
  c.String(n, "data", ctx, false, &j->data);
  c.Double(n, "eval_fraction", ctx, false, 0, 0.9, false, &j->eval_fraction);
  c.IntAs(n, "steps", ctx, false, 1, 100000000, &j->steps);
  c.IntAs(n, "global_batch", ctx, false, 1, 1 << 20, &j->global_batch);
  c.IntAs(n, "micro_batches", ctx, false, 0, 1 << 16, &j->micro_batches);
  c.IntAs(n, "sequence_length", ctx, false, 1, 1 << 20, &j->sequence_length);
  c.IntAs(n, "seed", ctx, false, 0, (1LL << 62), &j->seed);
  c.Bool(n, "replication", ctx, &j->replication);
  c.IntAs(n, "step_overlap", ctx, false, 0, 1 << 16, &j->step_overlap);
  if (j->micro_batches > 0 && j->global_batch % j->micro_batches != 0)
    c.Error(n["micro_batches"].Mark(), absl::StrCat("job.micro_batches: ", j->micro_batches,
                                                    " does not divide job.global_batch ", j->global_batch));
  if (j->step_overlap > 0 && j->step_overlap >= MicroBatchesOf(*j))
    c.Error(n["step_overlap"].Mark(),
            absl::StrCat("job.step_overlap: ", j->step_overlap, " must be below the step's micro-batches (",
                         MicroBatchesOf(*j), j->micro_batches > 0 ? "" : ", job.micro_batches' default", ")"));
  if (YAML::Node o = n["optimizer"]; o.IsDefined() && !o.IsNull()) {
    const std::string oc = "job.optimizer";
    if (c.Map(o, oc,
              {"name", "lr", "weight_decay", "beta1", "beta2", "eps", "warmup_steps", "min_lr_ratio", "grad_clip",
               "zero"})) {
      OptimizerSpec& op = j->optimizer;
      c.Choice(o, "name", oc, {"adamw", "sgd"}, &op.name);
      c.Double(o, "lr", oc, false, 0, 10, true, &op.lr);
      c.Double(o, "weight_decay", oc, false, 0, 10, false, &op.weight_decay);
      c.Double(o, "beta1", oc, false, 0, 1, false, &op.beta1);
      c.Double(o, "beta2", oc, false, 0, 1, false, &op.beta2);
      c.Double(o, "eps", oc, false, 0, 1, true, &op.eps);
      c.IntAs(o, "warmup_steps", oc, false, 0, 100000000, &op.warmup_steps);
      c.Double(o, "min_lr_ratio", oc, false, 0, 1, false, &op.min_lr_ratio);
      c.Double(o, "grad_clip", oc, false, 0, 1e9, false, &op.grad_clip);
      c.IntAs(o, "zero", oc, false, 0, 1, &op.zero);
    }
  }
  if (YAML::Node o = n["compression"]; o.IsDefined() && !o.IsNull()) {
    const std::string oc = "job.compression";
    if (c.Map(o, oc,
              {"policy", "activations", "gradients", "topk_fraction", "error_feedback", "activation_memory",
               "activation_spill"})) {
      CompressionSpec& cp = j->compression;
      c.Choice(o, "policy", oc, {CompressionPolicy::kAdaptive, CompressionPolicy::kNone, CompressionPolicy::kFixed},
               &cp.policy);
      c.Codec(o, "activations", oc, /*delta_allowed=*/true, &cp.activations);
      c.Codec(o, "gradients", oc, /*delta_allowed=*/false, &cp.gradients);
      std::optional<double> memory, spill;
      c.Quantity(o, "activation_memory", oc, false, ParseBytes, &memory);
      c.Quantity(o, "activation_spill", oc, false, ParseBytes, &spill);
      if (memory) cp.activation_memory_bytes = *memory;
      if (spill) cp.activation_spill_bytes = *spill;
      c.Double(o, "topk_fraction", oc, false, 0, 1, true, &cp.topk_fraction);
      c.Bool(o, "error_feedback", oc, &cp.error_feedback);
    }
  }
  if (YAML::Node o = n["sync"]; o.IsDefined() && !o.IsNull()) {
    const std::string oc = "job.sync";
    if (c.Map(o, oc, {"mode", "inner_steps", "outer_optimizer", "codec", "error_feedback", "fragments", "overlap"})) {
      SyncSpec& s = j->sync;
      c.Choice(o, "mode", oc, {SyncMode::kEveryStep, SyncMode::kDiloco}, &s.mode);
      c.IntAs(o, "inner_steps", oc, false, 1, 100000000, &s.inner_steps);
      c.IntAs(o, "fragments", oc, false, 1, 1 << 16, &s.fragments);
      c.Codec(o, "codec", oc, /*delta_allowed=*/false, &s.codec);
      c.Bool(o, "error_feedback", oc, &s.error_feedback);
      c.Bool(o, "overlap", oc, &s.overlap);
      if (YAML::Node oo = o["outer_optimizer"]; oo.IsDefined() && !oo.IsNull()) {
        const std::string ooc = "job.sync.outer_optimizer";
        if (c.Map(oo, ooc, {"name", "lr", "momentum"})) {
          c.Choice(oo, "name", ooc, {"nesterov", "sgd", "sparseloco"}, &s.outer_optimizer);
          if (s.sparseloco()) {  // the paper's values, unless given
            s.outer_lr = 1.0;
            s.outer_momentum = 0.95;
          }
          c.Double(oo, "lr", ooc, false, 0, 100, true, &s.outer_lr);
          c.Double(oo, "momentum", ooc, false, 0, 1, false, &s.outer_momentum);
          if (s.outer_momentum >= 1)
            c.Error(oo["momentum"].Mark(), "job.sync.outer_optimizer.momentum: must be below 1");
        }
      }
      if (s.sparseloco()) {
        const YAML::Node at = o["codec"].IsDefined() ? o["codec"] : o["outer_optimizer"];
        auto codec = CodecSpec::Parse(s.codec);
        if (codec.ok() && codec->kind != CodecKind::kTopK)
          c.Error(at.Mark(), absl::StrCat("job.sync.codec: outer_optimizer sparseloco sums top-k-sparsified "
                                          "pseudo-gradients: give a top-k codec (e.g. 'topk-int8:k=0.03'), not '",
                                          s.codec, "'"));
        if (!s.error_feedback)
          c.Error((o["error_feedback"].IsDefined() ? o["error_feedback"] : o).Mark(),
                  "job.sync.error_feedback: outer_optimizer sparseloco's momentum is its error feedback; it "
                  "cannot be false");
      }
      if (s.mode == SyncMode::kDiloco) {
        if (s.inner_steps % s.fragments != 0)
          c.Error(
              (o["fragments"].IsDefined() ? o["fragments"] : o).Mark(),
              absl::StrCat("job.sync.fragments: ", s.fragments, " does not divide job.sync.inner_steps ", s.inner_steps,
                           " (fragment f syncs every inner_steps at offset f x inner_steps / "
                           "fragments)"));
      }
    }
  }
  if (YAML::Node o = n["checkpoint"]; o.IsDefined() && !o.IsNull()) {
    const std::string oc = "job.checkpoint";
    if (c.Map(o, oc, {"dir", "interval", "keep", "store"})) {
      c.String(o, "dir", oc, false, &j->checkpoint.dir);
      c.Choice(o, "store", oc, {CheckpointStore::kShared, CheckpointStore::kCoordinator}, &j->checkpoint.store);
      c.IntAs(o, "interval", oc, false, 0, 100000000, &j->checkpoint.interval);
      c.IntAs(o, "keep", oc, false, 1, 1000, &j->checkpoint.keep);
    }
  }
  if (YAML::Node o = n["lora"]; o.IsDefined() && !o.IsNull()) {
    const std::string oc = "job.lora";
    if (c.Map(o, oc, {"enabled", "r", "alpha", "dropout", "target_modules"})) {
      LoraSpec& l = j->lora;
      l.enabled = true;
      c.Bool(o, "enabled", oc, &l.enabled);
      c.IntAs(o, "r", oc, false, 1, 4096, &l.r);
      c.Double(o, "alpha", oc, false, 0, 1e6, true, &l.alpha);
      c.Double(o, "dropout", oc, false, 0, 1, false, &l.dropout);
      if (YAML::Node t = o["target_modules"]; t.IsDefined()) {
        static const std::set<std::string> kTargets = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"};
        if (!t.IsSequence() || t.size() == 0) {
          c.Error(t.Mark(), "job.lora.target_modules: expected a non-empty list of projection names");
        } else {
          l.target_modules.clear();
          for (const auto& m : t) {
            if (!m.IsScalar() || !kTargets.count(m.Scalar())) {
              c.Error(m.Mark(),
                      "job.lora.target_modules: each entry must be one of q_proj, k_proj, v_proj, "
                      "o_proj, gate_proj, up_proj, down_proj");
              continue;
            }
            l.target_modules.push_back(m.Scalar());
          }
        }
      }
    }
  }
}

// Rejects content that is not YAML text before the parser sees it. Returns an error message or "".
std::string CheckRawText(const std::string& text, int* line, int* col) {
  *line = 1;
  *col = 1;
  if (text.size() > kMaxSpecFileBytes)
    return absl::StrCat("file is ", text.size(), " bytes; a spec may be at most ", kMaxSpecFileBytes, " bytes");
  size_t i = 0;
  while (i < text.size()) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    bool ok = len > 0 && i + len <= text.size();
    for (int k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(text[i + k]) >> 6) == 2;
    if (!ok || c == 0 || (c < 0x20 && c != '\n' && c != '\r' && c != '\t'))
      return absl::StrCat("this is not a text file (byte 0x", absl::Hex(c, absl::kZeroPad2), " at offset ", i,
                          "); a spec must be UTF-8 YAML");
    if (c == '\n') {
      ++*line;
      *col = 1;
    } else {
      ++*col;
    }
    i += len;
  }
  return "";
}

}  // namespace

bool ParseEndpoint(const std::string& text, Endpoint* out, std::string* error) {
  std::string host, port;
  if (!text.empty() && text[0] == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      *error = absl::StrCat("'", text, "' is not host:port ([v6 address]:port for IPv6)");
      return false;
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
    if (!IsIpv6(host)) {
      *error = absl::StrCat("'", host, "' is not an IPv6 address");
      return false;
    }
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      *error = absl::StrCat("'", text, "' is not host:port");
      return false;
    }
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    bool ok = AllDigitsAndDots(host) ? IsIpv4(host) : IsDnsName(host);
    if (!ok) {
      *error = absl::StrCat("'", host, "' in '", text, "' is neither a host name nor an IPv4 address");
      return false;
    }
  }
  if (port.empty() || port.size() > 5) {
    *error = absl::StrCat("'", text, "' has no valid port (1-65535)");
    return false;
  }
  for (char ch : port)
    if (!std::isdigit(static_cast<unsigned char>(ch))) {
      *error = absl::StrCat("port '", port, "' in '", text, "' is not a number");
      return false;
    }
  int p = std::stoi(port);
  if (p < 1 || p > 65535) {
    *error = absl::StrCat("port ", p, " in '", text, "' is outside 1-65535");
    return false;
  }
  out->host = host;
  out->port = p;
  return true;
}

SpecLoadResult ParseSpec(const std::string& text, const std::string& path) {
  SpecLoadResult result;
  Checker c(path);
  int line = 0, col = 0;
  if (std::string err = CheckRawText(text, &line, &col); !err.empty()) {
    result.errors.push_back({path, line, col, err});
    return result;
  }
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {
    int l = e.mark.is_null() ? 0 : e.mark.line + 1;
    int cl = e.mark.is_null() ? 0 : e.mark.column + 1;
    result.errors.push_back(
        {path, l, cl,
         absl::StrCat("YAML nesting is too deep (more than ", e.depth(), " levels); a spec needs only a few")});
    return result;
  } catch (const YAML::Exception& e) {
    int l = e.mark.is_null() ? 0 : e.mark.line + 1;
    int cl = e.mark.is_null() ? 0 : e.mark.column + 1;
    result.errors.push_back({path, l, cl, absl::StrCat("YAML syntax: ", e.msg)});
    return result;
  } catch (const std::exception& e) {
    result.errors.push_back({path, 1, 1, absl::StrCat("YAML could not be read: ", e.what())});
    return result;
  }
  if (!root.IsDefined() || root.IsNull()) {
    result.errors.push_back({path, 1, 1, "the file is empty; a spec is a mapping with 'sites' (a cluster) or 'job'"});
    return result;
  }
  size_t count = 0;
  try {
    if (!WithinNodeBudget(root, &count, 0)) {
      result.errors.push_back({path, 1, 1,
                               absl::StrCat("the document is too large or too deep once aliases are expanded (limit ",
                                            kMaxSpecNodes, " nodes, depth ", kMaxSpecDepth, ")")});
      return result;
    }
  } catch (const std::exception& e) {
    result.errors.push_back({path, 1, 1, absl::StrCat("YAML could not be walked: ", e.what())});
    return result;
  }

  SpecFile spec;
  spec.path = path;
  try {
    if (c.Map(root, "spec",
              {"cluster", "coordinator", "security", "heartbeat", "min_sites", "on_failure", "elastic", "sites",
               "links", "job"})) {
      const bool has_cluster = root["sites"].IsDefined();
      const bool has_job = root["job"].IsDefined();
      if (!has_cluster && !has_job)
        c.Error(root.Mark(), "spec: neither 'sites' (a cluster spec) nor 'job' (a job spec) is present");
      if (has_cluster) {
        ClusterSpec cs;
        c.String(root, "cluster", "spec", true, &cs.name);
        YAML::Node coord = root["coordinator"];
        if (!coord.IsDefined() || coord.IsNull()) {
          c.Error(root.Mark(), "spec: missing required key 'coordinator'");
        } else if (c.Map(coord, "coordinator", {"address", "metrics_port", "metrics_address"})) {
          c.Address(coord, "address", "coordinator", true, &cs.coordinator);
          c.IntAs(coord, "metrics_port", "coordinator", false, 0, 65535, &cs.metrics_port);
          c.String(coord, "metrics_address", "coordinator", false, &cs.metrics_address);
        }
        if (YAML::Node sec = root["security"]; sec.IsDefined() && !sec.IsNull()) {
          if (c.Map(sec, "security", {"certs"})) c.String(sec, "certs", "security", false, &cs.certs_dir);
        }
        if (YAML::Node hb = root["heartbeat"]; hb.IsDefined() && !hb.IsNull()) {
          if (c.Map(hb, "heartbeat", {"interval", "timeout"})) {
            std::optional<double> v;
            c.Quantity(hb, "interval", "heartbeat", false, ParseDuration, &v);
            if (v) cs.heartbeat_interval_seconds = *v;
            v.reset();
            c.Quantity(hb, "timeout", "heartbeat", false, ParseDuration, &v);
            if (v) cs.heartbeat_timeout_seconds = *v;
            if (cs.heartbeat_timeout_seconds <= cs.heartbeat_interval_seconds)
              c.Error(hb.Mark(), "heartbeat: timeout must be longer than interval");
          }
        }
        c.Choice(root, "on_failure", "spec", {OnFailure::kReplan, OnFailure::kWait}, &cs.on_failure);
        if (YAML::Node el = root["elastic"]; el.IsDefined() && !el.IsNull()) {
          if (c.Map(el, "elastic", {"enabled", "min_gain", "drift", "window"})) {
            c.Bool(el, "enabled", "elastic", &cs.elastic.enabled);
            c.Double(el, "min_gain", "elastic", false, 0.0, 0.99, false, &cs.elastic.min_gain);
            c.Double(el, "drift", "elastic", false, 0.0, 10.0, true, &cs.elastic.drift);
            c.IntAs(el, "window", "elastic", false, 1, 10000, &cs.elastic.window);
          }
        }
        ParseSites(c, root["sites"], &cs, path);
        c.IntAs(root, "min_sites", "spec", false, 0, 100000, &cs.min_sites);
        if (cs.min_sites > static_cast<int>(cs.sites.size()))
          c.Error(root["min_sites"].Mark(),
                  absl::StrCat("min_sites: ", cs.min_sites, " is more than the ", cs.sites.size(), " sites defined"));
        if (YAML::Node links = root["links"]; links.IsDefined() && !links.IsNull()) ParseLinks(c, links, &cs);
        for (const auto& s : cs.sites)
          if (s.address.port != 0 && s.address.ToString() == cs.coordinator.ToString())
            c.Error(root["coordinator"].Mark(), absl::StrCat("coordinator.address: ", s.address.ToString(),
                                                             " is also site '", s.name, "''s address"));
        spec.cluster = std::move(cs);
      } else {
        for (const char* k :
             {"cluster", "coordinator", "security", "heartbeat", "links", "min_sites", "on_failure", "elastic"})
          if (root[k].IsDefined())
            c.Error(root[k].Mark(), absl::StrCat("spec: '", k, "' belongs to a cluster spec, which needs 'sites'"));
      }
      if (has_job) {
        JobSpec j;
        ParseJob(c, root["job"], &j);
        spec.job = std::move(j);
      }
    }
  } catch (const std::exception& e) {  // yaml-cpp may throw on odd nodes; never let it escape
    c.Error(root.Mark(), absl::StrCat("spec could not be read: ", e.what()));
  }
  result.errors = std::move(c.errors());
  std::stable_sort(result.errors.begin(), result.errors.end(), [](const Diagnostic& a, const Diagnostic& b) {
    return std::tie(a.line, a.column) < std::tie(b.line, b.column);
  });
  if (result.errors.empty()) result.spec = std::move(spec);
  return result;
}

SpecLoadResult LoadSpecFile(const std::string& path) {
  SpecLoadResult result;
  auto text = ReadFile(path, static_cast<int64_t>(kMaxSpecFileBytes));
  switch (text.status().code()) {
    case absl::StatusCode::kOk:
      return ParseSpec(*text, path);
    case absl::StatusCode::kNotFound:
      result.errors.push_back({path, 0, 0, "cannot open file"});
      break;
    case absl::StatusCode::kFailedPrecondition:
      result.errors.push_back({path, 0, 0, "cannot read file (is it a directory?)"});
      break;
    case absl::StatusCode::kResourceExhausted: {
      std::error_code ec;
      const auto size = std::filesystem::file_size(path, ec);
      result.errors.push_back({path, 1, 1,
                               absl::StrCat("file is ", ec ? "too many" : std::to_string(size),
                                            " bytes; a spec may be at most ", kMaxSpecFileBytes, " bytes")});
      break;
    }
    default:
      result.errors.push_back({path, 0, 0, "cannot read file"});
  }
  return result;
}

std::string ResolveRelative(const std::string& spec_path, const std::string& p) {
  if (p.empty() || p[0] == '/') return p;
  size_t slash = spec_path.rfind('/');
  if (slash == std::string::npos) return p;
  return spec_path.substr(0, slash + 1) + p;
}

int MicroBatchesOf(const JobSpec& job) {
  if (job.micro_batches > 0) return job.micro_batches;
  int m = std::max(1, std::min(job.global_batch, 4));
  while (m > 1 && job.global_batch % m != 0) --m;
  return m;
}

}  // namespace meridian::core
