// The executor under a coordinator: after registering it serves its peer stream, heartbeats, and
// carries out the coordinator's commands (profile, assign, stop) until told to stop or the coordinator
// is lost (no successful heartbeat for the cluster's heartbeat timeout: it then exits within that time).
#ifndef MERIDIAN_EXECUTOR_JOINED_H_
#define MERIDIAN_EXECUTOR_JOINED_H_

#include "executor/options.h"
#include "proto/meridian.grpc.pb.h"

namespace meridian::executor {

// Returns the process exit code: 0 after a stop command, 1 on a failure.
int RunJoined(const ExecutorOptions& options, const v1::RegisterResponse& registration,
              v1::Coordinator::Stub* coordinator);

}  // namespace meridian::executor

#endif  // MERIDIAN_EXECUTOR_JOINED_H_
