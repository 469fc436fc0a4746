#include "core/files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace meridian::core {
namespace {

namespace fs = std::filesystem;

TEST(Files, Sha256MatchesTheStandardVectorsWholeInPiecesAndFromAFile) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  Sha256 pieces;
  pieces.Update("a");
  pieces.Update("bc");
  EXPECT_EQ(pieces.HexDigest(), Sha256Hex("abc"));
  const fs::path dir = fs::temp_directory_path() / ("meridian_files_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::string big(3 * 1000 * 1000 + 5, 'x');  // several read pieces
  for (size_t i = 0; i < big.size(); i += 97) big[i] = static_cast<char>(i);
  ASSERT_TRUE(WriteFileAtomic((dir / "f").string(), big, 0600).ok());
  struct stat st;
  ASSERT_EQ(::stat((dir / "f").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto digest = Sha256OfFile((dir / "f").string());
  ASSERT_TRUE(digest.ok()) << digest.status();
  EXPECT_EQ(*digest, Sha256Hex(big));
  EXPECT_TRUE(SyncFile((dir / "f").string()).ok());
  EXPECT_EQ(Sha256OfFile((dir / "missing").string()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(SyncFile((dir / "missing").string()).ok());
  for (const auto& e : fs::directory_iterator(dir)) EXPECT_EQ(e.path().filename(), "f");  // no temporary left
  fs::remove_all(dir);
}

}  // namespace
}  // namespace meridian::core
