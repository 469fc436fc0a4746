#include "core/certs.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/files.h"
#include "core/status.h"

namespace meridian::core {
namespace {

struct PkeyFree {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
struct X509Free {
  void operator()(X509* p) const { X509_free(p); }
};
struct BioFree {
  void operator()(BIO* p) const { BIO_free(p); }
};
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using BioPtr = std::unique_ptr<BIO, BioFree>;

std::string OpenSslError(const std::string& what) {
  std::string msg = what;
  unsigned long e;
  while ((e = ERR_get_error()) != 0) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    msg += absl::StrCat("; ", buf);
  }
  return msg;
}

bool FileExists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

std::string BioToString(BIO* bio) {
  char* p = nullptr;
  long n = BIO_get_mem_data(bio, &p);
  return std::string(p, static_cast<size_t>(n));
}

absl::StatusOr<PkeyPtr> NewKey() {
  PkeyPtr key(EVP_EC_gen("P-256"));
  if (!key) return absl::InternalError(OpenSslError("cannot generate a P-256 key"));
  return key;
}

absl::Status AddExt(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (!ext) return absl::InternalError(OpenSslError(absl::StrCat("bad certificate extension '", value, "'")));
  int ok = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  if (!ok) return absl::InternalError(OpenSslError("cannot add certificate extension"));
  return absl::OkStatus();
}

bool IsIpLiteral(const std::string& host) {
  ASN1_OCTET_STRING* ip = a2i_IPADDRESS(host.c_str());
  if (!ip) return false;
  ASN1_OCTET_STRING_free(ip);
  return true;
}

// Builds a certificate for `key` with subject CN=`cn`, signed by (issuer, issuer_key); self-signed when
// issuer is null. `san_host` empty means no subjectAltName (the CA).
absl::StatusOr<X509Ptr> MakeCert(EVP_PKEY* key, const std::string& cn, X509* issuer, EVP_PKEY* issuer_key, bool is_ca,
                                 const std::string& san_host, int days) {
  X509Ptr cert(X509_new());
  if (!cert) return absl::InternalError(OpenSslError("X509_new"));
  X509_set_version(cert.get(), 2);
  unsigned char serial_bytes[16];
  if (RAND_bytes(serial_bytes, sizeof serial_bytes) != 1) return absl::InternalError(OpenSslError("RAND_bytes"));
  serial_bytes[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial_bytes, sizeof serial_bytes, nullptr);
  BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get()));
  BN_free(bn);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -300);  // tolerate small clock skew
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(days) * 86400);
  X509_set_pubkey(cert.get(), key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("Meridian"), -1, -1, 0);
  if (X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8, reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1,
                                 0) != 1)
    return absl::InvalidArgumentError(OpenSslError(absl::StrCat("bad common name '", cn, "'")));
  X509* signer = issuer ? issuer : cert.get();
  X509_set_issuer_name(cert.get(), X509_get_subject_name(signer));
  if (is_ca) {
    MERIDIAN_RETURN_IF_ERROR(AddExt(cert.get(), signer, NID_basic_constraints, "critical,CA:TRUE,pathlen:0"));
    MERIDIAN_RETURN_IF_ERROR(AddExt(cert.get(), signer, NID_key_usage, "critical,keyCertSign,cRLSign"));
  } else {
    MERIDIAN_RETURN_IF_ERROR(AddExt(cert.get(), signer, NID_basic_constraints, "critical,CA:FALSE"));
    MERIDIAN_RETURN_IF_ERROR(AddExt(cert.get(), signer, NID_key_usage, "critical,digitalSignature,keyAgreement"));
    MERIDIAN_RETURN_IF_ERROR(AddExt(cert.get(), signer, NID_ext_key_usage, "serverAuth,clientAuth"));
    std::string san = IsIpLiteral(san_host) ? absl::StrCat("IP:", san_host) : absl::StrCat("DNS:", san_host);
    if (san_host != cn) san += absl::StrCat(",DNS:", cn);  // lets peers verify by site name too
    MERIDIAN_RETURN_IF_ERROR(AddExt(cert.get(), signer, NID_subject_alt_name, san));
  }
  MERIDIAN_RETURN_IF_ERROR(AddExt(cert.get(), signer, NID_subject_key_identifier, "hash"));
  if (issuer) MERIDIAN_RETURN_IF_ERROR(AddExt(cert.get(), signer, NID_authority_key_identifier, "keyid:always"));
  if (X509_sign(cert.get(), issuer_key ? issuer_key : key, EVP_sha256()) <= 0)
    return absl::InternalError(OpenSslError(absl::StrCat("cannot sign the certificate for ", cn)));
  return cert;
}

