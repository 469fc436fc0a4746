#include "coordinator/run_machine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "compression/activation_delta.h"
#include "coordinator/step_figures.h"
#include "core/log.h"
#include "core/run_layout.h"
#include "job/job.h"
#include "partitioner/schedule.h"

namespace meridian::coordinator {

namespace {

// The model's training state (weights and AdamW moments: the graph's parameter and optimizer bytes), what
// a checkpoint step (but for a switch's boundary under job.step_overlap: StoreQuotaBytes) or the final
// weights hold at most besides headers; and room for those headers.
int64_t TrainingStateBytes(const partitioner::OpGraph& graph) {
  double bytes = 0;
  for (const auto& op : graph.ops) bytes += op.param_bytes + op.optimizer_bytes;
  return static_cast<int64_t>(bytes);
}
constexpr int64_t kHeaderBytes = int64_t{64} << 20;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

Clock::duration After(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// A string a site sent, safe for the operator's terminal and the logs (core::Printable).
std::string Clean(const std::string& text) { return core::Printable(text); }

// A site's figures against the spec and the job, wherever they come from (its report, or --profile): as
// many workers as the spec gives it devices (a site cannot claim more to draw work, or fewer, for that
// matter), a finite all-reduce bandwidth, times only of the job's ops, finite. *capped: the figures with
// the memory capped at the spec's `memory:` for it, which bounds what the planner may use there whatever
// the device has free.
absl::Status CheckSiteFigures(const partitioner::SiteProfile& p, const core::ClusterSpec& spec,
                              const partitioner::OpGraph& graph, partitioner::SiteProfile* capped) {
  auto finite = [](double v) { return std::isfinite(v) && v >= 0; };
  const core::SiteSpec* in_spec = nullptr;
  for (const auto& s : spec.sites)
    if (s.name == p.name) in_spec = &s;
  const int devices = in_spec ? std::max<int>(1, static_cast<int>(in_spec->devices.size())) : 1;
  if (p.workers != devices)
    return absl::InvalidArgumentError(
        absl::StrCat("it reports ", p.workers, " workers, but the spec gives it ", devices, " device(s)"));
  if (!finite(p.intra_site_bytes_per_second))
    return absl::InvalidArgumentError("its workers' all-reduce bandwidth is not a finite number");
  for (const auto& [op, seconds] : p.op_seconds) {
    if (std::none_of(graph.ops.begin(), graph.ops.end(), [&](const auto& o) { return o.name == op; }))
      return absl::InvalidArgumentError(absl::StrCat("op '", op, "' is not in the job's model"));
    if (!finite(seconds)) return absl::InvalidArgumentError(absl::StrCat("op '", op, "' took a non-finite time"));
  }
  *capped = p;
  if (in_spec && in_spec->memory_bytes) capped->memory_bytes = std::min(capped->memory_bytes, *in_spec->memory_bytes);
  return absl::OkStatus();
}

// "'a', 'b'"
std::string Quoted(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "'" : ", '") + n + "'";
  return out;
}

// "a -> b+c": each stage's sites, in order.
std::string LayoutOf(const partitioner::Plan& plan) {
  std::string layout;
  for (const auto& st : plan.stages) {
    if (!layout.empty()) layout += " -> ";
    for (size_t i = 0; i < st.site_names.size(); ++i) layout += (i ? "+" : "") + st.site_names[i];
  }
  return layout;
}

std::set<std::string> SitesOf(const partitioner::Plan& plan) {
  std::set<std::string> out;
  for (const auto& st : plan.stages) out.insert(st.site_names.begin(), st.site_names.end());
  return out;
}

// The lower median. REQUIRES: !values.empty().
double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[(values.size() - 1) / 2];
}

// The last `n` of `values` (all of them when there are fewer).
std::vector<double> Last(const std::vector<double>& values, size_t n) {
  return {values.end() - static_cast<std::ptrdiff_t>(std::min(n, values.size())), values.end()};
}

// The index of site `name` in `profile`, or -1 when it is not there.
int SiteIndex(const partitioner::ClusterProfile& profile, const std::string& name) {
  for (size_t i = 0; i < profile.sites.size(); ++i)
    if (profile.sites[i].name == name) return static_cast<int>(i);
  return -1;
}

}  // namespace

RunMachine::RunMachine(RunConfig config) : c_(std::move(config)) {
  for (const auto& s : c_.spec.sites) sites_[s.name];
  resume_ = c_.resume;
}

std::vector<Action> RunMachine::Handle(const Event& event) {
  out_.clear();
  now_ = event.now;
  if (phase_ == Phase::kFinished) return {};
  std::visit(
      [&](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, RunStarted>) {
          started_ = true;
          join_deadline_ =
              c_.join_timeout_seconds > 0 ? now_ + After(c_.join_timeout_seconds) : Clock::time_point::max();
          if (Registered() >= (c_.spec.min_sites > 0 ? static_cast<size_t>(c_.spec.min_sites) : c_.spec.sites.size()))
            StartProfiling();
        } else if constexpr (std::is_same_v<T, SiteRegistered>) {
          OnRegistered(e);
        } else if constexpr (std::is_same_v<T, ProfileReported>) {
          OnProfile(e);
        } else if constexpr (std::is_same_v<T, MetricsReported>) {
          OnMetrics(e);
        } else if constexpr (std::is_same_v<T, StageReportedDone>) {
          OnDone(e);
        } else if constexpr (std::is_same_v<T, HeartbeatLost>) {
          OnLost(e);
        } else if constexpr (std::is_same_v<T, HeartbeatBack>) {
          OnBack(e);
        } else if constexpr (std::is_same_v<T, SiteLeaving>) {
          OnLeaving(e);
        } else {
          OnTick();
        }
      },
      event.what);
  // Deadlines pass whatever the events: a stream of reports must not keep a timeout from firing.
  if (phase_ != Phase::kFinished && !std::holds_alternative<Tick>(event.what)) OnTick();
  return std::move(out_);
}

size_t RunMachine::Registered() const {
  size_t n = 0;
  for (const auto& [name, s] : sites_) n += s.registered;
  return n;
}

