"""Issue 20's multi-card checks: the verdict on each probe's result, and the report.

Pure: no GPU, no torch, no subprocess. bench/gpu/multi.py runs the probes (or, with
--selftest, the fakes of multi_fake.py) and hands their JSON here. Units: memory in MiB,
compute in percent (of the SMs for a limit, of the native rate for a share), time in seconds.

A check is one row of the report: name, part (issue 20's item 1..5), expected, got, status:
``ok`` and ``fail`` are judged; ``skipped`` was not run (``why`` says why: never counted as
passed); ``info`` is a measurement shown beside the verdicts and never judged.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

CTX_ALLOWANCE_MIB = 1024  # a CUDA context plus the runtime's own memory (612 MiB on an H200)
ALLREDUCE_LIMIT_S = 60.0
NEEDS_2 = "needs 2 cards"


Env = dict[str, str | None]  # variables to set for a child; None: unset


@dataclass(frozen=True)
class Card:
    """A card as nvidia-smi lists it: index, UUID (``GPU-...``), model, memory MiB."""

    index: int
    uuid: str
    name: str
    mem_mib: int


@dataclass
class Check:
    """One row: ``status`` is ok, fail, skipped or info."""

    name: str
    part: int
    expected: str
    got: str = ""
    status: str = "skipped"
    why: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def verdict(name: str, part: int, expected: str, got: str, ok: bool, **data: Any) -> Check:
    """A judged check."""
    return Check(name, part, expected, got, "ok" if ok else "fail", data=data)


def skip(name: str, part: int, expected: str, why: str = NEEDS_2) -> Check:
    """A check that was not run: never passed."""
    return Check(name, part, expected, "not run", "skipped", why)


def info(name: str, part: int, got: str, **data: Any) -> Check:
    """A measurement, not judged."""
    return Check(name, part, "(measurement)", got, "info", data=data)


def uuid_key(u: str | None) -> str:
    """A UUID as a comparable key: lower case, without NVML's ``GPU-`` prefix."""
    u = (u or "").strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def probe_error(res: dict[str, Any]) -> str:
    """The probe's own failure (crash, timeout, no JSON), or ''."""
    return str(res.get("error") or "")


# --- part 1: a claim over the cards -------------------------------------------------------

def mem_expected(mib: int, block: int) -> str:
    """What a card of a ``mib`` MiB slice must show, in words."""
    low = max(0, mib - CTX_ALLOWANCE_MIB - block)
    return f"mem_get_info total = {mib} MiB; OOM after {low}..{mib} MiB of {block} MiB blocks"


def judge_mem_device(name: str, part: int, dev: dict[str, Any] | None, mib: int, block: int) -> Check:
    """One visible card in a memory probe against its slice of ``mib`` MiB."""
    exp = mem_expected(mib, block)
    if dev is None:
        return verdict(name, part, exp, "card not visible", False)
    total, granted = dev.get("total_mib"), dev.get("granted_mib", 0)
    oom = "OutOfMemoryError" in str(dev.get("error"))
    low = max(0, mib - CTX_ALLOWANCE_MIB - block)
    ok = total == mib and oom and low <= granted <= mib
    got = f"total {total} MiB; {granted} MiB granted, then {dev.get('error') or 'no error'}"
    return verdict(name, part, exp, got, ok, uuid=dev.get("uuid"), ordinal=dev.get("ordinal"),
                   total_mib=total, granted_mib=granted)


def judge_nvml_peak(name: str, part: int, dev: dict[str, Any] | None, mib: int) -> Check:
    """NVML's per-process figure (not virtualised) while holding: at most the slice."""
    exp = f"NVML per-process peak <= {mib} MiB"
    peak = (dev or {}).get("nvml_peak_mib")
    if peak is None or peak < 0:
        return info(name, part, "NVML per-process usage not available")
    return verdict(name, part, exp, f"{peak:.0f} MiB", peak <= mib, nvml_peak_mib=peak)


def device_by_uuid(res: dict[str, Any], uuid: str) -> dict[str, Any] | None:
    """The probe's entry for the card ``uuid``, or None."""
    for d in res.get("devices", []):
        if uuid_key(d.get("uuid")) == uuid_key(uuid):
            return d
    return None


SMI_ROW = re.compile(r"(\d+)MiB\s*/\s*(\d+)MiB")


def smi_table_totals(text: str) -> list[int]:
    """The totals of nvidia-smi's table rows (``0MiB / 3000MiB``), in its card order."""
    return [int(m.group(2)) for m in SMI_ROW.finditer(text)]


