// Files written whole or not at all, and SHA-256 digests: what checkpoints, certificates and the run's
// file transfers share. Torch- and gRPC-free; OpenSSL stays out of this header.
#ifndef MERIDIAN_CORE_FILES_H_
#define MERIDIAN_CORE_FILES_H_

#include <sys/types.h>

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX

namespace meridian::core {

// The whole content of the file at `path`. NotFound when it cannot be opened, FailedPrecondition for a
// directory, ResourceExhausted when `max_bytes` >= 0 and the file is larger (checked before reading:
// loaders of untrusted files bound their work), Internal when reading fails; errors name the file.
absl::StatusOr<std::string> ReadFile(const std::string& path, int64_t max_bytes = -1);

// Writes `data` to `path` through a temporary file beside it, fsync and rename, with `mode`: a crash
// leaves the old file or the whole new one. Errors name the file.
absl::Status WriteFileAtomic(const std::string& path, std::string_view data, mode_t mode = 0644);

// Flushes the file at `path` to its device (before it is renamed into place). Errors name the file.
absl::Status SyncFile(const std::string& path);

// SHA-256 over data given in pieces. Thread-compatible.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(std::string_view data);
  // The digest of everything given, as 64 lowercase hex digits. Call once.
  std::string HexDigest();

 private:
  evp_md_ctx_st* ctx_;
};

// The SHA-256 of `data`, or of the file at `path` (read in pieces), as 64 lowercase hex digits.
std::string Sha256Hex(std::string_view data);
absl::StatusOr<std::string> Sha256OfFile(const std::string& path);

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_FILES_H_