std::vector<std::string> RunMachine::SilentUsed() const {
  std::vector<std::string> out;
  for (const auto& name : attempt_.used)
    if (sites_.at(name).silent) out.push_back(name);
  for (const auto& name : attempt_.left_out)  // left out of the attempt, but lost from it all the same
    if (sites_.at(name).silent && std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  return out;
}

// ---- Joining and profiling ----

void RunMachine::OnRegistered(const SiteRegistered& e) {
  auto it = sites_.find(e.site);
  if (it == sites_.end()) return;  // the service admits only the spec's sites
  SiteState& s = it->second;
  s.registered = true;
  s.listen = e.listen;  // a restarted executor may listen elsewhere
  s.device = e.device;  // (silence is the heartbeats' to end: HeartbeatBack follows a re-registration)
  // (What a site says of itself is its to say: escaped and bounded before it is shown anywhere.)
  const std::string joined =
      absl::StrCat("joined: listens on ", Clean(e.listen.substr(0, 300)), ", device ", Clean(e.device.substr(0, 100)));
  Out(LogSite{e.site, joined});
  Note("join", e.site, joined);
  failed_joiners_.erase(e.site);  // registered again: it may be measured again
  DropRemeasure(e.site, "which registered again (the request was lost)");
  // A site lost from the run whose executor registers again while training goes on: measured afresh as a
  // site joining mid-run (its old figures dropped), and switched to when a plan with it pays; it then
  // resumes from the switch's checkpoint (under DiLoCo: the current outer parameters).
  if (lost_.count(e.site) && c_.spec.on_failure == core::OnFailure::kReplan && c_.spec.elastic.enabled &&
      (phase_ == Phase::kTraining || phase_ == Phase::kSwitching)) {
    lost_.erase(e.site);
    auto& ps = profile_.sites;
    ps.erase(std::remove_if(ps.begin(), ps.end(), [&](const partitioner::SiteProfile& p) { return p.name == e.site; }),
             ps.end());
    auto& ls = profile_.links;
    ls.erase(std::remove_if(ls.begin(), ls.end(),
                            [&](const partitioner::LinkProfile& l) { return l.from == e.site || l.to == e.site; }),
             ls.end());
    const std::string again = "registered again after it was lost: it is measured afresh as a site joining mid-run";
    Out(LogSite{e.site, again});
    Note("join", e.site, again);
  }
  // A measured site whose executor registered again (restarted) before answering its round: the new one
  // never got the request, so it is asked again.
  if (phase_ == Phase::kProfiling && std::find(joined_.begin(), joined_.end(), e.site) != joined_.end()) {
    if (!probing_links_ && !profiles_.count(e.site)) {
      Out(LogSite{e.site, "registered again while measuring: asked again to measure its device and the model"});
      Out(SendCommand{e.site, ProfileCommand(e.site, {}, /*links_only=*/false, /*keep_busy=*/true)});
    } else if (auto p = probing_.find(e.site); probing_links_ && p != probing_.end()) {
      Out(LogSite{e.site, "registered again while measuring: asked again to measure its links"});
      Out(SendCommand{e.site, ProfileCommand(e.site, {p->second.begin(), p->second.end()}, /*links_only=*/true)});
    }
  }
  const size_t need = c_.spec.min_sites > 0 ? static_cast<size_t>(c_.spec.min_sites) : c_.spec.sites.size();
  if (phase_ == Phase::kJoining && started_ && Registered() >= need) StartProfiling();
}

void RunMachine::StartProfiling() {
  for (const auto& [name, s] : sites_)
    if (s.registered && !s.silent && !leaving_.count(name))
      joined_.push_back(name);  // one that went silent since, or asked to leave, is not asked
  phase_ = Phase::kProfiling;
  if (c_.given_profile) return UseGivenProfile();
  Say(absl::StrCat(joined_.size(), " sites joined; measuring devices, the model and the links\n"));
  // Emulated sites are measured at once too: they share this host's cores, as they do when a plan runs
  // them together (measured one at a time, a three-site plan's step came out 22% shorter than it ran:
  // bench/RESULTS.md, "The WAN-bound regime").
  for (const auto& site : joined_) {
    Out(LogSite{site, "asked to measure its device and the model"});
    Out(SendCommand{site, ProfileCommand(site, {}, /*links_only=*/false, /*keep_busy=*/true)});
  }
}

namespace {

// Rounds of link probes in which no site takes part in two at once: a site's uplink (or its emulated
// one) is shared, and two probes at once each read about half its rate (a 20 Mbit/s link measured 9.5
// while its sender probed another link: bench/RESULTS.md, the simulator section, session 21). The circle
// method over the sites sorted by name, with a bye for an odd number: every pair once, in n - 1 rounds (n
// for odd n); in each pair the site whose name sorts first probes both directions, one after the other.
std::deque<std::map<std::string, std::set<std::string>>> ProbeRounds(std::vector<std::string> sites) {
  std::sort(sites.begin(), sites.end());
  if (sites.size() % 2) sites.push_back("");  // the bye
  std::deque<std::map<std::string, std::set<std::string>>> rounds;
  const size_t n = sites.size();
  for (size_t r = 0; n >= 2 && r + 1 < n; ++r) {
    std::map<std::string, std::set<std::string>> round;
    for (size_t i = 0; i < n / 2; ++i) {
      const std::string& x = sites[i];
      const std::string& y = sites[n - 1 - i];
      if (x.empty() || y.empty()) continue;
      round[std::min(x, y)].insert(std::max(x, y));
    }
    rounds.push_back(std::move(round));
    std::rotate(sites.begin() + 1, sites.end() - 1, sites.end());  // the first stays, the others turn
  }
  return rounds;
}

}  // namespace

void RunMachine::StartLinkProbes() {
  // Every site measured its model: the ones kept computing meanwhile (keep_busy) stop before any link is
  // probed, whether or not they probe one in the first round -- and one whose profile did not check out.
  for (const auto& [name, s] : sites_) {
    if (!s.registered || s.silent) continue;
    v1::Command settle;
    settle.set_settle(true);
    Out(SendCommand{name, settle});
  }
  probing_links_ = true;
  probe_rounds_ = ProbeRounds(joined_);
  NextProbeRound();
}

void RunMachine::NextProbeRound() {
  while (probing_.empty() && !probe_rounds_.empty()) {
    for (const auto& [site, peers] : probe_rounds_.front()) {
      // A site dropped in an earlier round (its links did not check out) probes and is probed no more.
      auto in = [&](const std::string& s) { return std::find(joined_.begin(), joined_.end(), s) != joined_.end(); };
      std::vector<std::string> live;
      for (const auto& p : peers)
        if (in(p)) live.push_back(p);
      if (!in(site) || live.empty()) continue;
      probing_[site] = {live.begin(), live.end()};
      Out(LogSite{site, absl::StrCat("asked to measure its links to ", absl::StrJoin(live, ", "))});
      Out(SendCommand{site, ProfileCommand(site, live, /*links_only=*/true)});
    }
    probe_rounds_.pop_front();
  }
  if (probing_.empty()) FinishProfiling();  // every round answered (one site: no link to measure)
}

void RunMachine::OnLinksProfile(const v1::ProfileReport& r) {
  const std::string& site = r.site();
  auto it = probing_.find(site);
  if (it == probing_.end() || std::find(joined_.begin(), joined_.end(), site) == joined_.end()) {
    Out(LogSite{site, "sent a profile nobody asked for; ignored"});
    return;
  }
  if (!r.error().empty())
    return Fail(absl::StrCat("site '", site, "' could not measure its links: ", Clean(r.error())));
  std::vector<partitioner::LinkProfile> links;
  absl::Status s = r.site_profile_json().empty() && r.graph_json().empty()
                       ? CheckLinks(site, r.links_json(), it->second, &links)
                       : absl::InvalidArgumentError("it sent a device or a model where only links were asked for");
  // Each link it was asked for, both directions, once each (a missing one would read as no link at all).
  for (const auto& peer : it->second)
    for (const auto& [from, to] : {std::pair{site, peer}, std::pair{peer, site}})
      if (s.ok() && std::count_if(links.begin(), links.end(), [&, &from = from, &to = to](const auto& l) {
                      return l.from == from && l.to == to;
                    }) != 1)
        s = absl::InvalidArgumentError(absl::StrCat("link ", from, " -> ", to, " is missing or given twice"));
  if (!s.ok()) {
    // As in the first round: not planned with, and its links with it (FinishProfiling drops them). (The
    // site whose name sorts last probes nobody, so some site is always left.)
    const std::string why =
        absl::StrCat("site '", site, "' sent links that do not check out: ", Clean(std::string(s.message())));
    Out(LogSite{site, why});
    joined_.erase(std::find(joined_.begin(), joined_.end(), site));
    Say(absl::StrCat(why, "; planning without it\n"));
  } else {
    auto& mine = checked_[site].links;  // a site probes in several rounds
    mine.insert(mine.end(), links.begin(), links.end());
    Out(LogSite{site, "measured its links"});
  }
  probing_.erase(it);
  if (probing_.empty()) NextProbeRound();
}

v1::Command RunMachine::ProfileCommand(const std::string& site, const std::vector<std::string>& peers, bool links_only,
                                       bool keep_busy) const {
  v1::Command c;
  auto* p = c.mutable_profile();
  p->set_job_yaml(c_.job_yaml);
  p->set_job_dir(c_.job_dir);
  p->set_probe_seconds(c_.probe_seconds);
  p->set_repeats(c_.profile_repeats);
  p->set_links_only(links_only);
  if (keep_busy) p->set_keep_busy_seconds(kKeepBusySeconds);
  for (const auto& other : peers) {
    auto* peer = p->add_peers();
    peer->set_site(other);
    peer->set_address(sites_.at(other).listen);
  }
  return c;
}

void RunMachine::MaybeMeasureJoiner() {
  if (phase_ != Phase::kTraining || joiner_asked_) return;
  if (joiner_.empty()) {  // the first registered site never measured, if any
    for (const auto& [name, s] : sites_)
      if (s.registered && !s.silent && !leaving_.count(name) && !lost_.count(name) &&
          std::none_of(profile_.sites.begin(), profile_.sites.end(),
                       [&](const partitioner::SiteProfile& p) { return p.name == name; }) &&
          !failed_joiners_.count(name)) {
        joiner_ = name;
        joiner_at_ = now_ + After(2 * c_.spec.heartbeat_interval_seconds);
        joiner_peers_.clear();
        for (const auto& p : LiveProfile().sites)
          if (sites_[p.name].registered && !sites_[p.name].silent) joiner_peers_.insert(p.name);
        Out(SetProbers{{name}});  // the running sites admit its probes from their next heartbeat on
        Say(absl::StrCat("join: site '", name, "' joined mid-run; measuring it while training goes on\n"));
        Note("join", name, "joined mid-run: measuring its device, the model and its links while training goes on");
        break;
      }
    return;
  }
  if (now_ < joiner_at_) return;
  joiner_asked_ = true;
  joiner_deadline_ = now_ + After(kRemeasureSeconds);
  Out(LogSite{joiner_, "asked to measure its device, the model and its links to the running sites"});
  Out(SendCommand{joiner_, ProfileCommand(joiner_, {joiner_peers_.begin(), joiner_peers_.end()})});
}

std::string RunMachine::EndJoinerMeasurement() {
  joiner_asked_ = false;
  Out(SetProbers{});
  return std::exchange(joiner_, "");
}

void RunMachine::RefuseJoiner(const std::string& site, const std::string& what) {
  failed_joiners_.insert(site);  // not asked again (it may rejoin: a fresh registration clears this)
  const std::string why = absl::StrCat(what, "; not planned with");
  Out(LogSite{site, why});
  Note("join", site, why);
  Say(absl::StrCat("join: site '", site, "': ", why, "\n"));
}

void RunMachine::OnJoinerProfile(const v1::ProfileReport& r) {
  const std::string site = EndJoinerMeasurement();
  measured_in_step_ = true;
  partitioner::ClusterProfile checked;
  absl::Status s =
      r.error().empty() ? CheckProfile(r, &checked, joiner_peers_) : absl::UnavailableError(Clean(r.error()));
  if (!s.ok()) return RefuseJoiner(site, absl::StrCat("measuring it failed: ", Clean(std::string(s.message()))));
  profile_.sites.push_back(checked.sites[0]);
  for (const auto& l : checked.links) profile_.links.push_back(l);
  Out(LogSite{site, "measured its device, the model per op and its links to the running sites"});
  Out(WriteRunFile{core::kProfileFile, partitioner::ProfileToJson(profile_)});
  if (!c_.pinned.empty() || c_.even_split || phase_ != Phase::kTraining) {
    Note("join", site,
         "measured; the layout is pinned (or the run is not training): planned with from the next attempt");
    return;
  }
  // A plan over every site against the current layout, both priced with the profile as it is now.
  auto priced_plans = ReplanAgainstCurrent();
  if (!priced_plans.ok()) {
    Note("join", site, absl::StrCat("measured; re-planning failed: ", priced_plans.status().message()));
    return;
  }
  const partitioner::Plan* fresh = &priced_plans->fresh;
  const partitioner::Plan* current = &priced_plans->current;
  const double gain = 1 - fresh->predicted_step_seconds / current->predicted_step_seconds;
  const std::string priced = absl::StrFormat(
      "site '%s' joined: a plan over %d sites predicts %.4f s/step against %.4f s/step for the current one", site,
      priced_plans->sites, fresh->predicted_step_seconds, current->predicted_step_seconds);
  if (gain > c_.spec.elastic.min_gain) {
    if (!SwitchAllowed(*fresh, "join", site, priced)) return;
    return BeginSwitch(absl::StrFormat("%s (%.0f%% faster)", priced, 100 * gain), /*for_speed=*/true);
  }
  Note("join", site,
       absl::StrFormat("%s: not above elastic.min_gain (%.0f%%); it waits as a spare", priced,
                       100 * c_.spec.elastic.min_gain));
  Say(absl::StrFormat("join: %s: not above elastic.min_gain (%.0f%%); it waits as a spare\n", priced,
                      100 * c_.spec.elastic.min_gain));
}

void RunMachine::OnProfile(const ProfileReported& e) {
  const v1::ProfileReport& r = e.report;
  if (!sites_.count(r.site())) return;
  if (joiner_asked_ && r.site() == joiner_) return OnJoinerProfile(r);
  if (remeasuring_.count(r.site())) return OnRemeasured(r);
  if (phase_ == Phase::kProfiling && probing_links_) return OnLinksProfile(r);
  const bool asked = std::find(joined_.begin(), joined_.end(), r.site()) != joined_.end();
  if (phase_ != Phase::kProfiling || !asked || profiles_.count(r.site())) {
    Out(LogSite{r.site(), "sent a profile nobody asked for; ignored"});
    return;
  }
  if (r.error().empty()) {
    partitioner::ClusterProfile checked;
    if (absl::Status s = CheckProfile(r, &checked, /*probed=*/{}); !s.ok()) {  // no link asked for yet
      // A site whose measurements do not check out is not planned with (a hostile site must not steer
      // the plan); the run goes on without it while others are left.
      const std::string why = absl::StrCat(
          "site '", r.site(), "' sent a profile that does not check out: ", Clean(std::string(s.message())));
      Out(LogSite{r.site(), why});
      joined_.erase(std::find(joined_.begin(), joined_.end(), r.site()));
      if (joined_.empty()) return Fail(why);
      Say(absl::StrCat(why, "; planning without it\n"));
    } else {
      checked_[r.site()] = std::move(checked);
      profiles_[r.site()] = r;
      Out(LogSite{r.site(), "measured its device and the model per op"});
    }
  } else {
    profiles_[r.site()] = r;
    Out(LogSite{r.site(), absl::StrCat("measuring failed: ", Clean(r.error()))});
  }
  for (const auto& site : joined_)
    if (!profiles_.count(site)) return;
  for (const auto& [name, p] : profiles_)  // no link is measured for a run that cannot start
    if (!p.error().empty()) return Fail(absl::StrCat("site '", name, "' could not profile: ", Clean(p.error())));
  StartLinkProbes();
}

absl::Status RunMachine::CheckProfile(const v1::ProfileReport& r, partitioner::ClusterProfile* checked,
                                      const std::set<std::string>& probed) const {
  const std::string& site = r.site();
  auto one = partitioner::ParseProfileJson(absl::StrCat("{\"sites\": [", r.site_profile_json(), "]}"),
                                           absl::StrCat("profile of site '", site, "'"));
  if (!one.ok()) return one.status();
  if (one->sites.size() != 1 || one->sites[0].name != site)
    return absl::InvalidArgumentError("it describes another site's device");
  const partitioner::SiteProfile& p = one->sites[0];
  auto finite = [](double v) { return std::isfinite(v) && v >= 0; };
  if (!finite(p.flops_per_second) || p.flops_per_second <= 0 || !finite(p.memory_bytes))
    return absl::InvalidArgumentError("its device's speed or memory is not a finite positive number");
  checked->sites.resize(1);
  if (absl::Status s = CheckSiteFigures(p, c_.spec, c_.graph, &checked->sites[0]); !s.ok()) return s;
  return CheckLinks(site, r.links_json(), probed, &checked->links);
}

absl::Status RunMachine::CheckLinks(const std::string& site, const std::string& links_json,
                                    const std::set<std::string>& probed,
                                    std::vector<partitioner::LinkProfile>* checked) const {
  auto links = nlohmann::json::parse(links_json, nullptr, false);
  if (!links.is_array()) return absl::InvalidArgumentError("its links are not a JSON array");
  for (const auto& l : links) {
    if (!l.is_object() || !l.contains("from") || !l["from"].is_string() || !l.contains("to") || !l["to"].is_string() ||
        !l.contains("bandwidth_bytes_per_second") || !l["bandwidth_bytes_per_second"].is_number() ||
        !l.contains("latency_seconds") || !l["latency_seconds"].is_number())
      return absl::InvalidArgumentError(absl::StrCat("a malformed link: ", l.dump()));
    partitioner::LinkProfile link{l["from"], l["to"], l["bandwidth_bytes_per_second"], l["latency_seconds"]};
    // Only the links it measured: between itself and a site it was asked to probe.
    const std::string& other = link.from == site ? link.to : link.from;
    if ((link.from != site && link.to != site) || !probed.count(other))
      return absl::InvalidArgumentError(absl::StrCat("a link it did not measure: ", link.from, " -> ", link.to));
    if (!finite(link.bandwidth_bytes_per_second) || link.bandwidth_bytes_per_second <= 0 ||
        !finite(link.latency_seconds))
      return absl::InvalidArgumentError(absl::StrCat("link ", link.from, " -> ", link.to, " has non-finite figures"));
    if (auto r = l.find("receive_seconds_per_byte"); r != l.end()) {  // optional: a CPU site's, where measured
      if (!r->is_number() || !finite(r->get<double>()) || r->get<double>() < 0 ||
          r->get<double>() > partitioner::kMaxReceiveSecondsPerByte)
        return absl::InvalidArgumentError(
            absl::StrCat("link ", link.from, " -> ", link.to, " has a receive cost that is not a number in [0, ",
                         partitioner::kMaxReceiveSecondsPerByte, "] s a byte: ", r->dump()));
      link.receive_seconds_per_byte = r->get<double>();
    }
    checked->push_back(link);
  }
  return absl::OkStatus();
}

// Every joined site's measurements, with the spec's link overrides: RUN/profile.json and graph.json.
void RunMachine::FinishProfiling() {
  for (const auto& site : joined_) {
    const partitioner::ClusterProfile& one = checked_.at(site);
    profile_.sites.push_back(one.sites[0]);
    for (const auto& l : one.links)  // a link to a site dropped since is not planned with
      if (std::find(joined_.begin(), joined_.end(), l.from == site ? l.to : l.from) != joined_.end())
        profile_.links.push_back(l);
  }
  ProfileReady(absl::StrCat("measured ", profile_.sites.size(), " sites' devices and the model, and ",
                            profile_.links.size(), " links"));
}

void RunMachine::UseGivenProfile() {
  auto joined = [&](const std::string& site) {
    return std::find(joined_.begin(), joined_.end(), site) != joined_.end();
  };
  for (const auto& site : c_.given_profile->sites) {
    if (!joined(site.name)) continue;
    // Figures of another device would plan another site (a CPU's for a GPU, or the reverse).
    if (const std::string& now = sites_[site.name].device; !site.device.empty() && site.device != now)
      return Fail(absl::StrCat("--profile ", c_.given_profile_path, ": site '", site.name, "' was measured on ",
                               site.device, " but registered with device ", Clean(now.substr(0, 100)),
                               "; measure it (run without --profile)"));
    profile_.sites.push_back(site);
  }
  for (const auto& l : c_.given_profile->links)
    if (joined(l.from) && joined(l.to)) profile_.links.push_back(l);
  Say(absl::StrCat(joined_.size(), " sites joined; planning from ", c_.given_profile_path,
                   " (measured before; --profile: nothing is measured again)\n"));
  for (const auto& site : joined_) Out(LogSite{site, absl::StrCat("planned from ", c_.given_profile_path)});
  ProfileReady(absl::StrCat("took ", profile_.sites.size(), " sites' devices and the model, and ",
                            profile_.links.size(), " links from ", c_.given_profile_path, " (not measured again)"));
}

void RunMachine::ProfileReady(const std::string& how) {
  for (const auto& l : c_.spec.links) {
    if (!l.override_measurement) continue;
    for (auto& pl : profile_.links)
      if ((pl.from == l.from && pl.to == l.to) || (l.symmetric && pl.from == l.to && pl.to == l.from)) {
        if (l.bandwidth_bytes_per_second) pl.bandwidth_bytes_per_second = *l.bandwidth_bytes_per_second;
        if (l.rtt_seconds) pl.latency_seconds = *l.rtt_seconds / 2;
      }
  }
  std::string lines;
  for (const auto& site : profile_.sites) {
    double model = 0;
    for (const auto& [op, secs] : site.op_seconds) model += secs;
    absl::StrAppendFormat(&lines, "  site %-10s %8.1f GFLOP/s GEMM, model forward+backward %8.1f ms per micro-batch",
                          site.name, site.flops_per_second / 1e9, model * 1e3);
    if (site.workers > 1)  // measured with its workers running together, each on its rows
      absl::StrAppendFormat(&lines, " on %d workers, their all-reduce %.1f Gbit/s", site.workers,
                            site.intra_site_bytes_per_second * 8 / 1e9);
    lines += "\n";
  }
  for (const auto& l : profile_.links)
    absl::StrAppendFormat(&lines, "  link %-10s -> %-10s %8.1f Mbit/s, %6.1f ms one way\n", l.from, l.to,
                          l.bandwidth_bytes_per_second * 8 / 1e6, l.latency_seconds * 1e3);
  Say(lines);
  Note("profiled", "", how);
  graph_ = c_.graph;
  graph_json_ = partitioner::GraphToJson(graph_);
  Out(WriteRunFile{core::kProfileFile, partitioner::ProfileToJson(profile_)});
  Out(WriteRunFile{core::kGraphFile, graph_json_});
  // A file a site sends holds at most the model's training state (weights and AdamW moments, within
  // param_bytes + optimizer_bytes of the graph) plus its header: twice that bounds it.
  max_file_bytes_ = 2 * TrainingStateBytes(graph_) + kHeaderBytes;
  t0_ = now_;
  StartAttempt();
}

// ---- Attempts ----

void RunMachine::StartAttempt() {
  for (const auto& site : leaving_)  // a site that asked to leave is in no plan again; it is stopped
    if (sites_[site].registered && StopLeaving(site)) Out(LogSite{site, "left the run; told to stop"});
  if (c_.spec.on_failure == core::OnFailure::kReplan)  // a site silent since it was measured is not planned with
    for (const auto& site : profile_.sites)
      if (sites_[site.name].silent) lost_.insert(site.name);
  if (Excluded().size() >= profile_.sites.size())
    return Fail("every measured site stopped answering or left; no site left");
  if (absl::Status s = PlanAttempt(); !s.ok()) return Fail(std::string(s.message()));
  // A new attempt first: from now on no file of the one before lands (FindResumePoint cleans up).
  job_id_ = attempts_ == 0 ? c_.run_id : absl::StrCat(c_.run_id, "-", attempts_);
  ++attempts_;
  for (const auto& site : attempt_.used) {  // what the attempt ending here sent: its final or latest counts
    if (auto d = attempt_.done.find(site); d != attempt_.done.end())
      earlier_wire_ += d->second.wire_bytes(), earlier_raw_ += d->second.raw_bytes();
    else if (auto m = attempt_.metrics.find(site); m != attempt_.metrics.end())
      earlier_wire_ += m->second.wire_bytes(), earlier_raw_ += m->second.raw_bytes();
  }
  attempt_ = Attempt();
  attempt_steps_.clear();
  switching_for_speed_.reset();     // CompleteSwitch took it, or the attempt ended otherwise
  trial_.reset();                   // CompleteSwitch sets it again for an attempt that a switch for speed began
  after_switch_for_speed_ = false;  // CompleteSwitch sets it for an attempt a switch for speed began
  remeasuring_.clear();             // a straggler decision pending for the attempt before is moot
  drift_.clear();                   // the new plan's shares are what each site is measured against
  progress_step_ = -1;
  std::map<std::string, int> stages, writers;  // replica 0 of each stage sends its weights and checkpoints
  for (size_t k = 0; k < plan_->stages.size(); ++k) {
    writers[plan_->stages[k].site_names[0]] = static_cast<int>(k);
    for (const auto& site : plan_->stages[k].site_names) stages[site] = static_cast<int>(k);
  }
  if (absl::Status s = FindResumePoint(); !s.ok()) return Fail(std::string(s.message()));
  const bool store = c_.job.checkpoint.store == core::CheckpointStore::kCoordinator;
  std::map<std::string, std::set<std::string>> readable;
  std::map<std::string, std::pair<int, int>> round_writers;  // DiLoCo: every replica sends its round state
  for (size_t k = 0; k < plan_->stages.size(); ++k) {
    const auto& sites = plan_->stages[k].site_names;
    for (size_t r = 0; r < sites.size(); ++r) {
      const std::vector<std::string> files = ResumeFilesFor(k, r);
      readable[sites[r]].insert(files.begin(), files.end());
      if (c_.job.sync.mode == core::SyncMode::kDiloco && sites.size() > 1)
        round_writers[sites[r]] = {static_cast<int>(k), static_cast<int>(r)};
    }
  }
  if (resume_files_ && c_.job.sync.mode == core::SyncMode::kDiloco) {
    if (!resume_files_->round_state_problems.empty())
      Say(absl::StrCat("round states left out: ", resume_files_->round_state_problems, "\n"));
    // Round states written right after every fragment was synchronised (a step boundary's): every replica
    // held the outer parameters, so replica 0's state is everyone's.
    bool synchronised = !resume_files_->round_states.empty();
    for (const auto& [stage, metas] : resume_files_->round_states)
      for (const auto& [replica, meta] : metas) synchronised = synchronised && meta.synchronised;
    for (size_t k = 0; k < plan_->stages.size(); ++k) {
      if (plan_->stages[k].site_names.size() < 2) continue;
      std::string why;
      Say(ResumesRoundStates(k, &why)
              ? absl::StrCat("stage ", k, ": every DiLoCo replica resumes its own round state\n")
          : synchronised ? absl::StrCat("stage ", k, ": every DiLoCo replica resumes from the outer parameters (", why,
                                        "every replica synchronised every fragment at step ", resume_step_,
                                        ", so they hold what each sent of its progress in the round; "
                                        "error-feedback residuals start empty)\n")
                         : absl::StrCat("stage ", k, ": every DiLoCo replica resumes from replica 0's state (", why,
                                        "what the others learnt since the last outer synchronisation is not kept)\n"));
    }
  }
  Out(BeginAttempt{job_id_, std::move(stages), std::move(writers), c_.steps, max_file_bytes_,
                   store ? c_.job.checkpoint.interval : 0, std::max<int64_t>(resume_step_, 0), std::move(readable),
                   store ? StoreQuotaBytes(c_) : 0, std::move(round_writers)});
  // What an abandoned attempt left above the resume point would otherwise mix with the steps written
  // again (after BeginAttempt: no file of the attempt before lands any more).
  if (store && resume_step_ > 0) Out(RemoveCheckpointsAbove{resume_step_});
  lease_ = 0;  // each stage's first step needs none; the first report grants one (GrantLease)
  Out(SetLease{job_id_, 0});
  Assign();
  phase_ = Phase::kTraining;
  if (!SilentUsed().empty()) {  // (on_failure: wait) a site of the plan is already silent: no event will say so
    attempt_.failure = "no heartbeat";
    EndAttempt();
  }
}

double RunMachine::BoundarySyncSeconds() const {
  if (!plan_ || c_.job.sync.mode != core::SyncMode::kDiloco) return 0;
  const partitioner::PlanOptions po = BaseOptions();
  double worst = 0;
  for (const auto& stage : plan_->stages) {
    const double x = partitioner::ExchangeSeconds(graph_, profile_, po.sync, stage, po.gradient_bytes_fraction);
    if (std::isfinite(x)) worst = std::max(worst, x);
  }
  return 2 * worst;  // the exchange in flight (at most the whole stage), then every fragment
}

partitioner::ClusterProfile RunMachine::LiveProfile() const {
  partitioner::ClusterProfile live;
  const std::set<std::string> out = Excluded();
  for (const auto& site : profile_.sites)
    if (!out.count(site.name)) live.sites.push_back(site);
  for (const auto& l : profile_.links)
    if (!out.count(l.from) && !out.count(l.to)) live.links.push_back(l);
  return live;
}

partitioner::PlanOptions RunMachine::BaseOptions() const {
  const core::JobSpec& job = c_.job;
  partitioner::PlanOptions po;
  po.micro_batches = c_.micro_batches;
  po.sync = partitioner::SyncModelOf(job.sync);
  po.adaptive_compression = job.compression.policy == core::CompressionPolicy::kAdaptive;
  po.deep_pipeline = true;
  po.zero = job.optimizer.zero;
  po.step_overlap = job.step_overlap;
  if (c_.revisit_fraction) po.link_codecs = partitioner::DefaultLinkCodecs(*c_.revisit_fraction);
  if (job.compression.policy != core::CompressionPolicy::kAdaptive) {
    // A fixed codec (or none): a menu of that one codec, so that the plan is priced, and plan.json says,
    // what Assign gives the executors.
    const bool none = job.compression.policy == core::CompressionPolicy::kNone;
    auto link = partitioner::PriceCodec(none ? "identity" : job.compression.activations);
    auto gradient = partitioner::PriceCodec(none ? "identity" : job.compression.gradients);
    if (link.ok() && gradient.ok()) {
      po.link_codecs = {*link};
      po.gradient_codecs = {*gradient};
      po.adaptive_compression = true;
    }
  }
  po.replication = job.replication && !c_.even_split;
  return po;
}

// Plans over the sites not lost: the partitioner's plan, the --split even ablation, or --plan's pinned
// layout (dropped, with a message, once it names a lost site). Prints the table, writes RUN/plan.json.
absl::Status RunMachine::PlanAttempt() {
  const int ops = static_cast<int>(graph_.ops.size());
  const partitioner::ClusterProfile live = LiveProfile();
  partitioner::PlanOptions po = BaseOptions();
  if (c_.even_split) {
    const int n = std::min<int>(static_cast<int>(live.sites.size()), ops);
    for (const auto& site : c_.spec.sites)
      if (const int i = SiteIndex(live, site.name); i >= 0 && static_cast<int>(po.fixed_sites.size()) < n)
        po.fixed_sites.push_back(i);
    po.fixed_last_ops = partitioner::EvenCuts(ops, static_cast<int>(po.fixed_sites.size()));
  }
  // The operator's layout (--plan), or the one a failed switch check goes back to.
  const bool operators = !c_.pinned.empty();
  std::vector<partitioner::PinnedStage> pinned = operators ? c_.pinned : std::exchange(switch_back_, {});
  if (!pinned.empty()) {
    std::string missing;
    for (const auto& st : pinned)
      for (const auto& site : st.sites)
        if (SiteIndex(live, site) < 0 && missing.empty()) missing = site;
    if (!missing.empty()) {
      Say(absl::StrCat(
          "plan: ", operators ? absl::StrCat("the pinned plan (", c_.plan_path, ")") : "the plan switched back to",
          " uses site '", missing, "', which is lost; planning over the sites left\n"));
      if (operators) c_.pinned.clear();
      pinned.clear();
    } else {
      if (pinned.back().last_op != ops - 1)
        return absl::InvalidArgumentError(absl::StrCat(c_.plan_path, ": the last stage ends at op ",
                                                       pinned.back().last_op, ", but the job's model has ", ops,
                                                       " ops (0-", ops - 1, ")"));
      po.replication = false;
      std::vector<std::vector<int>> sites, shares;
      std::vector<int> last_ops;
      for (const auto& st : pinned) {  // their shares were checked against the run's micro-batches (run.cc)
        sites.emplace_back();
        for (const auto& site : st.sites) sites.back().push_back(SiteIndex(live, site));
        last_ops.push_back(st.last_op);
        shares.push_back(st.micro_batches);
      }
      partitioner::PinLayout(sites, last_ops, &po, shares);
    }
  }
  auto planned = partitioner::PlanPipeline(graph_, live, po);
  if (!planned.ok()) return planned.status();
  std::vector<int> depth;  // the executors' schedules deadlock if a later stage keeps more in flight
  for (const auto& s : planned->stages) depth.push_back(s.in_flight);
  if (!partitioner::InFlightIsDeadlockFree(depth))
    return absl::InternalError("the plan's in-flight depths increase along the pipeline (a planner bug)");
  plan_ = std::move(*planned);
  Say(partitioner::PlanTable(*plan_, graph_, live));
  {
    const std::string layout = LayoutOf(*plan_);
    std::string why;  // a re-plan says what the attempt before it ran into
    if (attempts_ > 0)
      why = !attempt_.lost.empty() ? absl::StrCat(" after ", attempt_.lost)
            : !attempt_.failure.empty()
                ? absl::StrCat(" after site '", attempt_.failed_site, "' failed: ", attempt_.failure)
                : "";
    if (const std::set<std::string> out = Excluded(); !out.empty())
      why += absl::StrCat(" (without ", Quoted(std::vector<std::string>(out.begin(), out.end())), ")");
    Note(attempts_ == 0 ? "plan" : "replan", "",
         absl::StrFormat("%s: %d stage(s) %s, predicted %.3f s/step; bottleneck %s%s",
                         attempts_ == 0 ? "planned" : "re-planned", plan_->stages.size(), layout,
                         plan_->predicted_step_seconds, plan_->bottleneck, why));
  }
  const std::string plan_json = partitioner::PlanJson(*plan_, graph_);
  Out(WriteRunFile{core::kPlanFile, plan_json});
  Out(PublishRunInfo{partitioner::ProfileToJson(live), graph_json_, plan_json});
  return absl::OkStatus();
}

// Where the stages resume, when they do: with job.checkpoint.store: shared each loads the newest intact
// checkpoint of the shared directory itself (step -1); with store: coordinator the machine picks the
// newest complete, intact step of RUN/checkpoints and names its files, which the stages fetch.
absl::Status RunMachine::FindResumePoint() {
  resume_step_ = resume_ ? -1 : 0;
  resume_files_.reset();
  const int64_t exact = std::exchange(switch_step_, 0);  // after a switch: that step, nothing else
  if (resume_ && exact > 0 && c_.job.checkpoint.store != core::CheckpointStore::kCoordinator) {
    resume_step_ = exact;  // each stage loads the newest of the shared directory and checks it is this one
    return absl::OkStatus();
  }
  if (!resume_ || c_.job.checkpoint.store != core::CheckpointStore::kCoordinator) return absl::OkStatus();
  std::string skipped;
  auto found = c_.find_checkpoint ? c_.find_checkpoint(&skipped)
                                  : absl::StatusOr<core::CheckpointFiles>(absl::NotFoundError("no checkpoint store"));
  if (!found.ok())
    return absl::NotFoundError(
        absl::StrCat("cannot resume: ", found.status().message(),
                     " (job.checkpoint.store: coordinator keeps checkpoints in RUN/checkpoints)"));
  if (!skipped.empty()) Say(absl::StrCat("checkpoints skipped: ", skipped, "\n"));
  if (exact > 0 && found->step != exact)
    return absl::DataLossError(absl::StrCat("the switch's checkpoint of step ", exact,
                                            " is not the newest intact one of the coordinator's store (step ",
                                            found->step, ")"));
  resume_step_ = found->step;
  resume_files_ = std::move(*found);
  Say(absl::StrCat("resuming from step ", resume_step_, " of the coordinator's checkpoints (", resume_files_->path,
                   ")\n"));
  return absl::OkStatus();
}

absl::Status CheckGivenProfile(const partitioner::ClusterProfile& profile, const std::string& path,
                               const core::ClusterSpec& spec, const partitioner::OpGraph& graph,
                               partitioner::ClusterProfile* usable) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("--profile ", path, ": ", what));
  };
  std::set<std::string> in_spec, given;
  for (const auto& s : spec.sites) in_spec.insert(s.name);
  usable->sites.clear();
  usable->links.clear();
  for (const auto& site : profile.sites) {
    if (!in_spec.count(site.name)) return bad(absl::StrCat("site '", site.name, "' is not in the cluster spec"));
    given.insert(site.name);
    partitioner::SiteProfile capped;
    if (absl::Status s = CheckSiteFigures(site, spec, graph, &capped); !s.ok())
      return bad(absl::StrCat("site '", site.name, "': ", s.message()));
    if (!site.op_seconds.empty())
      for (const auto& op : graph.ops)
        if (!site.op_seconds.count(op.name))
          return bad(absl::StrCat("site '", site.name, "' has no time for op '", op.name,
                                  "' of the job's model: it was measured for another model"));
    usable->sites.push_back(std::move(capped));
  }
  for (const auto& name : in_spec)
    if (!given.count(name))
      return bad(absl::StrCat("site '", name,
                              "' of the cluster spec is not in it (measure the sites: run without "
                              "--profile)"));
  std::set<std::pair<std::string, std::string>> links;
  for (const auto& l : profile.links) {
    if (!in_spec.count(l.from) || !in_spec.count(l.to) || l.from == l.to)
      return bad(absl::StrCat("link ", l.from, " -> ", l.to, " is not between two sites of the cluster spec"));
    if (!links.insert({l.from, l.to}).second)
      return bad(absl::StrCat("link ", l.from, " -> ", l.to, " is given twice"));
    usable->links.push_back(l);
  }
  for (const auto& a : spec.sites)
    for (const auto& b : spec.sites)
      if (a.name != b.name && !links.count({a.name, b.name}))
        return bad(
            absl::StrCat("it has no link ", a.name, " -> ", b.name, " (measure the sites: run without --profile)"));
  return absl::OkStatus();
}

