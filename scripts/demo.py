#!/usr/bin/python3
"""Meridian's end-to-end demo on one machine: three sites of different speed joined by emulated WAN links.

1. Each site's executor measures its device and the model per op, under its CPU quota (a slower "GPU").
2. When run as root, each site gets its own network namespace; links are rate-limited with tbf and
   delayed by meridian-wanrelay (40 ms RTT), and the executors measure every link over mutual TLS.
   Without root, everything runs on loopback and the demo says so.
3. `meridian plan` partitions the model over the measured profile (stages, cuts, codecs per link).
4. One executor process per stage trains the model under the 1F1B schedule, with the plan's codecs.
5. A summary: the plan, tokens/s, bytes on the wire against uncompressed, the loss curve (SVG).

Usage: scripts/demo.py [--build build] [--run runs/demo] [--steps N]   (called by scripts/demo.sh)
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

SITES = [("fast", 1.0), ("medium", 0.6), ("slow", 0.4)]
LINKS = [("fast", "medium", 100), ("medium", "slow", 100), ("fast", "slow", 20)]  # Mbit/s, both ways
RTT_MS = 40


def sh(cmd, check=True):
    return subprocess.run(cmd, shell=True, check=check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class Emulation:
    """Namespaces, veth + tbf, relays and CPU quotas (root), or plain loopback."""

    def __init__(self, root_dir, bin_dir):
        self.root = os.geteuid() == 0
        self.bin = bin_dir
        self.prefix = "mrdemo"
        self.procs = []
        self.addr = {}  # (site, peer) -> address of site on its link with peer
        self.cgroups = os.path.isdir("/sys/fs/cgroup/cpu") and self.root
        if not self.root:
            print("notice: not root: sites run on loopback without WAN emulation or CPU quotas")
            return
        for s, _ in SITES:
            sh(f"ip netns del {self.prefix}-{s}", check=False)
            sh(f"ip netns add {self.prefix}-{s}")
            sh(f"ip netns exec {self.prefix}-{s} ip link set lo up")
        for k, (a, b, mbit) in enumerate(LINKS, start=1):
            va, vb = f"mdv{k}a", f"mdv{k}b"
            sh(f"ip link del {va}", check=False)
            sh(f"ip link add {va} type veth peer name {vb}")
            for v, s, host in ((va, a, 1), (vb, b, 2)):
                ns = f"{self.prefix}-{s}"
                sh(f"ip link set {v} netns {ns}")
                sh(f"ip netns exec {ns} ip addr add 10.213.{k}.{host}/24 dev {v}")
                sh(f"ip netns exec {ns} ip link set {v} up")
                burst = max(16384, int(mbit * 1e6 / 8 * 0.002))
                sh(f"ip netns exec {ns} tc qdisc add dev {v} root tbf rate {mbit}mbit burst {burst} latency 200ms")
            self.addr[(a, b)] = f"10.213.{k}.1"
            self.addr[(b, a)] = f"10.213.{k}.2"
        if self.cgroups:
            for s, quota in SITES:
                g = f"/sys/fs/cgroup/cpu/{self.prefix}-{s}"
                os.makedirs(g, exist_ok=True)
                # A 10 ms period throttles finely enough that short operators see the quota too.
                open(f"{g}/cpu.cfs_period_us", "w").write("10000")
                open(f"{g}/cpu.cfs_quota_us", "w").write(str(int(quota * 10000)))
        else:
            print("notice: no cgroup v1 cpu controller: sites run at full speed")

    def wrap(self, site, cmd):
        """The command line that runs `cmd` as `site` (in its namespace and CPU quota)."""
        if not self.root:
            return cmd
        # Join the CPU cgroup first: `ip netns exec` mounts a fresh /sys in which the cgroup tree is absent.
        netns = f"ip netns exec {self.prefix}-{site} {cmd}"
        if not self.cgroups:
            return netns
        return f"sh -c 'echo $$ > /sys/fs/cgroup/cpu/{self.prefix}-{site}/cgroup.procs && exec {netns}'"

    def start(self, site, cmd, log):
        # A process group of its own, so that stopping it stops every process the wrappers started.
        p = subprocess.Popen(self.wrap(site, cmd), shell=True, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    @staticmethod
    def stop(p):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()

    def peer_address(self, site, peer, port, relay_port):
        """Where `site` reaches `peer`'s executor: through a latency relay in the peer's namespace."""
        if not self.root:
            return f"127.0.0.1:{port}"
        listen = f"{self.addr[(peer, site)]}:{relay_port}"
        self.start(peer, f"{self.bin}/meridian-wanrelay --listen {listen} --target 127.0.0.1:{port} "
                         f"--delay-ms {RTT_MS / 2}", os.devnull)
        time.sleep(0.2)
        return listen

    def close(self):
        for p in self.procs:
            self.stop(p)
        if self.root:
            for s, _ in SITES:
                sh(f"ip netns del {self.prefix}-{s}", check=False)
                if self.cgroups:
                    try:
                        os.rmdir(f"/sys/fs/cgroup/cpu/{self.prefix}-{s}")
                    except OSError:
                        pass


def svg_curve(losses, path):
    w, h, pad = 640, 320, 40
    lo, hi = min(losses), max(losses)
    pts = " ".join(f"{pad + i * (w - 2 * pad) / max(len(losses) - 1, 1):.1f},"
                   f"{h - pad - (l - lo) / max(hi - lo, 1e-9) * (h - 2 * pad):.1f}" for i, l in enumerate(losses))
    open(path, "w").write(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">'
        f'<rect width="{w}" height="{h}" fill="white"/>'
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{pts}"/>'
        f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">step</text>'
        f'<text x="{pad}" y="{pad - 10}">loss {hi:.3f}</text><text x="{pad + 4}" y="{h - pad - 4}">{lo:.3f}</text>'
        f'<text x="{w / 2}" y="20" text-anchor="middle">Meridian demo: training loss across 3 emulated sites</text>'
        f'</svg>\n')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--steps", type=int, default=0)
    a = ap.parse_args()
    bin_dir = os.path.abspath(os.path.join(a.build, "bin"))
    run = os.path.abspath(a.run)
    os.makedirs(run, exist_ok=True)
    job = os.path.abspath("examples/jobs/demo.yaml")
    certs = os.path.join(run, "certs")
    os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    spec = os.path.join(run, "cluster.yaml")
    with open(spec, "w") as f:
        f.write("cluster: demo\ncoordinator: {address: 127.0.0.1:7600}\nsites:\n")
        for i, (s, q) in enumerate(SITES):
            f.write(f"  - {{name: {s}, address: 127.0.0.1:{7601 + i}, emulation: {{cpu_quota: {q}}}}}\n")
    sh(f"{bin_dir}/meridian certs init --spec {spec} --out {certs} --force")
    emu = Emulation(run, bin_dir)
    try:
        print("== measuring each site (GEMM throughput and every op's forward+backward time) under its CPU quota")
        prof = os.path.join(run, "profile")
        for s, q in SITES:
            p = emu.start(s, f"{bin_dir}/meridian-executor --site {s} --profile {job} --out {prof}",
                          os.path.join(run, f"profile-{s}.log"))
            if p.wait() != 0:
                sys.exit(f"profiling {s} failed: see {run}/profile-{s}.log")
            site = json.load(open(os.path.join(prof, f"profile-{s}.json")))["sites"][0]
            print(f"   {s:7s} quota {q:.1f} core: {site['flops_per_second'] / 1e9:6.1f} GFLOP/s GEMM, "
                  f"model fwd+bwd {sum(site['op_seconds'].values()) * 1000:7.1f} ms per micro-batch")
        sites = [json.load(open(os.path.join(prof, f"profile-{s}.json")))["sites"][0] for s, _ in SITES]
        links = []
        print("== measuring the links over mutual TLS" + ("" if emu.root else " (loopback)"))
        ports = {s: 7601 + i for i, (s, _) in enumerate(SITES)}
        for a_, b_, mbit in LINKS:
            server = emu.start(b_, f"{bin_dir}/meridian-peertool serve --certs {certs} --self {b_} --allow {a_} "
                                   f"--listen 127.0.0.1:{ports[b_]}", os.path.join(run, f"probe-{b_}.log"))
            time.sleep(0.5)
            addr = emu.peer_address(a_, b_, ports[b_], 17600 + len(links))
            out = sh(emu.wrap(a_, f"{bin_dir}/meridian-peertool probe --certs {certs} --self {a_} --peer {b_} "
                                  f"--address {addr} --seconds 2"), check=False).stdout
            emu.stop(server)
            try:
                m = json.loads(out)
            except ValueError:
                sys.exit(f"probing {a_} -> {b_} failed:\n{out}")
            links += m["links"]
            print(f"   {a_:7s} <-> {b_:7s}: {m['links'][0]['bandwidth_bytes_per_second'] * 8 / 1e6:7.1f} / "
                  f"{m['links'][1]['bandwidth_bytes_per_second'] * 8 / 1e6:7.1f} Mbit/s, RTT {m['rtt_seconds'] * 1000:.1f} ms"
                  + (f"  (emulated {mbit} Mbit/s, {RTT_MS} ms)" if emu.root else ""))
        json.dump({"sites": sites, "links": links}, open(os.path.join(run, "profile.json"), "w"), indent=2)
        print("== planning")
        plan_cmd = (f"{bin_dir}/meridian plan --graph {prof}/graph.json --profile {run}/profile.json "
                    f"--micro-batches 8 --no-replication")
        table = sh(plan_cmd).stdout
        print(table)
        plan = json.loads(sh(plan_cmd + " --json").stdout)
        stages = plan["stages"]
        steps = a.steps or 0
        print(f"== training: {len(stages)} executor processes, 1F1B, codecs per link from the plan")
        procs, logs = [], []
        # Each stage listens on its own port; neighbours reach it through a relay in its namespace.
        for k, st in enumerate(stages):
            site = st["sites"][0]
            asg = {"job_id": "demo", "stage": k, "num_stages": len(stages), "first_op": st["first_op"],
                   "last_op": st["last_op"]}
            if k > 0:
                prev = stages[k - 1]["sites"][0]
                codec = plan["links"][k - 1]["codec"]
                asg.update(prev_site=prev, prev_address=emu.peer_address(site, prev, ports[prev], 17700 + 2 * k),
                           backward_codec=codec)
            if k + 1 < len(stages):
                nxt = stages[k + 1]["sites"][0]
                codec = plan["links"][k]["codec"]
                asg.update(next_site=nxt, next_address=emu.peer_address(site, nxt, ports[nxt], 17701 + 2 * k),
                           forward_codec=codec)
            path = os.path.join(run, f"assignment-{k}.json")
            json.dump(asg, open(path, "w"))
            log = os.path.join(run, f"stage-{k}-{site}.log")
            logs.append(log)
            procs.append(emu.start(site, f"{bin_dir}/meridian-executor --site {site} --certs {certs} "
                                         f"--listen 127.0.0.1:{ports[site]} --assignment {path} --job {job} "
                                         f"--out {run}/weights" + (f" --steps {steps}" if steps else ""), log))
        total = steps or 80
        tokens_per_step = 16 * 64
        t0, losses, last_print = time.time(), [], 0
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            lines = [l for l in open(logs[0]).read().splitlines() if l.startswith("step ")]
            losses = [float(l.split()[3]) for l in lines]
            if len(losses) > last_print:
                last_print = len(losses)
                el = time.time() - t0
                rate = len(losses) * tokens_per_step / el
                eta = (total - len(losses)) * el / len(losses)
                print(f"\r   step {len(losses):3d}/{total}  loss {losses[-1]:.4f}  {rate:7.0f} tokens/s  "
                      f"ETA {eta:5.0f} s", end="", flush=True)
            if any(p.poll() not in (None, 0) for p in procs):
                break
        print()
        bad = [(k, p.returncode) for k, p in enumerate(procs) if p.wait() != 0]
        if bad:
            for k, rc in bad:
                print(open(logs[k]).read()[-2000:])
            sys.exit(f"training failed: stages {bad}")
        elapsed = time.time() - t0
        wire = raw = 0
        for log in logs:
            for l in open(log):
                if l.startswith("wire bytes"):
                    w_, r_ = int(l.split()[2]), int(l.split()[5])
                    wire, raw = wire + w_, raw + r_
        svg_curve(losses, os.path.join(run, "loss.svg"))
        summary = (f"\n== summary\n"
                   f"plan:             {len(stages)} stages: " +
                   ", ".join(f"{s['sites'][0]} ops {s['first_op']}-{s['last_op']}" for s in stages) + "\n"
                   f"links:            " + ", ".join(l["codec"] for l in plan["links"]) + "\n"
                   f"predicted step:   {plan['predicted_step_seconds']:.3f} s;  measured {elapsed / len(losses):.3f} s\n"
                   f"throughput:       {len(losses) * tokens_per_step / elapsed:.0f} tokens/s\n"
                   f"bytes on links:   {wire / 1e6:.1f} MB sent, {raw / 1e6:.1f} MB uncompressed "
                   f"({100 * wire / max(raw, 1):.0f}%)\n"
                   f"loss:             {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step {len(losses)}\n"
                   f"loss curve:       {run}/loss.svg\n"
                   f"weights:          {run}/weights/stage-*.safetensors\n")
        print(summary)
        open(os.path.join(run, "summary.txt"), "w").write(table + summary)
    finally:
        emu.close()


if __name__ == "__main__":
    main()