def smi_query_totals(text: str) -> dict[str, int]:
    """UUID key -> memory.total MiB from ``--query-gpu=index,uuid,memory.used,memory.total``."""
    out: dict[str, int] = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[3].isdigit():
            out[uuid_key(parts[1])] = int(parts[3])
    return out


def judge_smi_card(name: str, part: int, query: str, uuid: str, mib: int) -> Check:
    """nvidia-smi's memory.total for one claimed card under the preload."""
    got = smi_query_totals(query).get(uuid_key(uuid))
    return verdict(name, part, f"memory.total {mib} MiB", f"{got} MiB" if got is not None else "no row",
                   got == mib)


def judge_smi_table(name: str, part: int, table: str, mibs: list[int]) -> Check:
    """nvidia-smi's table under the preload shows every slice, in card order."""
    got = smi_table_totals(table)
    rows = [m.group(0) for m in SMI_ROW.finditer(table)]
    return verdict(name, part, "rows " + ", ".join(f"xMiB / {m}MiB" for m in mibs),
                   "; ".join(rows) or "no row", got == mibs, totals=got)


def compute_expected(cores: int, tol: float) -> str:
    """The share a card of ``cores`` % must reach, in words."""
    return f"{cores} +/- {tol:g} % of native"


def judge_share(name: str, part: int, native: float | None, shim: float | None, cores: int,
                tol: float, err: str = "") -> Check:
    """A matmul rate under the claim against the native rate (iterations/s), as a share;
    ``err``: the probes' failures, shown when a rate is missing."""
    exp = compute_expected(cores, tol)
    err = f": {err}" if err else ""
    if not native or shim is None:
        return verdict(name, part, exp, f"no rate (native {native}, shim {shim}){err}", False)
    share = 100.0 * shim / native
    return verdict(name, part, exp, f"{share:.1f} % ({shim:.1f} / {native:.1f} it/s)",
                   abs(share - cores) <= tol, share=round(share, 2), native_its=native, shim_its=shim)


def rate_by_uuid(res: dict[str, Any], uuid: str) -> float | None:
    """Iterations/s on card ``uuid`` in a matmul result, or None."""
    d = device_by_uuid(res, uuid)
    return None if d is None else d.get("its")


# --- part 2: CUDA_VISIBLE_DEVICES ---------------------------------------------------------

def cvd_expected(mibs: list[int]) -> str:
    """What a CUDA_VISIBLE_DEVICES form must show: the native order and each card's slice."""
    return f"ordinals as natively; totals {mibs} MiB; OOM within each slice"


def judge_cvd(name: str, native: dict[str, Any], shim: dict[str, Any], slices: dict[str, int],
              mibs: list[int], block: int, allow_none: bool = False) -> Check:
    """Per visible ordinal: the same UUID as natively, and the total and limit of its slice.
    ``allow_none``: a form CUDA may refuse; no card natively and none under the claim passes."""
    exp = cvd_expected(mibs)
    err = probe_error(native) or probe_error(shim)
    if err:
        return verdict(name, 2, exp, f"probe failed: {err}", False)
    nat = [uuid_key(d.get("uuid")) for d in native.get("devices", [])]
    got_u = [uuid_key(d.get("uuid")) for d in shim.get("devices", [])]
    if allow_none and not nat:
        return verdict(name, 2, exp + " (or no card, as natively)",
                       f"no card natively, {len(got_u)} under the claim", not got_u)
    rows, ok = [], nat == got_u and bool(nat)
    for d in shim.get("devices", []):
        mib = slices.get(uuid_key(d.get("uuid")))
        c = judge_mem_device(name, 2, d, mib or -1, block)
        ok = ok and c.status == "ok"
        rows.append(f"#{d.get('ordinal')} {uuid_key(d.get('uuid'))[:8]} total {d.get('total_mib')} "
                    f"granted {d.get('granted_mib')}")
    got = "; ".join(rows) or "no device"
    if nat != got_u:
        got += f" (native order {[u[:8] for u in nat]})"
    return verdict(name, 2, exp, got, ok, native=nat, shim=got_u)


# --- part 3: NCCL all-reduce ------------------------------------------------------------

def allreduce_expected(n: int) -> str:
    """The all-reduce verdict in words."""
    return f"{n} ranks, each on its own card, exact sum of 128 floats, within {ALLREDUCE_LIMIT_S:g} s"


