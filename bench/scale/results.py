"""Where a scale bench run's record goes (:mod:`bench.scale.run`): ``bench/results/scale.json``,
keyed by node count, machine size and node choice, with the machine and the command line it ran
with (less the options that only name local paths) and the commit it measured."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "scale.json"


def machine() -> dict[str, Any]:
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "cpu": cpu,
            "python": platform.python_version(), "kernel": platform.release()}


def code_version() -> str | None:
    """The commit measured (``git rev-parse --short HEAD``, ``+changes`` when tracked files
    differ from it); None outside a git checkout (the device bundle)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":!bench/results"], cwd=REPO,
                               timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "") if head else None


def public_args(argv: list[str]) -> list[str]:
    """The command line without options that only name local paths (they do not change results)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--run-dir", "--out"):
            skip = True
            continue
        if a.startswith(("--run-dir=", "--out=")) or a == "--keep":
            continue
        out.append(a)
    return out


def run_key(nodes: int, cores: int | None, node_choice: str = "extender") -> str:
    """Results are kept per node count, machine size and ``--node-choice``: ``"1000n-2c"``,
    ``"5000n-16c"``, ``"5000n-16c-scheduler"`` (the default choice has no suffix)."""
    return f"{nodes}n-{cores or 0}c" + ("" if node_choice == "extender" else f"-{node_choice}")


def merge_results(path: Path, nodes: int, record: dict[str, Any]) -> None:
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    key = run_key(nodes, record.get("machine", {}).get("cores"), record.get("node_choice", "extender"))
    data.setdefault("runs", {})[key] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
