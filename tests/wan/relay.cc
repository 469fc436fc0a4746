// meridian-wanrelay: a TCP relay that holds every chunk for a fixed one-way delay in each direction,
// for emulating WAN latency where tc netem does not exist. Rate limits come from tbf on the veth links.
//   meridian-wanrelay --listen HOST:PORT --target HOST:PORT --delay-ms D [--buffer-bytes B] [--gather-ms G]
// Each accepted connection is relayed to the target; each direction has a bounded queue (default
// 16 MiB, more than a bandwidth-delay product of 1 Gbit/s x 100 ms), so a slow receiver pushes back on
// the sender instead of the relay buffering without bound. Bytes that arrive within G milliseconds (default
// 1) of each other travel as one chunk (held the delay from the first one's arrival). Runs until killed.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string listen, target;
  double delay_ms = 0;
  size_t buffer = 16 << 20;
  double gather_ms = 1;
};

bool SplitHostPort(const std::string& s, std::string* host, std::string* port) {
  size_t c = s.rfind(':');
  if (c == std::string::npos) return false;
  *host = s.substr(0, c);
  *port = s.substr(c + 1);
  return true;
}

int Connect(const std::string& addr) {
  std::string host, port;
  if (!SplitHostPort(addr, &host, &port)) return -1;
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) return -1;
  int fd = socket(res->ai_family, SOCK_STREAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd >= 0) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return fd;
}

// One direction: a reader thread stamps chunks, a writer thread releases each after the delay.
class Pipe {
 public:
  Pipe(int in, int out, double delay_ms, double gather_ms, size_t cap)
      : in_(in), out_(out), delay_(delay_ms), gather_(static_cast<int64_t>(gather_ms * 1000)), cap_(cap) {}
  void Run() {
    std::thread writer([this] { Write(); });
    std::vector<char> buf(64 << 10);
    bool eof = false;
    while (!eof) {
      ssize_t n = read(in_, buf.data(), buf.size());
      if (n <= 0) break;
      const Clock::time_point due = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(delay_ * 1000));
      // Whatever else arrives within the gathering time (--gather-ms, or the delay when shorter) joins this
      // chunk, which is due a delay after its first byte came: one queue entry, one wake-up of the writer
      // and one write per gathering time of traffic (at most 64 KiB: the kernel's socket buffer holds what
      // arrives meanwhile), not one per TCP segment. The relay runs in its emulated
      // site's CPU quota: at 100 Mbit/s a site's relay spent about 19 ns of CPU a byte with a chunk a
      // segment, about 4 ns gathering (bench/RESULTS.md, session 33). A lone message keeps its exact delay;
      // bytes behind it in its chunk leave up to the gathering time early.
      std::this_thread::sleep_until(std::min(due, Clock::now() + gather_));
      while (static_cast<size_t>(n) < buf.size()) {
        const ssize_t m = recv(in_, buf.data() + n, buf.size() - static_cast<size_t>(n), MSG_DONTWAIT);
        if (m > 0) {
          n += m;
          continue;
        }
        if (m == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) eof = true;  // after this chunk
        break;
      }
      std::unique_lock<std::mutex> l(mu_);
      // An empty queue takes any chunk: one larger than --buffer-bytes would otherwise wait forever.
      space_.wait(l, [&] { return queued_ == 0 || queued_ + n <= cap_ || failed_; });
      if (failed_) break;
      q_.push_back({due, std::string(buf.data(), static_cast<size_t>(n))});
      queued_ += static_cast<size_t>(n);
      ready_.notify_one();
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      eof_ = true;
    }
    ready_.notify_one();
    writer.join();
    shutdown(out_, SHUT_WR);
  }

 private:
  void Write() {
    while (true) {
      std::unique_lock<std::mutex> l(mu_);
      ready_.wait(l, [&] { return !q_.empty() || eof_; });
      if (q_.empty()) return;
      auto [due, data] = std::move(q_.front());
      q_.pop_front();
      l.unlock();
      std::this_thread::sleep_until(due);
      size_t off = 0;
      while (off < data.size()) {
        ssize_t w = write(out_, data.data() + off, data.size() - off);
        if (w <= 0) {
          std::lock_guard<std::mutex> g(mu_);
          failed_ = true;
          space_.notify_all();
          shutdown(in_, SHUT_RD);
          return;
        }
        off += static_cast<size_t>(w);
      }
      l.lock();
      queued_ -= data.size();
      space_.notify_one();
    }
  }
  int in_, out_;
  double delay_;
  std::chrono::microseconds gather_;
  size_t cap_, queued_ = 0;
  bool eof_ = false, failed_ = false;
  std::mutex mu_;
  std::condition_variable ready_, space_;
  std::deque<std::pair<Clock::time_point, std::string>> q_;
};

void Serve(int client, const Args& a) {
  int upstream = Connect(a.target);
  if (upstream < 0) {
    std::fprintf(stderr, "meridian-wanrelay: cannot connect to %s\n", a.target.c_str());
    close(client);
    return;
  }
  Pipe up(client, upstream, a.delay_ms, a.gather_ms, a.buffer),
      down(upstream, client, a.delay_ms, a.gather_ms, a.buffer);
  std::thread t([&] { down.Run(); });
  up.Run();
  t.join();
  close(client);
  close(upstream);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--listen")
      a.listen = v;
    else if (k == "--target")
      a.target = v;
    else if (k == "--delay-ms")
      a.delay_ms = std::atof(v.c_str());
    else if (k == "--buffer-bytes")
      a.buffer = static_cast<size_t>(std::atoll(v.c_str()));
    else if (k == "--gather-ms")
      a.gather_ms = std::atof(v.c_str());
    else {
      std::fprintf(stderr, "meridian-wanrelay: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (a.listen.empty() || a.target.empty() || a.delay_ms < 0 || !(a.gather_ms > 0 && a.gather_ms <= 100)) {
    std::fprintf(stderr,
                 "usage: meridian-wanrelay --listen HOST:PORT --target HOST:PORT --delay-ms D [--buffer-bytes B] "
                 "[--gather-ms G, 0 < G <= 100]\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  std::string host, port;
  SplitHostPort(a.listen, &host, &port);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::atoi(port.c_str())));
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1 ||
      bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || listen(fd, 64) != 0) {
    std::fprintf(stderr, "meridian-wanrelay: cannot listen on %s: %s\n", a.listen.c_str(), std::strerror(errno));
    return 1;
  }
  std::printf("relaying %s -> %s with %.1f ms each way\n", a.listen.c_str(), a.target.c_str(), a.delay_ms);
  std::fflush(stdout);
  while (true) {
    int c = accept(fd, nullptr, nullptr);
    if (c < 0) continue;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::thread([c, a] { Serve(c, a); }).detach();
  }
}
