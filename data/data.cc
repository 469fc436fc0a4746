#include "data/data.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/files.h"
#include "data/internal/spm.h"
#include "nlohmann/json.hpp"

namespace meridian::data {

struct Tokenizer::Impl {
  internal::Spm sp;
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  std::ifstream probe(path, std::ios::binary);
  if (!probe) return absl::NotFoundError(absl::StrCat(path, ": cannot open the SentencePiece tokenizer"));
  std::string error;
  if (!impl->sp.Load(path, &error))
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a SentencePiece model: ", error));
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int> Tokenizer::Encode(const std::string& text) const { return impl_->sp.Encode(text); }

std::string Tokenizer::Decode(const std::vector<int>& ids) const {
  std::vector<int> valid;
  for (int id : ids)
    if (id >= 0 && id < vocab_size()) valid.push_back(id);
  return impl_->sp.Decode(valid);
}

int Tokenizer::vocab_size() const { return impl_->sp.size(); }
int Tokenizer::bos_id() const { return impl_->sp.bos(); }
int Tokenizer::eos_id() const { return impl_->sp.eos(); }
int Tokenizer::pad_id() const { return impl_->sp.pad(); }

absl::Status TrainTokenizer(const std::vector<std::string>& inputs, int vocab_size, const std::string& prefix) {
  if (inputs.empty()) return absl::InvalidArgumentError("tokenizer training: no input files");
  for (const auto& f : inputs)
    if (!std::ifstream(f)) return absl::NotFoundError(absl::StrCat(f, ": cannot open tokenizer training text"));
  const std::string args =
      absl::StrCat("--input=", absl::StrJoin(inputs, ","), " --model_prefix=", prefix, " --vocab_size=", vocab_size,
                   " --model_type=unigram --character_coverage=1.0 --byte_fallback=true --hard_vocab_limit=false"
                   " --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1 --num_threads=1 --minloglevel=2"
                   " --split_digits=true --max_sentence_length=16384");
  std::string error;
  if (!internal::SpmTrain(args, &error))
    return absl::InternalError(absl::StrCat("tokenizer training (", prefix, "): ", error));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Example>> ReadInstructions(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::vector<Example> out;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto where = [&] { return absl::StrCat(path, ":", n, ": "); };
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(where(), "not a JSON value"));
    if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where(), "expected a JSON object"));
    auto field = [&](const char* key, std::string* v) -> absl::Status {
      auto it = j.find(key);
      if (it == j.end()) return absl::NotFoundError(key);
      if (!it->is_string())
        return absl::InvalidArgumentError(absl::StrCat(where(), "field '", key, "' is not a string"));
      *v = it->get<std::string>();
      return absl::OkStatus();
    };
    Example e;
    e.line = n;
    absl::Status p = field("prompt", &e.prompt);
    if (absl::IsNotFound(p)) {  // Alpaca layout
      std::string input;
      if (absl::Status s = field("instruction", &e.prompt); !s.ok())
        return absl::IsNotFound(s)
                   ? absl::InvalidArgumentError(absl::StrCat(where(), "missing field 'prompt' (or 'instruction')"))
                   : s;
      if (absl::Status s = field("input", &input); !s.ok() && !absl::IsNotFound(s)) return s;
      if (!input.empty()) e.prompt += "\n" + input;
      if (absl::Status s = field("output", &e.response); !s.ok())
        return absl::IsNotFound(s) ? absl::InvalidArgumentError(absl::StrCat(where(), "missing field 'output'")) : s;
    } else if (!p.ok()) {
      return p;
    } else if (absl::Status s = field("response", &e.response); !s.ok()) {
      return absl::IsNotFound(s) ? absl::InvalidArgumentError(absl::StrCat(where(), "missing field 'response'")) : s;
    }
    if (e.response.empty()) return absl::InvalidArgumentError(absl::StrCat(where(), "field 'response' is empty"));
    if (absl::Status s = field("kind", &e.kind); !s.ok() && !absl::IsNotFound(s)) return s;
    out.push_back(std::move(e));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  return out;
}

