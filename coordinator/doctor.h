// `meridian doctor CLUSTER.yaml`: before a run, checks for the coordinator and every site what a join
// would check -- the spec, the CA, each identity (certificate signed by the cluster CA, CN = name, key
// matches), that each certificate covers the address it will be dialled at -- and, when a coordinator
// is already running at the spec's address, that it answers over mutual TLS. One line per check.
#ifndef MERIDIAN_COORDINATOR_DOCTOR_H_
#define MERIDIAN_COORDINATOR_DOCTOR_H_

#include <string>

namespace meridian::coordinator {

// Returns 0 when every check passes, 1 when one fails, 2 when the spec is invalid.
int Doctor(const std::string& cluster_path);

}  // namespace meridian::coordinator

#endif  // MERIDIAN_COORDINATOR_DOCTOR_H_
