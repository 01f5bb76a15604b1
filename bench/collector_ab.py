#!/usr/bin/env python3
"""A collector change against the code it replaces: bench/collector_stages.py on both, alternated.

This VM's speed moves by more than most changes between runs (collector_stages.py's total has moved
1.8x within half an hour), so a change is measured beside its base, in the same minutes:

1. The repository at ``--base`` (``git archive``) and the working tree (uncommitted changes included)
   are copied to a temporary folder each, and each copy's native parts (the C decoder, the modules
   Cython compiles: setup.py) are built in place, so that neither side runs the other's, nor stale ones.
2. Each copy imports its own ``kvtrace.collectors`` (checked before measuring) and runs its own
   ``bench/collector_stages.py`` with the same arguments, the two sides alternating in every round.
3. Printed per stage: both medians (µs of CPU per span), the change, and in how many rounds the
   working tree's total came lower.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from revisions import ROOT, copy_at, is_commit  # noqa: E402

PACKAGES = ("collectors", "telemetry", "connector", "dashboard")
"""The folders pyproject.toml maps to ``kvtrace.<name>``; a copy links each under its ``kvtrace/``."""
COPIED = ("kvtrace", *PACKAGES, "bench", "setup.py", "pyproject.toml")
_STAGE_LINE = re.compile(r"^\s+(\S.*?)\s+([\d.]+) µs(?:\s+[\d.]+%|\s+->.*)$")  # a stage's line, or the total's


def copy_tree(revision: str | None, into: Path) -> Path:
    """What the collector and its bench need, at ``revision`` (None: the working tree as it is), under
    ``into``, built and importing itself; returns the copy's root."""
    copy_at(revision, COPIED, into, skip=("__pycache__", "*.so", "_compiled.json"))
    for name in PACKAGES:  # kvtrace.<name> -> <name>/, found on sys.path before the installed package's finder
        (into / "kvtrace" / name).symlink_to(Path("..") / name)
    built = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=into, capture_output=True,
                           text=True)
    if built.returncode != 0:
        raise SystemExit(f"collector_ab: building {revision or 'the working tree'} failed:\n{built.stderr[-2000:]}")
    found = subprocess.run([sys.executable, "-c", "import kvtrace.collectors.store as s, kvtrace.collectors.wire as w;"
                            "print(s.__file__, w.native.__file__ if w.native else 'no-native-decoder')"],
                           cwd=into, capture_output=True, text=True, check=True).stdout.split()
    if len(found) != 2 or not all(Path(f).resolve().is_relative_to(into.resolve()) for f in found):
        raise SystemExit(f"collector_ab: the copy of {revision or 'the working tree'} imports {found}, not its own")
    return into


def stages(root: Path, arguments: list[str]) -> dict[str, float]:
    """One run of ``root``'s collector_stages.py: µs per span by stage (``total`` included)."""
    out = subprocess.run([sys.executable, str(root / "bench" / "collector_stages.py"), *arguments], cwd=root,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"collector_ab: collector_stages.py in {root} failed:\n{out.stderr[-2000:]}")
    return {m.group(1): float(m.group(2)) for line in out.stdout.splitlines() if (m := _STAGE_LINE.match(line))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--forward", action="store_true", help="passed to collector_stages.py")
    parser.add_argument("--clocks", action="store_true", help="passed to collector_stages.py")
    parser.add_argument("--traces", type=int, help="passed to collector_stages.py")
    parser.add_argument("--batch", type=int, help="passed to collector_stages.py (spans per export request)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not is_commit(args.base):
        parser.error(f"--base {args.base!r} is not a commit of {ROOT}")
    arguments = [*(["--forward"] if args.forward else []), *(["--clocks"] if args.clocks else []),
                 *(["--traces", str(args.traces)] if args.traces else []),
                 *(["--batch", str(args.batch)] if args.batch else [])]
    work = Path(tempfile.mkdtemp(prefix="kvtrace-collector-ab-"))
    try:
        print(f"building {args.base} and the working tree...", file=sys.stderr)
        roots = {"base": copy_tree(args.base, work / "base"), "head": copy_tree(None, work / "head")}
        seen: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
        for number in range(args.rounds):
            for side in (("base", "head") if number % 2 == 0 else ("head", "base")):  # neither always first
                seen[side].append(stages(roots[side], arguments))
            print(f"  round {number + 1}/{args.rounds}: total {seen['base'][-1]['total']:.2f} -> "
                  f"{seen['head'][-1]['total']:.2f} µs per span", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(seen, args.base, " ".join(arguments))
    return 0


def report(seen: dict[str, list[dict[str, float]]], base: str, arguments: str) -> None:
    rounds = len(seen["base"])
    print(f"\ncollector_stages.py {arguments or '(defaults)'}: CPU µs per span, median of {rounds} alternated runs "
          f"each, {base} against the working tree")
    print(f"  {'stage':<36}{'base':>8}{'head':>8}{'change':>9}")
    names = list(dict.fromkeys(name for run in seen["base"] + seen["head"] for name in run))
    for name in names:
        base_values = [run[name] for run in seen["base"] if name in run]
        head_values = [run[name] for run in seen["head"] if name in run]
        if not base_values or not head_values:
            print(f"  {name:<36}{'–' if not base_values else f'{statistics.median(base_values):.2f}':>8}"
                  f"{'–' if not head_values else f'{statistics.median(head_values):.2f}':>8}")
            continue
        a, b = statistics.median(base_values), statistics.median(head_values)
        print(f"  {name:<36}{a:>8.2f}{b:>8.2f}{b - a:>+9.2f}")
    lower = sum(h["total"] < b["total"] for b, h in zip(seen["base"], seen["head"]))
    a = statistics.median(run["total"] for run in seen["base"])
    b = statistics.median(run["total"] for run in seen["head"])
    print(f"  total: {1e6 / a:,.0f} -> {1e6 / b:,.0f} spans per CPU-second ({b / a - 1:+.1%} CPU per span); "
          f"the working tree lower in {lower}/{rounds} rounds")


if __name__ == "__main__":
    sys.exit(main())
