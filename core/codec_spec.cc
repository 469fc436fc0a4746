#include "core/codec_spec.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace meridian::core {
namespace {

// The codecs' names, the one table Parse reads and ToString/ShortString write.
struct CodecName {
  const char* name;
  CodecKind kind;
  bool topk_int8_values;
};
constexpr CodecName kCodecNames[] = {
    {"identity", CodecKind::kIdentity, false}, {"fp16", CodecKind::kFp16, false},     {"bf16", CodecKind::kBf16, false},
    {"int8", CodecKind::kInt8, false},         {"int4", CodecKind::kInt4, false},     {"int2", CodecKind::kInt2, false},
    {"topk", CodecKind::kTopK, false},         {"topk-int8", CodecKind::kTopK, true},
};

}  // namespace

absl::Status CodecSpec::Check() const {
  if (static_cast<uint8_t>(kind) > static_cast<uint8_t>(CodecKind::kInt2))
    return absl::InvalidArgumentError("unknown codec");
  if (delta && kind != CodecKind::kInt8 && kind != CodecKind::kInt4 && kind != CodecKind::kInt2)
    return absl::InvalidArgumentError(
        "only int8, int4 and int2 have delta variants (int8-delta, int4-delta, int2-delta)");
  if (block_size < 2 || block_size > 65536 || block_size % 2)
    return absl::InvalidArgumentError(absl::StrCat("block size ", block_size, " must be even and in [2, 65536]"));
  if (!(topk_fraction > 0 && topk_fraction <= 1) || topk_fraction < kMinTopkFraction)
    return absl::InvalidArgumentError(absl::StrCat("top-k fraction ", topk_fraction, " must be in [1e-5, 1]"));
  if (zstd_level < -5 || zstd_level > 19) return absl::InvalidArgumentError("zstd level must be in [-5, 19]");
  if (topk_chunk < 0) return absl::InvalidArgumentError("top-k chunk must be a count of elements in [1, 2^30]");
  if (topk_chunk > 0 && kind != CodecKind::kTopK)
    return absl::InvalidArgumentError("the chunk option is for the top-k codecs (topk, topk-int8)");
  return absl::OkStatus();
}

absl::StatusOr<CodecSpec> CodecSpec::Parse(const std::string& text) {
  CodecSpec s;
  std::string t = text;
  if (t.size() > 5 && t.compare(t.size() - 5, 5, "+zstd") == 0) {
    s.zstd = true;
    t.resize(t.size() - 5);
  }
  std::string name = t.substr(0, t.find(':'));
  if (name.size() > 6 && name.compare(name.size() - 6, 6, "-delta") == 0) {
    s.delta = true;
    name.resize(name.size() - 6);
    if (name != "int8" && name != "int4" && name != "int2")
      return absl::InvalidArgumentError(
          absl::StrCat("unknown codec '", name, "-delta'; delta codecs are int8-delta, int4-delta and int2-delta"));
  }
  if (name == "none") name = "identity";  // an alias
  const CodecName* known = nullptr;
  for (const CodecName& n : kCodecNames)
    if (name == n.name) known = &n;
  if (!known)
    return absl::InvalidArgumentError(
        absl::StrCat("unknown codec '", name,
                     "'; use identity, fp16, bf16, int8, int4, int2, topk, topk-int8 or int8/int4/int2-delta"));
  s.kind = known->kind;
  s.topk_int8_values = known->topk_int8_values;
  size_t pos = t.find(':');
  while (pos != std::string::npos) {
    size_t next = t.find(':', pos + 1);
    std::string opt = t.substr(pos + 1, next == std::string::npos ? std::string::npos : next - pos - 1);
    size_t eq = opt.find('=');
    std::string key = opt.substr(0, eq), val = eq == std::string::npos ? "" : opt.substr(eq + 1);
    char* end = nullptr;
    double v = std::strtod(val.c_str(), &end);
    if (val.empty() || *end) return absl::InvalidArgumentError(absl::StrCat("codec option '", opt, "' needs a number"));
    if (key == "block")
      s.block_size = static_cast<int>(v);
    else if (key == "k")
      s.topk_fraction = v;
    else if (key == "level")
      s.zstd_level = static_cast<int>(v);
    else if (key == "chunk")
      s.topk_chunk = v < 1 || v > (1 << 30) ? -1 : static_cast<int>(v);
    else
      return absl::InvalidArgumentError(absl::StrCat("unknown codec option '", key, "' (block, k, chunk, level)"));
    pos = next;
  }
  absl::Status st = s.Check();
  if (!st.ok()) return st;
  return s;
}

namespace {

// The codec's name without options: "int8", "int4-delta", "topk-int8".
std::string BaseName(const CodecSpec& spec) {
  std::string s;
  for (const CodecName& n : kCodecNames)
    if (n.kind == spec.kind && n.topk_int8_values == (spec.kind == CodecKind::kTopK && spec.topk_int8_values))
      s = n.name;
  if (spec.delta) s += "-delta";
  return s;
}

bool Blocked(const CodecSpec& spec) {
  return spec.kind == CodecKind::kInt8 || spec.kind == CodecKind::kInt4 || spec.kind == CodecKind::kInt2 ||
         (spec.kind == CodecKind::kTopK && spec.topk_int8_values);
}

// The options after the name; with `all`, every one, else only those that differ from the defaults.
std::string Options(const CodecSpec& spec, bool all) {
  const CodecSpec defaults;
  std::string s;
  if (spec.kind == CodecKind::kTopK && (all || spec.topk_fraction != defaults.topk_fraction))
    absl::StrAppend(&s, ":k=", spec.topk_fraction);
  if (Blocked(spec) && (all || spec.block_size != defaults.block_size)) absl::StrAppend(&s, ":block=", spec.block_size);
  if (spec.topk_chunk > 0) absl::StrAppend(&s, ":chunk=", spec.topk_chunk);
  if (spec.zstd) s += "+zstd";
  return s;
}

}  // namespace

std::string CodecSpec::ToString() const { return BaseName(*this) + Options(*this, /*all=*/true); }

std::string CodecSpec::ShortString() const { return BaseName(*this) + Options(*this, /*all=*/false); }

}  // namespace meridian::core
