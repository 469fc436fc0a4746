// Transport benchmarks with real processes:
//  1. streaming goodput over loopback TLS against the crypto ceiling (openssl speed, AES-128-GCM, 1 core);
//  2. streaming goodput over an emulated WAN link (tbf + latency relay in network namespaces) against
//     iperf3 over the same link. Needs root for (2).
//   build/bench/transport_bench [--mbit 100] [--rtt-ms 40]
//   (as root the WAN part adds stream goodput against iperf3 and the link probe's accuracy)
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/certs.h"
#include "tests/process.h"
#include "tests/wan/harness.h"

using namespace meridian;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::string Bin(const std::string& b) { return std::string(MERIDIAN_BINARY_DIR) + "/bin/" + b; }

double Json(const std::string& text, const std::string& key) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  return j.is_discarded() || !j.contains(key) ? 0 : j[key].get<double>();
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> f;
  for (int i = 1; i + 1 < argc; i += 2) f[argv[i]] = argv[i + 1];
  const double mbit = f.count("--mbit") ? std::atof(f["--mbit"].c_str()) : 100;
  const double rtt_ms = f.count("--rtt-ms") ? std::atof(f["--rtt-ms"].c_str()) : 40;
  fs::path dir = fs::temp_directory_path() / ("meridian_transport_bench_" + std::to_string(::getpid()));
  core::ClusterSpec spec;
  spec.name = "bench";
  spec.coordinator = {"127.0.0.1", 1};
  spec.sites = {{"a", {"127.0.0.1", 2}}, {"b", {"127.0.0.1", 3}}};
  std::vector<std::string> w;
  if (!core::InitClusterCerts(spec, dir.string(), {}, &w).ok()) return 1;
  const std::string certs = dir.string();

  // Crypto ceiling: AES-128-GCM on one core, 16 KiB blocks (TLS records are up to 16 KiB).
  testing::Process ssl("openssl speed -seconds 2 -evp aes-128-gcm 2>/dev/null | tail -1");
  std::string line = ssl.ReadAll(60s);
  double aes = 0;  // bytes/s at 16384-byte blocks: the last column, in kB/s (1000 bytes)
  {
    size_t k = line.rfind(' ');
    if (k != std::string::npos) aes = std::atof(line.substr(k + 1).c_str()) * 1000;
  }
  // Loopback goodput.
  auto serve = [&](const std::string& exec) {
    auto p = std::make_unique<testing::Process>(exec + Bin("meridian-peertool") + " serve --certs " + certs +
                                                " --self b --allow a --listen 127.0.0.1:0");
    std::string l = p->ReadLine(10s);
    return std::make_pair(std::move(p), l.size() > 10 ? std::stoi(l.substr(10)) : 0);
  };
  auto [server, port] = serve("");
  testing::Process send(Bin("meridian-peertool") + " send --certs " + certs +
                        " --self a --peer b --address 127.0.0.1:" + std::to_string(port) +
                        " --frame-mib 16 --frames 64");
  send.Wait(300s);
  double loop = Json(send.ReadAll(5s), "goodput_bytes_per_second");
  server.reset();
  std::printf("| loopback TLS stream goodput | %.2f GB/s | AES-128-GCM 1 core %.2f GB/s | %.0f%% |\n", loop / 1e9,
              aes / 1e9, aes > 0 ? 100 * loop / aes : 0);
  if (!testing::IsRoot()) {
    std::printf("(WAN comparison skipped: needs root)\n");
    fs::remove_all(dir);
    return 0;
  }
  auto wan = testing::WanHarness::Create({"a", "b"}, {{"a", "b", mbit, mbit}});
  if (!wan.ok()) {
    std::fprintf(stderr, "%s\n", std::string(wan.status().message()).c_str());
    return 1;
  }
  auto [wserver, wport] = serve((*wan)->Exec("b"));
  const std::string addr = (*wan)->Address("b", "a");
  const std::string delay = std::to_string(rtt_ms / 2);
  testing::Process relay1((*wan)->Exec("b") + Bin("meridian-wanrelay") + " --listen " + addr +
                          ":17400 --target 127.0.0.1:" + std::to_string(wport) + " --delay-ms " + delay);
  testing::Process iperf_server((*wan)->Exec("b") + "iperf3 -s -B 127.0.0.1 -p 5201 >/dev/null 2>&1");
  testing::Process relay2((*wan)->Exec("b") + Bin("meridian-wanrelay") + " --listen " + addr +
                          ":17401 --target 127.0.0.1:5201 --delay-ms " + delay);
  relay1.ReadLine(5s);
  relay2.ReadLine(5s);
  std::this_thread::sleep_for(500ms);
  // Link probe accuracy, on the fresh link as the coordinator probes it before a run (the figures go into
  // profile.json): both directions and the RTT against the emulated link. Targets: bandwidth within 15% of the tbf
  // rate, RTT within 20% of the relay's.
  testing::Process probe((*wan)->Exec("a") + Bin("meridian-peertool") + " probe --certs " + certs +
                         " --self a --peer b --address " + addr + ":17400 --seconds 3");
  probe.Wait(120s);
  auto pj = nlohmann::json::parse(probe.ReadAll(5s), nullptr, false);
  if (pj.is_discarded() || !pj.contains("links")) {
    std::fprintf(stderr, "probe failed\n");
    return 1;
  }
  const double fwd = pj["links"][0]["bandwidth_bytes_per_second"], rev = pj["links"][1]["bandwidth_bytes_per_second"];
  const double rtt = pj["rtt_seconds"];
  std::printf(
      "| probe over %.0f Mbit/s, %.0f ms RTT | %.1f / %.1f Mbit/s, %.1f ms | configured %.0f Mbit/s, %.0f ms | "
      "%.2f / %.2f, %.2f |\n",
      mbit, rtt_ms, fwd * 8 / 1e6, rev * 8 / 1e6, rtt * 1e3, mbit, rtt_ms, fwd * 8 / 1e6 / mbit, rev * 8 / 1e6 / mbit,
      rtt * 1e3 / rtt_ms);
  testing::Process iperf((*wan)->Exec("a") + "iperf3 -c " + addr + " -p 17401 -t 10 -J");
  iperf.Wait(60s);
  auto ij = nlohmann::json::parse(iperf.ReadAll(5s), nullptr, false);
  double ip = ij.is_discarded() ? 0 : ij["end"]["sum_received"]["bits_per_second"].get<double>() / 8;
  // About 10 s of traffic at the link rate.
  int frames = std::max(4, static_cast<int>(mbit * 1e6 / 8 * 10 / (4 << 20)));
  testing::Process wsend((*wan)->Exec("a") + Bin("meridian-peertool") + " send --certs " + certs +
                         " --self a --peer b --address " + addr + ":17400 --frame-mib 4 --frames " +
                         std::to_string(frames));
  wsend.Wait(300s);
  double g = Json(wsend.ReadAll(5s), "goodput_bytes_per_second");
  std::printf(
      "| stream goodput over %.0f Mbit/s, %.0f ms RTT (tbf + relay) | %.1f Mbit/s | iperf3 %.1f Mbit/s | %.2f |\n",
      mbit, rtt_ms, g * 8 / 1e6, ip * 8 / 1e6, ip > 0 ? g / ip : 0);
  fs::remove_all(dir);
  return 0;
}
