// meridian-peertool: drives the peer service from the command line, for integration tests, the WAN
// harness and the transport benchmarks.
//   serve --certs DIR --self NAME --allow PEER[,PEER] --listen HOST:PORT [--max-peer-bytes B] [--job ID]
//         [--cpu-share S]: acknowledge probe streams with this process's CPU over S (SetProbeCpuShare)
//   probe --certs DIR --self NAME --peer NAME --address HOST:PORT [--seconds S] [--cpu-share S]
//         (prints profile links JSON; receive_seconds_per_byte: what receiving costs each end, forward as the
//         server acknowledged it, reverse that at this process's --cpu-share; 0 without the shares)
//         [--both-ways one|own]: also both directions at once, the pull over the stream's connection or its own
//   send  --certs DIR --self NAME --peer NAME --address HOST:PORT --frame-mib M|--elements N --frames K
//         (prints goodput)
//         [--codec C] [--job-id ID] [--corrupt 1]: frame i is sent as (ID, step i, micro-batch 0, stage 0, FORWARD)
//         [--gap-ms G]: G ms between frames, as a pipeline sends between its passes (then cpu_seconds, this
//         process's CPU over the sends, says what each frame costs the sender)
// and, as a site calling the coordinator (the hostile-site tests: a valid certificate, forged requests):
//   put   --certs DIR --self NAME --coordinator HOST:PORT --job-id ID --path RUN_PATH --file LOCAL
//   get   --certs DIR --self NAME --coordinator HOST:PORT --path RUN_PATH --file LOCAL
// each exits 0 when the coordinator accepted, else 1 with its error on stderr.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "compression/codec.h"
#include "core/cpu_time.h"
#include "rpc/coordinator_client.h"
#include "rpc/credentials.h"
#include "rpc/peer.h"

