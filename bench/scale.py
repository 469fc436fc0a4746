#!/usr/bin/python3
"""Meridian projected onto real GPU fleets (issue #18): writes docs/scale.md.

For LLaMA-7B and LLaMA-70B, 8, 64 and 256 sites, and links of 1 and 10 Gbit/s (8 sequences of 2048 tokens per site and step), writes a fleet file
(simulator/fleet.h's format) under --out and runs `meridian simulate --fleet FILE --json` on it, which plans
and simulates three systems: Meridian's pipeline with replicas, the same with DiLoCo replicas, and DDP (the
whole model at every site, gradients summed every step). Sites are 8-GPU nodes, a quarter each of H100 SXM,
A100 80GB, L40S and RTX 4090 (examples/profiles/gpus/), each in a region of its own on three continents, so
that every pair is 50 to 150 ms apart (examples/profiles/gpus/links.json). Then one planning-and-simulation
of 256 sites and a 1024-op model (a LLaMA of 511 layers), timed.

Usage: bench/scale.py [--build build] [--out runs/scale] [--doc docs/scale.md]
"""
import argparse
import json
import os
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GPUS = ["h100-sxm", "a100-80gb", "l40s", "rtx-4090"]
CONTINENTS = ["us", "eu", "asia"]


def fleet_file(out, name, model, sites, gbit, micro_batches=None):
    micro_batches = micro_batches or 8 * sites  # the global batch grows with the fleet: 8 sequences a site
    path = os.path.join(out, f"{name}.yaml")
    lines = [f"# bench/scale.py: {model}, {sites} sites, {gbit} Gbit/s", f"fleet: {name}",
             f"model: {os.path.relpath(os.path.join(ROOT, 'examples', 'models', model, 'config.json'), out)}",
             "sequence_length: 2048", "micro_batch_size: 1", f"micro_batches: {micro_batches}",
             f"gpus: {os.path.relpath(os.path.join(ROOT, 'examples', 'profiles', 'gpus'), out)}",
             f"bandwidth_gbit: {gbit}", "diloco: {inner_steps: 50, codec: int4}", "sites:"]
    for i in range(sites):
        lines.append(f"  - {{gpu: {GPUS[i % 4]}, per_site: 8, count: 1, region: {CONTINENTS[i % 3]}-{i + 1}}}")
    open(path, "w").write("\n".join(lines) + "\n")
    return path