int64_t StoreQuotaBytes(const RunConfig& c) {
  // With job.step_overlap outside DiLoCo a switch's boundary step also holds the early weights (another
  // copy of the parameters: executor StageWorker::KeepsEarlyWeights).
  double early = 0;
  if (c.job.step_overlap > 0 && c.job.sync.mode != core::SyncMode::kDiloco)
    for (const auto& op : c.graph.ops) early += op.param_bytes;
  const int64_t per_step = TrainingStateBytes(c.graph) + static_cast<int64_t>(early) + kHeaderBytes;
  return (c.job.checkpoint.keep + 3) * per_step;  // keep + 2 steps, and the weights
}

// DiLoCo: a replica resumes its own round state when every replica of the stage had one for this very
// stage (all or none: a stage's replicas must agree on the exchange in flight).
bool RunMachine::ResumesRoundStates(size_t k, std::string* why) const {
  const partitioner::StagePlan& stage = plan_->stages[k];
  if (!resume_files_ || c_.job.sync.mode != core::SyncMode::kDiloco || stage.site_names.size() < 2) return false;
  const core::ReplicaLayout layout{static_cast<int>(k), static_cast<int>(plan_->stages.size()), stage.first_op,
                                   stage.last_op, stage.micro_batches};
  auto states = resume_files_->round_states.find(static_cast<int>(k));
  std::string ignored;
  if (states != resume_files_->round_states.end())
    return core::RoundStatesMatch(states->second, layout, why ? why : &ignored);
  if (why) absl::StrAppend(why, "stage ", k, ": the checkpoint holds no round state of its replicas; ");
  return false;
}

