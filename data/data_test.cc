#include "data/data.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

namespace meridian::data {
namespace {

namespace fs = std::filesystem;

std::string Write(const fs::path& p, const std::string& text) {
  std::ofstream(p) << text;
  return p.string();
}

// A tokenizer trained once for the whole suite on English text shipped with Debian plus task words.
class DataTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() / ("meridian-data-test-" + std::to_string(getpid())));
    fs::create_directories(*dir_);
    std::string text;
    for (int i = 0; i < 200; ++i)
      text += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\nopposite of hot is cold\n";
    const std::string corpus = Write(*dir_ / "corpus.txt", text);
    const absl::Status s = TrainTokenizer({corpus, "/usr/share/common-licenses/GPL-3"}, 600, (*dir_ / "tok").string());
    ASSERT_TRUE(s.ok()) << s;
    auto t = Tokenizer::Load((*dir_ / "tok.model").string());
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = t->release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    fs::remove_all(*dir_);
    delete dir_;
  }
  static fs::path* dir_;
  static Tokenizer* tok_;
};
fs::path* DataTest::dir_ = nullptr;
Tokenizer* DataTest::tok_ = nullptr;

TEST_F(DataTest, TokenizerRoundTripsTextAndHasLlamaSpecialIds) {
  EXPECT_EQ(tok_->bos_id(), 1);
  EXPECT_EQ(tok_->eos_id(), 2);
  EXPECT_GE(tok_->vocab_size(), 256);  // byte fallback pieces at least
  for (std::string s : {"the lazy dog", "Opposite of: hot cold", "unseen wörds ∑ 12345"}) {
    auto ids = tok_->Encode(s);
    EXPECT_FALSE(ids.empty());
    EXPECT_EQ(tok_->Decode(ids), s);
  }
}