namespace {

// Appends [BOS] a b [EOS] to the token stream; `count_a` says whether a's tokens count as targets.
void AppendDocument(const Tokenizer& tok, const std::string& a, bool count_a, const std::string& b,
                    std::vector<int32_t>* tokens, std::vector<uint8_t>* counted) {
  if (tok.bos_id() >= 0) {
    tokens->push_back(tok.bos_id());
    counted->push_back(0);
  }
  for (int id : tok.Encode(a)) {
    tokens->push_back(id);
    counted->push_back(count_a);
  }
  if (!b.empty())
    for (int id : tok.Encode(b)) {
      tokens->push_back(id);
      counted->push_back(1);
    }
  if (tok.eos_id() >= 0) {
    tokens->push_back(tok.eos_id());
    counted->push_back(1);
  }
}

std::vector<int64_t> Permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), 0);
  std::mt19937_64 rng(seed);
  // Fisher-Yates with our own index draw: std::shuffle's distribution is implementation-defined.
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[rng() % static_cast<uint64_t>(i + 1)]);
  return p;
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Dataset>> Dataset::Build(const std::string& path, const Tokenizer& tok,
                                                        const DatasetOptions& o) {
  if (o.sequence_length < 2) return absl::InvalidArgumentError("dataset: sequence_length must be at least 2");
  if (o.eval_fraction < 0 || o.eval_fraction >= 1)
    return absl::InvalidArgumentError("dataset: eval_fraction must be in [0, 1)");
  std::unique_ptr<Dataset> d(new Dataset());
  d->options_ = o;
  d->stride_ = o.sequence_length;
  std::vector<int32_t> tokens;
  std::vector<uint8_t> counted;
  if (EndsWith(path, ".jsonl")) {
    d->instruction_ = true;
    auto examples = ReadInstructions(path);
    if (!examples.ok()) return examples.status();
    const int64_t n = static_cast<int64_t>(examples->size());
    int64_t held = o.eval_fraction > 0 ? std::max<int64_t>(1, static_cast<int64_t>(o.eval_fraction * n + 0.5)) : 0;
    if (held >= n)
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": ", n, " examples leave none for training after holding out ", held, " (job.eval_fraction)"));
    const auto split = Permutation(n, o.seed ^ 0x5eed5eedull);
    std::vector<char> is_held(n, 0);
    for (int64_t i = 0; i < held; ++i) is_held[split[i]] = 1;
    std::vector<int64_t> train;
    for (int64_t i = 0; i < n; ++i) {
      if (is_held[i])
        d->held_out_.push_back((*examples)[i]);
      else
        train.push_back(i);
    }
    const auto order = Permutation(static_cast<int64_t>(train.size()), o.seed);
    for (int64_t k : order) {
      const Example& e = (*examples)[train[k]];
      AppendDocument(tok, e.prompt, false, e.response, &tokens, &counted);
    }
    d->train_examples_ = static_cast<int64_t>(train.size());
  } else {
    auto read = core::ReadFile(path);
    if (!read.ok()) return read.status();
    const std::string& text = *read;
    std::vector<std::string> docs;
    std::string cur;
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) {
        if (!cur.empty()) docs.push_back(std::move(cur));
        cur.clear();
      } else {
        cur += (cur.empty() ? "" : " ") + line;
      }
    }
    if (!cur.empty()) docs.push_back(std::move(cur));
    if (docs.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no text"));
    for (int64_t k : Permutation(static_cast<int64_t>(docs.size()), o.seed))
      AppendDocument(tok, docs[k], true, "", &tokens, &counted);
    d->train_examples_ = static_cast<int64_t>(docs.size());
  }
  d->train_tokens_ = static_cast<int64_t>(tokens.size());
  // Pad to a whole number of sequences (+1 for the last target); padding never counts.
  const int64_t seq = o.sequence_length;
  const int64_t nseq = std::max<int64_t>(1, (static_cast<int64_t>(tokens.size()) - 1 + seq - 1) / seq);
  const int32_t pad = tok.pad_id() >= 0 ? tok.pad_id() : (tok.eos_id() >= 0 ? tok.eos_id() : 0);
  tokens.resize(nseq * seq + 1, pad);
  counted.resize(nseq * seq + 1, 0);
  d->packed_ = std::move(tokens);
  d->counted_ = std::move(counted);
  return d;
}

const std::vector<int64_t>& Dataset::EpochOrder(int64_t epoch) const {
  if (cached_epoch_ != epoch) {
    order_ = Permutation(num_sequences(), options_.seed * 1000003ull + static_cast<uint64_t>(epoch) + 1);
    cached_epoch_ = epoch;
  }
  return order_;
}

int64_t Dataset::SequenceId(int64_t index) const {
  const int64_t n = num_sequences();
  const int64_t wrapped = ((index % n) + n) % n;
  std::lock_guard<std::mutex> l(mu_);
  return EpochOrder(index >= 0 ? index / n : 0)[wrapped];
}

void Dataset::Sequence(int64_t index, int32_t* tokens, uint8_t* counted) const {
  const int64_t j = SequenceId(index);
  const int64_t seq = options_.sequence_length;
  std::copy_n(packed_.begin() + j * seq, seq + 1, tokens);
  std::copy_n(counted_.begin() + j * seq + 1, seq, counted);
}

bool ExactMatch(const std::string& generated, const std::string& expected) {
  auto norm = [](const std::string& s) {
    std::string out;
    bool space = false;
    for (unsigned char c : s) {
      if (std::isspace(c)) {
        space = !out.empty();
      } else {
        if (space) out += ' ';
        space = false;
        out += static_cast<char>(c);
      }
    }
    return out;
  };
  return norm(generated) == norm(expected);
}

}  // namespace meridian::data
