"""The workload suite's plan: the workloads, groups and limits it measures, its configuration
from the environment, and the order and cost of its runs (see suite.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The kvgpu code under test: this tree, or a snapshot of it (KVGPU_TREE, e.g. `git archive HEAD`
# of shim/ and operator/kvgpu, so that a run measures committed code): its shim and its agent.
TREE = Path(os.environ.get("KVGPU_TREE") or ROOT)
sys.path.insert(0, str(TREE / "operator"))
HERE = Path(__file__).resolve().parent
MIB = 1 << 20

# ------------------------------------------------------------------------------------ the plan

# id, kind (suite_wl.py kind, "spin1"/"spin10" for suite_cu spin, "spinctx2" for suite_cu ctx2:
# 2 ms kernels in a second context after tiny ones in the first, "spinptds" for suite_cu ptds:
# the same on two threads' per-thread default streams, "spingrid1" for suite_cu spingrid), limits
# (percent of the card). gpt at 90 % wants less than its limit on every host seen (natively
# 36-79 % busy): a launch-bound tenant under its share, which must keep its native speed.
SINGLES: list[tuple[str, str, list[int]]] = [
    ("gpt", "gpt", [30, 50, 90]),
    ("conv", "conv", [30]),
    ("infer", "infer", [30]),
    ("longk-sync1", "spin1", [10]),
    ("longk-sync10", "spin10", [10]),
    ("longk-grid", "spingrid1", [10]),  # the same as longk-sync1 through the pre-4.0 cuLaunchGridAsync
    ("graphs", "graphs", [20]),
    ("compile", "compile", [30]),
    ("streams", "streams", [30]),
    ("ctx2", "spinctx2", [30]),
    ("ptds", "spinptds", [30]),
    ("threads", "threads", [30]),  # two Python threads, each its own stream and kernel size
    ("mm", "mm", []),  # native only: the co-tenants' baseline
]
# id, tenants (priority, cores; cores 0 = no compute limit), all running the mm workload. A 100 %
# limit is no limit in both shims (kvgpu gates 0 < cores < 100, HAMi-core SM_LIMIT < 100), so
# "priority 0 with no or 100 % limit" is one case.
GROUPS: list[tuple[str, list[tuple[int, int]]]] = [
    ("pair-30-70", [(1, 30), (1, 70)]),
    ("trio-20-30-50", [(1, 20), (1, 30), (1, 50)]),
    ("pair-70-50", [(1, 70), (1, 50)]),
    ("prio-a0none-b50", [(0, 0), (1, 50)]),
    ("prio-a0-70-b50", [(0, 70), (1, 50)]),
    ("procs2-30", [(1, 30)] * 2),
    ("procs4-30", [(1, 30)] * 4),
]
# Groups whose tenants are processes of one container (one claim, one region): its limit is the
# whole container's, each process's part of it is not prescribed; the sum is what is judged.
ONE_CONTAINER = {"procs2-30", "procs4-30"}
COMPUTE_MEM_MIB = 40000  # memory limit of every compute tenant (3 fit on the card)
START_LIMIT = 8000
# memory cases (suite_cu): the container's limit in MiB; green: 16 green contexts, then 256 MiB
# allocations (a green context's memory is what no allocation hook sees)
MEMORY_LIMITS = {"graphmem": 1000, "heap": 3000, "green": 2000}
START_RACERS, START_ROUNDS = 8, 5
# MiB the racers leave free (cuMemGetInfo) for a newcomer's context (612 MiB on the H200) and
# their own overshoot (8 racers x 64 MiB): with the contexts charged, racing to the limit itself
# refuses every newcomer's context, which measures a refusal, not a start-up.
START_RESERVE = 1536


@dataclass
class Config:
    out: Path
    modes: list[str]
    parts: list[str]
    only: set[str]
    secs: float
    budget_s: float
    t0: float
    py: str
    kvgpu_lib: str
    hami_lib: str
    suite_cu: str
    uuid: str = ""
    sched_dir: str = ""
    mps_dir: str = ""  # mode mps: the card's MPS control daemon (pipe/, log/), as the agent runs it
    fake: bool = False
    baseline: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, list[int]] = field(default_factory=dict)  # LIMITS: a single's own limits

    @classmethod
    def from_env(cls, out: Path, fake: bool = False) -> Config:
        env = os.environ
        base: dict[str, Any] = {}
        if env.get("BASELINE"):
            base = json.loads(Path(env["BASELINE"]).read_text())
        return cls(
            out=out,
            modes=env.get("MODES", "native hami kvgpu").split(),
            parts=env.get("PARTS", "memory startup single group").split(),
            only=set(env.get("ONLY", "").split()),
            secs=float(env.get("SECS", "4")),
            budget_s=float(env.get("SUITE_BUDGET_S", "0") or 0),
            t0=float(env.get("SUITE_T0", "0") or 0) or time.time(),
            py=env.get("PY", sys.executable),
            kvgpu_lib=env.get("KVGPU_LIB", str(TREE / "shim/_build/libvgpu.so")),
            hami_lib=env.get("HAMI_LIB", ""),
            suite_cu=env.get("SUITE_CU", str(ROOT / "shim/_build/suite_cu")),
            fake=fake,
            baseline=base,
            limits=parse_limits(env.get("LIMITS", "")),
        )

    def left_s(self) -> float:
        return self.budget_s - (time.time() - self.t0) if self.budget_s else 1e9

    def wanted(self, ident: str) -> bool:
        return not self.only or ident in self.only or ident.split("@")[0] in self.only



def parse_limits(text: str) -> dict[str, list[int]]:
    """LIMITS="gpt:30,50,80 conv:20" -> {"gpt": [30, 50, 80], "conv": [20]}: limits (percent of
    the card, 1..100) that replace a single workload's own. 100 is a claim with no compute limit
    (its memory limit only: what the shim's hooks cost a tenant the gate never holds). ValueError
    names a bad item."""
    out: dict[str, list[int]] = {}
    for item in text.split():
        ident, _, lims = item.partition(":")
        try:
            vals = [int(v) for v in lims.split(",")]
        except ValueError:
            vals = []
        if ident not in {s[0] for s in SINGLES} or not vals or not all(0 < v <= 100 for v in vals):
            raise ValueError(f"LIMITS item {item!r}: use <single id>:<percent>[,<percent>...], 1..100")
        out[ident] = vals
    return out


def plan(cfg: Config) -> list[tuple[str, Any]]:
    """(kind, args) in the order they run: the cheap memory and start-up cases first, then every
    workload alone (native first: it is the baseline and calibrates), then the co-tenants."""
    items: list[tuple[str, Any]] = []
    if "memory" in cfg.parts:
        for case in MEMORY_LIMITS:
            if cfg.wanted(case):
                items += [("memory", (case, m)) for m in cfg.modes]
    if "startup" in cfg.parts and cfg.wanted("startup"):
        items += [("startup", m) for m in cfg.modes]
    if "single" in cfg.parts:
        for ident, kind, limits in SINGLES:
            if not cfg.wanted(ident) and not (ident == "mm" and "group" in cfg.parts):
                continue
            if "native" in cfg.modes:
                items.append(("single", (ident, kind, "native", None)))
            for lim in cfg.limits.get(ident, limits):
                items += [("single", (ident, kind, m, lim)) for m in cfg.modes if m != "native"]
    if "group" in cfg.parts:
        if "native" in cfg.modes and "pair-native" in cfg.only:  # reference only: on request
            items.append(("group", ("pair-native", [(1, 0), (1, 0)], "native")))
        for gid, tenants in GROUPS:
            if cfg.wanted(gid):
                items += [("group", (gid, tenants, m)) for m in cfg.modes if m != "native"]
    return items


def cost(cfg: Config, kind: str, args: Any) -> float:
    if kind == "memory":
        return 4
    if kind == "startup":
        return 8
    if kind == "single":
        k = args[1]
        secs = cfg.secs * (1.5 if k in ("infer", "spin1", "spin10", "spingrid1") else 1)
        return secs + (3 if k.startswith("spin") else 6) + (20 if k == "compile" and args[2] == "native" else 0)
    return cfg.secs + 7