TEST_F(DataTest, TokenizerLoadErrorsNameTheFile) {
  auto missing = Tokenizer::Load((*dir_ / "nope.model").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope.model"), std::string::npos);
  auto bad = Tokenizer::Load(Write(*dir_ / "bad.model", "not a protobuf at all"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bad.model"), std::string::npos);
}

TEST_F(DataTest, ReadsPromptResponseAndAlpacaLayouts) {
  auto p = Write(*dir_ / "ok.jsonl",
                 "{\"prompt\": \"a\", \"response\": \"b\", \"kind\": \"copy\"}\n\n"
                 "{\"instruction\": \"do\", \"input\": \"x\", \"output\": \"y\"}\n");
  auto ex = ReadInstructions(p);
  ASSERT_TRUE(ex.ok()) << ex.status();
  ASSERT_EQ(ex->size(), 2u);
  EXPECT_EQ((*ex)[0].prompt, "a");
  EXPECT_EQ((*ex)[0].response, "b");
  EXPECT_EQ((*ex)[0].kind, "copy");
  EXPECT_EQ((*ex)[1].kind, "");
  EXPECT_EQ((*ex)[1].prompt, "do\nx");
  EXPECT_EQ((*ex)[1].response, "y");
  EXPECT_EQ((*ex)[1].line, 3);
}

TEST_F(DataTest, BadInstructionLinesAreNamedByFileAndLine) {
  struct Case {
    std::string text, want;
  } cases[] = {
      {"{\"prompt\": \"a\", \"response\": \"b\"}\n{oops\n", "bad.jsonl:2: not a JSON value"},
      {"[1, 2]\n", "bad.jsonl:1: expected a JSON object"},
      {"{\"prompt\": \"a\"}\n", "bad.jsonl:1: missing field 'response'"},
      {"{\"prompt\": 3, \"response\": \"b\"}\n", "bad.jsonl:1: field 'prompt' is not a string"},
      {"{\"prompt\": \"a\", \"response\": \"\"}\n", "bad.jsonl:1: field 'response' is empty"},
      {"{\"x\": \"a\"}\n", "bad.jsonl:1: missing field 'prompt' (or 'instruction')"},
      {"{\"prompt\": \"a\", \"response\": \"b\", \"kind\": 7}\n", "bad.jsonl:1: field 'kind' is not a string"},
      {"\n\n", "bad.jsonl: no examples"},
  };
  for (const auto& c : cases) {
    auto r = ReadInstructions(Write(*dir_ / "bad.jsonl", c.text));
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_NE(r.status().message().find(c.want), std::string::npos) << r.status();
  }
  EXPECT_FALSE(ReadInstructions((*dir_ / "absent.jsonl").string()).ok());
}

TEST_F(DataTest, InstructionLossCountsResponseAndEosOnlyAndHoldsOutASeededSplit) {
  std::string jsonl;
  for (int i = 0; i < 50; ++i)
    jsonl += "{\"prompt\": \"opposite of hot " + std::to_string(i) + "\", \"response\": \"cold " + std::to_string(i) +
             "\"}\n";
  const auto path = Write(*dir_ / "inst.jsonl", jsonl);
  DatasetOptions o{16, 7, 0.2};
  auto d = Dataset::Build(path, *tok_, o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE((*d)->instruction());
  EXPECT_EQ((*d)->held_out().size(), 10u);
  EXPECT_EQ((*d)->train_examples(), 40);
  // Every training example contributes exactly its response tokens plus EOS as counted targets.
  int64_t expected = 0;
  std::set<int> held_lines;
  for (const auto& e : (*d)->held_out()) held_lines.insert(e.line);
  for (int i = 0; i < 50; ++i)
    if (!held_lines.count(i + 1))
      expected += static_cast<int64_t>(tok_->Encode("cold " + std::to_string(i)).size()) + 1;
  int64_t counted = 0;
  const int64_t n = (*d)->num_sequences();
  std::vector<int32_t> t(17);
  std::vector<uint8_t> c(16);
  std::multiset<std::vector<int32_t>> epoch0, epoch1;
  for (int64_t i = 0; i < n; ++i) {
    (*d)->Sequence(i, t.data(), c.data());
    for (int k = 0; k < 16; ++k) {
      counted += c[k];
      if (t[k + 1] == tok_->bos_id()) {
        EXPECT_EQ(c[k], 0) << "predicting BOS must not count";
      }
    }
    epoch0.insert(t);
    (*d)->Sequence(n + i, t.data(), c.data());
    epoch1.insert(t);
  }
  EXPECT_EQ(counted, expected);
  EXPECT_EQ(epoch0, epoch1);  // every epoch visits the same sequences
  // Same options, same data; another seed, another split.
  auto again = Dataset::Build(path, *tok_, o);
  std::vector<int32_t> t2(17);
  std::vector<uint8_t> c2(16);
  for (int64_t i = 0; i < 2 * n; ++i) {
    (*d)->Sequence(i, t.data(), c.data());
    (*again)->Sequence(i, t2.data(), c2.data());
    ASSERT_EQ(t, t2);
    ASSERT_EQ(c, c2);
  }
  o.seed = 8;
  auto other = Dataset::Build(path, *tok_, o);
  std::set<int> other_lines;
  for (const auto& e : (*other)->held_out()) other_lines.insert(e.line);
  EXPECT_NE(other_lines, held_lines);
}

TEST_F(DataTest, PlainTextCountsEveryTokenButBos) {
  const auto path = Write(*dir_ / "text.txt", "the quick brown fox\njumps\n\nover the lazy dog\n");
  auto d = Dataset::Build(path, *tok_, DatasetOptions{8, 1, 0.5});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE((*d)->instruction());
  EXPECT_EQ((*d)->train_examples(), 2);
  EXPECT_TRUE((*d)->held_out().empty());
  const int64_t tokens = (*d)->train_tokens();
  EXPECT_EQ(tokens, static_cast<int64_t>(tok_->Encode("the quick brown fox jumps").size() +
                                         tok_->Encode("over the lazy dog").size()) +
                        4);
  int64_t counted = 0;
  std::vector<int32_t> t(9);
  std::vector<uint8_t> c(8);
  for (int64_t i = 0; i < (*d)->num_sequences(); ++i) {
    (*d)->Sequence(i, t.data(), c.data());
    for (auto x : c) counted += x;
  }
  EXPECT_EQ(counted, tokens - 2);  // all but the two BOS tokens
}

TEST_F(DataTest, DatasetErrorsNameTheFile) {
  auto r = Dataset::Build((*dir_ / "missing.txt").string(), *tok_, DatasetOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("missing.txt"), std::string::npos);
  auto one = Write(*dir_ / "one.jsonl", "{\"prompt\": \"a\", \"response\": \"b\"}\n");
  auto tiny = Dataset::Build(one, *tok_, DatasetOptions{16, 1, 0.5});
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("eval_fraction"), std::string::npos);
}

TEST(ExactMatchTest, IgnoresOuterAndRepeatedWhitespaceOnly) {
  EXPECT_TRUE(ExactMatch("  cold   small ", "cold small"));
  EXPECT_FALSE(ExactMatch("cold smal", "cold small"));
  EXPECT_FALSE(ExactMatch("Cold small", "cold small"));
  EXPECT_FALSE(ExactMatch("", "cold"));
}

}  // namespace
}  // namespace meridian::data
