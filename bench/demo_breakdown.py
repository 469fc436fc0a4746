#!/usr/bin/python3
"""Where the README demo's steps go: each attempt's plan (predicted step, compute bound) against its
measured steps, and each stage's compute, wait and the rest, from a finished demo run's files.

usage: bench/demo_breakdown.py [RUN_DIR] [--results bench/RESULTS.md] [--command TEXT]
       (after `bash scripts/demo.sh`; RUN_DIR defaults to runs/demo)

It reads RUN_DIR/metrics.jsonl (a line per step: `attempt`, `step_seconds` and each stage's
`compute_seconds`, `wait_seconds`, `send_blocked_seconds`, `codec_seconds`) and RUN_DIR/coordinator.log
(each plan's table, in the order of the attempts it started), and writes its section of the results
file between the `demo` markers, leaving the rest of the file as it was. The first 5 steps of each
attempt (warm-up, and the steps before a switch's checkpoint lands) are not counted.
"""
import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_all import splice_section  # noqa: E402  (the results file's one section writer)

BEGIN, END = "<!-- demo:begin -->", "<!-- demo:end -->"
WARMUP = 5


def plans(log_text):
    """Each plan the coordinator printed, in order: its sites and ops, predicted step, compute bound."""
    out = []
    for block in log_text.split("Plan: ")[1:]:
        pred = re.search(r"predicted step time:\s+([\d.e+-]+) s", block)
        bound = re.search(r"compute bound:\s+([\d.e+-]+) s", block)
        stages = re.findall(r"^\s*(\d+)\s+(\S+)\s+(\d+-\d+) ", block, re.M)
        if not pred or not bound:
            sys.exit("demo_breakdown.py: a plan in coordinator.log has no predicted step or compute bound")
        out.append({"predicted": float(pred.group(1)), "bound": float(bound.group(1)),
                    "layout": " -> ".join(f"{site} ops {ops}" for _, site, ops in stages)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default="runs/demo")
    ap.add_argument("--results", default="bench/RESULTS.md")
    ap.add_argument("--command", default="bash scripts/demo.sh && bench/demo_breakdown.py runs/demo")
    a = ap.parse_args()
    metrics_path, log_path = os.path.join(a.run, "metrics.jsonl"), os.path.join(a.run, "coordinator.log")
    for p in (metrics_path, log_path):
        if not os.path.exists(p):
            sys.exit(f"demo_breakdown.py: {p} does not exist (run `bash scripts/demo.sh` first)")
    metrics = []
    for n, line in enumerate(open(metrics_path), start=1):
        try:
            metrics.append(json.loads(line))
        except json.JSONDecodeError as e:
            sys.exit(f"demo_breakdown.py: {metrics_path}:{n}: not JSON ({e})")
    plan_list = plans(open(log_path).read())
    attempts = sorted({m["attempt"] for m in metrics})
    if len(plan_list) < len(attempts):
        sys.exit(f"demo_breakdown.py: {log_path} has {len(plan_list)} plans for {len(attempts)} attempts")
    med = statistics.median
    total_steps = max(m["step"] for m in metrics)
    elapsed = max(m["elapsed_seconds"] for m in metrics)
    first_bound = plan_list[0]["bound"]
    L = [BEGIN, "## The README demo: where its steps go", "",
         f"Command: `{a.command}`. The demo's job (examples/llm-finetune/finetune.yaml: 64 sequences of 64 "
         "tokens a step in 16 micro-batches) on its three emulated sites (quotas 1.0 / 0.6 / 0.4, 40 ms RTT). "
         f"Medians over each attempt's steps after its first {WARMUP}; an attempt is a plan, and a straggler's "
         "switch starts the next one.", "",
         "| attempt | plan | steps | predicted step (s) | measured step (s) | error | compute bound (s) | of its bound |",
         "|---|---|---|---|---|---|---|---|"]
    breakdown = []
    for i, att in enumerate(attempts):
        rows = [m for m in metrics if m["attempt"] == att]
        steps = [m["step"] for m in rows]
        timed = rows[WARMUP:] if len(rows) > WARMUP else rows
        p = plan_list[i]
        measured = med([m["step_seconds"] for m in timed])
        L.append(f"| {att} | {p['layout']} | {min(steps)}-{max(steps)} | {p['predicted']:.3f} | {measured:.3f} | "
                 f"{100 * (p['predicted'] - measured) / measured:+.0f}% | {p['bound']:.3f} | "
                 f"{100 * p['bound'] / measured:.0f}% |")
        sites = {}
        for m in timed:
            for st in m["stages"]:
                sites.setdefault(st["site"], []).append((m["step_seconds"], st))
        for site, v in sites.items():
            c = med([s["compute_seconds"] for _, s in v])
            w = med([s["wait_seconds"] for _, s in v])
            b = med([s["send_blocked_seconds"] for _, s in v])
            k = med([s["codec_seconds"] for _, s in v])
            rest = med([t - s["compute_seconds"] - s["wait_seconds"] for t, s in v])
            breakdown.append(f"| {att} | {site} | {c:.3f} | {w:.3f} | {b:.4f} | {k:.4f} | {rest:.3f} |")
    L += ["", f"Over the whole run: {total_steps} steps in {elapsed:.1f} s, {elapsed / total_steps:.3f} s a step "
          f"(switches included), {100 * first_bound * total_steps / elapsed:.0f}% of the first plan's compute "
          f"bound ({first_bound:.3f} s). A later attempt's plan comes from profiles retaken while the other sites "
          "train, so its compute bound is not the first plan's: the whole-run figure uses the first.", "",
          "Each stage's step (medians, seconds): compute (its forward and backward passes and its optimizer "
          "step), waiting for its neighbours, blocked on a send, codec work (within compute), and the rest "
          "(step minus compute and wait: data, gradient-norm exchange, reports).", "",
          "| attempt | site | compute | waiting | send-blocked | codec | rest |", "|---|---|---|---|---|---|---|"]
    L += breakdown + ["", END, ""]
    section = "\n".join(L)
    splice_section(a.results, section, BEGIN, END)
    print(section)


if __name__ == "__main__":
    main()
