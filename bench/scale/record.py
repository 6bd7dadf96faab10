"""Record the runs of a ``scale.json`` that came back from the device machine
(``bench/scale/device.sh`` writes it into ``$OUT``) into ``bench/results/scale.json``, then
re-render docs/benchmarks.md with ``bench/scale/report.py`` (or ``make generate``)::

    .venv/bin/python bench/scale/record.py <files_at>/scale.json [--code <commit>] [--note TEXT]

Each run replaces the run of the same key (node count, cores, node choice) and gets what the
remote could not know: ``code`` (the commit the bundle was made from: default ``git rev-parse
--short HEAD`` here), ``where`` (the machine in words) and ``via`` (the device.sh command line).
A 16-core run with the default node choice also becomes a row of ``history_16c`` (the
run-to-run spread table); rows of other code are dropped, since that table shows the current
code's spread only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: bench/scale/record.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.scale.results import RESULTS, code_version, run_key

DEVICE = ("the device machine (the H200 host lent to this project for GPU runs: 16 cores, a Firecracker VM; "
          "its GPU is not used here), reached through the `device` tool with the bundle of `hack/device_bundle.sh`")
RUN_PY = "python bench/scale/run.py"


def via(command: str) -> str:
    """The device.sh command line of a run recorded as ``python bench/scale/run.py ARGS``."""
    return "bash bench/scale/device.sh" + command[len(RUN_PY):] if command.startswith(RUN_PY) else command


def history_row(run: dict[str, Any], note: str = "") -> dict[str, Any]:
    """The spread table's row of ``run``: its extender-phase bursts' pods/s."""
    bursts = [{k: b[k] for k in ("kind", "mode", "pods", "bound_per_s")}
              for b in run.get("bursts", []) if b.get("phase", "extender") == "extender" and b.get("bound_per_s")]
    row = {"date": run["date"], "code": run.get("code"), "nodes": (run["setup"]["nodes"] // 10) * 10,
           "command": run.get("via") or run["command"], "bursts": bursts}
    return {**row, "note": note} if note else row


def record(data: dict[str, Any], remote: dict[str, Any], code: str | None, note: str = "",
           *, override: bool = False) -> list[str]:
    """Merge ``remote``'s runs into ``data`` (both shaped as ``bench/results/scale.json``) in
    place; returns the keys recorded. ``code`` fills a run's missing ``code``; with ``override``
    it replaces the one the remote wrote (its copy of the tree may carry a stale git state, e.g.
    ``<older commit>+changes``). Raises ``ValueError`` for a file without runs."""
    runs = remote.get("runs") or {}
    if not runs:
        raise ValueError("scale.json: no 'runs' in the file (is it the one device.sh wrote into $OUT?)")
    keys = []
    for run in runs.values():
        run = dict(run)
        if code and (override or not run.get("code")):
            run["code"] = code
        cores = run.get("machine", {}).get("cores")
        if (cores or 0) >= 16:
            run.setdefault("where", DEVICE)
            run.setdefault("via", via(run.get("command", "")))
        key = run_key(run["setup"]["nodes"] // 10 * 10, cores, run.get("node_choice", "extender"))
        data.setdefault("runs", {})[key] = run
        keys.append(key)
        if (cores or 0) >= 16 and run.get("node_choice", "extender") == "extender":
            hist = [h for h in data.get("history_16c") or [] if h.get("code") == run.get("code")]
            data["history_16c"] = [*hist, history_row(run, note)]
    return keys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scale_json", type=Path, help="the scale.json device.sh wrote into $OUT")
    p.add_argument("--code", default=None,
                   help="the commit the bundle was made from (default: HEAD here, where the remote "
                        "did not name one; given, it replaces the remote's)")
    p.add_argument("--note", default="", help="a note for the run-to-run spread table")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    try:
        remote = json.loads(args.scale_json.read_text())
    except (OSError, ValueError) as e:
        p.error(f"{args.scale_json}: not a readable scale.json ({e})")
    try:
        keys = record(data, remote, args.code or code_version(), args.note, override=args.code is not None)
    except ValueError as e:
        p.error(str(e))
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"recorded {', '.join(keys)} into {args.out}; now run: .venv/bin/python bench/scale/report.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