std::vector<std::string> RunMachine::ResumeFilesFor(size_t k, size_t replica) const {
  std::vector<std::string> out;
  if (!resume_files_) return out;
  const partitioner::StagePlan& stage = plan_->stages[k];
  std::set<std::string> ops;
  for (int op = stage.first_op; op <= stage.last_op; ++op) ops.insert(graph_.ops[op].name);
  for (const auto& f : resume_files_->files) {
    bool needed = true;  // stage JSONs, and shards whose JSON lists no tensors
    if (auto t = resume_files_->shard_tensors.find(f); t != resume_files_->shard_tensors.end())
      needed = std::any_of(t->second.begin(), t->second.end(), [&](const std::string& name) {
        const std::optional<std::string> op = job::OpNameOfTensor(name);
        return op && ops.count(*op);
      });
    if (needed) out.push_back(core::CheckpointFile(resume_step_, f));
  }
  if (ResumesRoundStates(k, nullptr)) {
    const int r = static_cast<int>(replica);
    out.push_back(core::CheckpointFile(resume_step_, core::ReplicaShardName(static_cast<int>(k), r)));
    out.push_back(core::CheckpointFile(resume_step_, core::ReplicaMetaName(static_cast<int>(k), r)));
  }
  return out;
}

// Sends every site of the plan (every replica of every stage) its assignment for the attempt.
void RunMachine::Assign() {
  const core::JobSpec& job = c_.job;
  const auto& st = plan_->stages;
  // Codecs: the plan's (adaptive), the job's (fixed), or none.
  auto fixed = [&](const std::string& codec) {  // the job's top-k fraction goes with a top-k codec
    return codec.rfind("topk", 0) == 0 ? absl::StrCat(codec, ":k=", job.compression.topk_fraction) : codec;
  };
  auto link_codec = [&](size_t link) {
    if (job.compression.policy == core::CompressionPolicy::kFixed) return fixed(job.compression.activations);
    if (job.compression.policy == core::CompressionPolicy::kNone) return std::string("identity");
    return plan_->links[link].codec;
  };
  // Gradients to the previous stage: the link's codec, but AQ-SGD's deltas are for activations only:
  // behind int8-delta the gradients go as int8, behind int4-delta and int2-delta as int4.
  auto gradient_link_codec = [&](size_t link) { return compression::GradientCodecBehind(link_codec(link)); };
  auto gradient_codec = [&](size_t k) {
    if (job.compression.policy == core::CompressionPolicy::kFixed) return fixed(job.compression.gradients);
    if (job.compression.policy == core::CompressionPolicy::kNone || st[k].gradient_codec.empty())
      return std::string("identity");
    return st[k].gradient_codec;
  };
  auto group = [&](size_t k, v1::StageSites* g) {
    for (size_t i = 0; i < st[k].site_names.size(); ++i) {
      auto* p = g->add_sites();
      p->set_site(st[k].site_names[i]);
      p->set_address(sites_[st[k].site_names[i]].listen);
      g->add_micro_batches(st[k].micro_batches[i]);
    }
  };
  // DiLoCo over whole-pipeline replicas: every stage replicated alike, so each pipeline keeps its micro-batches.
  const bool whole_pipelines =
      job.sync.mode == core::SyncMode::kDiloco && partitioner::WholePipelineReplicas(plan_->stages);
  for (size_t k = 0; k < st.size(); ++k) {
    for (const auto& site : st[k].site_names) {  // every replica of the stage gets the same assignment
      v1::Command c;
      auto* a = c.mutable_assign();
      a->set_job_id(job_id_);
      a->set_stage(static_cast<int>(k));
      a->set_num_stages(static_cast<int>(st.size()));
      a->set_first_op(st[k].first_op);
      a->set_last_op(st[k].last_op);
      attempt_.used.insert(site);
      attempt_.stage[site] = static_cast<int>(k);
      if (k == 0 && site == st[0].site_names[0]) attempt_.reporter = site;
      for (const auto& r : st[k].site_names) a->add_replicas(r);
      group(k, a->mutable_this_stage());
      a->set_gradient_codec(gradient_codec(k));
      if (k > 0) {
        a->set_prev_site(st[k - 1].site_names[0]);
        a->set_prev_address(sites_[st[k - 1].site_names[0]].listen);
        a->set_backward_codec(gradient_link_codec(k - 1));
        a->set_prev_forward_codec(link_codec(k - 1));
        group(k - 1, a->mutable_prev_stage());
      }
      if (k + 1 < st.size()) {
        a->set_next_site(st[k + 1].site_names[0]);
        a->set_next_address(sites_[st[k + 1].site_names[0]].listen);
        a->set_forward_codec(link_codec(k));
        group(k + 1, a->mutable_next_stage());
      }
      a->set_micro_batches(c_.micro_batches);
      a->set_in_flight(st[k].in_flight);
      a->set_recompute(st[k].recompute);
      a->set_whole_pipelines(whole_pipelines);
      a->set_job_yaml(c_.job_yaml);
      a->set_job_dir(c_.job_dir);
      a->set_steps(c_.steps);
      a->set_weights_to_coordinator(true);  // RUN/weights/stage-K.safetensors, through PutFile
      a->set_checkpoints_to_coordinator(job.checkpoint.store == core::CheckpointStore::kCoordinator);
      a->set_resume_step(resume_step_);  // 0 afresh; -1 each stage loads the newest intact checkpoint; S
      // This run's checkpoints only, unless it was started to continue from what the directory holds.
      if (!c_.resume) a->set_resume_run(c_.run_id);
      const size_t replica = static_cast<size_t>(std::find(st[k].site_names.begin(), st[k].site_names.end(), site) -
                                                 st[k].site_names.begin());
      for (const auto& f : ResumeFilesFor(k, replica)) a->add_resume_files(f);
      Out(LogSite{
          site, absl::StrCat("assigned stage ", k + 1, "/", st.size(), " (ops ", st[k].first_op, "-", st[k].last_op,
                             ") of job ", job_id_, k > 0 ? absl::StrCat(", after '", st[k - 1].site_names[0], "'") : "",
                             k + 1 < st.size() ? absl::StrCat(", before '", st[k + 1].site_names[0], "'") : "",
                             resume_step_ != 0 ? ", resuming from the newest checkpoint" : "")});
      Out(SendCommand{site, std::move(c)});
    }
  }
  // Where every stage resumes from, said once for the progress line and the event.
  const std::string from = resume_step_ > 0
                               ? absl::StrCat("step ", resume_step_,
                                              c_.job.checkpoint.store == core::CheckpointStore::kCoordinator
                                                  ? " (the coordinator's checkpoints)"
                                                  : " (each stage's checkpoint of that step)")
                               : "the newest intact checkpoint";
  if (resume_) Note("resume", "", absl::StrCat("every stage resumes from ", from));
  Say(absl::StrCat("training: ", st.size(), " stages, ", c_.steps, " steps",
                   resume_ ? absl::StrCat(", resuming from ", from) : "", "\n"));
}

