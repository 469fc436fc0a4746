#include "executor/site_group.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef MERIDIAN_HAVE_NCCL
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <future>
#include <random>

#include "gpu/nccl_group.h"
#endif

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/log.h"
#include "core/thread_name.h"

namespace meridian::executor {
namespace {

#ifdef MERIDIAN_HAVE_NCCL
// A CUDA site's NCCL group with its calls on a thread of its own, run in the order submitted: an NcclGroup
// is used by one thread, and a gradient bucket's sum started from autograd's hooks runs while the backward
// pass goes on (the group's stream waits for the device's default stream only up to each call's
// StreamMark, and the default stream never waits for it).
// Thread-safe: Submit from any thread; the group itself is touched by the thread only (Abort excepted).
class NcclThread {
 public:
  using Op = std::function<absl::Status(gpu::NcclGroup&, const gpu::StreamMark*)>;
  NcclThread() : thread_(core::NamedThread("mrd-nccl", [this] { Loop(); })) {}
  // A call still queued or running belongs to a step that failed (a step waits for every call it starts):
  // the group is aborted rather than waited for, so each ends at once with an error no one reads.
  ~NcclThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      if ((busy_ || !queue_.empty()) && joined_) joined_->Abort();
    }
    cv_.notify_all();
    thread_.join();
  }
  absl::Status Join(const std::string& id_file, int rank, int size, int device, std::chrono::milliseconds timeout) {
    return Post([=, this]() -> absl::Status {
             auto g = gpu::NcclGroup::Join(id_file, rank, size, device, timeout);
             if (!g.ok()) return g.status();
             group_ = std::move(*g);
             std::lock_guard<std::mutex> lock(mu_);
             joined_ = group_.get();
             return absl::OkStatus();
           })
        .get();
  }
  // `op` on the joined group, after `after`'s work on the device and after everything submitted before it.
  std::shared_future<absl::Status> Submit(Op op, std::shared_ptr<const gpu::StreamMark> after) {
    return Post([this, op = std::move(op), after = std::move(after)]() -> absl::Status {
      if (!group_) return absl::FailedPreconditionError("the NCCL group was not joined");
      return op(*group_, after.get());
    });
  }

 private:
  // Runs `fn` on the thread; an exception it throws (torch's, reading a tensor) becomes its error.
  std::shared_future<absl::Status> Post(std::function<absl::Status()> fn) {
    std::packaged_task<absl::Status()> task([fn = std::move(fn)]() -> absl::Status {
      try {
        return fn();
      } catch (const std::exception& e) {
        return absl::InternalError(core::Printable(e.what()));
      }
    });
    std::shared_future<absl::Status> done = task.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_all();
    return done;
  }
  void Loop() {
    for (;;) {
      std::packaged_task<absl::Status()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        busy_ = false;
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) break;  // stopping, and everything run
        task = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      task();
    }
    group_.reset();  // ncclCommDestroy on the thread that used it
  }

  std::mutex mu_;  // guards the five below
  std::condition_variable cv_;
  std::deque<std::packaged_task<absl::Status()>> queue_;
  bool stop_ = false, busy_ = false;
  gpu::NcclGroup* joined_ = nullptr;       // group_ once joined: for Abort, its one call from another thread
  std::unique_ptr<gpu::NcclGroup> group_;  // the thread's alone
  std::thread thread_;                     // last: it uses everything above
};
#endif

}  // namespace

struct SiteGroup::Impl {
  c10::intrusive_ptr<::c10d::ProcessGroup> pg;
  torch::Device device{torch::kCPU};  // the worker's
#ifdef MERIDIAN_HAVE_NCCL
  std::unique_ptr<NcclThread> nccl;  // on a CUDA device
#endif

