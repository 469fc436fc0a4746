// The only translation unit that includes libsentencepiece. Built as a separate shared module
// (libmeridian_spm.so) that data/internal/spm.cc loads with dlmopen(LM_ID_NEWLM), in a link-map
// namespace of its own: Debian's libsentencepiece exports its own bundled copy of protobuf-lite, whose
// symbols would otherwise interpose on libprotobuf (used by gRPC and libtorch) and crash the process during static
// initialisation. Plain C entry points only; the namespace has its own allocator, so buffers returned here are released
// with mspm_release, never with the caller's free().
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {
char* Dup(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  std::memcpy(p, s.data(), s.size());
  p[s.size()] = 0;
  return p;
}
}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* mspm_load(const char* path, char** error) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  const auto s = sp->Load(path);
  if (!s.ok()) {
    *error = Dup(s.ToString());
    delete sp;
    return nullptr;
  }
  return sp;
}

__attribute__((visibility("default"))) void mspm_free(void* sp) {
  delete static_cast<sentencepiece::SentencePieceProcessor*>(sp);
}

__attribute__((visibility("default"))) void mspm_release(void* buffer) { std::free(buffer); }

// Encodes `len` bytes of `text`; *ids (malloc'ed) receives *n ids.
__attribute__((visibility("default"))) void mspm_encode(void* sp, const char* text, size_t len, int** ids, size_t* n) {
  std::vector<int> v;
  static_cast<sentencepiece::SentencePieceProcessor*>(sp)->Encode(std::string(text, len), &v);
  *n = v.size();
  *ids = static_cast<int*>(std::malloc(std::max<size_t>(1, v.size()) * sizeof(int)));
  std::memcpy(*ids, v.data(), v.size() * sizeof(int));
}

__attribute__((visibility("default"))) char* mspm_decode(void* sp, const int* ids, size_t n, size_t* len) {
  std::string out;
  static_cast<sentencepiece::SentencePieceProcessor*>(sp)->Decode(std::vector<int>(ids, ids + n), &out);
  *len = out.size();
  return Dup(out);
}

// what: 0 pieces, 1 BOS id, 2 EOS id, 3 PAD id.
__attribute__((visibility("default"))) int mspm_info(void* sp, int what) {
  auto* p = static_cast<sentencepiece::SentencePieceProcessor*>(sp);
  switch (what) {
    case 0:
      return p->GetPieceSize();
    case 1:
      return p->bos_id();
    case 2:
      return p->eos_id();
    default:
      return p->pad_id();
  }
}

__attribute__((visibility("default"))) int mspm_train(const char* args, char** error) {
  const auto s = sentencepiece::SentencePieceTrainer::Train(args);
  if (!s.ok()) *error = Dup(s.ToString());
  return s.ok() ? 0 : 1;
}

}  // extern "C"
