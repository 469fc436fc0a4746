#include "compression/activation_delta.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace meridian::compression {
namespace {

constexpr uint8_t kMagic[4] = {'M', 'R', 'A', 'D'};
constexpr uint8_t kVersion = 1;
constexpr size_t kHeader = 4 + 4 + 4 + 8;
constexpr size_t kRowHeader = 8 + 4 + 4 + 8;
enum Mode : uint8_t { kFresh = 0, kDelta = 1, kDirect = 2 };

template <typename T>
void Append(std::vector<uint8_t>* out, T v) {
  const size_t at = out->size();
  out->resize(at + sizeof v);
  std::memcpy(out->data() + at, &v, sizeof v);
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

absl::Status Bad(const std::string& what) { return absl::DataLossError(absl::StrCat("bad activation delta: ", what)); }

// Writes `n` bytes at `offset` of `fd`, or reads them; errors name the file.
absl::Status FullIo(bool write, int fd, void* buf, size_t n, off_t offset, const std::string& path) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = write ? ::pwrite(fd, p, n, offset) : ::pread(fd, p, n, offset);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return absl::InternalError(absl::StrCat("activation spill file ", path, ": ", write ? "write" : "read",
                                              " failed: ", r < 0 ? std::strerror(errno) : "short read"));
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
  return absl::OkStatus();
}

}  // namespace

std::string GradientCodecBehind(const std::string& activation_codec) {
  if (activation_codec.find("-delta") == std::string::npos) return activation_codec;
  return activation_codec.rfind("int8", 0) == 0 ? "int8" : "int4";
}

// ---- ActivationStore ----

ActivationStore::ActivationStore(Options options, int64_t row_elements)
    : o_(std::move(options)), row_elements_(row_elements) {}

ActivationStore::~ActivationStore() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(o_.spill_path.c_str());
  }
}

uint32_t ActivationStore::Version(int64_t id) const {
  auto it = slots_.find(id);
  return it == slots_.end() ? 0 : it->second.version;
}

absl::Status ActivationStore::Read(int64_t id, float* out) const {
  auto it = slots_.find(id);
  if (it == slots_.end()) return absl::NotFoundError(absl::StrCat("no stored activation for sequence ", id));
  const size_t bytes = static_cast<size_t>(row_elements_) * sizeof(float);
  if (it->second.in_memory) {
    std::memcpy(out, memory_[static_cast<size_t>(it->second.index)].data(), bytes);
    return absl::OkStatus();
  }
  return FullIo(false, fd_, out, bytes, static_cast<off_t>(it->second.index * static_cast<int64_t>(bytes)),
                o_.spill_path);
}

absl::StatusOr<bool> ActivationStore::Write(int64_t id, uint32_t version, const float* row) {
  const int64_t bytes = row_elements_ * static_cast<int64_t>(sizeof(float));
  auto it = slots_.find(id);
  if (it == slots_.end()) {
    Slot slot{true, 0, version};
    if ((memory_rows() + 1) * bytes <= o_.memory_bytes) {
      slot.index = memory_rows();
      memory_.emplace_back(static_cast<size_t>(row_elements_));
    } else if (!o_.spill_path.empty() && (spilled_ + 1) * bytes <= o_.spill_bytes) {
      if (fd_ < 0) {
        fd_ = ::open(o_.spill_path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd_ < 0)
          return absl::InternalError(
              absl::StrCat("activation spill file ", o_.spill_path, ": cannot create: ", std::strerror(errno)));
      }
      slot.in_memory = false;
      slot.index = spilled_++;
    } else {
      return false;
    }
    it = slots_.emplace(id, slot).first;
  }
  it->second.version = version;
  if (it->second.in_memory) {
    std::memcpy(memory_[static_cast<size_t>(it->second.index)].data(), row, static_cast<size_t>(bytes));
    return true;
  }
  absl::Status s = FullIo(true, fd_, const_cast<float*>(row), static_cast<size_t>(bytes),
                          static_cast<off_t>(it->second.index * bytes), o_.spill_path);
  if (!s.ok()) return s;
  return true;
}

// ---- DeltaEncoder ----

DeltaEncoder::DeltaEncoder(CodecSpec spec, ActivationStore::Options store)
    : delta_(spec), first_(spec), store_options_(std::move(store)) {
  delta_.delta = false;
  first_.delta = false;
  first_.kind = CodecKind::kInt8;
}

