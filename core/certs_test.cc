#include "core/certs.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <string>

#include "tests/test_util.h"

namespace meridian::core {
namespace {

namespace fs = std::filesystem;
using meridian::testing::Shell;
using ::testing::HasSubstr;

ClusterSpec Spec(const std::string& name) {
  ClusterSpec s;
  s.name = name;
  s.coordinator = {"127.0.0.1", 7000};
  s.sites.push_back({"fast", {"127.0.0.1", 7001}});
  s.sites.push_back({"far", {"far.example.com", 7002}});
  return s;
}

class CertsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("meridian_certs_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string D(const std::string& f = "") const { return f.empty() ? dir_.string() : (dir_ / f).string(); }
  fs::path dir_;
};

TEST_F(CertsTest, EveryCertificateVerifiesWithOpenssl) {
  std::vector<std::string> written;
  ASSERT_TRUE(InitClusterCerts(Spec("c1"), D(), {}, &written).ok());
  // ca + coordinator + 2 sites, pem and key each; and each site's bundle: ca.pem, its pem and key
  EXPECT_EQ(written.size(), 14u);
  for (const char* n : {"coordinator", "fast", "far"}) {
    auto [rc, out] = Shell("openssl verify -CAfile " + D("ca.pem") + " " + D(std::string(n) + ".pem"));
    EXPECT_EQ(rc, 0) << out;
    EXPECT_THAT(out, HasSubstr(": OK"));
    EXPECT_EQ(*CertificateCommonName(D(std::string(n) + ".pem")), n);
    EXPECT_TRUE(CheckIdentityFiles(D(), n).ok());
  }
  auto [rc, out] = Shell("openssl x509 -noout -ext subjectAltName -in " + D("far.pem"));
  EXPECT_THAT(out, HasSubstr("DNS:far.example.com"));
  EXPECT_THAT(out, HasSubstr("DNS:far"));
  auto [rc2, out2] = Shell("openssl x509 -noout -ext subjectAltName -in " + D("fast.pem"));
  EXPECT_THAT(out2, HasSubstr("IP Address:127.0.0.1"));
}

TEST_F(CertsTest, KeysArePrivate) {
  std::vector<std::string> written;
  ASSERT_TRUE(InitClusterCerts(Spec("c1"), D(), {}, &written).ok());
  for (const char* k : {"ca.key", "coordinator.key", "fast.key", "bundles/fast/fast.key"}) {
    struct stat st;
    ASSERT_EQ(::stat(D(k).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << k;
  }
}

TEST_F(CertsTest, SiteBundleHoldsOnlyItsOwnIdentity) {
  std::vector<std::string> w;
  ASSERT_TRUE(InitClusterCerts(Spec("c1"), D(), {}, &w).ok());
  EXPECT_EQ(SiteBundleDir(D(), "fast"), D("bundles/fast"));
  EXPECT_TRUE(CheckSiteBundle(D("bundles/fast"), "fast").ok());
  EXPECT_TRUE(CheckSiteBundle(D("bundles/far"), "far").ok());
  // The full directory holds the CA's key: refused, naming it.
  absl::Status whole = CheckSiteBundle(D(), "fast");
  EXPECT_EQ(whole.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(whole.message()), HasSubstr(D("ca.key")));
  // Another site's key in the bundle: refused, naming it.
  fs::copy_file(D("far.key"), D("bundles/fast/far.key"));
  absl::Status other = CheckSiteBundle(D("bundles/fast"), "fast");
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other.message()), HasSubstr(D("bundles/fast/far.key")));
  fs::remove(D("bundles/fast/far.key"));
  // A site given another site's bundle.
  EXPECT_FALSE(CheckSiteBundle(D("bundles/far"), "fast").ok());
  EXPECT_EQ(CheckSiteBundle(D("nowhere"), "fast").code(), absl::StatusCode::kNotFound);
  // Issuing one more site writes its bundle too.
  ASSERT_TRUE(IssueSiteCert(D(), "late", "127.0.0.1", {}, &w).ok());
  EXPECT_TRUE(CheckSiteBundle(D("bundles/late"), "late").ok());
  EXPECT_FALSE(IssueSiteCert(D(), "coordinator", "127.0.0.1", {}, &w).ok());
}

TEST_F(CertsTest, CertificateFromAnotherCaDoesNotVerify) {
  std::vector<std::string> w;
  ASSERT_TRUE(InitClusterCerts(Spec("c1"), D("one"), {}, &w).ok());
  ASSERT_TRUE(InitClusterCerts(Spec("c2"), D("two"), {}, &w).ok());
  auto [rc, out] = Shell("openssl verify -CAfile " + D("one/ca.pem") + " " + D("two/fast.pem"));
  EXPECT_NE(rc, 0) << out;
  // Our own check agrees, and names the file.
  fs::copy_file(D("two/fast.pem"), D("one/fast.pem"), fs::copy_options::overwrite_existing);
  fs::copy_file(D("two/fast.key"), D("one/fast.key"), fs::copy_options::overwrite_existing);
  absl::Status s = CheckIdentityFiles(D("one"), "fast");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("not signed by the cluster CA"));
}

TEST_F(CertsTest, RefusesToOverwriteWithoutForce) {
  std::vector<std::string> w;
  ASSERT_TRUE(InitClusterCerts(Spec("c1"), D(), {}, &w).ok());
  auto before = Shell("openssl x509 -noout -fingerprint -in " + D("ca.pem")).second;
  absl::Status s = InitClusterCerts(Spec("c1"), D(), {}, &w);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(s.message()), HasSubstr("--force"));
  EXPECT_EQ(before, Shell("openssl x509 -noout -fingerprint -in " + D("ca.pem")).second);
  CertOptions force;
  force.force = true;
  ASSERT_TRUE(InitClusterCerts(Spec("c1"), D(), force, &w).ok());
  EXPECT_NE(before, Shell("openssl x509 -noout -fingerprint -in " + D("ca.pem")).second);
}

TEST_F(CertsTest, IssueAddsASiteSignedByTheSameCa) {
  std::vector<std::string> w;
  ASSERT_TRUE(InitClusterCerts(Spec("c1"), D(), {}, &w).ok());
  ASSERT_TRUE(IssueSiteCert(D(), "tokyo", "10.0.0.7", {}, &w).ok());
  auto [rc, out] = Shell("openssl verify -CAfile " + D("ca.pem") + " " + D("tokyo.pem"));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(IssueSiteCert(D(), "tokyo", "10.0.0.7", {}, &w).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(IssueSiteCert(D(), "bad name", "h", {}, &w).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IssueSiteCert(D("missing"), "x", "h", {}, &w).code(), absl::StatusCode::kNotFound);
}

TEST_F(CertsTest, IdentityCheckCatchesWrongNameAndMismatchedKey) {
  std::vector<std::string> w;
  ASSERT_TRUE(InitClusterCerts(Spec("c1"), D(), {}, &w).ok());
  fs::copy_file(D("fast.pem"), D("impostor.pem"));
  fs::copy_file(D("fast.key"), D("impostor.key"));
  EXPECT_THAT(std::string(CheckIdentityFiles(D(), "impostor").message()), HasSubstr("names 'fast', not 'impostor'"));
  fs::copy_file(D("far.key"), D("fast.key"), fs::copy_options::overwrite_existing);
  EXPECT_THAT(std::string(CheckIdentityFiles(D(), "fast").message()), HasSubstr("does not belong to"));
  EXPECT_EQ(CheckIdentityFiles(D(), "nobody").code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace meridian::core
