#include "executor/torch_boundary.h"

#include <c10/util/Exception.h>

#include <exception>
#include <new>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace meridian::executor {
namespace {

bool SaysOutOfMemory(absl::string_view message) {
  for (const char* phrase : {"not enough memory", "out of memory", "can't allocate memory", "Out of memory"})
    if (absl::StrContains(message, phrase)) return true;
  return false;
}

}  // namespace

absl::Status StatusOfCurrentException(absl::string_view what) {
  try {
    throw;
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory: ", e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    if (SaysOutOfMemory(message)) return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory: ", message));
    return absl::InternalError(absl::StrCat(what, ": libtorch: ", message));
  } catch (const std::bad_alloc& e) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory (", e.what(), ")"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, ": an exception of unknown type"));
  }
}

}  // namespace meridian::executor