// ---- Supervision ----

void RunMachine::OnMetrics(const MetricsReported& e) {
  const v1::MetricsReport& r = e.report;
  if (!sites_.count(r.site())) return;
  if (r.job_id() != job_id_ || job_id_.empty()) return;  // an abandoned attempt's
  // The plan says which stage a site runs, and steps come in order: a report that says otherwise is not
  // believed (it would forge the progress).
  auto stage = attempt_.stage.find(r.site());
  auto last = attempt_.metrics.find(r.site());
  // A report sent again (a stage waiting for its lease resends its latest: executor/agent.cc) adds nothing.
  if (last != attempt_.metrics.end() && r.step() == last->second.step() && r.stage() == last->second.stage()) return;
  if (stage == attempt_.stage.end() || r.stage() != stage->second || r.step() < 0 || r.step() >= c_.steps ||
      (last != attempt_.metrics.end() && r.step() <= last->second.step())) {
    Out(LogSite{r.site(), absl::StrCat("a metrics report of stage ", r.stage(), ", step ", r.step() + 1,
                                       " does not fit the plan or the steps before it; ignored")});
    return;
  }
  const std::string parts = absl::StrFormat(
      "%.2f s (%.2f s computing, %.2f s waiting, %.3f s blocked sending, %.3f s codecs; CPU %.3f s, %.3f s of "
      "it the compute thread's), %d bytes sent (%d uncompressed)",
      r.step_seconds(), r.compute_seconds(), r.wait_seconds(), r.send_blocked_seconds(), r.codec_seconds(),
      r.cpu_seconds(), r.compute_thread_cpu_seconds(), r.wire_bytes(), r.raw_bytes());
  Out(LogSite{r.site(), r.stage() != 0
                            ? absl::StrFormat("step %d: %s", r.step() + 1, parts)
                            : absl::StrFormat("step %d: loss %s%.4f, %s", r.step() + 1,
                                              r.site() == attempt_.reporter ? "" : "share ", r.loss(), parts)});
  attempt_.metrics[r.site()] = r;
  if (phase_ == Phase::kTraining) GrantLease();
  if (phase_ == Phase::kSwitching && boundary_ == 0) PlaceBoundary();
  CheckDrift(r);
  if (r.site() != attempt_.reporter || r.step() <= progress_step_) return;
  if (r.step() > data_loss_at_) data_loss_recoveries_ = 0;  // past where data went bad: a new count
  progress_step_ = r.step();
  last_loss_ = r.loss();
  last_step_seconds_ = r.step_seconds();
  tokens_ += r.tokens();
  // A step during which a site measured its device mid-run (a joiner, a re-measure) shared the cores.
  attempt_steps_.push_back({r.step_seconds(), std::exchange(measured_in_step_, false) || MeasuringMidRun()});
  ReportStep(r);
  CheckSwitch();
  // The coordinator's checkpoint store keeps job.checkpoint.keep complete steps (the stages prune a
  // shared directory themselves).
  const auto& ck = c_.job.checkpoint;
  if (ck.store != core::CheckpointStore::kCoordinator && ck.interval > 0 && (r.step() + 1) % ck.interval == 0)
    Note("checkpoint", "",
         absl::StrCat("step ", r.step() + 1, ": every stage saves a checkpoint to ", ck.dir, " (store: shared)"));
  if (ck.store == core::CheckpointStore::kCoordinator && ck.interval > 0) {
    const int64_t newest = (r.step() + 1) / ck.interval * ck.interval;
    if (newest > pruned_at_) {
      pruned_at_ = newest;
      Out(PruneCheckpoints{ck.keep, newest});
    }
  }
}

// The progress line: the slowest site (most compute in its latest step), the bytes the stages sent over
// the whole run, how long the slowest site waited for its peers and the longest any stage was blocked by
// a send; RUN/metrics.jsonl has the same (its bytes: this attempt's running totals, which the dashboard
// differences per attempt) and each stage's breakdown ("stages").
void RunMachine::ReportStep(const v1::MetricsReport& p) {
  const double el = Seconds(now_ - t0_);
  std::string slowest;
  double slowest_seconds = 0, slowest_wait = 0, most_blocked = 0;
  int64_t wire = 0, raw = 0;
  int64_t last_sync = 0, sync_bytes = 0;  // DiLoCo: the newest outer sync any replica reported, and its bytes
  double sync_seconds = 0;
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& [name, m] : attempt_.metrics) {
    if (!attempt_.used.count(name)) continue;
    wire += m.wire_bytes();
    raw += m.raw_bytes();
    if (m.compute_seconds() > slowest_seconds)
      slowest = name, slowest_seconds = m.compute_seconds(), slowest_wait = m.wait_seconds();
    most_blocked = std::max(most_blocked, m.send_blocked_seconds());
    nlohmann::json stage = StepFiguresJson(m);
    stage["site"] = name;
    stage["stage"] = m.stage();
    if (m.site_reduce_seconds() > 0) stage["site_reduce_seconds"] = m.site_reduce_seconds();
    if (m.outer_sync_step() > 0) {  // DiLoCo: the replica's last outer synchronisation
      stage["outer_sync_step"] = m.outer_sync_step();
      stage["outer_sync_bytes"] = m.outer_sync_bytes();
      stage["outer_sync_seconds"] = m.outer_sync_seconds();
      stage["outer_drift"] = m.outer_drift();
      last_sync = std::max(last_sync, m.outer_sync_step());
      sync_bytes += m.outer_sync_bytes();
      sync_seconds = std::max(sync_seconds, m.outer_sync_seconds());
    }
    stages.push_back(std::move(stage));
  }
  std::string diloco;
  if (c_.job.sync.mode == core::SyncMode::kDiloco) {
    const int H = c_.job.sync.inner_steps;
    diloco = absl::StrFormat("  inner step %d/%d", (p.step() % H) + 1, H);
    if (last_sync > 0)
      diloco +=
          absl::StrFormat("  last sync after step %d: %.1f MB, %.2f s", last_sync, sync_bytes / 1e6, sync_seconds);
  }
  Say(absl::StrFormat(
      "step %d/%d  loss %.4f  %.0f tokens/s  %.2f s/step  ETA %.0f s  slowest %s (%.2f s compute)  "
      "WAN %.1f MB (%.0f%% of uncompressed)  waiting %.2f s  send-blocked %.3f s%s\n",
      p.step() + 1, c_.steps, p.loss(), el > 0 ? tokens_ / el : 0.0, p.step_seconds(),
      p.step_seconds() * (c_.steps - p.step() - 1), slowest.empty() ? "-" : slowest, slowest_seconds,
      (earlier_wire_ + wire) / 1e6, earlier_raw_ + raw ? 100.0 * (earlier_wire_ + wire) / (earlier_raw_ + raw) : 100.0,
      slowest_wait, most_blocked, diloco));
  Out(WriteRunFile{core::kMetricsFile,
                   nlohmann::json{{"step", p.step() + 1},
                                  {"loss", p.loss()},
                                  {"step_seconds", p.step_seconds()},
                                  {"tokens", tokens_},
                                  {"elapsed_seconds", el},
                                  {"attempt", attempts_ - 1},
                                  {"slowest_site", slowest},
                                  {"slowest_compute_seconds", slowest_seconds},
                                  {"wire_bytes", wire},
                                  {"raw_bytes", raw},
                                  {"stages", stages}}
                           .dump() +
                       "\n",
                   /*append=*/true});
}

void RunMachine::OnDone(const StageReportedDone& e) {
  const v1::StageDone& d = e.done;
  if (!sites_.count(d.site())) return;
  if (d.job_id() != job_id_ || job_id_.empty()) {
    Out(LogSite{d.site(), absl::StrCat("abandoned attempt ", Clean(d.job_id()), " ended", d.error().empty() ? "" : ": ",
                                       Clean(d.error()))});
    return;
  }
  if (!attempt_.used.count(d.site())) {  // a site outside the plan has no stage to end
    Out(LogSite{d.site(), "reported the end of a stage it does not run; ignored"});
    return;
  }
  attempt_.done[d.site()] = d;
  Out(LogSite{d.site(), d.error().empty() ? absl::StrCat("finished: ", d.steps(), " steps")
                                          : absl::StrCat("failed after ", d.steps(), " steps: ", Clean(d.error()))});
  if (phase_ == Phase::kDraining) {
    for (const auto& u : attempt_.used)
      if (!attempt_.done.count(u) && !sites_[u].silent) return;
    return AfterDrain();
  }
  if (phase_ == Phase::kFailing && !d.error().empty()) attempt_.failed.insert(d.site());
  if (phase_ != Phase::kTraining && phase_ != Phase::kSwitching) return;
  // A stage that went past the switch's boundary (which the step lease rules out unless a site breaks
  // it) fails -- it says so, or a neighbour that ended at the boundary never answers it -- and so may its
  // neighbours: an unaligned end, after which the next attempt resumes from the newest intact checkpoint
  // (CompleteSwitch). A boundary not yet placed (boundary_ 0) was not missed.
  const bool missed_boundary = phase_ == Phase::kSwitching && boundary_ > 0 && d.steps() >= boundary_;
  if (!d.error().empty() && !missed_boundary) {
    // Said at once, with the site and its stage; heartbeats then get the time to name a site that died
    // (a stage fails when a neighbour dies).
    attempt_.failed = {d.site()};
    attempt_.before_failing = phase_;
    int stage = -1;
    for (size_t k = 0; plan_ && k < plan_->stages.size(); ++k)
      for (const auto& s : plan_->stages[k].site_names)
        if (s == d.site()) stage = static_cast<int>(k);
    attempt_.failure = Clean(d.error());
    Say(absl::StrCat("stage ", stage, " at site '", d.site(), "' failed: ", attempt_.failure, "\n"));
    Note("stage_failed", d.site(), absl::StrCat("stage ", stage, " failed: ", attempt_.failure));
    attempt_.failed_site = d.site();
    attempt_.failure_code = d.error_code();
    attempt_.deadline = now_ + After(c_.spec.heartbeat_timeout_seconds + 1);
    phase_ = Phase::kFailing;
    if (!SilentUsed().empty()) EndAttempt();
    return;
  }
  for (const auto& u : attempt_.used)
    if (!attempt_.done.count(u)) return;
  if (phase_ == Phase::kSwitching) return CompleteSwitch();
  Finish();
}

void RunMachine::OnLost(const HeartbeatLost& e) {
  auto it = sites_.find(e.site);
  if (it == sites_.end() || !it->second.registered || it->second.silent) return;
  it->second.silent = true;
  Out(LogSite{e.site, absl::StrCat("no heartbeat for ", c_.spec.heartbeat_timeout_seconds, " s")});
  DropRemeasure(e.site, "which stopped answering");
  if (e.site == joiner_) {  // a site joining mid-run that went away before it was measured
    joiner_.clear();
    joiner_asked_ = false;
    Out(SetProbers{});
  }
  switch (phase_) {
    case Phase::kJoining:
      return;
    case Phase::kProfiling:
      if (std::find(joined_.begin(), joined_.end(), e.site) != joined_.end())
        Fail(absl::StrCat("site '", e.site, "' stopped answering"));
      return;
    case Phase::kTraining:
    case Phase::kSwitching:
      if (attempt_.used.count(e.site)) {  // a silent spare site does not interrupt the attempt
        if (LeaveOutDilocoWorker(e.site)) return;
        attempt_.failure = "no heartbeat";
        EndAttempt();
      }
      return;
    case Phase::kFailing:
      if (!attempt_.used.count(e.site)) return;
      // The stages that failed meanwhile may be the lost site's pipeline-mates alone (their neighbour
      // went): that pipeline is left out, and the attempt goes on as it was.
      if (!DilocoPipelineOf(e.site).empty()) {
        const Phase failing = std::exchange(phase_, attempt_.before_failing);
        if (LeaveOutDilocoWorker(e.site, attempt_.failed)) {
          Say(absl::StrCat("  (the failure of ",
                           Quoted(std::vector<std::string>(attempt_.failed.begin(), attempt_.failed.end())),
                           " was the lost site's pipeline's own)\n"));
          attempt_.failure.clear();
          attempt_.failed_site.clear();
          attempt_.failure_code = 0;
          attempt_.failed.clear();
          return;
        }
        phase_ = failing;
      }
      EndAttempt();
      return;
    case Phase::kDraining:
      for (const auto& u : attempt_.used)
        if (!attempt_.done.count(u) && !sites_[u].silent) return;
      AfterDrain();
      return;
    default:
      return;
  }
}