  bool has_nccl() const {
#ifdef MERIDIAN_HAVE_NCCL
    return nccl != nullptr;
#else
    return false;
#endif
  }
  const char* backend() const { return has_nccl() ? "NCCL" : "c10d/Gloo"; }
  // Point to point, waited for: `t` (float32, contiguous, on collective_device()) to or from worker
  // `peer`. Gloo's failures throw; NCCL's come back.
  absl::Status SendRows(torch::Tensor t, int peer) {
#ifdef MERIDIAN_HAVE_NCCL
    if (nccl)
      return StartNccl([t, peer](gpu::NcclGroup& n, const gpu::StreamMark* after) {
               return n.Send(t.data_ptr<float>(), t.numel(), peer, after);
             })
          .get();
#endif
    std::vector<at::Tensor> v{t};
    pg->send(v, peer, 0)->wait();
    return absl::OkStatus();
  }
  absl::Status RecvRows(torch::Tensor t, int peer) {
#ifdef MERIDIAN_HAVE_NCCL
    if (nccl)
      return StartNccl([t, peer](gpu::NcclGroup& n, const gpu::StreamMark* after) {
               return n.Recv(t.data_ptr<float>(), t.numel(), peer, after);
             })
          .get();
#endif
    std::vector<at::Tensor> v{t};
    pg->recv(v, peer, 0)->wait();
    return absl::OkStatus();
  }
  // Whether `t` goes through NCCL: float32, contiguous, on the worker's CUDA device, under NCCL.
  bool OnNccl(const torch::Tensor& t) const {
    return has_nccl() && t.defined() && t.device() == device && t.scalar_type() == torch::kFloat32 && t.is_contiguous();
  }
#ifdef MERIDIAN_HAVE_NCCL
  // Starts `op` after the work queued so far on the device's default stream, where torch computed what it
  // reads (a StreamMark recorded here, on the caller's thread); the tensors it uses must outlive it
  // (capture them). A mark that cannot be recorded fails the call.
  std::shared_future<absl::Status> StartNccl(NcclThread::Op op) {
    auto mark = gpu::StreamMark::Record(device.index());
    if (!mark.ok()) {
      std::promise<absl::Status> failed;
      failed.set_value(mark.status());
      return failed.get_future().share();
    }
    return nccl->Submit(std::move(op), std::move(*mark));
  }
#endif
};

SiteGroup::SiteGroup(int rank, int size, std::string where)
    : rank_(rank), size_(size), where_(std::move(where)), impl_(std::make_unique<Impl>()) {}

absl::StatusOr<std::unique_ptr<SiteGroup>> SiteGroup::Join(const std::string& store_path, int rank, int size,
                                                           std::chrono::milliseconds timeout, std::string where,
                                                           const std::string& device) {
  std::unique_ptr<SiteGroup> g(new SiteGroup(rank, size, std::move(where)));
  absl::Status s = g->Guard("joining the site's process group", [&] {
    g->impl_->device = torch::Device(device);
    auto store = c10::make_intrusive<::c10d::FileStore>(store_path, size);
    store->setTimeout(timeout);
    auto opts = ::c10d::ProcessGroupGloo::Options::create();
    // The workers of a site share its host: loopback, which every network namespace has.
    opts->devices.push_back(::c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    opts->timeout = timeout;
    g->impl_->pg = c10::make_intrusive<::c10d::ProcessGroupGloo>(store, rank, size, opts);
  });
  if (!s.ok()) return s;
  if (!g->impl_->device.is_cuda()) return g;
#ifdef MERIDIAN_HAVE_NCCL
  // Rank 0's NCCL id goes through a file named by rank 0's random number, shared through Gloo: a file an
  // earlier group left at that path is never read. ncclCommInitRank returns once every rank has read it.
  torch::Tensor nonce = torch::zeros({1}, torch::kInt64);
  if (rank == 0) {
    std::random_device random;
    nonce[0] = static_cast<int64_t>((uint64_t{random()} << 31) ^ random());
  }
  if (absl::Status b = g->Broadcast(nonce); !b.ok()) return b;
  const std::string id_file = absl::StrCat(store_path, ".nccl-id.", nonce.item<int64_t>());
  g->impl_->nccl = std::make_unique<NcclThread>();
  if (absl::Status j = g->impl_->nccl->Join(id_file, rank, size, g->impl_->device.index(), timeout); !j.ok())
    return absl::UnavailableError(
        absl::StrCat(g->where_, " worker ", rank, " of ", size, ": joining the site's NCCL group: ", j.message()));
  if (rank == 0) std::remove(id_file.c_str());
  spdlog::info("{}", absl::StrCat(g->where_, " worker ", rank, " of ", size, " on ", device,
                                  ": NCCL among the site's workers, Gloo for host tensors"));
#else
  spdlog::warn("{}", absl::StrCat(g->where_, " worker ", rank, " of ", size, " on ", device,
                                  ": this build has no NCCL; the site's workers sum through Gloo via host memory"));
#endif
  return g;
}

SiteGroup::~SiteGroup() = default;

bool SiteGroup::uses_nccl() const { return impl_->has_nccl(); }

torch::Device SiteGroup::collective_device() const { return impl_->has_nccl() ? impl_->device : torch::kCPU; }

namespace {
// A collective's failure: the site cannot go on with this group.
absl::Status GroupFailure(const SiteGroup& g, const char* what, const char* backend, absl::string_view message) {
  return absl::UnavailableError(
      absl::StrCat(g.where(), " worker ", g.rank(), " of ", g.size(), ": ", what, " (", backend, "): ", message));
}
// An NCCL call's outcome, its failure worded as Guard words Gloo's.
absl::Status NcclFailure(const SiteGroup& g, const char* what, const absl::Status& s) {
  return s.ok() ? s : GroupFailure(g, what, "NCCL", s.message());
}
}  // namespace

absl::Status SiteGroup::Guard(const char* what, const std::function<void()>& fn, const char* backend) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    // Gloo reports a worker gone or late as an exception: the site cannot go on with this group.
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    return GroupFailure(*this, what, backend, core::Printable(msg));
  }
}

