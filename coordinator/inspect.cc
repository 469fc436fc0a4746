#include "coordinator/inspect.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/run_layout.h"
#include "rpc/coordinator_client.h"

namespace meridian::coordinator {

absl::StatusOr<LiveRun> InspectCoordinator(const std::string& address, const std::string& certs_dir,
                                           const std::string& identity) {
  auto client = rpc::ConnectCoordinator(certs_dir, identity, address);
  if (!client.ok()) return absl::FailedPreconditionError(std::string(client.status().message()));
  auto resp = (*client)->Inspect(std::chrono::seconds(10));
  if (!resp.ok())
    return absl::Status(resp.status().code(), absl::StrCat("coordinator at ", address, ": ", resp.status().message()));
  return LiveRun{resp->status_json(), resp->profile_json(), resp->graph_json(), resp->plan_json()};
}

namespace {

void AddCommon(CLI::App* cmd, InspectOptions* o) {
  cmd->add_option("--coordinator", o->address, "HOST:PORT of the running coordinator")->required();
  cmd->add_option("--certs", o->certs_dir, "The cluster's certificate directory")->required();
  cmd->add_option("--as", o->identity, "Identity to present: the coordinator's (default) or a site's");
}

int Fail(const char* cmd, const absl::Status& s) {
  std::cerr << "meridian " << cmd << ": " << s.message() << "\n";
  return s.code() == absl::StatusCode::kFailedPrecondition ? 2 : 1;
}

}  // namespace

void AddStatusOptions(CLI::App* cmd, InspectOptions* o) {
  AddCommon(cmd, o);
  cmd->add_flag("--json", o->json, "Print the status as JSON");
}

int RunStatus(const InspectOptions& o) {
  auto run = InspectCoordinator(o.address, o.certs_dir, o.identity);
  if (!run.ok()) return Fail("status", run.status());
  if (o.json) {
    auto j = nlohmann::json::parse(run->status_json, nullptr, false);  // indented for reading
    std::printf("%s\n", j.is_discarded() ? run->status_json.c_str()
                                         : j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  auto j = nlohmann::json::parse(run->status_json, nullptr, false);
  if (j.is_discarded()) return Fail("status", absl::DataLossError("the coordinator's status is not JSON"));
  const auto& p = j["progress"];
  std::printf("cluster %s, run %s, job %s\n", j["cluster"].get<std::string>().c_str(),
              j["run_id"].get<std::string>().c_str(),
              j["job_id"].get<std::string>().empty() ? "(not started)" : j["job_id"].get<std::string>().c_str());
  std::printf("step %lld, loss %.4f, %.2f s/step, %lld tokens trained\n", p["step"].get<long long>(),
              p["loss"].get<double>(), p["step_seconds"].get<double>(), p["tokens"].get<long long>());
  std::printf("%-14s %-10s %-12s %8s %14s  %s\n", "site", "answering", "state", "step", "last heartbeat", "listens on");
  for (const auto& s : j["sites"]) {
    const double age = s["heartbeat_age_seconds"];
    std::printf("%-14s %-10s %-12s %8lld %14s  %s\n", s["name"].get<std::string>().c_str(),
                s["answering"].get<bool>() ? "yes" : "no", s["state"].get<std::string>().c_str(),
                s["step"].get<long long>(),
                age < 0 ? "-" : absl::StrCat(static_cast<int>(age * 10) / 10.0, " s ago").c_str(),
                s["listen"].get<std::string>().c_str());
    if (s.contains("outer_sync")) {
      const auto& o = s["outer_sync"];
      std::printf("%-14s DiLoCo: last outer sync after step %lld, %lld bytes, %.2f s, drift %.4g\n", "",
                  o["after_step"].get<long long>(), o["bytes"].get<long long>(), o["seconds"].get<double>(),
                  o["drift"].get<double>());
    }
  }
  return 0;
}

void AddDrainOptions(CLI::App* cmd, InspectOptions* o) {
  cmd->add_option("SITE", o->site, "The site to re-plan without")->required();
  AddCommon(cmd, o);
}

int RunDrain(const InspectOptions& o) {
  auto client = rpc::ConnectCoordinator(o.certs_dir, o.identity, o.address);
  if (!client.ok()) return Fail("drain", absl::FailedPreconditionError(std::string(client.status().message())));
  auto r = (*client)->Drain(o.site, std::chrono::seconds(10));
  if (!r.ok())
    return Fail("drain", absl::Status(r.status().code() == absl::StatusCode::kFailedPrecondition
                                          ? absl::StatusCode::kUnavailable  // an unjoined site: not a usage error
                                          : r.status().code(),
                                      absl::StrCat("coordinator at ", o.address, ": ", r.status().message())));
  std::printf("%s\n", r->message().c_str());
  return 0;
}

void AddProfileOptions(CLI::App* cmd, InspectOptions* o) {
  AddCommon(cmd, o);
  cmd->add_option("--out", o->out_path,
                  "Write profile.json there instead of printing it, and the job's graph.json beside it (what "
                  "`meridian run --profile` needs to plan from them)");
}

int RunProfile(const InspectOptions& o) {
  auto run = InspectCoordinator(o.address, o.certs_dir, o.identity);
  if (!run.ok()) return Fail("profile", run.status());
  if (run->profile_json.empty())
    return Fail("profile", absl::UnavailableError(
                               absl::StrCat("coordinator at ", o.address, ": the sites have not been measured yet")));
  if (o.out_path.empty()) {
    std::printf("%s", run->profile_json.c_str());
    return 0;
  }
  std::ofstream out(o.out_path);
  out << run->profile_json;
  if (!out) return Fail("profile", absl::InternalError(absl::StrCat(o.out_path, ": cannot write")));
  if (!run->graph_json.empty()) {  // the model and micro-batch shape the per-op times are of
    const std::string graph_path = (std::filesystem::path(o.out_path).parent_path() / core::kGraphFile).string();
    std::ofstream graph(graph_path);
    graph << run->graph_json;
    if (!graph) return Fail("profile", absl::InternalError(absl::StrCat(graph_path, ": cannot write")));
  }
  return 0;
}

}  // namespace meridian::coordinator