using namespace meridian;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: meridian-peertool serve|probe|send|put|get --flag value ...\n");
    return 2;
  }
  std::string mode = argv[1];
  std::map<std::string, std::string> f;
  for (int i = 2; i + 1 < argc; i += 2) f[argv[i]] = argv[i + 1];
  auto need = [&](const char* k) {
    if (!f.count(k)) {
      std::fprintf(stderr, "meridian-peertool %s: missing %s\n", mode.c_str(), k);
      std::exit(2);
    }
    return f[k];
  };
  if (mode == "serve") {
    std::set<std::string> allow;
    std::stringstream ss(need("--allow"));
    for (std::string p; std::getline(ss, p, ',');) allow.insert(p);
    rpc::TensorInbox inbox;
    rpc::PeerLimits limits;
    if (f.count("--max-peer-bytes")) limits.max_peer_bytes = std::atoll(f["--max-peer-bytes"].c_str());
    rpc::PeerService service(need("--self"), allow, &inbox, limits);
    if (f.count("--job")) service.SetJob(f["--job"]);
    if (f.count("--cpu-share")) service.SetProbeCpuShare(std::atof(f["--cpu-share"].c_str()));
    int port = 0;
    auto server = rpc::StartMtlsServer(need("--certs"), need("--self"), need("--listen"), {&service}, &port);
    if (!server.ok()) {
      std::fprintf(stderr, "meridian-peertool: %s\n", std::string(server.status().message()).c_str());
      return 2;
    }
    std::printf("listening %d\n", port);
    std::fflush(stdout);
    (*server)->Wait();
    return 0;
  }
  if (mode == "put" || mode == "get") {
    auto coordinator = rpc::ConnectCoordinator(need("--certs"), need("--self"), need("--coordinator"));
    if (!coordinator.ok()) {
      std::fprintf(stderr, "meridian-peertool: %s\n", std::string(coordinator.status().message()).c_str());
      return 2;
    }
    const absl::Status s = mode == "put"
                               ? (*coordinator)->PutFile(f["--self"], need("--job-id"), need("--file"), need("--path"))
                               : (*coordinator)->GetFile(f["--self"], need("--path"), need("--file"));
    if (!s.ok()) {
      std::fprintf(stderr, "meridian-peertool %s: %s\n", mode.c_str(), s.ToString().c_str());
      return 1;
    }
    return 0;
  }
  auto client = rpc::PeerClient::Create(need("--certs"), need("--self"), need("--peer"), need("--address"));
  if (!client.ok()) {
    std::fprintf(stderr, "meridian-peertool: %s\n", std::string(client.status().message()).c_str());
    return 2;
  }
  if (mode == "probe") {
    // A first 1 MiB transfer estimates the rate; the measured transfer then lasts about --seconds.
    rpc::ProbeOptions o;
    o.bulk_bytes = 1 << 20;
    auto first = rpc::ProbeLink(**client, o);
    if (!first.ok()) {
      std::fprintf(stderr, "meridian-peertool: %s\n", std::string(first.status().message()).c_str());
      return 1;
    }
    double secs = f.count("--seconds") ? std::atof(f["--seconds"].c_str()) : 3.0;
    o.bulk_bytes =
        std::clamp<int64_t>(static_cast<int64_t>(first->forward_bytes_per_second * secs), 1 << 20, 512 << 20);
    o.deadline = std::chrono::seconds(120);
    if (f.count("--cpu-share")) o.cpu_share = std::atof(f["--cpu-share"].c_str());
    // --both-ways one|own: also both directions at once, the pull over the stream's connection or its own.
    std::unique_ptr<rpc::PeerClient> pull_client;
    if (f.count("--both-ways")) {
      o.both_ways = true;
      if (f["--both-ways"] == "own") {
        auto c = rpc::PeerClient::Create(need("--certs"), need("--self"), need("--peer"), need("--address"), true);
        if (!c.ok()) {
          std::fprintf(stderr, "meridian-peertool: %s\n", std::string(c.status().message()).c_str());
          return 2;
        }
        pull_client = std::move(*c);
      } else if (f["--both-ways"] != "one") {
        std::fprintf(stderr, "meridian-peertool: --both-ways takes one or own\n");
        return 2;
      }
    }
    auto m = rpc::ProbeLink(**client, o, pull_client.get());
    if (!m.ok()) {
      std::fprintf(stderr, "meridian-peertool: %s\n", std::string(m.status().message()).c_str());
      return 1;
    }
    const std::string self = f["--self"], peer = f["--peer"];
    nlohmann::json links = nlohmann::json::array();
    links.push_back({{"from", self},
                     {"to", peer},
                     {"bandwidth_bytes_per_second", m->forward_bytes_per_second},
                     {"latency_seconds", m->rtt_seconds / 2}});
    links.push_back({{"from", peer},
                     {"to", self},
                     {"bandwidth_bytes_per_second", m->reverse_bytes_per_second},
                     {"latency_seconds", m->rtt_seconds / 2}});
    nlohmann::json out{{"links", links}, {"rtt_seconds", m->rtt_seconds}};
    if (o.both_ways)
      out["loaded_bytes_per_second"] = {m->forward_loaded_bytes_per_second, m->reverse_loaded_bytes_per_second};
    // What receiving cost each end a byte (0 unless the server was given --cpu-share, and this probe).
    out["receive_seconds_per_byte"] = {m->forward_receive_seconds_per_byte, m->reverse_receive_seconds_per_byte};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  if (mode == "send") {
    // --elements N sends N float32 elements instead of --frame-mib M MiB.
    const int64_t elements =
        f.count("--elements") ? std::atoll(f["--elements"].c_str()) : std::atoll(need("--frame-mib").c_str()) << 18;
    const int frames = std::atoi(need("--frames").c_str());
    std::vector<float> x(static_cast<size_t>(elements));
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 9973) * 0.001f;
    auto frame = compression::Encode({core::DType::kFloat32, {static_cast<int64_t>(x.size())}, x.data()},
                                     *compression::CodecSpec::Parse(f.count("--codec") ? f["--codec"] : "identity"));
    if (f.count("--corrupt")) (*frame)[frame->size() / 2] ^= 0xff;  // fails the receiver's integrity check
    const std::string job_id = f.count("--job-id") ? f["--job-id"] : "bench";
    auto stream = (*client)->OpenStream(std::chrono::seconds(600));
    if (!stream.ok()) return 1;
    const int gap_ms = f.count("--gap-ms") ? std::atoi(f["--gap-ms"].c_str()) : 0;
    auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = core::ProcessCpuSeconds();
    for (int i = 0; i < frames; ++i) {
      if (gap_ms > 0 && i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
      absl::Status s = (*stream)->Send({job_id, i, 0, 0, v1::FORWARD, 0}, *frame);
      if (!s.ok()) {
        std::fprintf(stderr, "meridian-peertool: %s\n", std::string(s.message()).c_str());
        return 1;
      }
    }
    auto acked = (*stream)->Finish();
    if (!acked.ok()) {
      std::fprintf(stderr, "meridian-peertool: %s\n", std::string(acked.status().message()).c_str());
      return 1;
    }
    const double cpu = core::ProcessCpuSeconds() - cpu0;
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double bytes = static_cast<double>(frame->size()) * frames;
    std::printf("{\"bytes\": %.0f, \"seconds\": %.4f, \"goodput_bytes_per_second\": %.1f, \"cpu_seconds\": %.4f}\n",
                bytes, secs, bytes / secs, cpu);
    return 0;
  }
  std::fprintf(stderr, "meridian-peertool: unknown mode %s\n", mode.c_str());
  return 2;
}