def simulate(meridian, path):
    t0 = time.time()
    r = subprocess.run([meridian, "simulate", "--fleet", path, "--json"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, check=True)
    return json.loads(r.stdout), time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--out", default="runs/scale")
    ap.add_argument("--doc", default="docs/scale.md")
    a = ap.parse_args()
    meridian = os.path.abspath(os.path.join(a.build, "bin", "meridian"))
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    rows = []
    for model in ("llama-7b", "llama-70b"):
        for sites in (8, 64, 256):
            for gbit in (1, 10):
                name = f"{model}-{sites}-{gbit}g"
                path = fleet_file(out, name, model, sites, gbit)
                res, secs = simulate(meridian, path)
                rows.append((model, sites, gbit, path, res, secs))
                print(f"{name}: " + ", ".join(
                    f"{s['system']} {s['tokens_per_second']:.0f} tok/s" if s["feasible"] else f"{s['system']} -"
                    for s in res["systems"]) + f" ({secs:.1f} s)", flush=True)
    # The planner and simulator at 256 sites x 1024 ops: a LLaMA-7B shape with 511 layers.
    big = os.path.join(out, "llama-1024ops")
    os.makedirs(big, exist_ok=True)
    cfg = json.load(open(os.path.join(ROOT, "examples", "models", "llama-7b", "config.json")))
    cfg["num_hidden_layers"] = 511
    json.dump(cfg, open(os.path.join(big, "config.json"), "w"), indent=2)
    big_path = fleet_file(out, "llama-1024ops-256-10g", "llama-7b", 256, 10, micro_batches=64)
    text = open(big_path).read().replace(
        os.path.relpath(os.path.join(ROOT, "examples", "models", "llama-7b", "config.json"), out),
        os.path.relpath(os.path.join(big, "config.json"), out))
    open(big_path, "w").write(text)
    big_res, big_secs = simulate(meridian, big_path)
    print(f"256 sites x 1024 ops: {big_secs:.1f} s", flush=True)

    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731
    L = ["# Meridian at scale: projections onto GPU fleets", "",
         "Produced by `bench/scale.py` (which writes the fleet files and runs `meridian simulate --fleet FILE` on "
         "each); re-run it to refresh this page. The simulator is validated on the emulated WAN "
         "([bench/RESULTS.md](../bench/RESULTS.md), *The simulator against measured runs*); these are projections "
         "from published device figures, not measurements.", "",
         "**Fleets.** Sites are nodes of 8 GPUs, a quarter each of H100 SXM, A100 80GB, L40S and RTX 4090 "
         "([examples/profiles/gpus/](../examples/profiles/gpus/): peak dense BF16 from the datasheets, an assumed "
         "MFU of 0.4, memory), each site a pool of its 8 GPUs (a site's GPUs working as one, as issue #22 builds). "
         "Each site is in a region of its own on three continents: every pair is 50 ms (same continent), 75 ms "
         "(transatlantic), 110 ms (transpacific) or 150 ms (Europe-Asia) apart "
         "([links.json](../examples/profiles/gpus/links.json)); every link has the stated bandwidth both ways and a "
         "site's links share its uplink of that bandwidth. Sequences of 2048 tokens, 64 per step (one per "
         "micro-batch); bf16 weights, gradients and activations, AdamW state in fp32.", "",
         "**Systems.** *pipeline*: Meridian's planner (heuristic beyond 8 sites) with replicas, deep pipelines and "
         "adaptive compression, replicas summing gradients every step. *DiLoCo*: the same with `sync: {mode: "
         "diloco, inner_steps: 50, codec: int4}` (the step is the mean over two rounds, exchanges overlapped). "
         "*DDP*: every site trains the whole model and all sum their gradients every step, uncompressed (what "
         "DistributedDataParallel does across sites); it does not run where the model with its optimizer state "
         "does not fit one site. Utilisation is of the fleet's compute bound (every GPU at its assumed MFU, no "
         "communication).", "",
         "| model | sites | link | compute bound (tokens/s) | pipeline tokens/s (util.) | layout | DiLoCo tokens/s (util.) "
         "| layout | DDP tokens/s (util.) | command |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    reasons = []
    for model, sites, gbit, path, res, secs in rows:
        bound = res["micro_batches"] * res["tokens_per_micro_batch"] / res["compute_bound_seconds"]
        cells = []
        for sysname in ("pipeline", "diloco", "ddp"):
            s = next(x for x in res["systems"] if x["system"] == sysname)
            if not s["feasible"]:
                reasons.append(f"{model}, {sites} sites, {gbit} Gbit/s, {sysname}: {s['why']}")
                cells.append(f"does not run [{len(reasons)}]")
                if sysname != "ddp":
                    cells.append("-")
                continue
            cells.append(f"{s['tokens_per_second']:,.0f} ({100 * s['utilisation']:.0f}%)")
            if sysname != "ddp":
                cells.append(s["layout"].replace(" (sites per stage: ", ": ").rstrip(")"))
        L.append(f"| {model} | {sites} | {gbit} Gbit/s | {bound:,.0f} | " + " | ".join(cells) +
                 f" | `meridian simulate --fleet {rel(path)}` |")
    def tps(model, sites, gbit, system):
        res = next(r[4] for r in rows if r[:3] == (model, sites, gbit))
        s = next(x for x in res["systems"] if x["system"] == system)
        return s["tokens_per_second"] if s["feasible"] else None
    summary = []
    for model in ("llama-7b", "llama-70b"):
        for gbit in (1, 10):
            d, p, q = tps(model, 256, gbit, "diloco"), tps(model, 256, gbit, "pipeline"), tps(model, 256, gbit, "ddp")
            summary.append(f"{model} on 256 sites at {gbit} Gbit/s: DiLoCo {d:,.0f} tokens/s, the pipeline {p:,.0f}"
                           + (f", DDP {q:,.0f} (DiLoCo {d / q:.0f}x as fast)" if q else ", DDP does not fit a site"))
    L += ["", "**What it shows.** " + "; ".join(summary) + ". Gradient sums every step across the WAN (DDP, and the "
          "pipeline's replicas) are bound by the links from a few sites on; DiLoCo's exchange every 50 steps keeps "
          "adding sites useful, and a model too large for one site is trained as a pipeline (or DiLoCo over pipeline "
          "stages)."]
    big_sys = {s["system"]: s for s in big_res["systems"]}
    if reasons:
        L += [""] + [f"[{i + 1}] {r}" + "  " for i, r in enumerate(reasons)]
    L += ["", "Wall time here of planning and simulating each fleet's three systems: " +
          ", ".join(f"{m} {n} sites {g} Gbit/s {t:.0f} s" for m, n, g, _, _, t in rows) + ".", "",
          f"**Planning and simulating at scale.** 256 sites and a 1024-op model (LLaMA-7B's shape with 511 "
          f"layers, 10 Gbit/s, 64 micro-batches a step): `meridian simulate --fleet {rel(big_path)}` plans and simulates the three systems in "
          f"{big_secs:.1f} s on this machine (pipeline: planned in {big_sys['pipeline']['plan_seconds']:.1f} s, "
          f"simulated in {big_sys['pipeline']['simulate_seconds']:.1f} s). Target: under 30 s.", "",
          "Fleet files are written to runs/scale/ (not kept in the repository); examples/fleets/llama7b-geo.yaml is "
          "a hand-written one.", ""]
    open(a.doc, "w").write("\n".join(L))
    print(f"wrote {a.doc}")


if __name__ == "__main__":
    main()
