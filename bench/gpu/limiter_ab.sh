#!/usr/bin/env bash
# Same-call A/B of two builds of the shim's limiter on a GPU machine: the suite's co-tenant
# groups (and any singles named), run A B A B ... on the same card, then one table.
#
# Device call (carry [".hami"]: baseline.json, wheels/), from the repository root:
#   AB_A="" AB_B="-DVGPU_CAL_MIN_PM=700u" bash bench/gpu/limiter_ab.sh
# Env: AB_A / AB_B (VGPU_CFLAGS of each build, e.g. a compile-time switch that keeps the
# earlier rule), AB_A_TAR / AB_B_TAR (build that side from a `git archive` tarball of shim/ and
# operator/kvgpu instead of this working tree: another commit, e.g.
# `git archive 62a8e62 shim operator/kvgpu | xz >.hami/old.tar.xz`; AB_B or AB_B_TAR required),
# AB_RUNS (2 of each), AB_PARTS ("group"), AB_ONLY (suite ids, all groups by default),
# AB_STATS=1 (build both with -DVGPU_STATS: vgpu-stats/vgpu-trace lines in each run's logs),
# SECS (3), BASELINE (.hami/baseline.json: the native numbers), LIMITS (suite.py's),
# AB_FLAT (a folder: each run's results.json copied there as A1.json, B1.json, ... as soon as the
# run ends, so a call cut off at its limit still brings back the runs it finished).
# Results: $OUT/ab.json and, packed into $OUT/runs.tar.xz, one suite directory and log per run
# (A1, A1.log, B1, ...).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/raw/limiter-ab}
mkdir -p "$OUT"
AB_A=${AB_A-}
AB_B=${AB_B-}
[ -n "$AB_B" ] || [ -n "${AB_B_TAR:-}" ] || { echo "set AB_B (VGPU_CFLAGS) or AB_B_TAR (another tree)" >&2; exit 2; }
STATS=""
# (suite_cu's programs then leave through exit(), so that the shim's exit handler prints them)
[ "${AB_STATS:-0}" = 1 ] && STATS="-DVGPU_STATS" && export SUITE_CU_EXIT=1
for i in $(seq 1 "${AB_RUNS:-2}"); do
    for v in A B; do
        flags=$AB_A tar=${AB_A_TAR:-}
        [ "$v" = B ] && flags=$AB_B tar=${AB_B_TAR:-}
        echo "=== run $v$i: ${tar:-this tree}, VGPU_CFLAGS='$flags $STATS' ($(date -u +%T)) ==="
        OUT=$OUT/$v$i KVGPU_TREE_TAR="$tar" VGPU_CFLAGS="$flags $STATS" MODES=kvgpu SECS=${SECS:-3} \
            PARTS=${AB_PARTS:-group} ONLY=${AB_ONLY:-} BASELINE=${BASELINE:-.hami/baseline.json} \
            bash bench/gpu/suite.sh >"$OUT/$v$i.log" 2>&1
        tail -3 "$OUT/$v$i.log"
        [ -z "${AB_FLAT:-}" ] || { mkdir -p "$AB_FLAT" && cp "$OUT/$v$i/results.json" "$AB_FLAT/$v$i.json"; }
    done
done
python3 - "$OUT" "$AB_A" "$AB_B" <<'EOF'
import json, sys
from pathlib import Path
out, a, b = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = {}
for run in sorted(out.glob("[AB][0-9]*/results.json")):
    for r in json.loads(run.read_text())["runs"]:
        m = r.get("metrics", {})
        if r["section"] == "group":  # each tenant's share of the native single tenant, %
            vals = [t.get("share") for t in m.get("tenants", [])]
            rows.setdefault(r["id"], {})["expected"] = [
                t.get("expected") if s["cores"] else None for t, s in zip(m.get("tenants", []), r["tenants"])]
        else:  # busy %, its lowest and highest second, % of native
            s = m.get("busy_sec_stats", {})
            vals = [m.get("busy"), s.get("min"), s.get("max"), m.get("share")]
        rows.setdefault(r["id"], {})[run.parent.name] = vals
err = {}  # capped tenants only
for key, runs in rows.items():
    exp = runs.get("expected")
    for name, vals in runs.items():
        if exp and name != "expected" and None not in vals:
            err[name] = err.get(name, 0.0) + sum(v - e for v, e in zip(vals, exp) if e is not None)
    print(key, json.dumps(runs))
print("summed error of the groups' tenants, points:", json.dumps({k: round(v, 1) for k, v in sorted(err.items())}))
(out / "ab.json").write_text(json.dumps({"A": a, "B": b, "rows": rows, "summed_err": err}, indent=1))
EOF
# A device call brings back at most 8 files of $OUT: the runs' folders and logs travel as one
# archive beside ab.json (AB_PACK=0 leaves them).
if [ "${AB_PACK:-1}" = 1 ]; then
    runs=$(cd "$OUT" && ls -d [AB][0-9]* 2>/dev/null)
    # shellcheck disable=SC2086  # run names are letters and digits
    [ -n "$runs" ] && tar -C "$OUT" -cJf "$OUT/runs.tar.xz" $runs && (cd "$OUT" && rm -rf $runs)
fi
