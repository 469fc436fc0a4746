#include "core/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace meridian::core {
namespace {

using json = nlohmann::json;

bool DTypeFromName(const std::string& s, DType* t) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F32", DType::kFloat32}, {"F16", DType::kFloat16}, {"BF16", DType::kBFloat16}, {"I8", DType::kInt8},
      {"I32", DType::kInt32},   {"I64", DType::kInt64},   {"U8", DType::kUInt8}};
  for (auto [n, d] : kNames)
    if (s == n) {
      *t = d;
      return true;
    }
  return false;
}

absl::Status Bad(const std::string& path, const std::string& msg) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", msg));
}

}  // namespace

const char* SafetensorsDType(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "F32";
    case DType::kFloat16:
      return "F16";
    case DType::kBFloat16:
      return "BF16";
    case DType::kInt8:
      return "I8";
    case DType::kInt32:
      return "I32";
    case DType::kInt64:
      return "I64";
    case DType::kUInt8:
      return "U8";
  }
  return "?";
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes, const std::string& path) {
  if (bytes.size() < 8) return Bad(path, "truncated: no header length");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > kMaxSafetensorsHeaderBytes)
    return Bad(path, absl::StrCat("header of ", n, " bytes exceeds the ", kMaxSafetensorsHeaderBytes, "-byte limit"));
  if (n > bytes.size() - 8)
    return Bad(path, absl::StrCat("truncated: header of ", n, " bytes, file of ", bytes.size()));
  json h = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n), nullptr, false);
  if (h.is_discarded() || !h.is_object()) return Bad(path, "header is not a JSON object");
  const uint64_t data_size = bytes.size() - 8 - n;
  const char* data = bytes.data() + 8 + n;
  SafetensorsFile f;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return Bad(path, "__metadata__ must be an object of strings");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) return Bad(path, absl::StrCat("__metadata__.", m.key(), " must be a string"));
        f.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const std::string& name = it.key();
    const json& e = *it;
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      return Bad(path, absl::StrCat("tensor '", name, "' needs dtype, shape and data_offsets"));
    Tensor t;
    if (!e["dtype"].is_string() || !DTypeFromName(e["dtype"].get<std::string>(), &t.dtype))
      return Bad(path, absl::StrCat("tensor '", name, "' has an unsupported dtype ", e["dtype"].dump()));
    if (!e["shape"].is_array() || e["shape"].size() > 16) return Bad(path, absl::StrCat("tensor '", name, "' shape"));
    uint64_t numel = 1;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned()) return Bad(path, absl::StrCat("tensor '", name, "' has a bad dimension"));
      uint64_t v = d.get<uint64_t>();
      // A dimension must fit int64 (shapes are int64 everywhere); with a zero elsewhere in the shape the
      // size check below cannot catch it.
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return Bad(path, absl::StrCat("tensor '", name, "' has dimension ", v, ", out of range"));
      if (v != 0 && numel > data_size / v)
        return Bad(path, absl::StrCat("tensor '", name, "' is larger than the file"));
      numel *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      return Bad(path, absl::StrCat("tensor '", name, "' data_offsets must be [begin, end]"));
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (b > en || en > data_size)
      return Bad(path, absl::StrCat("tensor '", name, "' offsets [", b, ", ", en, ") are outside the ", data_size,
                                    "-byte data section"));
    if (en - b != numel * DTypeSize(t.dtype))
      return Bad(path, absl::StrCat("tensor '", name, "' holds ", en - b, " bytes but its dtype and shape need ",
                                    numel * DTypeSize(t.dtype)));
    ranges.push_back({b, en});
    t.bytes.assign(data + b, data + en);
    f.tensors[name] = std::move(t);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t pos = 0;
  for (auto [b, e] : ranges) {
    if (b < pos) return Bad(path, absl::StrCat("tensors overlap at byte ", b));
    if (b > pos) return Bad(path, absl::StrCat("bytes [", pos, ", ", b, ") belong to no tensor"));
    pos = e;
  }
  if (pos != data_size) return Bad(path, absl::StrCat("bytes [", pos, ", ", data_size, ") belong to no tensor"));
  return f;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseSafetensors(ss.str(), path);
}

std::string SerializeSafetensors(const SafetensorsFile& f) {
  json h = json::object();
  uint64_t off = 0;
  for (const auto& [name, t] : f.tensors) {
    h[name] = {{"dtype", SafetensorsDType(t.dtype)}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  if (!f.metadata.empty()) h["__metadata__"] = f.metadata;
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  std::string out(8, '\0');
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  out += header;
  out.reserve(out.size() + off);
  for (const auto& [name, t] : f.tensors) out.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const SafetensorsFile& file) {
  std::string data = SerializeSafetensors(file);
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat(tmp, ": cannot create: ", std::strerror(errno)));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::InternalError(absl::StrCat(tmp, ": write failed: ", std::strerror(errno)));
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": cannot write: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace meridian::core
