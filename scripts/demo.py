#!/usr/bin/python3
"""Meridian's end-to-end demo on one machine: a coordinator and three executors of different speed,
joined by emulated WAN links.

As root, each site gets its own network namespace and a CPU quota (1.0, 0.6, 0.4 of a core: three
"GPU types"); site pairs are joined by veth links rate-limited with tbf (100, 100, 20 Mbit/s) and
delayed by meridian-wanrelay (40 ms RTT); the coordinator is reached over an unshaped bridge. Without
root everything runs on loopback at full speed, and the demo says so.

The job is the fine-tuning example (examples/llm-finetune): build_base.sh first builds a small
LLaMA-architecture base model and SentencePiece tokenizer from text on this machine and pre-trains it
(meridian train-local, about two and a half minutes, kept for later runs); then `meridian run` does the real work: the executors join over mutual
TLS, measure their devices, the model and every link, the partitioner plans, each executor fine-tunes
its stage of the pipeline with the codec chosen for each link, and the coordinator exports the model and
scores held-out exact match before and after. This script adds the summary and the loss curve (SVG).

Usage: scripts/demo.py [--build build] [--run runs/demo] [--steps N]   (called by scripts/demo.sh)
                      [--job finetune-lora.yaml --base runs/strong]  (the LoRA job on the stronger base,
                      with PRETRAIN_BATCH=8: examples/llm-finetune/README.md)
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulation import Emulation, sh  # noqa: E402

SITES = [("fast", 1.0), ("medium", 0.6), ("slow", 0.4)]
LINKS = [("fast", "medium", 100), ("medium", "slow", 100), ("fast", "slow", 20)]  # Mbit/s, both ways
RTT_MS = 40


def svg_curve(points, curve, path):
    """The loss per step (left axis; points: [(step, loss)] in the order reported) and held-out exact
    match at each evaluation point (right axis, %; curve: eval.json's [{step, accuracy}])."""
    w, h, pad = 680, 340, 50
    losses = [l for _, l in points]
    lo, hi = min(losses), max(losses)
    last = max([s for s, _ in points] + [c["step"] for c in curve])
    x = lambda step: pad + step * (w - 2 * pad) / max(last, 1)  # noqa: E731
    pts = " ".join(f"{x(s):.1f},{h - pad - (l - lo) / max(hi - lo, 1e-9) * (h - 2 * pad):.1f}" for s, l in points)
    acc = ""
    if curve:
        ya = lambda a: h - pad - a * (h - 2 * pad)  # noqa: E731
        apts = [(x(c["step"]), ya(c["accuracy"]), c) for c in curve]
        acc = (f'<polyline fill="none" stroke="#d62728" stroke-width="2" stroke-dasharray="5,3" '
               f'points="{" ".join(f"{px:.1f},{py:.1f}" for px, py, _ in apts)}"/>')
        for px, py, c in apts:
            acc += (f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#d62728"/>'
                    f'<text x="{px:.1f}" y="{py - 8:.1f}" text-anchor="middle" fill="#d62728">'
                    f'{100 * c["accuracy"]:.0f}%</text>')
        acc += (f'<line x1="{w - pad}" y1="{pad}" x2="{w - pad}" y2="{h - pad}" stroke="#d62728"/>'
                f'<text x="{w - pad + 4}" y="{pad + 4}" fill="#d62728">100%</text>'
                f'<text x="{w - pad + 4}" y="{h - pad}" fill="#d62728">0%</text>')
    open(path, "w").write(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">'
        f'<rect width="{w}" height="{h}" fill="white"/>'
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{pts}"/>{acc}'
        f'<text x="{w / 2}" y="{h - 14}" text-anchor="middle">step (0 - {last}): '
        f'<tspan fill="#1f77b4">training loss</tspan>, '
        f'<tspan fill="#d62728">held-out exact match (inputs never trained on)</tspan></text>'
        f'<text x="{pad}" y="{pad - 10}" fill="#1f77b4">loss {hi:.3f}</text>'
        f'<text x="{pad + 4}" y="{h - pad - 4}" fill="#1f77b4">{lo:.3f}</text>'
        f'<text x="{w / 2}" y="20" text-anchor="middle">Meridian demo: fine-tuning across 3 emulated sites</text>'
        f'</svg>\n')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--steps", type=int, default=0, help="fine-tuning steps (default: the job's)")
    ap.add_argument("--job", default="finetune.yaml", help="the job of examples/llm-finetune to run")
    ap.add_argument("--pretrain-steps", type=int, default=800)
    ap.add_argument("--base", default="runs/base",
                    help="where build_base.sh builds the base model, kept between demo runs and reused")
    a = ap.parse_args()
    start = time.time()
    bin_dir = os.path.abspath(os.path.join(a.build, "bin"))
    run = os.path.abspath(a.run)
    shutil.rmtree(run, ignore_errors=True)
    os.makedirs(run)
    example = os.path.abspath("examples/llm-finetune")
    job = os.path.join(run, "finetune.yaml")  # the example's job; its relative paths resolve in the run dir
    shutil.copy(os.path.join(example, a.job), job)
    certs = os.path.join(run, "certs")
    os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    base = os.path.abspath(a.base)
    if os.path.commonpath([base, run]) == run:
        sys.exit(f"demo.py: --base {a.base} is inside --run {a.run}, which each demo run starts afresh")
    print(f"-- building the base model and tokenizer in {a.base} (examples/llm-finetune/build_base.sh)", flush=True)
    subprocess.run(["bash", os.path.join(example, "build_base.sh"), base, str(a.pretrain_steps)],
                   check=True, env=dict(os.environ, MERIDIAN_BIN=bin_dir))
    os.symlink(base, os.path.join(run, "work"))  # the job's work/base and work/tasks.jsonl
    os.symlink(base, os.path.join(run, "work-strong"))  # finetune-lora.yaml's (with --base on the stronger base)
    emu = Emulation(bin_dir, SITES, LINKS, RTT_MS)
    try:
        spec = os.path.join(run, "cluster.yaml")
        addresses = {}
        for i, (s, _) in enumerate(SITES, start=1):
            addresses[s] = emu.site_addresses(i, s)
        emu.write_spec(spec, "demo", addresses, heartbeat_timeout_s=6, metrics_port=9600)
        sh(f"{bin_dir}/meridian certs init --spec {spec} --out {certs} --force")
        steps = f" --steps {a.steps}" if a.steps else ""
        coord = emu.start(None, f"{bin_dir}/meridian run {spec} {job} --run-dir {run} --export {run}/export "
                                f"--join-timeout 60{steps}", None)
        time.sleep(0.5)
        for s, _ in SITES:
            listen, advertise = addresses[s]
            emu.start(s, f"{bin_dir}/meridian-executor --coordinator {emu.coordinator} --site {s} --certs {certs}/bundles/{s} "
                         f"--listen {listen} --advertise {advertise}", os.path.join(run, f"executor-{s}.log"))
        t0 = time.time()
        log = []
        for line in coord.stdout:
            log.append(line)
            # Every progress line goes to coordinator.log; the terminal gets about 25 of them.
            m = re.match(r"step (\d+)/(\d+) ", line)
            if m and int(m.group(1)) % max(int(m.group(2)) // 25, 1) and m.group(1) != m.group(2):
                continue
            print("   " + line, end="", flush=True)
        rc = coord.wait()
        open(os.path.join(run, "coordinator.log"), "w").write("".join(log))
        if rc != 0:
            for s, _ in SITES:
                print(f"--- executor {s}:\n" + open(os.path.join(run, f"executor-{s}.log")).read()[-1500:])
            sys.exit(f"meridian run failed ({rc})")
        metrics = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
        losses = [m["loss"] for m in metrics]
        plan = json.load(open(os.path.join(run, "plan.json")))
        ev = os.path.join(run, "eval.json")
        e = json.load(open(ev)) if os.path.exists(ev) else None
        svg_curve([(m["step"], m["loss"]) for m in metrics], e["curve"] if e else [], os.path.join(run, "loss.svg"))
        done = [l for l in log if l.startswith("done:")]
        print("\n== summary")
        print("plan:        " + ", ".join(f"{s['sites'][0]} ops {s['first_op']}-{s['last_op']}" for s in plan["stages"]))
        print("link codecs: " + (", ".join(l["codec"] for l in plan["links"]) or "none"))
        print(done[0].strip() if done else "")
        print(f"throughput:  {metrics[-1]['tokens'] / metrics[-1]['elapsed_seconds']:.0f} tokens/s over the run")
        print(f"loss:        {losses[0]:.4f} after step 1 -> {losses[-1]:.4f} after step {len(losses)}")
        if e:
            print(f"held-out:    exact match {100 * e['accuracy_before']:.1f}% before -> {100 * e['accuracy_after']:.1f}% "
                  f"after fine-tuning ({e['examples']} examples whose inputs were never trained on)")
            kinds = sorted(e["by_kind_after"])
            if kinds != [""]:
                print("             " + ", ".join(f"{k} {100 * e['by_kind_before'][k]['accuracy']:.0f}% -> "
                                                  f"{100 * e['by_kind_after'][k]['accuracy']:.0f}%" for k in kinds))
            print("             during training: " + ", ".join(f"step {c['step']} {100 * c['accuracy']:.0f}%"
                                                               for c in e["curve"]))
        print(f"wall time:   {time.time() - t0:.0f} s for join, measurement, planning, training and evaluation; "
              f"{time.time() - start:.0f} s in all")
        print(f"files:       {run}/loss.svg, {run}/export (HF model), {run}/eval.json, {run}/profile.json, "
              f"{run}/plan.json, {run}/metrics.jsonl")
    finally:
        emu.close()


if __name__ == "__main__":
    main()