std::pair<int64_t, int64_t> SiteGroup::Rows(int64_t rows, int worker) const {
  const int64_t base = rows / size_, extra = rows % size_;
  const int64_t first = worker * base + std::min<int64_t>(worker, extra);
  return {first, base + (worker < extra ? 1 : 0)};
}

// Scatter and Gather move rows point to point, worker 0 with each worker in turn: through NCCL on the
// worker's CUDA device, else through Gloo on the host (rows of a contiguous tensor are contiguous). A Gloo
// failure throws, caught by Guard; an NCCL one comes back as a status.
absl::StatusOr<torch::Tensor> SiteGroup::Scatter(const torch::Tensor& whole, const std::vector<int64_t>& whole_shape) {
  const char* what = "scattering a micro-batch's rows";
  const auto opts = torch::TensorOptions().device(collective_device()).dtype(torch::kFloat32);
  torch::Tensor mine;
  absl::Status moved;
  absl::Status s = Guard(
      what,
      [&] {
        if (rank_ == 0) {
          torch::Tensor w = whole.detach().to(opts).contiguous();
          for (int r = 1; r < size_ && moved.ok(); ++r) {
            auto [first, count] = Rows(whole_shape[0], r);
            moved = impl_->SendRows(w.narrow(0, first, count), r);
          }
          auto [first, count] = Rows(whole_shape[0], 0);
          mine = w.narrow(0, first, count).clone();
        } else {
          std::vector<int64_t> shape = whole_shape;
          shape[0] = Rows(whole_shape[0], rank_).second;
          mine = torch::empty(shape, opts);
          moved = impl_->RecvRows(mine, 0);
        }
      },
      impl_->backend());
  if (!s.ok()) return s;
  if (!moved.ok()) return NcclFailure(*this, what, moved);
  return mine;
}

absl::StatusOr<torch::Tensor> SiteGroup::Gather(const torch::Tensor& mine, const std::vector<int64_t>& whole_shape) {
  const char* what = "gathering a micro-batch's rows";
  const auto opts = torch::TensorOptions().device(collective_device()).dtype(torch::kFloat32);
  torch::Tensor whole;
  absl::Status moved;
  absl::Status s = Guard(
      what,
      [&] {
        torch::Tensor m = mine.detach().to(opts).contiguous();
        if (rank_ == 0) {
          whole = torch::empty(whole_shape, opts);
          auto [first0, count0] = Rows(whole_shape[0], 0);
          whole.narrow(0, first0, count0).copy_(m);
          for (int r = 1; r < size_ && moved.ok(); ++r) {
            auto [first, count] = Rows(whole_shape[0], r);
            moved = impl_->RecvRows(whole.narrow(0, first, count), r);
          }
        } else {
          moved = impl_->SendRows(m, 0);
        }
      },
      impl_->backend());
  if (!s.ok()) return s;
  if (!moved.ok()) return NcclFailure(*this, what, moved);
  return whole;
}

