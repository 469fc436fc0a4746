#include "core/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

namespace meridian::core {
namespace {

using ::testing::HasSubstr;

SafetensorsFile Sample() {
  SafetensorsFile f;
  Tensor a{DType::kFloat32, {2, 3}, std::vector<uint8_t>(24)};
  for (int i = 0; i < 6; ++i) a.data<float>()[i] = static_cast<float>(i) * 1.5f;
  Tensor b{DType::kBFloat16, {4}, std::vector<uint8_t>(8, 7)};
  f.tensors["model.embed_tokens.weight"] = a;
  f.tensors["model.norm.weight"] = b;
  f.metadata["format"] = "pt";
  return f;
}

std::string WithHeader(const std::string& header, size_t data_bytes) {
  std::string s(8, '\0');
  uint64_t n = header.size();
  std::memcpy(s.data(), &n, 8);
  return s + header + std::string(data_bytes, '\0');
}

TEST(Safetensors, RoundTrip) {
  auto text = SerializeSafetensors(Sample());
  auto f = ParseSafetensors(text, "m.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tensors.at("model.embed_tokens.weight").data<float>()[5], 7.5f);
  EXPECT_EQ(f->tensors.at("model.norm.weight").dtype, DType::kBFloat16);
  EXPECT_EQ(f->metadata.at("format"), "pt");
  uint64_t n;
  std::memcpy(&n, text.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
}

TEST(Safetensors, PythonCanReadWhatWeWrite) {
  std::string path = ::testing::TempDir() + "/py.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, Sample()).ok());
  // Read back with an independent reader: the format's own layout, parsed by Python's json and struct.
  std::string cmd = "/usr/bin/python3 -c \"import json,struct,sys;b=open('" + path +
                    "','rb').read();n=struct.unpack('<Q',b[:8])[0];h=json.loads(b[8:8+n]);"
                    "o=h['model.embed_tokens.weight']['data_offsets'];"
                    "print(struct.unpack('<6f',b[8+n+o[0]:8+n+o[1]])[5])\"";
  FILE* p = popen(cmd.c_str(), "r");
  char buf[64] = {};
  ASSERT_NE(fgets(buf, sizeof buf, p), nullptr);
  pclose(p);
  EXPECT_EQ(std::string(buf), "7.5\n");
}

TEST(Safetensors, RejectsMalformedFiles) {
  auto err = [](const std::string& bytes) { return std::string(ParseSafetensors(bytes, "x.st").status().message()); };
  EXPECT_THAT(err("abc"), HasSubstr("x.st: truncated"));
  std::string huge(16, '\0');
  uint64_t n = 100u << 20;
  n += 1;
  std::memcpy(huge.data(), &n, 8);
  EXPECT_THAT(err(huge), HasSubstr("exceeds the"));  // a 100 MB header
  EXPECT_THAT(err(WithHeader("{\"a\": 1", 0)), HasSubstr("not a JSON object"));
  EXPECT_THAT(err(WithHeader(R"({"a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", 8)),
              HasSubstr("unsupported dtype"));
  EXPECT_THAT(err(WithHeader(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", 8)),
              HasSubstr("outside the 8-byte data section"));
  EXPECT_THAT(err(WithHeader(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8)),
              HasSubstr("need"));
  EXPECT_THAT(err(WithHeader(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                             12)),
              HasSubstr("overlap"));
  EXPECT_THAT(err(WithHeader(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 8)),
              HasSubstr("belong to no tensor"));
  auto good = SerializeSafetensors(Sample());
  EXPECT_THAT(err(good.substr(0, good.size() - 3)), HasSubstr("outside"));
  // With a zero dimension the byte count is 0 whatever the other dimensions say: a dimension beyond int64
  // would wrap negative.
  EXPECT_THAT(
      err(WithHeader(R"({"a": {"dtype": "F32", "shape": [0, 18446744073709551615], "data_offsets": [0, 0]}})", 0)),
      HasSubstr("has dimension 18446744073709551615, out of range"));
}

}  // namespace
}  // namespace meridian::core
