"""Start-up: seconds from `splitserve serve` starting to its /ready answering 200, and
where they go, read off the server's own log (the local runtime):
- frontend: process start to the first worker started (imports, the layout and its
  profile key, the router);
- workers: the first worker started to the last one registered (imports, the checkpoint,
  the weights packed, the KV cache committed; the workers load side by side);
- after: the last registration to /ready (the model list, the app, the heap frozen).

    python benchmarks/startup.py                    # ~5 min on 2 cores; writes docs/benchmarks.md
    python benchmarks/startup.py --baseline ../old  # the same, against another checkout,
                                                    # rounds interleaved (A/B, same run)

`--baseline` takes a checkout of this repository (e.g. `git worktree add ../old <commit>`)
run with this virtualenv; its kernels build once on its first start. Each tree has a profile
cache of its own for the run (two versions of the code may key or store curves
differently). Each setup starts once untimed first (the default layout measures its cost
curves there, ~1 min). Rounds alternate the order of the trees.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _path in (_ROOT, _ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from benchmarks.common import (DEFAULT_OUTPUT, markdown_table, median,  # noqa: E402
                               write_section)
from tests.conftest import ServerProcess  # noqa: E402

SECTION = "Start-up"
SETUPS = {"disagg 1P+1D": ("--prefill", "1", "--decode", "1"),
          "agg, 2 workers": ("--mode", "agg", "--decode", "2"),
          "default (auto, curves cached)": ()}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_LAYOUT = re.compile(r"\] layout: ([^,]+),")


def _stamps(log: str, marker: str) -> list[float]:
    """Wall-clock seconds of the log lines that contain `marker`."""
    out = []
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m and marker in line:
            when = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            out.append(when.timestamp())
    return out


def start_once(flags: tuple[str, ...], tree: str) -> tuple[dict[str, float], str]:
    """One start of `splitserve serve flags` run from `tree`: total and its three parts,
    and the layout it started (the default's is measured per tree and may differ)."""
    began, t0 = time.time(), time.monotonic()
    server = ServerProcess(*flags, cwd=tree)
    total = time.monotonic() - t0
    ready = began + total
    log = server.log()
    server.stop()
    started, registered = _stamps(log, "] started "), _stamps(log, "registered (pid")
    if not started or not registered:
        raise RuntimeError(f"no worker start or registration in the log:\n{log[-3000:]}")
    layout = _LAYOUT.search(log)
    return ({"total": total, "frontend": started[0] - began,
             "workers": registered[-1] - started[0], "after": ready - registered[-1]},
            layout.group(1) if layout else "?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", default=None, help="another checkout to compare with")
    ap.add_argument("--output", default=DEFAULT_OUTPUT)
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    trees = {"this tree": str(_ROOT)}
    if args.baseline:
        trees["baseline"] = os.path.abspath(args.baseline)
    rows = []
    caches = tempfile.mkdtemp(prefix="splitserve-startup-")
    for setup, setup_flags in SETUPS.items():
        flags = {name: (*setup_flags, "--profile-cache", os.path.join(caches, f"{i}.json"))
                 for i, name in enumerate(trees)}
        for name, tree in trees.items():
            start_once(flags[name], tree)  # untimed: kernels built, curves cached
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        layouts: dict[str, set[str]] = {name: set() for name in trees}
        for r in range(args.rounds):
            order = list(trees.items())
            for name, tree in (order if r % 2 == 0 else order[::-1]):
                times, layout = start_once(flags[name], tree)
                runs[name].append(times)
                layouts[name].add(layout)
                time.sleep(2)  # the stopped server's memory handed back
        base = median([x["total"] for x in runs.get("baseline", [])] or [0.0])
        for name, got in runs.items():
            total = median([x["total"] for x in got])
            row = [setup, name, " / ".join(sorted(layouts[name])), f"{total:.2f}"]
            row += [f"{median([x[k] for x in got]):.2f}" for k in ("frontend", "workers", "after")]
            row += [f"{total / base:.3f}" if base and name != "baseline" else "",
                    " ".join(f"{x['total']:.1f}" for x in got)]
            rows.append(row)
            print(" | ".join(row), flush=True)
    table = markdown_table(["setup", "tree", "layout started", "ready s (median)", "frontend s", "workers s",
                            "after s", "vs baseline", "each start s"], rows)
    body = (f"Medians of {args.rounds} starts per setup and tree"
            + (f", baseline {trees['baseline']}" if args.baseline else "") + ".\n\n" + table)
    print(body)
    if not args.no_doc:
        write_section(args.output, SECTION, body)


if __name__ == "__main__":
    main()
