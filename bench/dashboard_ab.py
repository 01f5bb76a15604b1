"""Dashboard A/B: each page as a git revision had it against the working tree, side by side in one run.

``dashboard_scale.py`` prints each page's ratio to a bare Streamlit page; on a shared 2-core VM that ratio
moves between runs by as much as most changes to a page (docs/PERFORMANCE.md). A change is
measured here instead against the page it replaces, in the same rounds, on the same store:

1. The ``dashboard/`` folder at ``--base`` (``git archive``) and the working tree's are copied side by
   side, each made to import its own ``kvtrace.dashboard`` (:data:`OWN_PACKAGE`; the reader and the rest
   of kvtrace are the working tree's, so the store's schema must be the one both read).
2. Each copy is served as ``kvtrace dashboard`` serves it (its own ``server.py``, the same flags), with
   the bare one-chart page of ``dashboard_scale.py`` beside them for scale.
3. One warm tab per server (Chromium, on a profile on disk: ``dashboard_scale.Chromium``); each round
   reloads every page in each tab in turn, so the two sides of a page alternate and see the same machine.
   Printed per page: both medians, the change, and in how many rounds the working tree's load came sooner.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dashboard_scale import BARE_APP, PAGES, URLS, chromium_beside, first_chart, streamlit_command, warm_tab  # noqa: E402
from revisions import ROOT, copy_at, is_commit  # noqa: E402

OWN_PACKAGE = '''# dashboard_ab.py: this copy's pages import this copy's kvtrace.dashboard, not the installed one.
import importlib.util as _util, sys as _sys
if getattr(_sys.modules.get("kvtrace.dashboard"), "__file__", None) != {init!r}:
    import kvtrace as _kvtrace
    _spec = _util.spec_from_file_location("kvtrace.dashboard", {init!r}, submodule_search_locations=[{folder!r}])
    _module = _util.module_from_spec(_spec)
    for _name in [n for n in _sys.modules if n.startswith("kvtrace.dashboard.")]:
        del _sys.modules[_name]
    _sys.modules["kvtrace.dashboard"] = _kvtrace.dashboard = _module
    _spec.loader.exec_module(_module)
'''
"""Put at the top of each copy's ``app.py`` (the script Streamlit re-runs on every page load): the first
run swaps ``kvtrace.dashboard`` for the copy's own package; later runs find it swapped and do nothing."""


def copy_dashboard(revision: str | None, into: Path) -> Path:
    """``dashboard/`` at ``revision`` (None: the working tree, uncommitted changes included) under ``into``,
    its ``app.py`` importing its own package; returns the copy's ``server.py``."""
    folder = into / "dashboard"
    copy_at(revision, ("dashboard",), into)
    app = folder / "app.py"
    app.write_text(OWN_PACKAGE.format(init=str(folder / "__init__.py"), folder=str(folder)) + app.read_text())
    return folder / "server.py"


def measure(db: str, base: str, pages: list[str], rounds: int, port: int) -> dict[str, dict[str, list[float]]]:
    """Per page, the warm loads' seconds to the first chart: ``base`` and ``head`` (the working tree); and
    the bare page's (``bare``)."""
    from kvtrace.dashboard.settings import ENV_DB

    work = Path(tempfile.mkdtemp(prefix="kvtrace-ab-"))
    scripts = {"base": copy_dashboard(base, work / "base"), "head": copy_dashboard(None, work / "head")}
    (work / "bare.py").write_text(BARE_APP)
    scripts["bare"] = work / "bare.py"
    ports = {side: port + i for i, side in enumerate(scripts)}
    servers = [(streamlit_command(script, ports[side]), ports[side], {**os.environ, ENV_DB: db})
               for side, script in scripts.items()]
    seen: dict[str, dict[str, list[float]]] = {page: {"base": [], "head": []} for page in pages}
    seen["bare"] = {"bare": []}
    with chromium_beside(servers, work) as chromium:
        tabs = {side: warm_tab(chromium) for side in scripts}
        for side, tab in tabs.items():
            first_chart(tab, f"http://127.0.0.1:{ports[side]}/")  # the server's first session, the HTTP cache
        for number in range(rounds):
            seen["bare"]["bare"].append(first_chart(tabs["bare"], f"http://127.0.0.1:{ports['bare']}/"))
            for page in pages:
                for side in (("base", "head") if number % 2 == 0 else ("head", "base")):  # neither always first
                    url = f"http://127.0.0.1:{ports[side]}/{URLS.get(page, page)}"
                    seen[page][side].append(first_chart(tabs[side], url))
            print(f"  round {number + 1}/{rounds} done", file=sys.stderr)
    return seen


def report(seen: dict[str, dict[str, list[float]]], base: str) -> None:
    bare = statistics.median(seen["bare"]["bare"])
    print(f"\nwarm reload to the first chart, median of {len(seen['bare']['bare'])} (s), {base} against the working "
          f"tree in the same rounds; the bare one-chart page {bare:.3f}")
    print(f"  {'page':<14}{'base':>8}{'× bare':>8}{'head':>8}{'× bare':>8}{'change':>9}   head sooner")
    for page, sides in seen.items():
        if page == "bare":
            continue
        a, b = statistics.median(sides["base"]), statistics.median(sides["head"])
        sooner = sum(h < o for o, h in zip(sides["base"], sides["head"]))
        print(f"  {page:<14}{a:>8.3f}{a / bare:>8.2f}{b:>8.3f}{b / bare:>8.2f}{(b - a) * 1000:>+7.0f}ms"
              f"   {sooner}/{len(sides['head'])} rounds")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", required=True, help="the store both sides read (e.g. dashboard_scale.py's --db)")
    parser.add_argument("--base", default="HEAD", help="the git revision to compare the working tree with")
    parser.add_argument("--pages", default=",".join(PAGES), help=f"comma-separated, of: {', '.join(PAGES)}")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--port", type=int, default=8620, help="the first of three ports")
    args = parser.parse_args()
    pages = [p for p in args.pages.split(",") if p]
    unknown = sorted(set(pages) - set(PAGES))
    if unknown or not pages:
        parser.error(f"unknown page(s) {', '.join(unknown) or '(none given)'}; pages are {', '.join(PAGES)}")
    if not Path(args.db).exists():
        parser.error(f"no store at {args.db} (build one with bench/dashboard_scale.py --db {args.db})")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not is_commit(args.base):
        parser.error(f"--base {args.base!r} is not a commit of {ROOT}")
    report(measure(args.db, args.base, pages, args.rounds, args.port), args.base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