std::string KeyPem(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr);
  return BioToString(bio.get());
}

std::string CertPem(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  PEM_write_bio_X509(bio.get(), cert);
  return BioToString(bio.get());
}

absl::Status EnsureDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create directory: ", ec.message()));
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return absl::InvalidArgumentError(absl::StrCat(dir, ": is not a directory"));
  return absl::OkStatus();
}

struct Leaf {
  std::string name, host;
  bool bundle = true;  // also write bundles/NAME/ (every site; not the coordinator)
};

absl::Status WriteLeaves(const std::string& dir, X509* ca, EVP_PKEY* ca_key, const std::vector<Leaf>& leaves,
                         const CertOptions& o, std::vector<std::string>* written) {
  for (const Leaf& leaf : leaves) {
    MERIDIAN_ASSIGN_OR_RETURN(PkeyPtr key, NewKey());
    MERIDIAN_ASSIGN_OR_RETURN(X509Ptr cert,
                              MakeCert(key.get(), leaf.name, ca, ca_key, false, leaf.host, o.leaf_validity_days));
    std::string base = absl::StrCat(dir, "/", leaf.name);
    MERIDIAN_RETURN_IF_ERROR(WriteFileAtomic(base + ".key", KeyPem(key.get()), 0600));
    MERIDIAN_RETURN_IF_ERROR(WriteFileAtomic(base + ".pem", CertPem(cert.get()), 0644));
    written->push_back(base + ".pem");
    written->push_back(base + ".key");
    if (!leaf.bundle) continue;
    // The site's bundle: what that site needs and nothing more (no CA key, no other site's key).
    const std::string bundle = SiteBundleDir(dir, leaf.name);
    MERIDIAN_RETURN_IF_ERROR(EnsureDir(bundle));
    ::chmod(bundle.c_str(), 0700);
    const std::string bbase = absl::StrCat(bundle, "/", leaf.name);
    MERIDIAN_RETURN_IF_ERROR(WriteFileAtomic(bundle + "/ca.pem", CertPem(ca), 0644));
    MERIDIAN_RETURN_IF_ERROR(WriteFileAtomic(bbase + ".key", KeyPem(key.get()), 0600));
    MERIDIAN_RETURN_IF_ERROR(WriteFileAtomic(bbase + ".pem", CertPem(cert.get()), 0644));
    written->push_back(bundle + "/ca.pem");
    written->push_back(bbase + ".pem");
    written->push_back(bbase + ".key");
  }
  return absl::OkStatus();
}

absl::Status RefuseOverwrite(const std::vector<std::string>& paths, const CertOptions& o) {
  if (o.force) return absl::OkStatus();
  for (const auto& p : paths)
    if (FileExists(p))
      return absl::AlreadyExistsError(absl::StrCat(p, " already exists; pass --force to replace the keys"));
  return absl::OkStatus();
}

}  // namespace