def allreduce_got(res: dict[str, Any]) -> tuple[bool, str]:
    """(passed, words) for one torchrun result: rc, seconds, per-rank correctness."""
    ranks = res.get("ranks", [])
    good = [r for r in ranks if r.get("ok")]
    cards = {uuid_key(r.get("uuid")) for r in ranks}
    secs = res.get("secs", float("inf"))
    ok = (res.get("rc") == 0 and len(good) == res.get("nproc", 2) == len(cards)
          and secs <= ALLREDUCE_LIMIT_S)
    err = f"; {res['error']}" if res.get("error") else ""
    return ok, (f"rc {res.get('rc')}, {secs:.1f} s, {len(good)}/{len(ranks)} ranks exact "
                f"on {len(cards)} cards{err}")


def judge_allreduce(native: dict[str, Any], shim: dict[str, Any]) -> list[Check]:
    """The native run (shown) and the run under the claim (judged)."""
    n_ok, n_got = allreduce_got(native)
    s_ok, s_got = allreduce_got(shim)
    if not n_ok:
        s_got += " (native failed too)"
    return [info("allreduce.native", 3, n_got, ok=n_ok),
            verdict("allreduce.claim", 3, allreduce_expected(shim.get("nproc", 2)), s_got, s_ok)]


# --- part 4: peer access ------------------------------------------------------------------

def judge_peer(native: dict[str, Any], shim: dict[str, Any]) -> list[Check]:
    """can_device_access_peer and a cross-card copy under the claim, as natively."""
    err = probe_error(shim) or probe_error(native)
    nc, sc = native.get("can"), shim.get("can")
    out = [verdict("peer.can_access", 4, f"as natively: {nc}", f"{sc}{' ' + err if err else ''}",
                   nc == sc and nc is not None),
           verdict("peer.copy", 4, f"as natively: exact = {native.get('copy_ok')}",
                   f"exact = {shim.get('copy_ok')}", shim.get("copy_ok") == native.get("copy_ok") is True)]
    out.append(info("peer.bandwidth", 4, f"{shim.get('gbps')} GB/s (native {native.get('gbps')})",
                    native_gbps=native.get("gbps"), shim_gbps=shim.get("gbps")))
    return out


# --- part 5: discovery --------------------------------------------------------------------

def judge_discovery(res: dict[str, Any], n_cards: int) -> Check:
    """discovery_check.py's exit status and its MISMATCH lines."""
    text = res.get("text", "")
    bad = [ln for ln in text.splitlines() if ln.startswith("MISMATCH")]
    got = f"rc {res.get('rc')}, {n_cards} cards, {len(bad)} mismatches"
    if bad:
        got += ": " + "; ".join(bad[:3])
    return verdict("discovery", 5, "rc 0: every card's UUID, index, model, memory as nvidia-smi",
                   got, res.get("rc") == 0 and not bad)


# --- the report ---------------------------------------------------------------------------

def summarize(checks: list[Check]) -> dict[str, int]:
    """Counts per status."""
    out = {"ok": 0, "fail": 0, "skipped": 0, "info": 0}
    for c in checks:
        out[c.status] += 1
    return out


def exit_code(checks: list[Check]) -> int:
    """0 only when every judged check passed (and at least one was judged)."""
    s = summarize(checks)
    return 0 if s["fail"] == 0 and s["ok"] > 0 else 1


def report_json(checks: list[Check], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: meta, the counts, every check."""
    return {**meta, "summary": summarize(checks), "exit": exit_code(checks),
            "checks": [asdict(c) for c in checks]}


def md_cell(s: str) -> str:
    """Text safe in a markdown table cell."""
    return s.replace("|", "/").replace("\n", " ")


def report_md(checks: list[Check], meta: dict[str, Any]) -> str:
    """A short markdown summary: counts, then one row per check."""
    s = summarize(checks)
    lines = [f"# Multi-card checks (issue 20), {meta.get('date', '')}", "",
             f"Machine: {meta.get('machine', '')}; "
             f"claim: `{meta.get('claim', '')}`", "",
             f"**{s['ok']} ok, {s['fail']} failed, {s['skipped']} skipped, {s['info']} measurements; "
             f"exit {exit_code(checks)}**", "",
             "| part | check | status | expected | got |", "|---|---|---|---|---|"]
    for c in checks:
        st = c.status if not c.why else f"{c.status}: {c.why}"
        lines.append(f"| {c.part} | {c.name} | {st} | {md_cell(c.expected)} | {md_cell(c.got)} |")
    return "\n".join(lines) + "\n"