void RunMachine::OnBack(const HeartbeatBack& e) {
  auto it = sites_.find(e.site);
  if (it == sites_.end() || !it->second.silent) return;
  it->second.silent = false;
  Out(LogSite{e.site, "heartbeats again"});
  Note("back", e.site, "heartbeats again");
  if (phase_ == Phase::kWaitingForReturn &&
      std::none_of(lost_.begin(), lost_.end(), [&](const std::string& s) { return sites_[s].silent; })) {
    Say(absl::StrCat("recovery: ", Quoted(std::vector<std::string>(lost_.begin(), lost_.end())),
                     " answering again; resuming from the newest intact checkpoint\n"));
    lost_.clear();
    resume_ = true;
    StartAttempt();
  }
}

void RunMachine::DropRemeasure(const std::string& site, const std::string& why) {
  if (!remeasuring_.count(site)) return;
  remeasuring_.clear();
  const std::string what = absl::StrCat("the straggler's re-plan waited for site '", site, "' to be measured again, ",
                                        why, ": dropped (no switch)");
  Note("straggler", site, what);
  Say(absl::StrCat("straggler: ", what, "\n"));
}

void RunMachine::OnTick() {
  if (!remeasuring_.empty() && now_ >= remeasure_deadline_)
    DropRemeasure(*remeasuring_.begin(), absl::StrCat("which did not answer within ", kRemeasureSeconds, " s"));
  if (joiner_asked_ && now_ >= joiner_deadline_)  // registered and heartbeating, but never answered
    RefuseJoiner(EndJoinerMeasurement(),
                 absl::StrCat("did not answer its measurement within ", kRemeasureSeconds, " s"));
  if (c_.spec.elastic.enabled && phase_ == Phase::kTraining) MaybeMeasureJoiner();
  if (phase_ == Phase::kJoining && started_ && now_ > join_deadline_) {
    std::string missing;
    for (const auto& [name, s] : sites_)
      if (!s.registered) missing += " " + name;
    return Fail(absl::StrCat("sites did not join in time:", missing));
  }
  if (phase_ == Phase::kFailing && now_ >= attempt_.deadline) return EndAttempt();
  if (phase_ == Phase::kSwitching && now_ >= attempt_.deadline) {
    Say(absl::StrCat("switch: the stages did not all end at step ", boundary_, " in time; ending the attempt\n"));
    attempt_.failure = absl::StrCat("the switch at step ", boundary_, " did not complete");
    Out(SetBoundary{"", 0});
    return EndAttempt();
  }
  if (phase_ == Phase::kDraining && now_ >= attempt_.deadline) return AfterDrain();
}

// ---- Sites leaving: a switch at a step boundary ----

void RunMachine::OnLeaving(const SiteLeaving& e) {
  auto it = sites_.find(e.site);
  if (it == sites_.end() || !it->second.registered || !leaving_.insert(e.site).second) return;
  Out(LogSite{e.site, absl::StrCat("asked to leave (", e.why, ")")});
  DropRemeasure(e.site, "which asked to leave");
  const bool running = attempt_.used.count(e.site) > 0;
  switch (phase_) {
    case Phase::kTraining:
      if (running) return BeginSwitch(absl::StrCat("site '", e.site, "' leaves (", e.why, ")"));
      break;
    case Phase::kSwitching:  // already switching: the next plan leaves this one out too
      Note("leave", e.site, absl::StrCat("asked to leave (", e.why, "); the switch under way leaves it out too"));
      return;
    default:
      break;
  }
  // Joining, measuring, between attempts, or a spare: no stage to end; the next plan leaves it out.
  Note("leave", e.site,
       absl::StrCat("asked to leave (", e.why, "); it runs no stage: no plan includes it from now on"));
  // While measuring, it finishes with the others (the attempt's start stops it); otherwise it stops now.
  if (phase_ == Phase::kProfiling && std::find(joined_.begin(), joined_.end(), e.site) != joined_.end()) return;
  StopLeaving(e.site);
}

bool RunMachine::StopLeaving(const std::string& site) {
  if (!stopped_.insert(site).second) return false;
  v1::Command stop;
  stop.set_stop(true);
  Out(SendCommand{site, std::move(stop)});
  return true;
}

int64_t RunMachine::SwitchMargin() const {
  // How far the lease reaches ahead of the furthest stage: far enough that the stages' heartbeats bring
  // the next lease before they use this one up (a stage that does waits, which is safe but idle):
  // three heartbeat intervals of steps at the fastest of the attempt's last 20 steps (a slow step just
  // before -- a probe, a checkpoint -- made such a margin too short once: the steps after it ran 4x
  // faster), and at least two steps.
  // Before the reporter's first step of the attempt, any stage's latest step; before any, the plan's.
  double fastest = std::numeric_limits<double>::infinity();
  for (size_t i = attempt_steps_.size() > 20 ? attempt_steps_.size() - 20 : 0; i < attempt_steps_.size(); ++i)
    if (attempt_steps_[i].first > 0) fastest = std::min(fastest, attempt_steps_[i].first);
  for (const auto& [site, m] : attempt_.metrics)
    if (m.step_seconds() > 0) fastest = std::min(fastest, m.step_seconds());
  if (std::isinf(fastest)) fastest = plan_ ? plan_->predicted_step_seconds : 0;
  const double per_step = std::max(fastest, 1e-3);
  return std::max<int64_t>(2,
                           static_cast<int64_t>(std::ceil(3 * c_.spec.heartbeat_interval_seconds / per_step - 1e-9)));
}

int64_t RunMachine::Reached() const {
  int64_t reached = progress_step_ + 1;
  for (const auto& [site, m] : attempt_.metrics) reached = std::max<int64_t>(reached, m.step() + 1);
  return reached;
}

void RunMachine::GrantLease() {
  const int64_t want = std::min<int64_t>(Reached() + SwitchMargin(), c_.steps);
  if (want <= lease_) return;
  lease_ = want;
  Out(SetLease{job_id_, lease_});
}

void RunMachine::PlaceBoundary() {
  const int64_t step = Reached();
  if (step >= c_.steps) {  // the attempt's first step was the run's last
    phase_ = Phase::kTraining;
    switching_for_speed_.reset();
    Say(absl::StrCat("switch: ", attempt_.lost, "; the run ends at step ", c_.steps, " first, so it leaves then\n"));
    return;
  }
  boundary_ = step;
  Out(SetBoundary{job_id_, boundary_, attempt_.left_out});
  Say(absl::StrCat("switch: every stage ends after step ", boundary_, ", its first of this attempt\n"));
  Note("switch", "",
       absl::StrCat("the switch is placed at step ", boundary_,
                    ", the attempt's first: no stage goes past it before a lease is granted"));
}

std::vector<std::string> RunMachine::DilocoPipelineOf(const std::string& site) const {
  // Only where the run re-plans around lost sites (on_failure: wait waits for them instead).
  if (!plan_ || !plan_->sync.diloco || c_.spec.on_failure != core::OnFailure::kReplan) return {};
  const auto& st = plan_->stages;
  if (st.size() != 1 && !partitioner::WholePipelineReplicas(st)) return {};
  for (const auto& stage : st) {
    const auto it = std::find(stage.site_names.begin(), stage.site_names.end(), site);
    if (it == stage.site_names.end()) continue;
    const size_t r = static_cast<size_t>(it - stage.site_names.begin());
    if (stage.site_names.size() < 2 || r == 0) return {};  // replica 0 writes the stage's checkpoints
    std::vector<std::string> pipeline;
    for (const auto& k : st) {
      if (sites_.at(k.site_names[0]).silent) return {};  // pipeline 0 is needed whole
      pipeline.push_back(k.site_names[r]);
    }
    return pipeline;
  }
  return {};
}

bool RunMachine::LeaveOutDilocoWorker(const std::string& site, const std::set<std::string>& failed) {
  const std::vector<std::string> pipeline = DilocoPipelineOf(site);
  if (pipeline.empty()) return false;
  // Errors reported meanwhile must all be the left-out pipeline's own (its stages fail when one goes).
  for (const auto& f : failed)
    if (std::find(pipeline.begin(), pipeline.end(), f) == pipeline.end()) return false;
  // The workers left must reach a switch before the run's last step, whose final outer sync needs all.
  if ((phase_ == Phase::kSwitching ? boundary_ : lease_) >= c_.steps) return false;
  for (const auto& p : pipeline) {
    attempt_.used.erase(p);
    attempt_.done.erase(p);  // a failure of its own, not the attempt's
    if (std::find(attempt_.left_out.begin(), attempt_.left_out.end(), p) == attempt_.left_out.end())
      attempt_.left_out.push_back(p);
  }
  lost_.insert(site);
  const bool several = pipeline.size() > 1;
  const std::string what =
      several ? absl::StrCat("its DiLoCo pipeline (", Quoted(pipeline), ") is left out of the outer average")
              : std::string("its DiLoCo worker is left out of the outer average");
  const std::string why = absl::StrCat("site '", site, "' stopped answering (no heartbeat for ",
                                       c_.spec.heartbeat_timeout_seconds, " s); ", what, " and the others go on");
  Out(LogSite{site, absl::StrCat("lost: no heartbeat for ", c_.spec.heartbeat_timeout_seconds, " s; ", what)});
  Note("left_out", site, why);
  Say(absl::StrCat("lost: ", why, "\n"));
  if (phase_ != Phase::kSwitching) {
    BeginSwitch(absl::StrCat("site '", site, "' was lost; the DiLoCo ", several ? "pipelines" : "workers",
                             " left re-plan without it"));
    return true;
  }
  Out(SetBoundary{job_id_, boundary_, attempt_.left_out});  // the switch under way leaves it out too
  // The survivors may have waited for the coordinator's word until now: time to reach the boundary.
  attempt_.deadline = std::max(attempt_.deadline, now_ + After(c_.spec.heartbeat_timeout_seconds + c_.drain_seconds));
  for (const auto& u : attempt_.used)
    if (!attempt_.done.count(u)) return true;
  CompleteSwitch();
  return true;
}

void RunMachine::BeginSwitch(const std::string& why, bool for_speed) {
  // The boundary is the largest lease granted, which no stage can have passed; 0: none granted yet, so it
  // is placed at the first report (PlaceBoundary).
  const int64_t step = lease_;
  attempt_.lost = why;
  switching_for_speed_.reset();
  if (step >= c_.steps) {
    Say(absl::StrCat("switch: ", why, "; the run ends at step ", c_.steps, " first, so it leaves then\n"));
    Note("leave", "", absl::StrCat(why, "; the run ends at step ", c_.steps, " first, so it leaves then"));
    return;
  }
  boundary_ = step;
  phase_ = Phase::kSwitching;
  if (for_speed && plan_) {  // the plan switched away from, to check the new one against (CheckSwitch)
    SwitchTrial t;
    for (const auto& st : plan_->stages)
      t.before.push_back({st.site_names, st.last_op, {}});  // a replicated stage's shares: by speed, as priced now
    t.before_layout = LayoutOf(*plan_);
    switching_for_speed_ = std::move(t);
  }
  attempt_.deadline =
      now_ + After(c_.drain_seconds + 2 * SwitchMargin() * std::max(last_step_seconds_, 1e-3) + BoundarySyncSeconds());
  if (step == 0) {
    if (!attempt_.left_out.empty()) Out(SetBoundary{job_id_, 0, attempt_.left_out});  // the workers left out, now
    Say(absl::StrCat("switch: ", why,
                     "; every stage ends after its first step of this attempt with its checkpoint, and the sites "
                     "left resume from there\n"));
    Note("switch", "",
         absl::StrCat(why,
                      "; every stage ends after its first step of this attempt with its checkpoint of that "
                      "step, then a new plan resumes from it"));
    return;
  }
  Out(SetBoundary{job_id_, step, attempt_.left_out});
  Say(absl::StrCat("switch: ", why, "; every stage ends after step ", step,
                   " with its checkpoint, and the sites "
                   "left resume from there\n"));
  Note("switch", "",
       absl::StrCat(why, "; every stage ends after step ", step,
                    " with its checkpoint of that step, then a new plan resumes from it"));
}

absl::StatusOr<partitioner::Plan> RunMachine::PriceLayout(const partitioner::Plan& layout,
                                                          const partitioner::ClusterProfile& live) const {
  partitioner::PlanOptions pin = BaseOptions();
  std::vector<std::vector<int>> sites, shares;
  std::vector<int> last_ops;
  for (const auto& st : layout.stages) {
    sites.emplace_back();
    for (const auto& name : st.site_names) {
      const int index = SiteIndex(live, name);
      if (index < 0) return absl::FailedPreconditionError(absl::StrCat("site '", name, "' is not in the run"));
      sites.back().push_back(index);
    }
    last_ops.push_back(st.last_op);
    // A replicated stage's replicas run the shares they were assigned, whatever their speed now.
    shares.push_back(st.site_names.size() > 1 && st.micro_batches.size() == st.site_names.size() ? st.micro_batches
                                                                                                 : std::vector<int>{});
  }
  partitioner::PinLayout(sites, last_ops, &pin, shares);
  return partitioner::PlanPipeline(graph_, live, pin);
}

