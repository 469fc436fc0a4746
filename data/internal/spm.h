// A thin wrapper over libsentencepiece that keeps its headers out of every other translation unit:
// sentencepiece 0.1.97 declares `absl::string_view` itself, which clashes with Abseil's. Only std types
// cross this interface.
#ifndef MERIDIAN_DATA_INTERNAL_SPM_H_
#define MERIDIAN_DATA_INTERNAL_SPM_H_

#include <memory>
#include <string>
#include <vector>

namespace meridian::data::internal {

// Thread-safe after a successful Load (sentencepiece's processor is const for encoding and decoding).
class Spm {
 public:
  Spm();
  ~Spm();
  bool Load(const std::string& path, std::string* error);
  std::vector<int> Encode(const std::string& text) const;
  std::string Decode(const std::vector<int>& ids) const;
  int size() const;
  int bos() const;
  int eos() const;
  int pad() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// SentencePieceTrainer::Train with a command-line style argument string; false and `error` on failure.
bool SpmTrain(const std::string& args, std::string* error);

}  // namespace meridian::data::internal

#endif  // MERIDIAN_DATA_INTERNAL_SPM_H_