absl::Status InitClusterCerts(const ClusterSpec& spec, const std::string& dir, const CertOptions& o,
                              std::vector<std::string>* written) {
  std::vector<Leaf> leaves = {{kCoordinatorName, spec.coordinator.host, false}};
  for (const auto& s : spec.sites) leaves.push_back({s.name, s.address.host, true});
  std::vector<std::string> targets = {dir + "/ca.pem", dir + "/ca.key"};
  for (const auto& l : leaves) {
    targets.push_back(absl::StrCat(dir, "/", l.name, ".pem"));
    targets.push_back(absl::StrCat(dir, "/", l.name, ".key"));
    if (l.bundle) targets.push_back(absl::StrCat(SiteBundleDir(dir, l.name), "/", l.name, ".key"));
  }
  MERIDIAN_RETURN_IF_ERROR(RefuseOverwrite(targets, o));
  MERIDIAN_RETURN_IF_ERROR(EnsureDir(dir));
  MERIDIAN_ASSIGN_OR_RETURN(PkeyPtr ca_key, NewKey());
  MERIDIAN_ASSIGN_OR_RETURN(X509Ptr ca, MakeCert(ca_key.get(), absl::StrCat("Meridian CA ", spec.name), nullptr,
                                                 nullptr, true, "", o.ca_validity_days));
  MERIDIAN_RETURN_IF_ERROR(WriteFileAtomic(dir + "/ca.key", KeyPem(ca_key.get()), 0600));
  MERIDIAN_RETURN_IF_ERROR(WriteFileAtomic(dir + "/ca.pem", CertPem(ca.get()), 0644));
  written->push_back(dir + "/ca.pem");
  written->push_back(dir + "/ca.key");
  return WriteLeaves(dir, ca.get(), ca_key.get(), leaves, o, written);
}

absl::Status IssueSiteCert(const std::string& ca_dir, const std::string& name, const std::string& host,
                           const CertOptions& o, std::vector<std::string>* written) {
  Endpoint ep;
  std::string err;
  if (!ParseEndpoint(host + ":1", &ep, &err)) return absl::InvalidArgumentError(absl::StrCat("--host: ", err));
  if (name.empty() || name.size() > 63 ||
      name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_") != std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat("--site: '", name, "' is not a valid site name"));
  if (name == kCoordinatorName)
    return absl::InvalidArgumentError(absl::StrCat("--site: '", name, "' is the coordinator's name"));
  MERIDIAN_RETURN_IF_ERROR(
      RefuseOverwrite({absl::StrCat(ca_dir, "/", name, ".key"), absl::StrCat(ca_dir, "/", name, ".pem"),
                       absl::StrCat(SiteBundleDir(ca_dir, name), "/", name, ".key")},
                      o));
  BioPtr cb(BIO_new_file((ca_dir + "/ca.pem").c_str(), "r"));
  if (!cb) return absl::NotFoundError(absl::StrCat(ca_dir, "/ca.pem: cannot open"));
  X509Ptr ca(PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr));
  if (!ca) return absl::InvalidArgumentError(OpenSslError(absl::StrCat(ca_dir, "/ca.pem: not a PEM certificate")));
  BioPtr kb(BIO_new_file((ca_dir + "/ca.key").c_str(), "r"));
  if (!kb) return absl::NotFoundError(absl::StrCat(ca_dir, "/ca.key: cannot open"));
  PkeyPtr ca_key(PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr));
  if (!ca_key) return absl::InvalidArgumentError(OpenSslError(absl::StrCat(ca_dir, "/ca.key: not a PEM private key")));
  if (X509_check_private_key(ca.get(), ca_key.get()) != 1)
    return absl::InvalidArgumentError(absl::StrCat(ca_dir, "/ca.key does not belong to ", ca_dir, "/ca.pem"));
  return WriteLeaves(ca_dir, ca.get(), ca_key.get(), {{name, ep.host, true}}, o, written);
}

absl::StatusOr<std::string> CertificateCommonName(const std::string& pem_path) {
  BioPtr b(BIO_new_file(pem_path.c_str(), "r"));
  if (!b) return absl::NotFoundError(absl::StrCat(pem_path, ": cannot open"));
  X509Ptr cert(PEM_read_bio_X509(b.get(), nullptr, nullptr, nullptr));
  if (!cert) return absl::InvalidArgumentError(OpenSslError(absl::StrCat(pem_path, ": not a PEM certificate")));
  char cn[256];
  if (X509_NAME_get_text_by_NID(X509_get_subject_name(cert.get()), NID_commonName, cn, sizeof cn) < 0)
    return absl::InvalidArgumentError(absl::StrCat(pem_path, ": certificate has no CN"));
  return std::string(cn);
}