absl::StatusOr<RunMachine::Repriced> RunMachine::ReplanAgainstCurrent() const {
  const partitioner::ClusterProfile live = LiveProfile();
  auto fresh = partitioner::PlanPipeline(graph_, live, BaseOptions());
  if (!fresh.ok()) return fresh.status();
  auto current = PriceLayout(*plan_, live);
  if (!current.ok()) return current.status();
  return Repriced{std::move(*fresh), std::move(*current), static_cast<int>(live.sites.size())};
}

int RunMachine::UsedSiteCount() const { return plan_ ? static_cast<int>(SitesOf(*plan_).size()) : 0; }

double RunMachine::PlannedStepCompute(const std::string& site) const {
  if (!plan_) return 0;
  for (const auto& st : plan_->stages)
    for (size_t i = 0; i < st.site_names.size(); ++i) {
      if (st.site_names[i] != site) continue;
      for (const auto& p : profile_.sites)
        if (p.name == site)
          return partitioner::StagePassSeconds(graph_, p, st) *
                     (i < st.micro_batches.size() ? st.micro_batches[i] : c_.micro_batches) +
                 partitioner::OptimizerSeconds(graph_, p, st.first_op, st.last_op, plan_->zero);
    }
  return 0;
}

void RunMachine::CheckDrift(const v1::MetricsReport& r) {
  const core::ElasticSpec& el = c_.spec.elastic;
  // A pinned layout (--plan, --split even) is the operator's: re-planning would not be allowed to change it.
  if (!el.enabled || phase_ != Phase::kTraining || !c_.pinned.empty() || c_.even_split) return;
  // Reports that come in while a site measures itself mid-run (a joiner, a re-measure) are left out: on a
  // shared host the others computed beside the measurement (the switch checks leave such steps out too).
  if (MeasuringMidRun()) return;
  // An attempt a switch for speed began is checked before it is judged: its first step and a window go to
  // CheckSwitch, which may take the run back. Judged from its first report, a site off its figures from
  // the plan's start would be flagged at its `window`-th report, before the check, and its switch would
  // end the attempt with the check still pending: two sites could trade places at every window. The same
  // holds after a switch that only moved the cuts (it starts no check; its figures are as new).
  if (after_switch_for_speed_ && attempt_steps_.size() <= static_cast<size_t>(el.window)) return;
  const double planned = PlannedStepCompute(r.site());
  if (planned <= 0 || !(r.compute_seconds() > 0) || !std::isfinite(r.compute_seconds())) return;
  Drift& mine = drift_[r.site()];
  const double latest = r.compute_seconds() / planned;
  // A window of reports, and one more: a slowdown is seen through one step that ran at full speed (a CPU
  // quota or a shared GPU lets a whole step through now and then; the window must not start again then).
  const size_t window = static_cast<size_t>(el.window), span = window + 1;
  mine.recent.push_back(latest);
  if (mine.recent.size() > span) mine.recent.erase(mine.recent.begin());
  const bool settled = mine.lo > 0;  // below: the range of a window it spent on plan
  double common;
  const int used = UsedSiteCount();
  const bool alone = used < 2;
  if (alone) {
    // One site alone: nothing to compare it with, so its own first `window` reports under this plan (after
    // the first, a warm-up) set the ratio it is measured against.
    if (mine.baseline <= 0) {
      if (!std::exchange(mine.warmed_up, true)) return;
      mine.first.push_back(latest);
      if (mine.first.size() < static_cast<size_t>(el.window)) return;
      mine.baseline = Median(mine.first);
      return;
    }
    common = mine.baseline;
  } else {
    if (drift_.size() < 2) return;  // until a second used site has reported
    // Each site's typical ratio: the median of its recent reports, so that one site's spike (a step
    // preempted on a shared host) does not move what every other site is measured against. The common
    // ratio is their lower median, the site's own included: of two sites off each other from the start,
    // the slower is the one flagged. But of two sites, a settled one is measured against the other's
    // alone (it must also have changed itself, below): the lower median of two is the faster one's, so a
    // site that grew faster (a slowdown it was re-measured at easing) was its own reference and never
    // flagged. With three or more, the median of all is robust to one site off either way.
    std::vector<double> typical;
    const bool other_alone = settled && used == 2;
    for (const auto& [site, d] : drift_)
      if (!other_alone || site != r.site()) typical.push_back(Median(Last(d.recent, window)));
    common = Median(typical);
  }
  std::vector<double>& q = mine.window;
  q.push_back(latest / common);
  if (q.size() > span) q.erase(q.begin());
  if (q.size() < window) return;
  // `window` of its latest `window` + 1 reports off the same way (all of them while only `window` have
  // come): a noisy or transient step does not count, nor does one step at full speed within a slowdown.
  // Once the site has settled under the plan, it must also have changed itself, as many of its own
  // reports off its settled range by `drift`: with two sites, the one re-measured at a CPU quota's
  // slowdown that then eases makes the other seem slower relative to it, but the other has not changed.
  const std::vector<double> own = Last(mine.recent, q.size());
  auto enough = [&](const std::vector<double>& xs, auto&& off) {
    return static_cast<size_t>(std::count_if(xs.begin(), xs.end(), off)) >= window;
  };
  const auto slow = [&](double x) { return x >= 1 + el.drift; };
  const auto fast = [&](double x) { return x <= 1 - el.drift; };
  const bool slower =
      enough(q, slow) && (alone || !settled || enough(own, [&](double x) { return x >= (1 + el.drift) * mine.lo; }));
  // A site alone is flagged only when slower: measured against itself, a site whose speed swings (a CPU
  // quota on steps of milliseconds) would otherwise be re-measured slower, then faster, then slower again.
  // Each flag rescales its profile, so the next needs a slowdown beyond the last one.
  const bool faster = !alone && el.drift < 1 && enough(q, fast) &&
                      (!settled || enough(own, [&](double x) { return x <= (1 - el.drift) * mine.hi; }));
  const std::vector<double> latest_window = Last(q, window);
  if (!slower && !faster) {
    // The first full window it spends within `drift` of the others (under this plan, or since it was last
    // re-measured) is where it settled: its range then is what a later change is measured against. A
    // site off its figures from the start never settles, and is measured against the common ratio alone.
    if (!settled && !alone && std::all_of(latest_window.begin(), latest_window.end(), [&](double x) {
          return x > 1 - el.drift && x < 1 + el.drift;
        })) {
      const std::vector<double> range = Last(own, window);
      mine.lo = *std::min_element(range.begin(), range.end());
      mine.hi = *std::max_element(range.begin(), range.end());
    }
    return;
  }
  // The re-measured ratio: the median of the reports off -- the latest `window` when they all are, else
  // those of the latest `window` + 1 (a full-speed step among them is not one).
  const auto is_off = [&](double x) { return slower ? slow(x) : fast(x); };
  const bool each = std::all_of(latest_window.begin(), latest_window.end(), is_off);
  std::vector<double> off;
  for (double x : each ? latest_window : q)
    if (is_off(x)) off.push_back(x);
  const double ratio = Median(off);
  q.clear();
  // Re-measured from the running stage: the site's op times scale by the median ratio (its profile is
  // what every later plan prices it with).
  for (auto& p : profile_.sites)
    if (p.name == r.site()) {
      for (auto& [op, t] : p.op_seconds) t *= ratio;
      p.flops_per_second /= ratio;
    }
  for (auto& [site, d] : drift_) d.window.clear();  // the others are measured against the new figures too
  for (double& x : mine.recent) x /= ratio;         // its recent reports, against its re-measured figures
  mine.lo = mine.hi = 0;                            // and its range settles anew under them
  const std::string what =
      absl::StrFormat("site '%s' computed %.2fx its planned time (relative to %s) in %s (to step %d)", r.site(), ratio,
                      alone ? "its first steps under this plan" : "the other sites",
                      each ? absl::StrFormat("each of its last %d steps", window)
                           : absl::StrFormat("%d of its last %d steps", window, span),
                      r.step() + 1);
  // The current layout and a new plan, both priced with the re-measured profile.
  auto priced_plans = ReplanAgainstCurrent();
  if (!priced_plans.ok()) {
    Note("straggler", r.site(), absl::StrCat(what, "; re-planning failed: ", priced_plans.status().message()));
    return;
  }
  const partitioner::Plan* fresh = &priced_plans->fresh;
  const partitioner::Plan* current = &priced_plans->current;
  const double gain = 1 - fresh->predicted_step_seconds / current->predicted_step_seconds;
  const std::string priced =
      gain > 0 ? absl::StrFormat(
                     "%s; a new plan predicts %.4f s/step against %.4f s/step for the current one "
                     "(%.0f%% faster)",
                     what, fresh->predicted_step_seconds, current->predicted_step_seconds, 100 * gain)
               : absl::StrFormat("%s; the current plan stays the best (%.4f s/step; a new one predicts %.4f)", what,
                                 current->predicted_step_seconds, fresh->predicted_step_seconds);
  Out(LogSite{r.site(), priced});
  if (gain > el.min_gain) {
    if (!SwitchAllowed(*fresh, "straggler", r.site(), priced)) return;
    std::vector<std::string> idle;  // sites the new plan uses and the current one does not
    for (const auto& st : fresh->stages)
      for (const auto& site : st.site_names)
        if (!attempt_.used.count(site) && std::find(idle.begin(), idle.end(), site) == idle.end()) idle.push_back(site);
    if (std::any_of(idle.begin(), idle.end(), [&](const std::string& s) { return sites_[s].silent; })) {
      Note("straggler", r.site(), absl::StrCat(priced, "; the new plan uses a site that does not answer: no switch"));
      return;
    }
    if (!idle.empty()) {
      remeasure_deadline_ = now_ + After(kRemeasureSeconds);
      const std::string names = Quoted(idle);
      remeasure_why_ = priced;
      for (const auto& site : idle) {
        remeasuring_.insert(site);
        Out(LogSite{site, "asked to measure its device and the model again (a straggler's re-plan would use it)"});
        Out(SendCommand{site, ProfileCommand(site, {})});
      }
      Note("straggler", r.site(), absl::StrCat(priced, "; measuring ", names, " again before switching to it"));
      Say(absl::StrCat("straggler: ", priced, "; measuring ", names,
                       " again first (idle since it was measured) while training goes on\n"));
      return;
    }
    Note("straggler", r.site(), priced);
    return BeginSwitch(priced, /*for_speed=*/true);
  }
  Note("straggler", r.site(),
       absl::StrFormat("%s; not above elastic.min_gain (%.0f%%): no switch", priced, 100 * el.min_gain));
  Say(absl::StrFormat("straggler: %s; not above elastic.min_gain (%.0f%%): no switch\n", priced, 100 * el.min_gain));
}

void RunMachine::OnRemeasured(const v1::ProfileReport& r) {
  const std::string site = r.site();
  measured_in_step_ = true;
  remeasuring_.erase(site);
  partitioner::ClusterProfile checked;
  const std::set<std::string> no_links;  // its links stand as measured: only its device and the model again
  absl::Status s = r.error().empty() ? CheckProfile(r, &checked, no_links) : absl::UnavailableError(Clean(r.error()));
  if (!s.ok()) {  // the decision waited for it: no switch onto figures that did not check out
    remeasuring_.clear();
    const std::string why = absl::StrCat("measuring it again failed: ", Clean(std::string(s.message())),
                                         "; the straggler's re-plan is dropped (no switch)");
    Out(LogSite{site, why});
    Note("straggler", site, why);
    Say(absl::StrCat("straggler: site '", site, "': ", why, "\n"));
    return;
  }
  for (auto& p : profile_.sites)
    if (p.name == site) {
      Out(LogSite{site,
                  absl::StrFormat(
                      "measured again: the model takes %.4f s per micro-batch (was %.4f s)",
                      partitioner::RangeSeconds(graph_, checked.sites[0], 0, static_cast<int>(graph_.ops.size()) - 1),
                      partitioner::RangeSeconds(graph_, p, 0, static_cast<int>(graph_.ops.size()) - 1))});
      p = checked.sites[0];
    }
  Out(WriteRunFile{core::kProfileFile, partitioner::ProfileToJson(profile_)});
  if (phase_ != Phase::kTraining) {  // a switch under way: no decision on them any more; figures kept
    remeasuring_.clear();
    return Out(LogSite{site, "measured again while the run switches plans: its figures serve the next plan"});
  }
  if (!remeasuring_.empty()) return;  // the others next
  auto priced_plans = ReplanAgainstCurrent();
  if (!priced_plans.ok()) {  // the end of the re-plan announced as "measuring ... again first": said too
    const std::string why =
        absl::StrCat("re-planning after measuring again failed: ", priced_plans.status().message(), " (no switch)");
    Note("straggler", site, why);
    Say(absl::StrCat("straggler: site '", site, "': ", why, "\n"));
    return;
  }
  const double gain = 1 - priced_plans->fresh.predicted_step_seconds / priced_plans->current.predicted_step_seconds;
  const std::string priced = absl::StrFormat(
      "%s; measured again, a new plan predicts %.4f s/step against %.4f s/step for the current one", remeasure_why_,
      priced_plans->fresh.predicted_step_seconds, priced_plans->current.predicted_step_seconds);
  if (gain > c_.spec.elastic.min_gain) {
    if (!SwitchAllowed(priced_plans->fresh, "straggler", site, priced)) return;
    Note("straggler", site, priced);
    return BeginSwitch(absl::StrFormat("%s (%.0f%% faster)", priced, 100 * gain), /*for_speed=*/true);
  }
  Note("straggler", site,
       absl::StrFormat("%s: not above elastic.min_gain (%.0f%%): no switch", priced, 100 * c_.spec.elastic.min_gain));
  Say(absl::StrFormat("straggler: %s: not above elastic.min_gain (%.0f%%): no switch\n", priced,
                      100 * c_.spec.elastic.min_gain));
}

