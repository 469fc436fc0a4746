// A thin wrapper over libsentencepiece, loaded at run time from the shared module libmeridian_spm.so
// (spm_module.cc) with dlmopen(LM_ID_NEWLM), in a link-map namespace of its own. Debian's
// libsentencepiece 0.1.97 exports a bundled protobuf-lite that interposes on libprotobuf (gRPC, libtorch)
// when both are in one namespace and crashes static initialisation; RTLD_DEEPBIND does not help (it
// breaks libstdc++'s copy-relocated globals such as std::cerr). Its header also declares
// `absl::string_view`, clashing with Abseil. Only std types cross this interface.
#ifndef MERIDIAN_DATA_INTERNAL_SPM_H_
#define MERIDIAN_DATA_INTERNAL_SPM_H_

#include <memory>
#include <string>
#include <vector>

namespace meridian::data::internal {

// Thread-safe after a successful Load (sentencepiece's processor is const for encoding and decoding).
// Methods other than Load require a successful Load.
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
