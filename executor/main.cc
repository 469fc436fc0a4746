// `meridian-executor`: runs at each site. Today it resolves its settings, checks its identity files
// against the cluster CA, and registers with the coordinator over mutual TLS. The training loop and
// the peer service arrive with issues #5-#7 (see docs/status.md).
// Exit codes: 0 success, 1 runtime failure (e.g. coordinator unreachable), 2 invalid settings.
#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>
#include <iostream>

#include "core/version.h"
#include "executor/options.h"
#include "proto/meridian.grpc.pb.h"
#include "rpc/credentials.h"

int main(int argc, char** argv) {
  using namespace meridian;
  CLI::App app{"meridian-executor: runs one site's slice of a Meridian job"};
  app.set_version_flag("--version", std::string("meridian-executor ") + kVersion);
  executor::ExecutorFlags f;
  auto opt = [&](const char* name, std::optional<std::string>* out, const char* help) {
    app.add_option_function<std::string>(name, [out](const std::string& v) { *out = v; }, help);
  };
  opt("--coordinator", &f.coordinator, "Coordinator address HOST:PORT (env MERIDIAN_COORDINATOR)");
  opt("--site", &f.site, "This site's name, as in the cluster spec and its certificate (env MERIDIAN_SITE)");
  opt("--certs", &f.certs, "Directory with ca.pem, SITE.pem, SITE.key (env MERIDIAN_CERTS)");
  opt("--listen", &f.listen, "Address for the peer service HOST:PORT (env MERIDIAN_LISTEN)");
  opt("--device", &f.device, "cpu or cuda:N (env MERIDIAN_DEVICE)");
  opt("--spec", &f.spec, "Cluster spec to take defaults from (env MERIDIAN_SPEC)");
  double timeout = 10;
  app.add_option("--join-timeout", timeout, "Seconds to wait for the coordinator")->check(CLI::Range(0.1, 3600.0));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  auto options = executor::ResolveOptions(f, [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  });
  if (!options.ok()) {
    std::cerr << "meridian-executor: " << options.status().message() << "\n";
    return 2;
  }
  auto creds = rpc::MakeChannelCredentials(options->certs, options->site);
  if (!creds.ok()) {
    std::cerr << "meridian-executor: bad certificate for site '" << options->site << "': " << creds.status().message()
              << "\n";
    return 2;
  }
  auto channel = grpc::CreateCustomChannel(options->coordinator, *creds, rpc::PeerChannelArguments("coordinator"));
  auto stub = v1::Coordinator::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int>(timeout * 1000)));
  ctx.set_wait_for_ready(true);
  v1::RegisterRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_site(options->site);
  req.set_listen_address(options->listen);
  req.set_device(options->device);
  req.set_build_version(kVersion);
  v1::RegisterResponse resp;
  grpc::Status s = stub->Register(&ctx, req, &resp);
  if (!s.ok()) {
    std::string why = s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                          ? "no answer (is the coordinator running there, and do both use the same cluster CA?)"
                          : s.error_message();
    std::cerr << "meridian-executor: cannot join the coordinator at " << options->coordinator << " as site '"
              << options->site << "': " << why << "\n";
    return 1;
  }
  std::cout << "joined cluster '" << resp.cluster() << "' as site '" << options->site << "' (run " << resp.run_id()
            << ")\n";
  std::cerr << "meridian-executor: this build does not run training yet (see docs/status.md)\n";
  return 1;
}