void RunMachine::CompleteSwitch() {
  Out(SetBoundary{"", 0});
  bool aligned = true;
  for (const auto& [site, d] : attempt_.done) aligned &= d.error().empty() && d.steps() == boundary_;
  resume_ = true;
  if (aligned) {
    switch_step_ = boundary_;
    Say(absl::StrCat("switch: every stage saved step ", boundary_, "; re-planning\n"));
  } else {
    Say(absl::StrCat("switch: the stages did not all end at step ", boundary_,
                     "; resuming from the newest intact checkpoint\n"));
  }
  // The plan before: its median step over its last `window` steps after its first (which warms up),
  // steps during which a site measured itself mid-run left out (the cores were shared). A switch for speed
  // is checked against it (CheckSwitch), and with a full window it is what the layout measured, beside
  // its price over the profile as it is now (a straggler's re-measure included), for later switches onto
  // it (SwitchAllowed). Not where DiLoCo workers were left out: those steps ran without them.
  std::optional<SwitchTrial> trial = std::exchange(switching_for_speed_, std::nullopt);
  const std::vector<double> before = RecentSteps();
  if (trial && !before.empty()) trial->before_seconds = Median(before);
  if (plan_ && attempt_.left_out.empty() && before.size() == static_cast<size_t>(c_.spec.elastic.window))
    if (auto priced = PriceLayout(*plan_, LiveProfile()); priced.ok() && priced->predicted_step_seconds > 0)
      measured_[LayoutOf(*plan_)] = {Median(before), priced->predicted_step_seconds, progress_step_ + 1};
  StartAttempt();
  after_switch_for_speed_ = trial.has_value();
  if (trial && trial->before_seconds > 0 && phase_ == Phase::kTraining && plan_ &&
      LayoutOf(*plan_) != trial->before_layout)
    trial_ = std::move(trial);
}

std::vector<double> RunMachine::RecentSteps() const {
  std::vector<double> out;
  for (size_t i = attempt_steps_.size(); i-- > 1 && out.size() < static_cast<size_t>(c_.spec.elastic.window);)
    if (!attempt_steps_[i].second) out.push_back(attempt_steps_[i].first);
  return out;
}

bool RunMachine::SwitchAllowed(const partitioner::Plan& fresh, const std::string& kind, const std::string& site,
                               const std::string& priced) {
  std::string why;
  if (refused_.count(SitesOf(fresh))) {
    why = absl::StrCat(priced,
                       "; a switch onto these sites measured slower than the plan before it earlier in this run: no "
                       "switch");
  } else if (const std::string layout = LayoutOf(fresh); plan_ && layout != LayoutOf(*plan_)) {
    const auto earlier = measured_.find(layout);
    // The current plan's last `window` steps after its first: fewer early in a plan (a site off its figures
    // from the start is flagged at its `window`-th report, when the reporter, stage 0, may have `window` - 2
    // steps after its first), but at least one.
    const std::vector<double> now = RecentSteps();
    if (earlier == measured_.end() || now.empty()) return true;
    // What the layout measured against its price then carries its prediction's error over to its price
    // now: re-measured sites (a slowdown that has eased, a joiner) count, the error of its pricing too.
    const Measured& m = earlier->second;
    const double ratio = m.seconds / m.priced, expected = fresh.predicted_step_seconds * ratio;
    const double current = Median(now), gain = 1 - expected / current;
    if (gain > c_.spec.elastic.min_gain) return true;
    why = absl::StrFormat(
        "%s; but %s ran a median %.4f s a step over its last %d steps to step %d earlier in this run, %.2fx its "
        "price then (%.4f s): at that, the new plan's %.4f s would run %.4f s, against %.4f s for the current plan "
        "over its last %d steps: %.0f%% %s, not above elastic.min_gain (%.0f%%): no switch",
        priced, layout, m.seconds, c_.spec.elastic.window, m.last_step, ratio, m.priced, fresh.predicted_step_seconds,
        expected, current, now.size(), 100 * std::abs(gain), gain >= 0 ? "faster" : "slower",
        100 * c_.spec.elastic.min_gain);
  } else {
    return true;
  }
  Note(kind, site, why);
  Say(absl::StrCat(kind == "join" ? "join: " : "straggler: ", why, "\n"));
  return false;
}

void RunMachine::CheckSwitch() {
  if (!trial_ || phase_ != Phase::kTraining) return;
  const size_t window = static_cast<size_t>(c_.spec.elastic.window);
  if (attempt_steps_.size() < window + 1) return;  // its first step warms up (resume, allocations)
  const SwitchTrial t = *std::exchange(trial_, std::nullopt);
  std::vector<double> steps;
  for (size_t i = 1; i < attempt_steps_.size(); ++i) steps.push_back(attempt_steps_[i].first);
  const double after = Median(steps);
  const std::string layout = LayoutOf(*plan_);  // the attempt's plan: the one switched to (StartAttempt resets trial_)
  const std::string measured = absl::StrFormat(
      "the switch to %s ran a median %.4f s a step over its steps %d-%d (predicted %.4f s) against %.4f s for %s "
      "before it",
      layout, after, progress_step_ + 2 - static_cast<int64_t>(attempt_steps_.size() - 1), progress_step_ + 1,
      plan_->predicted_step_seconds, t.before_seconds, t.before_layout);
  const double back = 1 - t.before_seconds / after;  // what switching back would gain
  if (back <= c_.spec.elastic.min_gain) {
    const std::string verdict =
        absl::StrFormat("%s: %.0f%% %s", measured, 100 * std::abs(1 - after / t.before_seconds),
                        after <= t.before_seconds ? "faster" : "slower, within elastic.min_gain; kept");
    Note("switch_check", "", verdict);
    Say(absl::StrCat("switch check: ", verdict, "\n"));
    return;
  }
  const std::set<std::string> sites = SitesOf(*plan_);
  refused_.insert(sites);
  const std::vector<std::string> names(sites.begin(), sites.end());
  const std::string verdict = absl::StrFormat(
      "%s: the plan before was %.0f%% faster, above elastic.min_gain (%.0f%%); switching back to %s, and no "
      "switch for speed onto %s again in this run",
      measured, 100 * back, 100 * c_.spec.elastic.min_gain, t.before_layout, Quoted(names));
  Note("switch_check", "", verdict);
  Say(absl::StrCat("switch check: ", verdict, "\n"));
  switch_back_ = t.before;
  BeginSwitch(absl::StrCat("switching back to ", t.before_layout, " (the switch check above)"));
  if (phase_ != Phase::kSwitching) switch_back_.clear();  // the run ends first
}

// ---- Recovery ----

// The attempt ended early. Names the lost sites and lets the survivors abandon the attempt (draining);
// fails when no site was lost (a stage failed on its own) or the job has no checkpoints.
void RunMachine::EndAttempt() {
  const core::ClusterSpec& spec = c_.spec;
  const std::vector<std::string> silent = SilentUsed();
  if (silent.empty() && attempt_.failure_code == static_cast<int>(absl::StatusCode::kDataLoss) &&
      c_.job.checkpoint.interval > 0 && data_loss_recoveries_ < c_.max_data_loss_recoveries) {
    // Corrupt or non-finite data (a neighbour's, or this stage's own): nothing is lost but the steps since
    // the newest checkpoint, which holds finite values only. Resume every stage from it.
    ++data_loss_recoveries_;
    data_loss_at_ = progress_step_;
    Say(absl::StrCat("recovery: site '", attempt_.failed_site, "' failed on corrupt or non-finite data (",
                     attempt_.failure, "); resuming every stage from the newest intact checkpoint (",
                     data_loss_recoveries_, " of at most ", c_.max_data_loss_recoveries, " such recoveries)\n"));
    Note("recovery", attempt_.failed_site,
         absl::StrCat("failed on corrupt or non-finite data; every stage resumes from the newest intact checkpoint"));
    phase_ = Phase::kDraining;
    Out(SetLease{job_id_, lease_, /*abandoned=*/true});
    attempt_.deadline = now_ + After(c_.drain_seconds);
    for (const auto& u : attempt_.used)
      if (!attempt_.done.count(u) && !sites_[u].silent) return;
    return AfterDrain();
  }
  if (silent.empty()) return Fail(absl::StrCat("site '", attempt_.failed_site, "' failed: ", attempt_.failure));
  data_loss_recoveries_ = 0;
  const std::string names = Quoted(silent);
  const std::string what =
      absl::StrCat("site ", names, " stopped answering (no heartbeat for ", spec.heartbeat_timeout_seconds, " s)",
                   attempt_.failed_site.empty()
                       ? ""
                       : absl::StrCat("; then site '", attempt_.failed_site, "' failed: ", attempt_.failure));
  Say(absl::StrCat("lost: ", what, "\n"));
  attempt_.lost = what;
  for (const auto& n : silent)
    Note("lost", n,
         absl::StrCat("no heartbeat for ", spec.heartbeat_timeout_seconds, " s; ",
                      spec.on_failure == core::OnFailure::kWait ? "waiting for it" : "re-planning without it"));
  for (const auto& n : silent)
    Out(LogSite{n,
                absl::StrCat("lost: no heartbeat for ", spec.heartbeat_timeout_seconds, " s; ",
                             spec.on_failure == core::OnFailure::kWait ? "waiting for it" : "re-planning without it")});
  if (c_.job.checkpoint.interval <= 0)
    return Fail(absl::StrCat(what,
                             ". The job has no checkpoints (job.checkpoint.interval), so nothing to resume "
                             "from; set one to survive lost sites"));
  for (const auto& n : silent) lost_.insert(n);
  // The survivors abandon the attempt when their neighbours' streams break (or at the step timeout), or
  // at once when they wait for a lease.
  phase_ = Phase::kDraining;
  Out(SetLease{job_id_, lease_, /*abandoned=*/true});
  attempt_.deadline = now_ + After(c_.drain_seconds);
  for (const auto& u : attempt_.used)
    if (!attempt_.done.count(u) && !sites_[u].silent) return;
  AfterDrain();
}

// The survivors are done with the abandoned attempt: wait for the lost sites (on_failure: wait) or plan
// without them (replan), and resume.
void RunMachine::AfterDrain() {
  const std::vector<std::string> lost(lost_.begin(), lost_.end());
  resume_ = true;
  if (lost.empty()) return StartAttempt();  // no site lost (corrupt or non-finite data): the same sites
  if (c_.spec.on_failure == core::OnFailure::kWait) {
    if (std::any_of(lost.begin(), lost.end(), [&](const std::string& s) { return sites_[s].silent; })) {
      Say(absl::StrCat("recovery: waiting for ", Quoted(lost), " to rejoin (on_failure: wait)\n"));
      phase_ = Phase::kWaitingForReturn;
      return;
    }
    Say(absl::StrCat("recovery: ", Quoted(lost), " answering again; resuming from the newest intact checkpoint\n"));
    lost_.clear();
    return StartAttempt();
  }
  for (const auto& s : SilentUsed()) lost_.insert(s);  // went silent while the others drained
  if (Excluded().size() >= profile_.sites.size()) return Fail(absl::StrCat(attempt_.lost, "; no site left"));
  Say(absl::StrCat("recovery: re-planning over the ", profile_.sites.size() - Excluded().size(),
                   " sites left and resuming from the newest intact checkpoint\n"));
  StartAttempt();
}

void RunMachine::Finish() {
  int64_t wire = earlier_wire_, raw = earlier_raw_;  // over every attempt
  for (const auto& [name, d] : attempt_.done) wire += d.wire_bytes(), raw += d.raw_bytes();
  const double el = Seconds(now_ - t0_);
  Say(absl::StrFormat(
      "done: %d steps in %.1f s (%.2f s/step, predicted %.2f); %.1f MB on the links, %.0f%% of uncompressed; "
      "final loss %.4f; weights in %s/%s\n",
      c_.steps, el, el / c_.steps, plan_->predicted_step_seconds, wire / 1e6, raw ? 100.0 * wire / raw : 100.0,
      last_loss_, c_.run_dir, core::kWeightsDir));
  Note("done", "", absl::StrFormat("%d steps in %.1f s, final loss %.4f", c_.steps, el, last_loss_));
  Out(StopAll{});
  Out(Exit{0});
  phase_ = Phase::kFinished;
}

void RunMachine::Fail(const std::string& message) {
  Out(Print{absl::StrCat("meridian run: ", message, "\n"), /*to_stderr=*/true});
  Note("failed", "", message);
  Out(StopAll{});
  Out(Exit{1});
  phase_ = Phase::kFinished;
}

}  // namespace meridian::coordinator