absl::Status SiteGroup::AllReduce(torch::Tensor& t) { return StartAllReduce(t).Wait(); }

absl::Status SiteGroup::Broadcast(torch::Tensor& t) {
#ifdef MERIDIAN_HAVE_NCCL
  if (impl_->OnNccl(t)) {
    std::shared_future<absl::Status> done;
    auto op = [t](gpu::NcclGroup& n, const gpu::StreamMark* after) {
      return n.Broadcast(t.data_ptr<float>(), t.numel(), after);
    };
    if (absl::Status s = Guard(
            "broadcasting from worker 0", [&] { done = impl_->StartNccl(op); }, "NCCL");
        !s.ok())
      return s;
    return NcclFailure(*this, "broadcasting from worker 0", done.get());
  }
#endif
  return Guard("broadcasting from worker 0", [&] {
    std::vector<at::Tensor> v{t};
    ::c10d::BroadcastOptions o;
    o.rootRank = 0;
    impl_->pg->broadcast(v, o)->wait();
  });
}

absl::Status SiteGroup::BroadcastInPlace(const std::vector<torch::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  // Through NCCL when every tensor is on the worker's CUDA device; host tensors (a checkpoint's moments)
  // stay on the host, through Gloo.
  bool on_device = impl_->has_nccl();
  for (const auto& t : tensors) on_device = on_device && t.device() == impl_->device;
  std::vector<torch::Tensor> parts;
  for (const auto& t : tensors)
    parts.push_back(t.detach().reshape({-1}).to(on_device ? impl_->device : torch::kCPU, torch::kFloat32));
  torch::Tensor flat = torch::cat(parts);
  if (absl::Status s = Broadcast(flat); !s.ok()) return s;
  int64_t offset = 0;
  for (const auto& t : tensors) {
    torch::Tensor(t).copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> SiteGroup::AllGather(const torch::Tensor& mine) {
  torch::Tensor out;
#ifdef MERIDIAN_HAVE_NCCL
  if (impl_->has_nccl() && mine.device() == impl_->device) {
    const char* what = "gathering the workers' shards";
    std::shared_future<absl::Status> done;
    absl::Status s = Guard(
        what,
        [&] {
          const auto opts = torch::TensorOptions().device(impl_->device).dtype(torch::kFloat32);
          torch::Tensor in = mine.detach().to(opts).contiguous();
          if (in.dim() == 0) in = in.reshape({1});
          std::vector<int64_t> shape = in.sizes().vec();
          shape[0] *= size_;  // as the workers' tensors concatenated along dimension 0
          out = torch::empty(shape, opts);
          done = impl_->StartNccl([in, out](gpu::NcclGroup& n, const gpu::StreamMark* after) {
            return n.AllGather(in.data_ptr<float>(), out.data_ptr<float>(), in.numel(), after);
          });
        },
        "NCCL");
    if (!s.ok()) return s;
    if (absl::Status n = NcclFailure(*this, what, done.get()); !n.ok()) return n;
    return out;
  }
#endif
  absl::Status s = Guard("gathering the workers' shards", [&] {
    std::vector<at::Tensor> in{mine.detach().to(torch::kCPU, torch::kFloat32).contiguous()};
    std::vector<std::vector<at::Tensor>> parts(1);
    for (int r = 0; r < size_; ++r) parts[0].push_back(torch::empty_like(in[0]));
    impl_->pg->allgather(parts, in)->wait();
    out = torch::cat(parts[0]);
  });
  if (!s.ok()) return s;
  return out;
}

SiteGroup::PendingSum SiteGroup::StartAllReduce(torch::Tensor t) {
  PendingSum p;
#ifdef MERIDIAN_HAVE_NCCL
  if (impl_->OnNccl(t)) {
    std::shared_future<absl::Status> done;
    auto op = [t](gpu::NcclGroup& n, const gpu::StreamMark* after) {
      return n.AllReduceSum(t.data_ptr<float>(), t.numel(), after);
    };
    absl::Status started = Guard(
        "summing over the workers", [&] { done = impl_->StartNccl(op); }, "NCCL");
    if (!started.ok())
      p.wait_ = [started] { return started; };
    else
      p.wait_ = [this, done] { return NcclFailure(*this, "summing over the workers", done.get()); };
    return p;
  }
#endif
  c10::intrusive_ptr<::c10d::Work> work;
  absl::Status started = Guard("summing over the workers", [&] {
    std::vector<at::Tensor> v{t};
    work = impl_->pg->allreduce(v);
  });
  if (!started.ok()) {
    p.wait_ = [started] { return started; };
    return p;
  }
  p.wait_ = [this, work] { return Guard("summing over the workers", [&] { work->wait(); }); };
  return p;
}

absl::Status SiteGroup::PendingSum::Wait() {
  if (!wait_) return absl::FailedPreconditionError("no sum was started");
  auto w = std::move(wait_);
  wait_ = nullptr;
  return w();
}

// ---- SiteReducer ----

SiteReducer::SiteReducer(SiteGroup* group, std::vector<std::pair<std::string, torch::Tensor>> params,
                         int64_t bucket_bytes)
    : group_(group), params_(std::move(params)) {
  const BucketLayout layout = LayOutBuckets(params_, bucket_bytes);
  bucket_of_ = layout.bucket_of;
  offset_of_ = layout.offset_of;
  for (const auto& l : layout.buckets) {
    Bucket b;
    b.params = l.params;
    b.data = torch::zeros({l.numel}, torch::TensorOptions().device(group_->collective_device()).dtype(torch::kFloat32));
    buckets_.push_back(std::move(b));
  }
  captured_.assign(params_.size(), false);
  hooks_ = std::make_unique<GradientHooks>(params_, [this](int i, const torch::Tensor& grad) { OnGradient(i, grad); });
}

SiteReducer::~SiteReducer() { hooks_.reset(); }

void SiteReducer::CaptureNextBackward() {
  capturing_ = true;
  during_backward_ = 0;
  std::fill(captured_.begin(), captured_.end(), false);
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.started = false;
  }
}

void SiteReducer::OnGradient(int param, const torch::Tensor& grad) {
  if (!capturing_ || captured_[param]) return;
  // The hook runs before autograd adds `grad` to .grad: the final gradient is their sum.
  const torch::Tensor& p = params_[param].second;
  Capture(param, p.grad().defined() ? p.grad() + grad : grad);
  const int b = bucket_of_[param];
  if (buckets_[b].pending == 0) {
    Start(b);
    ++during_backward_;
  }
}

void SiteReducer::Capture(int param, const torch::Tensor& final_grad) {
  Bucket& b = buckets_[bucket_of_[param]];
  auto dst = b.data.narrow(0, offset_of_[param], params_[param].second.numel());
  if (final_grad.defined())
    dst.copy_(final_grad.detach().reshape({-1}).to(b.data.device(), torch::kFloat32));
  else
    dst.zero_();
  captured_[param] = true;
  --b.pending;
}

void SiteReducer::Start(int bucket) {
  Bucket& b = buckets_[bucket];
  b.started = true;
  b.sum = group_->StartAllReduce(b.data);
}

absl::StatusOr<double> SiteReducer::Finish() {
  const auto t0 = std::chrono::steady_clock::now();
  if (!capturing_) CaptureNextBackward();  // no backward pass this step (LoRA's frozen first stages)
  capturing_ = false;
  for (int i = 0; i < static_cast<int>(params_.size()); ++i)
    if (!captured_[i]) Capture(i, params_[i].second.grad());
  for (int b = 0; b < static_cast<int>(buckets_.size()); ++b)
    if (!buckets_[b].started) Start(b);
  absl::Status first;
  for (auto& b : buckets_) {
    absl::Status s = b.sum.Wait();
    if (!s.ok() && first.ok()) first = s;
  }
  if (!first.ok()) return first;
  torch::NoGradGuard no_grad;
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    torch::Tensor& p = params_[i].second;
    auto sum = buckets_[bucket_of_[i]].data.narrow(0, offset_of_[i], p.numel()).view(p.sizes());
    p.mutable_grad() = sum.to(p.device()).clone();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- WorkerPool ----

absl::StatusOr<std::pair<int, int>> ParseSiteWorker(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, '/');
  int r = 0, k = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &r) || !absl::SimpleAtoi(parts[1], &k) || k < 2 || k > 64 ||
      r < 1 || r >= k)
    return absl::InvalidArgumentError(absl::StrCat("--site-worker: '", core::Printable(text),
                                                   "' is not R/K with 1 <= R < K <= 64 (worker 0 is the executor)"));
  return std::make_pair(r, k);
}