absl::StatusOr<std::vector<uint8_t>> DeltaEncoder::Encode(const core::TensorView& x, const std::vector<int64_t>& ids) {
  if (x.dtype != core::DType::kFloat32) return absl::InvalidArgumentError("activation deltas need a float32 tensor");
  if (x.shape.empty() || x.shape[0] != static_cast<int64_t>(ids.size()))
    return absl::InvalidArgumentError(absl::StrCat("activation deltas: ", ids.size(), " sequence ids for a tensor of ",
                                                   x.shape.empty() ? 0 : x.shape[0], " rows"));
  const int64_t rows = x.shape[0];
  const int64_t row_elements = rows ? x.numel() / rows : 0;
  if (!store_) store_ = std::make_unique<ActivationStore>(store_options_, row_elements);
  if (store_->row_elements() != row_elements)
    return absl::InvalidArgumentError(
        absl::StrCat("activation deltas: rows of ", row_elements, " elements after rows of ", store_->row_elements()));
  const float* in = static_cast<const float*>(x.data);
  std::vector<uint8_t> msg;
  msg.insert(msg.end(), kMagic, kMagic + 4);
  Append<uint8_t>(&msg, kVersion);
  msg.insert(msg.end(), 3, 0);
  Append<uint32_t>(&msg, static_cast<uint32_t>(rows));
  Append<uint64_t>(&msg, static_cast<uint64_t>(row_elements));
  std::vector<float> base(static_cast<size_t>(row_elements)), change(static_cast<size_t>(row_elements)),
      back(static_cast<size_t>(row_elements));
  struct Staged {
    int64_t id;
    uint32_t version;  // the row's version once stored
    std::vector<float> row;
    Mode mode;
    std::vector<uint8_t> frame;
  };
  std::vector<Staged> staged;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < r; ++j)
      if (ids[j] == ids[r])
        return absl::InvalidArgumentError(absl::StrCat("activation deltas: sequence ", ids[r], " twice in one tensor"));
    const float* row = in + r * row_elements;
    const uint32_t version = store_->Version(ids[r]);
    const Mode mode = version > 0 ? kDelta : kFresh;
    // A revisit sends its change against the stored base, a first visit the row itself; the receiver's
    // reconstruction is what decodes, plus the base.
    const float* send = row;
    if (mode == kDelta) {
      if (absl::Status s = store_->Read(ids[r], base.data()); !s.ok()) return s;
      for (int64_t i = 0; i < row_elements; ++i) change[i] = row[i] - base[i];
      send = change.data();
    }
    std::vector<uint8_t> frame;
    if (absl::Status s =
            EncodeTo({core::DType::kFloat32, {row_elements}, send}, mode == kDelta ? delta_ : first_, &frame);
        !s.ok())
      return absl::InvalidArgumentError(absl::StrCat("sequence ", ids[r], ": ", s.message()));
    if (absl::Status s = DecodeInto(frame.data(), frame.size(), core::DType::kFloat32, {row_elements}, back.data());
        !s.ok())
      return s;
    if (mode == kDelta)
      for (int64_t i = 0; i < row_elements; ++i) back[i] += base[i];
    staged.push_back({ids[r], version + 1, back, mode, std::move(frame)});
  }
  // Every row encoded: only now do the reconstructions change, so a failed message leaves the two
  // sides as they were. A new sequence that finds the store full goes direct (mode 2).
  for (size_t r = 0; r < staged.size(); ++r) {
    Staged& st = staged[r];
    auto stored = store_->Write(st.id, st.version, st.row.data());
    if (!stored.ok()) return stored.status();
    if (!*stored) st.mode = kDirect;
    (st.mode == kFresh ? stats_.fresh_rows : st.mode == kDelta ? stats_.delta_rows : stats_.direct_rows)++;
    Append<int64_t>(&msg, st.id);
    Append<uint8_t>(&msg, st.mode);
    msg.insert(msg.end(), 3, 0);
    Append<uint32_t>(&msg, st.mode == kDelta ? st.version - 1 : 0);
    Append<uint64_t>(&msg, st.frame.size());
    msg.insert(msg.end(), st.frame.begin(), st.frame.end());
  }
  return compression::Encode({core::DType::kUInt8, {static_cast<int64_t>(msg.size())}, msg.data()}, CodecSpec{});
}

absl::Status DeltaEncoder::Reconstruction(int64_t id, std::vector<float>* out) const {
  if (!store_ || store_->Version(id) == 0) return absl::NotFoundError(absl::StrCat("sequence ", id, " was not stored"));
  out->resize(static_cast<size_t>(store_->row_elements()));
  return store_->Read(id, out->data());
}

// ---- DeltaDecoder ----

DeltaDecoder::DeltaDecoder(ActivationStore::Options store) : store_options_(std::move(store)) {}

