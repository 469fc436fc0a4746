#include "core/files.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace meridian::core {

absl::StatusOr<std::string> ReadFile(const std::string& path, int64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  struct stat st;
  if (::fstat(fd, &st) != 0 || S_ISDIR(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": cannot read (is it a directory?)"));
  }
  if (max_bytes >= 0 && S_ISREG(st.st_mode) && st.st_size > max_bytes) {
    ::close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat(path, ": ", st.st_size, " bytes, more than the ", max_bytes, " allowed"));
  }
  std::string data;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat(path, ": read failed: ", std::strerror(err)));
    }
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
    if (max_bytes >= 0 && static_cast<int64_t>(data.size()) > max_bytes) {  // a pipe or a growing file
      ::close(fd);
      return absl::ResourceExhaustedError(absl::StrCat(path, ": more than the ", max_bytes, " bytes allowed"));
    }
  }
  ::close(fd);
  return data;
}

absl::Status WriteFileAtomic(const std::string& path, std::string_view data, mode_t mode) {
  // A fresh temporary name beside the file (mkstemp: O_EXCL, unpredictable), never an existing file or link.
  std::string tmp = path + ".tmp.XXXXXX";
  int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0)
    return absl::InternalError(absl::StrCat(path, ": cannot create a temporary file: ", std::strerror(errno)));
  ::fchmod(fd, mode);  // the umask must not widen or narrow what we ask for
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::InternalError(absl::StrCat(tmp, ": write failed: ", std::strerror(err)));
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": cannot flush: ", std::strerror(errno)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": cannot rename into place: ", std::strerror(err)));
  }
  // The rename itself survives a crash only once the directory is synced.
  const std::string dir = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/') + 1);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::Status SyncFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::InternalError(absl::StrCat(path, ": cannot open to sync: ", std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat(path, ": fsync failed: ", std::strerror(err)));
  return absl::OkStatus();
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  if (!ctx_ || EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) != 1) throw std::bad_alloc();
}

Sha256::~Sha256() { EVP_MD_CTX_free(ctx_); }

void Sha256::Update(std::string_view data) { EVP_DigestUpdate(ctx_, data.data(), data.size()); }

std::string Sha256::HexDigest() {
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  EVP_DigestFinal_ex(ctx_, d, &n);
  static const char* digits = "0123456789abcdef";
  std::string hex;
  for (unsigned i = 0; i < n; ++i) hex += digits[d[i] >> 4], hex += digits[d[i] & 15];
  return hex;
}

std::string Sha256Hex(std::string_view data) {
  Sha256 h;
  h.Update(data);
  return h.HexDigest();
}

absl::StatusOr<std::string> Sha256OfFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  Sha256 h;
  std::string buf(size_t{1} << 20, '\0');
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    h.Update(std::string_view(buf.data(), static_cast<size_t>(in.gcount())));
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return h.HexDigest();
}

}  // namespace meridian::core
