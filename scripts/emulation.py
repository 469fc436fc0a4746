"""Sites and WAN links on one machine, for the demo and the benchmarks.

As root, each site gets its own network namespace and a CPU quota (cgroup v1 cpu controller, a 10 ms
period; none for a site alone on its core with a whole core's quota: `_write_quota`), and is pinned to a
core its quota fits beside the others' (`_pin`); site pairs are joined by
veth links rate-limited with tbf in both directions, and each site's executor is reached through
meridian-wanrelay, which adds the RTT (tc here has no netem). The
coordinator is reached over an unshaped bridge. Addresses: site i listens for peers on 10.NET.100.i
(routed over the links), reaches the coordinator at 10.NET.200.254. Without root everything runs on
loopback at full speed, and the class says so.
"""
import os
import signal
import subprocess
import time

# How long each relay gathers the bytes that arrive together into one delayed chunk (meridian-wanrelay
# --gather-ms). The relay runs in its site's quota and on its core, and wakes once a gathering period while
# bytes flow, taking the core from the site's compute thread: with 1 ms chunks an identity link at 20 Mbit/s
# between the two sites sharing a core cost the bottleneck's compute thread 7-10% more CPU and the run
# 11-13% of its tokens/s, against 5 ms (docs/transport.md). The tail of a bulk transfer arrives up to
# this early; a lone message keeps its exact delay.
RELAY_GATHER_MS = float(os.environ.get("MERIDIAN_RELAY_GATHER_MS", "5"))