absl::StatusOr<std::unique_ptr<WorkerPool>> WorkerPool::Start(const std::vector<std::string>& args,
                                                              const std::vector<std::string>& devices,
                                                              std::string where) {
  std::unique_ptr<WorkerPool> pool(new WorkerPool());
  pool->where_ = std::move(where);
  const int k = static_cast<int>(devices.size());
  for (int r = 1; r < k; ++r) {
    std::vector<std::string> argv = {"/proc/self/exe"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--site-worker", absl::StrCat(r, "/", k), "--site-device", devices[r]});
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0)
      return absl::InternalError(absl::StrCat(pool->where_, ": cannot start worker ", r, ": ", std::strerror(errno)));
    if (pid == 0) {
      // A worker never outlives its executor (kill -9 of the executor included).
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(3);
      ::execv(cargv[0], cargv.data());
      ::_exit(127);
    }
    pool->pids_.push_back(pid);
    spdlog::info("{}", absl::StrCat(pool->where_, ": worker ", r, " of ", k, " on ", devices[r], " is process ", pid));
  }
  pool->exited_.assign(pool->pids_.size(), false);
  pool->killed_.assign(pool->pids_.size(), false);
  pool->monitor_ = core::NamedThread("mrd-workers", [p = pool.get()] { p->Monitor(); });
  return pool;
}