absl::Status CheckIdentityFiles(const std::string& dir, const std::string& name) {
  const std::string ca_path = dir + "/ca.pem", cert_path = absl::StrCat(dir, "/", name, ".pem"),
                    key_path = absl::StrCat(dir, "/", name, ".key");
  BioPtr cb(BIO_new_file(ca_path.c_str(), "r"));
  if (!cb) return absl::NotFoundError(absl::StrCat(ca_path, ": cannot open the cluster CA certificate"));
  X509Ptr ca(PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr));
  if (!ca) return absl::InvalidArgumentError(OpenSslError(absl::StrCat(ca_path, ": not a PEM certificate")));
  BioPtr lb(BIO_new_file(cert_path.c_str(), "r"));
  if (!lb) return absl::NotFoundError(absl::StrCat(cert_path, ": cannot open the certificate for '", name, "'"));
  X509Ptr cert(PEM_read_bio_X509(lb.get(), nullptr, nullptr, nullptr));
  if (!cert) return absl::InvalidArgumentError(OpenSslError(absl::StrCat(cert_path, ": not a PEM certificate")));
  BioPtr kb(BIO_new_file(key_path.c_str(), "r"));
  if (!kb) return absl::NotFoundError(absl::StrCat(key_path, ": cannot open the private key for '", name, "'"));
  PkeyPtr key(PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr));
  if (!key) return absl::InvalidArgumentError(OpenSslError(absl::StrCat(key_path, ": not a PEM private key")));
  if (X509_check_private_key(cert.get(), key.get()) != 1)
    return absl::InvalidArgumentError(absl::StrCat(key_path, " does not belong to ", cert_path));
  std::unique_ptr<X509_STORE, decltype(&X509_STORE_free)> store(X509_STORE_new(), X509_STORE_free);
  X509_STORE_add_cert(store.get(), ca.get());
  std::unique_ptr<X509_STORE_CTX, decltype(&X509_STORE_CTX_free)> ctx(X509_STORE_CTX_new(), X509_STORE_CTX_free);
  X509_STORE_CTX_init(ctx.get(), store.get(), cert.get(), nullptr);
  if (X509_verify_cert(ctx.get()) != 1)
    return absl::FailedPreconditionError(
        absl::StrCat(cert_path, " is not signed by the cluster CA in ", ca_path, " (",
                     X509_verify_cert_error_string(X509_STORE_CTX_get_error(ctx.get())), ")"));
  char cn[256];
  if (X509_NAME_get_text_by_NID(X509_get_subject_name(cert.get()), NID_commonName, cn, sizeof cn) < 0 || name != cn)
    return absl::FailedPreconditionError(absl::StrCat(cert_path, " names '", cn, "', not '", name, "'"));
  return absl::OkStatus();
}

std::string SiteBundleDir(const std::string& certs_dir, const std::string& site) {
  return absl::StrCat(certs_dir, "/bundles/", site);
}

absl::Status CheckSiteBundle(const std::string& dir, const std::string& site) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": cannot list the certificate directory: ", ec.message()));
  const std::string own_key = site + ".key";
  for (const auto& e : it) {
    const std::string file = e.path().filename().string();
    if (file == "ca.key")
      return absl::FailedPreconditionError(
          absl::StrCat(e.path().string(),
                       ": the cluster CA's private key must not be at a site (anyone holding it can mint "
                       "identities); give site '",
                       site, "' only ", SiteBundleDir("CERTS", site), " from `meridian certs init`"));
    if (file.size() > 4 && file.compare(file.size() - 4, 4, ".key") == 0 && file != own_key)
      return absl::FailedPreconditionError(absl::StrCat(e.path().string(), ": another identity's private key in site '",
                                                        site, "'s certificate directory; give it only ",
                                                        SiteBundleDir("CERTS", site)));
  }
  return CheckIdentityFiles(dir, site);
}

}  // namespace meridian::core
