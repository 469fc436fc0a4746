// Status conversion at the gRPC boundary: gRPC and absl share their canonical codes, so a code crosses
// unchanged in both directions. The one spelling of it; thread-safe (pure functions).
#ifndef MERIDIAN_RPC_STATUS_H_
#define MERIDIAN_RPC_STATUS_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace meridian::rpc {

// A gRPC status as an absl::Status of the same code, its message prefixed with "`what`: " (what was
// called, e.g. "coordinator at HOST:PORT") when `what` is not empty.
inline absl::Status FromGrpc(const grpc::Status& s, absl::string_view what = {}) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      what.empty() ? s.error_message() : absl::StrCat(what, ": ", s.error_message()));
}

// An absl::Status as the gRPC status of the same code and message (a handler's result to its caller).
inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace meridian::rpc

#endif  // MERIDIAN_RPC_STATUS_H_
