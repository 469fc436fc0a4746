// The cluster's certificates: a CA, and for the coordinator and each site a key and a certificate
// signed by it (CN = site name, subjectAltName = the host of its address plus DNS:<name>).
// Uses the OpenSSL 3 API directly. Thread-compatible: each call works on its own objects and files.
#ifndef MERIDIAN_CORE_CERTS_H_
#define MERIDIAN_CORE_CERTS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/cluster_spec.h"

namespace meridian::core {

struct CertOptions {
  bool force = false;  // overwrite existing keys and certificates
  int ca_validity_days = 3650;
  int leaf_validity_days = 825;
};

// Name used for the coordinator's certificate (CN and file stem).
inline constexpr char kCoordinatorName[] = "coordinator";

// Creates DIR/ca.pem, DIR/ca.key and DIR/NAME.{pem,key} for the coordinator and every site of `spec`, and
// for every site its bundle DIR/bundles/SITE/ holding ca.pem, SITE.pem and SITE.key and nothing else: the
// directory that goes to that site. Keys are written with mode 0600, atomically. Errors: AlreadyExists when a key
// exists and !force (nothing is written then), or the failing file and OpenSSL's reason. `written` lists created files.
absl::Status InitClusterCerts(const ClusterSpec& spec, const std::string& dir, const CertOptions& options,
                              std::vector<std::string>* written);

// Signs a key and certificate for one more site with the CA in `ca_dir` (ca.pem + ca.key), and writes its
// bundle ca_dir/bundles/NAME/.
absl::Status IssueSiteCert(const std::string& ca_dir, const std::string& name, const std::string& host,
                           const CertOptions& options, std::vector<std::string>* written);

// Reads the CN of the first certificate in a PEM file.
absl::StatusOr<std::string> CertificateCommonName(const std::string& pem_path);

// Checks the identity files a process presents: DIR/ca.pem, DIR/NAME.pem and DIR/NAME.key exist, the key
// matches the certificate, the certificate verifies against the CA and its CN is `name`.
// Errors name the file and what is wrong with it (FailedPrecondition / NotFound / InvalidArgument).
absl::Status CheckIdentityFiles(const std::string& dir, const std::string& name);

// DIR/bundles/SITE: where InitClusterCerts and IssueSiteCert put the files for `site`.
std::string SiteBundleDir(const std::string& certs_dir, const std::string& site);

// What an executor checks of the directory it was given: CheckIdentityFiles(dir, site), and that the
// directory holds no ca.key and no private key but SITE.key (FailedPrecondition naming the file), so that a
// compromised site holds its own identity only.
absl::Status CheckSiteBundle(const std::string& dir, const std::string& site);

}  // namespace meridian::core

#endif  // MERIDIAN_CORE_CERTS_H_
