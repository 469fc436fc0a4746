#!/usr/bin/env python3
"""Per-thread CPU of every running meridian-executor, by thread name.

Every PERIOD seconds (default 15) prints, for each executor process on this host (named by its --site),
the CPU seconds each of its threads used since the last sample, grouped by thread name and largest
first. The executor names its own threads (core/thread_name.h): mrd-send (a link's queued sender),
mrd-recv-ahead (receives decoded ahead of the compute thread), mrd-rs-scatter / mrd-rs-reduce (the
replicas' gradient sum), mrd-diloco (an overlapped outer exchange), mrd-report, mrd-heartbeat,
mrd-ckpt-upload, mrd-workers, mrd-nccl; gRPC's are grpcpp_sync_ser (the peer service's receiving
threads) and grpc_global_tim; the main thread, marked *main, is the compute thread while training.
A diagnostic for docs/cost-model.md's transport pricing; reads /proc only, so run it as the executors'
user or root.

    python3 scripts/thread_cpu.py [PERIOD]
"""
import collections
import os
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def executors():
    """{pid: site} of the meridian-executor processes."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if not cmd or not cmd[0].endswith(b"meridian-executor"):
            continue
        site = "?"
        for i, arg in enumerate(cmd):
            if arg == b"--site" and i + 1 < len(cmd):
                site = cmd[i + 1].decode()
            elif arg.startswith(b"--site="):
                site = arg[7:].decode()
        out[int(pid)] = site
    return out


def cpu_by_name(pid):
    """{thread name: CPU seconds so far} of one process (its main thread's name marked *main)."""
    d = collections.Counter()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return d
    for tid in tids:
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        d[name + ("*main" if tid == str(pid) else "")] += (int(fields[11]) + int(fields[12])) / TICK
    return d


def main():
    period = float(sys.argv[1]) if len(sys.argv) > 1 else 15
    last = {}
    while True:
        sites = executors()
        now = {pid: cpu_by_name(pid) for pid in sites}
        for pid, d in now.items():
            if pid not in last:
                continue
            delta = {k: v - last[pid].get(k, 0) for k, v in d.items()}
            total = sum(delta.values())
            if total <= 0:
                continue
            parts = ", ".join(f"{k}={v:.2f}" for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v > 0)
            print(f"{time.strftime('%H:%M:%S')} {sites[pid]} (pid {pid}): {total:.2f} s of CPU: {parts}", flush=True)
        last = now
        time.sleep(period)


if __name__ == "__main__":
    main()