absl::Status DeltaDecoder::DecodeInto(const uint8_t* frame, size_t size, const std::vector<int64_t>& ids,
                                      const std::vector<int64_t>& shape, float* out) {
  // What the receiver expects comes first: the message must fit it, whatever it claims.
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (ids.empty() || shape.empty() || shape[0] != static_cast<int64_t>(ids.size()) ||
      numel % static_cast<int64_t>(ids.size()) != 0)
    return absl::InvalidArgumentError("activation deltas: the expected shape and sequence ids disagree");
  const uint64_t expected_row = static_cast<uint64_t>(numel / static_cast<int64_t>(ids.size()));
  // The largest message those rows can make (int8 inner frames, the largest codec used), so a frame
  // cannot make the decoder allocate more; zstd is never used on the outer frame.
  auto info = InspectFrame(frame, size);
  if (!info.ok()) return info.status();
  if (info->dtype != core::DType::kUInt8 || info->spec.kind != CodecKind::kIdentity || info->spec.zstd)
    return Bad("not a plain byte frame (was the sender's codec a delta codec?)");
  const uint64_t max_inner = 64 + 8 * expected_row + 4 * (expected_row / 2 + 1);
  const uint64_t max_bytes = kHeader + ids.size() * (kRowHeader + max_inner);
  if (info->frame_bytes > max_bytes + 128)
    return absl::InvalidArgumentError(absl::StrCat("activation deltas: a message of ", info->frame_bytes, " bytes for ",
                                                   ids.size(), " rows of ", expected_row, " elements"));
  auto outer = Decode(frame, size, DecodeLimits{static_cast<int64_t>(max_bytes)});
  if (!outer.ok()) return outer.status();
  const uint8_t* p = outer->bytes.data();
  const size_t n = outer->bytes.size();
  if (n < kHeader || std::memcmp(p, kMagic, 4) != 0)
    return Bad("no MRAD header (was the sender's codec a delta codec?)");
  if (p[4] != kVersion) return Bad(absl::StrCat("version ", p[4]));
  if (p[5] || p[6] || p[7]) return Bad("reserved bytes are not zero");
  const uint32_t rows = Get<uint32_t>(p + 8);
  const uint64_t row_elements = Get<uint64_t>(p + 12);
  if (rows != ids.size() || row_elements != expected_row)
    return absl::InvalidArgumentError(absl::StrCat("activation deltas: the message carries ", rows, " rows of ",
                                                   row_elements, " elements; expected ", ids.size(), " of ",
                                                   expected_row));
  if (!store_) store_ = std::make_unique<ActivationStore>(store_options_, static_cast<int64_t>(row_elements));
  if (store_->row_elements() != static_cast<int64_t>(row_elements))
    return absl::InvalidArgumentError("activation deltas: the row size changed within a stream");
  std::vector<float> base(static_cast<size_t>(row_elements));
  size_t at = kHeader;
  for (uint32_t r = 0; r < rows; ++r) {
    if (n - at < kRowHeader) return Bad("truncated row header");
    const int64_t id = Get<int64_t>(p + at);
    const uint8_t mode = p[at + 8];
    const uint32_t base_version = Get<uint32_t>(p + at + 12);
    const uint64_t inner = Get<uint64_t>(p + at + 16);
    at += kRowHeader;
    if (p[at - 15] || p[at - 14] || p[at - 13]) return Bad("reserved bytes are not zero");
    if (inner > n - at) return Bad("truncated row");
    if (id != ids[r])
      return absl::InvalidArgumentError(absl::StrCat("activation deltas: row ", r, " carries sequence ", id,
                                                     " where sequence ", ids[r], " was expected"));
    float* row = out + static_cast<int64_t>(r) * static_cast<int64_t>(row_elements);
    if (absl::Status s =
            compression::DecodeInto(p + at, inner, core::DType::kFloat32, {static_cast<int64_t>(row_elements)}, row);
        !s.ok())
      return absl::DataLossError(absl::StrCat("sequence ", id, ": ", s.message()));
    at += inner;
    const uint32_t have = store_->Version(id);
    if (mode == kDelta) {
      if (have != base_version || have == 0)
        return absl::DataLossError(absl::StrCat("sequence ", id, ": a delta against version ", base_version,
                                                " of its activation, but this receiver holds ",
                                                have == 0 ? std::string("none") : absl::StrCat("version ", have),
                                                " (a message was lost, or one side restarted)"));
      if (absl::Status s = store_->Read(id, base.data()); !s.ok()) return s;
      for (uint64_t i = 0; i < row_elements; ++i) row[i] += base[i];
    } else if (mode != kFresh && mode != kDirect) {
      return Bad(absl::StrCat("sequence ", id, ": mode ", static_cast<int>(mode)));
    }
    if (mode != kDirect) {
      auto stored = store_->Write(id, mode == kDelta ? base_version + 1 : 1, row);
      if (!stored.ok()) return stored.status();
      if (!*stored)
        return absl::ResourceExhaustedError(
            absl::StrCat("sequence ", id,
                         ": the sender stored it but this receiver's activation store is full (the two sides' "
                         "compression.activation_memory differ?)"));
    }
  }
  if (at != n) return Bad("trailing bytes");
  return absl::OkStatus();
}

}  // namespace meridian::compression
