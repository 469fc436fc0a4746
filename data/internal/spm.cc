#include "data/internal/spm.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

namespace meridian::data::internal {

struct Spm::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

Spm::Spm() : impl_(std::make_unique<Impl>()) {}
Spm::~Spm() = default;

bool Spm::Load(const std::string& path, std::string* error) {
  const auto s = impl_->sp.Load(path);
  if (!s.ok()) *error = s.ToString();
  return s.ok();
}

std::vector<int> Spm::Encode(const std::string& text) const {
  std::vector<int> ids;
  impl_->sp.Encode(text, &ids);  // cannot fail on a loaded model: byte fallback or <unk>
  return ids;
}

std::string Spm::Decode(const std::vector<int>& ids) const {
  std::string out;
  impl_->sp.Decode(ids, &out);
  return out;
}

int Spm::size() const { return impl_->sp.GetPieceSize(); }
int Spm::bos() const { return impl_->sp.bos_id(); }
int Spm::eos() const { return impl_->sp.eos_id(); }
int Spm::pad() const { return impl_->sp.pad_id(); }

bool SpmTrain(const std::string& args, std::string* error) {
  const auto s = sentencepiece::SentencePieceTrainer::Train(args);
  if (!s.ok()) *error = s.ToString();
  return s.ok();
}

}  // namespace meridian::data::internal
