// Training data for language models, without torch: a SentencePiece tokenizer, JSONL instruction data
// (prompt/response pairs, loss on the response only) and plain text, packed into fixed-length
// sequences, shuffled with a seed and split into training and held-out parts.
//
// Every process of a distributed run builds the same Dataset from the same file, tokenizer and options,
// so sequence `i` is the same everywhere: the executors need no data exchange.
#ifndef MERIDIAN_DATA_DATA_H_
#define MERIDIAN_DATA_DATA_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace meridian::data {

// A SentencePiece model (libsentencepiece). Immutable after Load; thread-safe.
class Tokenizer {
 public:
  // Loads a `tokenizer.model`. Errors name the file.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  ~Tokenizer();

  std::vector<int> Encode(const std::string& text) const;
  std::string Decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  int bos_id() const;  // -1 when the model has none
  int eos_id() const;  // -1 when the model has none
  int pad_id() const;  // -1 when the model has none

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Trains a unigram SentencePiece model on the text files `inputs` and writes `<prefix>.model` and
// `<prefix>.vocab`. Ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS), as LLaMA's tokenizer; byte fallback so any
// text encodes. Deterministic for the same inputs.
absl::Status TrainTokenizer(const std::vector<std::string>& inputs, int vocab_size, const std::string& prefix);

struct Example {
  std::string prompt;
  std::string response;
  std::string kind;  // optional "kind" of the line (a task name); evaluation reports accuracy per kind
  int line = 0;      // 1-based line in the JSONL file
};

// Reads JSONL instruction data: one object per line with string fields "prompt" and "response"
// (Alpaca-style "instruction" [+ "input"] / "output" are accepted too), and optionally a string "kind"
// naming the task the line belongs to. Blank lines are skipped; other fields are ignored.
// Errors name the file, line and field.
absl::StatusOr<std::vector<Example>> ReadInstructions(const std::string& path);

struct DatasetOptions {
  int sequence_length = 256;  // tokens a sequence is trained on; a sequence holds sequence_length + 1
  uint64_t seed = 1234;
  double eval_fraction = 0.1;  // JSONL only: share of examples held out (at least one when > 0)
};

// Tokenised, packed training data. Examples become [BOS] prompt response [EOS]; the loss counts the
// response and EOS tokens only (for plain text, every token). Examples are concatenated in a seeded
// order and cut into sequences of sequence_length + 1 tokens overlapping by one (the last is padded);
// each epoch visits the sequences in its own seeded permutation.
// Thread-safe (the per-epoch permutation cache is guarded).
class Dataset {
 public:
  // `path` ending in .jsonl is instruction data; anything else is UTF-8 plain text (paragraphs separated
  // by blank lines become documents). Errors name the file.
  static absl::StatusOr<std::unique_ptr<Dataset>> Build(const std::string& path, const Tokenizer& tokenizer,
                                                        const DatasetOptions& options);

  int64_t num_sequences() const { return static_cast<int64_t>(packed_.size() / stride_); }
  int sequence_length() const { return options_.sequence_length; }
  // Training sequence `index` (0, 1, 2, ...; wraps into further epochs): tokens[sequence_length + 1]
  // and counted[sequence_length], where counted[i] says whether predicting tokens[i + 1] counts.
  void Sequence(int64_t index, int32_t* tokens, uint8_t* counted) const;
  // Which packed sequence (0 .. num_sequences - 1) training sequence `index` is: the same number every
  // epoch that visits it (AQ-SGD keys its stored activations by it).
  int64_t SequenceId(int64_t index) const;

  const std::vector<Example>& held_out() const { return held_out_; }
  int64_t train_examples() const { return train_examples_; }
  int64_t train_tokens() const { return train_tokens_; }  // before padding
  bool instruction() const { return instruction_; }

 private:
  Dataset() = default;
  const std::vector<int64_t>& EpochOrder(int64_t epoch) const;

  DatasetOptions options_;
  bool instruction_ = false;
  int64_t stride_ = 1;
  std::vector<int32_t> packed_;   // num_sequences * stride + 1 tokens
  std::vector<uint8_t> counted_;  // counted_[i]: token i is a target that counts
  std::vector<Example> held_out_;
  int64_t train_examples_ = 0, train_tokens_ = 0;
  mutable std::mutex mu_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> order_;
};

// Exact-match comparison used for held-out accuracy: equal after trimming whitespace at both ends and
// collapsing inner runs of whitespace.
bool ExactMatch(const std::string& generated, const std::string& expected);

}  // namespace meridian::data

#endif  // MERIDIAN_DATA_DATA_H_