def sh(cmd, check=True):
    return subprocess.run(cmd, shell=True, check=check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class Emulation:
    """Namespaces, links, relays and CPU quotas (root), or plain loopback."""

    def __init__(self, bin_dir, sites, links, rtt_ms, prefix="mrdemo", net=213, port_base=7600):
        """sites: [(name, cpu quota)]; links: [(site, site, Mbit/s)], both ways; rtt_ms: added by relays.
        `net` picks the 10.NET.0.0/16 addresses and `prefix` the interface/namespace names, so two
        emulations (the demo and a benchmark) do not collide."""
        self.sites, self.links, self.rtt_ms, self.prefix, self.net, self.port_base = sites, links, rtt_ms, prefix, net, port_base
        self.root = os.geteuid() == 0
        prefix = self.prefix
        self.bin = bin_dir
        self.procs = []
        self.cgroups = self.root and os.path.isdir("/sys/fs/cgroup/cpu")
        self.coordinator = f"127.0.0.1:{port_base}"
        self.cpus = {}
        if not self.root:
            print("notice: not root: sites run on loopback without WAN emulation or CPU quotas")
            return
        self.teardown()
        # Control plane: a bridge in the root namespace, one unshaped veth per site.
        sh(f"ip link add {prefix}br type bridge && ip addr add 10.{net}.200.254/24 dev {prefix}br && "
           f"ip link set {prefix}br up")
        self.coordinator = f"10.{net}.200.254:{port_base}"
        for i, (s, _) in enumerate(sites, start=1):
            ns = f"{prefix}-{s}"
            sh(f"ip netns add {ns} && ip netns exec {ns} ip link set lo up")
            # The site's public address, the one its peers dial (through the link between them).
            sh(f"ip netns exec {ns} ip addr add 10.{net}.100.{i}/32 dev lo")
            sh(f"ip link add {prefix}c{i} type veth peer name {prefix}d{i} && ip link set {prefix}c{i} master {prefix}br && "
               f"ip link set {prefix}c{i} up && ip link set {prefix}d{i} netns {ns} && "
               f"ip netns exec {ns} ip addr add 10.{net}.200.{i}/24 dev {prefix}d{i} && ip netns exec {ns} ip link set {prefix}d{i} up")
        index = {s: i for i, (s, _) in enumerate(sites, start=1)}
        for k, (a, b, mbit) in enumerate(links, start=1):
            va, vb = f"{prefix}{k}a", f"{prefix}{k}b"
            sh(f"ip link add {va} type veth peer name {vb}")
            for v, s, host, other in ((va, a, 1, b), (vb, b, 2, a)):
                ns = f"{prefix}-{s}"
                burst = max(16384, int(mbit * 1e6 / 8 * 0.002))
                sh(f"ip link set {v} netns {ns} && ip netns exec {ns} ip addr add 10.{net}.{k}.{host}/24 dev {v} && "
                   f"ip netns exec {ns} ip link set {v} up && "
                   f"ip netns exec {ns} tc qdisc add dev {v} root tbf rate {mbit}mbit burst {burst} latency 200ms && "
                   f"ip netns exec {ns} ip route add 10.{net}.100.{index[other]}/32 via 10.{net}.{k}.{3 - host} dev {v}")
        if self.cgroups:
            for s, quota in sites:
                g = self._group(s)
                os.makedirs(g, exist_ok=True)
                # A 10 ms period: the executors' profiler times the operators over at least 50 ms of passes,
                # so it measures the quota's sustained speed, not the full speed short calls get between
                # throttles.
                open(f"{g}/cpu.cfs_period_us", "w").write("10000")
            self.cpus = self._pin(sites)
            for s, quota in sites:
                self._write_quota(s, quota)
        else:
            print("notice: no cgroup v1 cpu controller: sites run at full speed")

    @staticmethod
    def _pin(sites):
        """Each site's CPU, {site: cpu}: the quotas packed onto the host's cores (first fit, largest first), so
        that every site's quota fits one core and a core's sites together fit it, as a real site's device is
        its own. Unpinned, the scheduler chose each site's core from moment to moment and a site's speed
        moved with the other sites' load: in one run a site of quota 0.6 computed at about 0.5 of a core
        while the three sites together used 1.6 of the 2 cores (docs/transport.md). {} (no pinning) for a
        single site, or when the quotas do not pack."""
        if len(sites) < 2:
            return {}
        free = [1.0] * (os.cpu_count() or 1)
        cpus = {}
        for s, quota in sorted(sites, key=lambda x: -x[1]):
            cpu = next((c for c, f in enumerate(free) if quota <= f + 1e-9), None)
            if cpu is None:
                print(f"notice: the sites' quotas do not pack onto {len(free)} cores: sites are not pinned")
                return {}
            free[cpu] -= quota
            cpus[s] = cpu
        return cpus

    def set_quota(self, site, quota):
        """Changes a site's CPU quota now, for every process in its group (as a shared GPU slows down).
        Without cgroups (not root, or no v1 cpu controller) it cannot, and raises."""
        if not self.cgroups:
            raise RuntimeError("set_quota needs root and the cgroup v1 cpu controller")
        self._write_quota(site, quota)

    def _group(self, site):
        """The site's cgroup v1 cpu directory."""
        return f"/sys/fs/cgroup/cpu/{self.prefix}-{site}"

    def _write_quota(self, site, quota):
        # The quota caps the site; its weight (cpu.shares, 1024 for a whole core) decides who runs first
        # when the sites together want more than the host's cores. With equal weights a site of quota 1.0
        # sharing a core with one of 0.6 got half of it, and its GEMM measured 21 to 85 GFLOP/s from one
        # demo run to the next.
        # A site pinned alone to its core with a quota of a whole core gets no quota at all: the pinning
        # already gives it that core, and the kernel's bandwidth control, enforcing a quota equal to its
        # period, throttled even a lone single-threaded trainer in about half the periods and cost it 6% of
        # its wall time (7.82 against 7.39 s a step of `meridian train-local` at the same CPU), and more
        # where the site's other threads woke up: the fast site then ran at 0.92-0.97 of its core.
        group = self._group(site)
        cpu = self.cpus.get(site)
        alone = cpu is not None and all(c != cpu for s, c in self.cpus.items() if s != site)
        open(f"{group}/cpu.cfs_quota_us", "w").write("-1" if alone and quota >= 1 else str(int(quota * 10000)))
        open(f"{group}/cpu.shares", "w").write(str(max(2, int(quota * 1024))))

    def wrap(self, site, cmd):
        prefix = self.prefix
        if not self.root:
            return cmd
        # Join the CPU cgroup first: `ip netns exec` mounts a fresh /sys without the cgroup tree.
        netns = f"ip netns exec {prefix}-{site} {cmd}"
        if not self.cgroups:
            return netns
        if site in self.cpus:
            netns = f"taskset -c {self.cpus[site]} {netns}"
        return f"sh -c 'echo $$ > {self._group(site)}/cgroup.procs && exec {netns}'"

    def start(self, site, cmd, log):
        out = subprocess.PIPE if log is None else open(log, "w")
        p = subprocess.Popen(self.wrap(site, cmd) if site else cmd, shell=True, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, text=True)
        self.procs.append(p)
        return p

    def site_addresses(self, i, site):
        """(listen, advertise) of a site's executor, and starts its latency relay when emulating."""
        port = self.port_base + i
        if not self.root:
            return f"127.0.0.1:{port}", f"127.0.0.1:{port}"
        public = f"10.{self.net}.100.{i}:17600"
        # The relay's queues hold what a WAN router would: the one-way delay's worth of the site's slowest
        # link plus 200 ms (as tbf's queue). A deeper queue (its default 16 MiB) would hold minutes of data
        # at 1-2 Mbit/s and delay every HTTP/2 ping behind it past gRPC's keepalive timeout.
        rates = [mbit for a, b, mbit in self.links if site in (a, b)]
        buffer = max(65536, int(min(rates) * 1e6 / 8 * (self.rtt_ms / 2000 + 0.2))) if rates else 16 << 20
        self.start(site, f"{self.bin}/meridian-wanrelay --listen {public} --target 127.0.0.1:{port} "
                         f"--delay-ms {self.rtt_ms / 2} --buffer-bytes {buffer} --gather-ms {RELAY_GATHER_MS}",
                   os.devnull)
        return f"127.0.0.1:{port}", public

    def write_spec(self, path, cluster, addresses, heartbeat_timeout_s, metrics_port=None, elastic=True):
        """Writes the cluster spec of these sites: `addresses` maps a site to (listen, advertise), as
        site_addresses returns; each site's cpu_quota is recorded under `emulation`. elastic=False turns
        off re-planning around stragglers (a benchmark measures the plan it was given)."""
        metrics = f", metrics_port: {metrics_port}" if metrics_port else ""
        with open(path, "w") as f:
            f.write(f"cluster: {cluster}\ncoordinator: {{address: {self.coordinator}{metrics}}}\n"
                    f"security: {{certs: certs}}\nheartbeat: {{interval: 1s, timeout: {heartbeat_timeout_s}s}}\n"
                    + ("" if elastic else "elastic: {enabled: false}\n") + "sites:\n")
            for s, q in self.sites:
                f.write(f"  - {{name: {s}, address: {addresses[s][1]}, emulation: {{cpu_quota: {q}}}}}\n")

    def teardown(self):
        prefix = self.prefix
        for s, _ in self.sites:
            sh(f"ip netns del {prefix}-{s}", check=False)
            if self.cgroups and os.path.isdir(self._group(s)):
                try:
                    os.rmdir(self._group(s))
                except OSError:
                    pass
        sh(f"ip link del {prefix}br", check=False)

    def close(self):
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        if self.root:
            time.sleep(0.2)
            self.teardown()
