#include "data/internal/spm.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstring>
#include <mutex>

namespace meridian::data::internal {
namespace {

struct Api {
  void* (*load)(const char*, char**);
  void (*free)(void*);
  void (*release)(void*);
  void (*encode)(void*, const char*, size_t, int**, size_t*);
  char* (*decode)(void*, const int*, size_t, size_t*);
  int (*info)(void*, int);
  int (*train)(const char*, char**);
};

std::string ExeDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string p(buf, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/'));
}

// Loads libmeridian_spm.so once, into a new link-map namespace: $MERIDIAN_SPM_MODULE, next to the executable, ../lib
// from it, or the build tree's copy. Returns null and sets `error` when none loads.
const Api* GetApi(std::string* error) {
  static std::once_flag once;
  static Api api;
  static bool ok = false;
  static std::string load_error;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("MERIDIAN_SPM_MODULE")) candidates.push_back(env);
    const std::string dir = ExeDir();
    candidates.push_back(dir + "/libmeridian_spm.so");
    candidates.push_back(dir + "/../lib/libmeridian_spm.so");
    candidates.push_back(MERIDIAN_SPM_MODULE_PATH);
    void* h = nullptr;
    for (const auto& c : candidates) {
      h = dlmopen(LM_ID_NEWLM, c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h) break;
      load_error += std::string(load_error.empty() ? "" : "; ") + dlerror();
    }
    if (!h) return;
    auto sym = [&](const char* name) { return dlsym(h, name); };
    api.load = reinterpret_cast<decltype(api.load)>(sym("mspm_load"));
    api.free = reinterpret_cast<decltype(api.free)>(sym("mspm_free"));
    api.release = reinterpret_cast<decltype(api.release)>(sym("mspm_release"));
    api.encode = reinterpret_cast<decltype(api.encode)>(sym("mspm_encode"));
    api.decode = reinterpret_cast<decltype(api.decode)>(sym("mspm_decode"));
    api.info = reinterpret_cast<decltype(api.info)>(sym("mspm_info"));
    api.train = reinterpret_cast<decltype(api.train)>(sym("mspm_train"));
    ok = api.load && api.free && api.release && api.encode && api.decode && api.info && api.train;
    if (!ok) load_error = "libmeridian_spm.so lacks an mspm_* entry point";
  });
  if (!ok) *error = "cannot load the SentencePiece module: " + load_error;
  return ok ? &api : nullptr;
}

std::string TakeError(const Api* api, char* e) {
  std::string s = e ? e : "unknown error";
  if (e) api->release(e);
  return s;
}

}  // namespace

struct Spm::Impl {
  const Api* api = nullptr;
  void* handle = nullptr;
};

Spm::Spm() : impl_(std::make_unique<Impl>()) {}
Spm::~Spm() {
  if (impl_->handle) impl_->api->free(impl_->handle);
}

bool Spm::Load(const std::string& path, std::string* error) {
  impl_->api = GetApi(error);
  if (!impl_->api) return false;
  char* e = nullptr;
  impl_->handle = impl_->api->load(path.c_str(), &e);
  if (!impl_->handle) *error = TakeError(impl_->api, e);
  return impl_->handle != nullptr;
}

std::vector<int> Spm::Encode(const std::string& text) const {
  int* ids = nullptr;
  size_t n = 0;
  impl_->api->encode(impl_->handle, text.data(), text.size(), &ids, &n);
  std::vector<int> out(ids, ids + n);
  impl_->api->release(ids);
  return out;
}

std::string Spm::Decode(const std::vector<int>& ids) const {
  size_t len = 0;
  char* s = impl_->api->decode(impl_->handle, ids.data(), ids.size(), &len);
  std::string out(s, len);
  impl_->api->release(s);
  return out;
}

int Spm::size() const { return impl_->api->info(impl_->handle, 0); }
int Spm::bos() const { return impl_->api->info(impl_->handle, 1); }
int Spm::eos() const { return impl_->api->info(impl_->handle, 2); }
int Spm::pad() const { return impl_->api->info(impl_->handle, 3); }

bool SpmTrain(const std::string& args, std::string* error) {
  const Api* api = GetApi(error);
  if (!api) return false;
  char* e = nullptr;
  if (api->train(args.c_str(), &e) == 0) return true;
  *error = TakeError(api, e);
  return false;
}

}  // namespace meridian::data::internal
