"""A fake machine for ``multi.py --selftest``: answers every probe as H200s would, natively
or under a shim that keeps the claim (or, with ``bugs``, one that gets a part wrong).

Units as in multi_probe.py: MiB, iterations/s, GB/s, seconds. No GPU, no torch, no processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import multi_judge as J
from multi_judge import Card, Env

CTX_MIB = 612  # an H200's CUDA context under torch
NATIVE_ITS = 372.0  # 4096^2 fp32 products per second on an H200
UUIDS = ["GPU-1a2b3c4d-0000-4000-8000-000000000000", "GPU-5e6f7a8b-1111-4111-8111-111111111111"]


class FakeMachine:
    """``n`` fake H200s. ``bugs``: ``ordinal`` (a slice follows the CUDA ordinal, not the UUID),
    ``nccl-hang`` (the all-reduce under the claim never ends), ``peer`` (no peer access under
    the claim), ``smi`` (nvidia-smi shows the whole card)."""

    def __init__(self, n: int, bugs: frozenset[str] = frozenset()) -> None:
        self._cards = [Card(i, UUIDS[i], "NVIDIA H200", 143771) for i in range(n)]
        self.bugs = bugs

    def cards(self) -> list[Card]:
        return list(self._cards)

    def visible(self, env: Env) -> list[Card]:
        """The cards CUDA_VISIBLE_DEVICES leaves, in its order (fake CUDA: a UUID needs ``GPU-``)."""
        cvd = env.get("CUDA_VISIBLE_DEVICES")
        if cvd is None:
            return self.cards()
        out = []
        for tok in cvd.split(","):
            hits = [c for c in self._cards
                    if tok == str(c.index) or (tok.startswith("GPU-") and c.uuid.startswith(tok))]
            if len(hits) != 1:
                break
            out.append(hits[0])
        return out

    def slices(self, env: Env) -> list[tuple[str, int, int]] | None:
        """(UUID, MiB, cores %) of the claim when the shim is preloaded, else None."""
        if not env.get("LD_PRELOAD") or not env.get("KVGPU_CLAIM"):
            return None
        devs = [f[4:].split(",") for f in str(env["KVGPU_CLAIM"]).split(";") if f.startswith("dev=")]
        return [(u, int(m), int(k)) for u, m, k in devs]

    def limit(self, env: Env, ordinal: int, card: Card) -> tuple[int, int]:
        """(MiB, cores %) the fake shim gives this ordinal; natively (the card's MiB, 100)."""
        sl = self.slices(env)
        if sl is None:
            return card.mem_mib, 100
        if "ordinal" in self.bugs:
            return sl[min(ordinal, len(sl) - 1)][1:]
        return next(((m, k) for u, m, k in sl if u == card.uuid), (0, 0))

    def probe(self, label: str, kind: str, env: Env, args: list[str], timeout: float) -> dict[str, Any]:
        return {"mem": self._mem, "view": self._mem, "matmul": self._matmul, "peer": self._peer}[kind](env, args)

    def _mem(self, env: Env, args: list[str]) -> dict[str, Any]:
        block = int(args[args.index("--block") + 1]) if "--block" in args else 256
        out = []
        for i, c in enumerate(self.visible(env)):
            mib, _ = self.limit(env, i, c)
            granted = (mib - CTX_MIB) // block * block
            out.append({"ordinal": i, "uuid": c.uuid, "total_mib": mib, "free_mib": mib - CTX_MIB,
                        "granted_mib": granted, "nvml_peak_mib": CTX_MIB + granted + 2,
                        "error": "torch.OutOfMemoryError: CUDA out of memory."})
        return {"devices": out}

    def _matmul(self, env: Env, args: list[str]) -> dict[str, Any]:
        pairs = list(enumerate(self.visible(env)))
        if "--device" in args:
            pairs = [pairs[int(args[args.index("--device") + 1])]]
        return {"devices": [{"ordinal": i, "uuid": c.uuid, "its": NATIVE_ITS * self.limit(env, i, c)[1] / 100 * 1.01}
                            for i, c in pairs]}

    def matmul_procs(self, label: str, env: Env, devices: list[int], secs: float) -> dict[str, Any]:
        devs = [self._matmul(env, ["--device", str(d)])["devices"][0] for d in devices]
        return {"devices": devs}

    def _peer(self, env: Env, args: list[str]) -> dict[str, Any]:
        off = "peer" in self.bugs and self.slices(env) is not None
        n = len(self.visible(env))
        can = [[None if i == j else not off for j in range(n)] for i in range(n)]
        return {"count": n, "can": can, "copy_ok": True, "gbps": 40.0 if off else 120.0}

    def smi(self, label: str, env: Env, indices: list[int]) -> dict[str, Any]:
        rows = []
        for c in (self._cards[i] for i in indices):
            mib = c.mem_mib if "smi" in self.bugs else self.limit(env, c.index, c)[0]
            rows.append((c, mib))
        query = "".join(f"{c.index}, {c.uuid}, 0, {m}\n" for c, m in rows)
        table = "".join(f"| N/A   30C    P0    75W / 700W |      0MiB / {m:>6}MiB |      0%  Default |\n"
                        for _, m in rows)
        return {"query": query, "table": table, "rc": [0, 0]}

    def torchrun(self, label: str, env: Env, nproc: int, timeout: float) -> dict[str, Any]:
        if "nccl-hang" in self.bugs and self.slices(env) is not None:
            return {"rc": 124, "secs": timeout, "nproc": nproc, "ranks": [], "error": f"killed after {timeout:g} s"}
        ranks = [{"rank": r, "uuid": self._cards[r].uuid, "ok": True, "max_err": 0.0, "secs": 4.2}
                 for r in range(nproc)]
        return {"rc": 0, "secs": 9.5, "nproc": nproc, "ranks": ranks, "error": ""}

    def discovery(self, label: str) -> dict[str, Any]:
        text = "".join(f"ok       {c.uuid} memoryMiB: kvgpu={c.mem_mib} nvidia-smi/cuda={c.mem_mib}\n"
                       for c in self._cards)
        return {"rc": 0, "text": text + "RESULT: PASS\n"}


# --- what each scenario must end as -------------------------------------------------------

Want = Callable[[list[J.Check], int], list[str]]


def by_status(checks: list[J.Check], status: str) -> set[str]:
    """The names of the checks with ``status``."""
    return {c.name for c in checks if c.status == status}


def want_pass(skipped: set[str]) -> Want:
    """Exit 0, nothing failed, exactly ``skipped`` skipped (each for want of a second card)."""
    def check(checks: list[J.Check], rc: int) -> list[str]:
        out = []
        if rc != 0 or by_status(checks, "fail"):
            out.append(f"expected exit 0, got {rc}; failed {sorted(by_status(checks, 'fail'))}")
        if by_status(checks, "skipped") != skipped:
            out.append(f"skipped {sorted(by_status(checks, 'skipped'))}, expected {sorted(skipped)}")
        out += [f"{c.name} skipped for {c.why!r}" for c in checks if c.status == "skipped" and c.why != J.NEEDS_2]
        return out
    return check


def want_fail(failed: set[str]) -> Want:
    """Exit 1, and exactly ``failed`` failed."""
    def check(checks: list[J.Check], rc: int) -> list[str]:
        got = by_status(checks, "fail")
        return [] if rc == 1 and got == failed else [f"exit {rc}, failed {sorted(got)}, expected {sorted(failed)}"]
    return check


TWO_CARD = {"claim.mem.card1", "claim.nvml.card1", "claim.smi.card1", "claim.compute.card1",
            "claim.compute1p.card1", "cvd.1", "cvd.1,0", "cvd.uuid1", "cvd.uuid1,uuid0",
            "cvd.short1,short0", "cvd.bare1,bare0", "allreduce.claim", "peer.can_access", "peer.copy"}

#: name -> (cards, bugs, what the checks must end as)
SCENARIOS: dict[str, tuple[int, frozenset[str], Want]] = {
    "one-card": (1, frozenset(), want_pass(TWO_CARD)),
    "two-cards": (2, frozenset(), want_pass(set())),
    "two-cards-broken": (2, frozenset({"ordinal", "nccl-hang", "peer", "smi"}), want_fail({
        "cvd.1", "cvd.1,0", "cvd.uuid1", "cvd.uuid1,uuid0", "cvd.short1,short0", "allreduce.claim",
        "peer.can_access", "claim.smi.card0", "claim.smi.card1", "claim.smi.table"})),
    "one-card-broken": (1, frozenset({"smi"}), want_fail({"claim.smi.card0", "claim.smi.table"})),
}