// With mu_ held: reaps worker i + 1 if it has exited (waitpid without waiting). A worker that ended by a
// signal or an error code, unless Stop killed it, is the site's loss: this process ends (exit code 3).
bool WorkerPool::ReapLocked(size_t i) {
  if (exited_[i]) return true;
  int status = 0;
  const pid_t got = ::waitpid(pids_[i], &status, WNOHANG);
  if (got == 0) return false;
  exited_[i] = true;
  const bool clean = got == pids_[i] && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (clean || killed_[i]) return true;
  const std::string how = got != pids_[i]       ? std::string("lost")
                          : WIFSIGNALED(status) ? absl::StrCat("killed by signal ", WTERMSIG(status))
                                                : absl::StrCat("exit code ", WEXITSTATUS(status));
  spdlog::error("{}", absl::StrCat(where_, ": worker ", i + 1, " (process ", pids_[i], ") died (", how,
                                   "); the site reports itself lost and this executor exits"));
  for (pid_t other : pids_) ::kill(other, SIGKILL);
  spdlog::default_logger()->flush();
  std::_Exit(3);
}

void WorkerPool::Monitor() {
  for (;;) {
    bool all = true;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (size_t i = 0; i < pids_.size(); ++i) all &= ReapLocked(i);
    }
    if (all) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void WorkerPool::Stop(std::chrono::milliseconds grace) {
  const auto until = std::chrono::steady_clock::now() + grace;
  for (;;) {
    bool all = true;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (size_t i = 0; i < pids_.size(); ++i) all &= ReapLocked(i);
    }
    if (all || std::chrono::steady_clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {
    // A worker still running now is killed on purpose; one that died meanwhile was judged by ReapLocked.
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < pids_.size(); ++i)
      if (!ReapLocked(i)) {
        killed_[i] = true;
        ::kill(pids_[i], SIGKILL);
      }
  }
  if (monitor_.joinable()) monitor_.join();
}

// A worker killed by someone else closes its sockets before it can be reaped: worker 0 may see its group
// fail and come here first. A second lets such a worker finish dying and be judged (a death, not our
// kill); the workers still running are waiting in a collective and are killed then.
WorkerPool::~WorkerPool() { Stop(std::chrono::seconds(1)); }

}  // namespace meridian::executor
