#!/usr/bin/env python3
"""Idle CPU of a 1P1D pair with vLLM's defaults vs kvtrace's CPU options.

vLLM's defaults: NIXL's progress thread polls with a zero delay, and the NIXL worker pins
the model thread to the machine's last core. kvtrace's options (``nixl_progress_delay_us:
1000``, ``keep_cpu_affinity: true``) change only those two things. Each pair is started,
given a few requests, left idle, and its processes' CPU time is sampled from /proc.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtrace.testbed.launch import LocalPair, PairConfig, group_pids  # noqa: E402


def warm(pair: LocalPair) -> None:
    for i in range(3):
        body = {"model": "tiny", "prompt": "alpha bravo " * (20 + 100 * i), "max_tokens": 4}
        request = urllib.request.Request(pair.router_url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=120).read()


def thread_cores(pair: LocalPair) -> dict[str, list[str]]:
    """For P and D: the distinct core sets their threads may run on (vLLM re-pins one)."""
    out = {}
    for proc in pair.procs[:2]:
        cores = set()
        for pid in group_pids(proc.popen.pid):
            for task in Path(f"/proc/{pid}/task").iterdir():
                try:
                    status = (task / "status").read_text()
                except OSError:
                    continue
                cores.add(next(line.split(":")[1].strip() for line in status.splitlines()
                               if line.startswith("Cpus_allowed_list")))
        out[proc.name] = sorted(cores)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument("--seconds", type=float, default=10.0, help="idle sampling window")
    args = parser.parse_args()
    rows = []
    for label, cpu_options in (("vLLM defaults", False), ("kvtrace CPU options", True)):
        print(f"starting a {args.mode} pair with {label}...", file=sys.stderr)
        with LocalPair(PairConfig(mode=args.mode, cpu_options=cpu_options, tracing=False)) as pair:
            warm(pair)
            idle = pair.idle_cpu_percent(args.seconds)
            rows.append((label, idle, thread_cores(pair)))
    print(f"{args.mode} pair idle for {args.seconds:.0f} s after 3 requests (all P and D processes):")
    for label, idle, cores in rows:
        print(f"  {label:<22} {idle:6.1f} % of one core   thread core sets {cores}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
