#include "core/thread_name.h"

#include <pthread.h>

namespace meridian::core {

void NameThisThread(std::string_view name) {
  const std::string cut(name.substr(0, 15));  // the kernel's limit is 16 bytes with the terminator
  (void)::pthread_setname_np(::pthread_self(), cut.c_str());
}

std::string ThisThreadName() {
  char buf[16] = {};
  if (::pthread_getname_np(::pthread_self(), buf, sizeof buf) != 0) return "";
  return buf;
}

}  // namespace meridian::core
