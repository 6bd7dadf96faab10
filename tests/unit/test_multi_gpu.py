"""Issue 20's multi-card GPU script (bench/gpu/multi.py) on CPU: the plan and the report on the
fake machines of multi_fake.py, and the verdicts of multi_judge.py on their own."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from kvgpu.core.claimstr import decode

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"


@pytest.fixture
def multi(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(GPU))
    for name in ("multi", "multi_judge", "multi_fake"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("multi")


def plan(multi: ModuleType, tmp_path: Path, n: int, bugs: frozenset[str] = frozenset()) -> list:
    fake = importlib.import_module("multi_fake").FakeMachine(n, bugs)
    return multi.run_plan(fake, multi.Setup(fake.cards(), "libvgpu.so", tmp_path, secs=1.0))


def test_every_scenario_of_the_selftest_ends_as_it_should(multi: ModuleType, tmp_path: Path) -> None:
    assert multi.selftest(tmp_path) == 0
    doc = json.loads((tmp_path / "one-card" / "multi.json").read_text())
    assert doc["exit"] == 0 and doc["n_cards"] == 1
    assert "| skipped: needs 2 cards |" in (tmp_path / "one-card" / "multi.md").read_text()


def test_one_card_runs_the_one_card_checks_and_never_passes_a_skipped_one(multi: ModuleType, tmp_path: Path) -> None:
    checks = {c.name: c for c in plan(multi, tmp_path, 1)}
    ran = {n for n, c in checks.items() if c.status == "ok"}
    assert {"claim.mem.card0", "claim.smi.card0", "claim.compute.card0", "cvd.0", "cvd.uuid0", "cvd.short0",
            "discovery"} <= ran
    for name in ("claim.mem.card1", "cvd.1,0", "allreduce.claim", "peer.copy"):
        assert checks[name].status == "skipped" and checks[name].why == "needs 2 cards"
        assert checks[name].got == "not run"


def test_the_check_names_do_not_depend_on_the_number_of_cards(multi: ModuleType, tmp_path: Path) -> None:
    judged = [{c.name for c in plan(multi, tmp_path, n) if c.status != "info"} for n in (1, 2)]
    assert judged[0] == judged[1]


def test_a_shim_that_follows_ordinals_fails_only_the_reordered_forms(multi: ModuleType, tmp_path: Path) -> None:
    failed = {c.name for c in plan(multi, tmp_path, 2, frozenset({"ordinal"})) if c.status == "fail"}
    assert failed == {"cvd.1", "cvd.1,0", "cvd.uuid1", "cvd.uuid1,uuid0", "cvd.short1,short0"}


def test_the_claim_is_one_the_shim_parses(multi: ModuleType, tmp_path: Path) -> None:
    fake = importlib.import_module("multi_fake").FakeMachine(2)
    s = multi.Setup(fake.cards(), "libvgpu.so", tmp_path)
    c = decode(s.claim())
    assert [(d.uuid, d.memory_mib, d.cores) for d in c.devices] == [
        (fake.cards()[0].uuid, 3000, 30), (fake.cards()[1].uuid, 6000, 50)]
    env = s.shim("x", "1,0")
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0" and Path(str(env["KVGPU_REGION_DIR"])).is_dir()
    assert s.native()["LD_PRELOAD"] is None


def test_the_cli_selftest_exits_0(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(GPU / "multi.py"), "--selftest", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "selftest" / "two-cards" / "multi.json").exists()


def test_verdicts(multi: ModuleType) -> None:
    J = importlib.import_module("multi_judge")
    row = "| N/A   29C    P0    75W /  700W |       0MiB /   3000MiB |      0%      Default |"
    assert J.smi_table_totals(row + "\n" + row.replace("3000", "6000")) == [3000, 6000]
    assert J.judge_share("s", 1, 372.0, 113.0, 30, 5.0).status == "ok"
    assert J.judge_share("s", 1, 372.0, 150.0, 30, 5.0).status == "fail"
    assert J.judge_share("s", 1, None, 150.0, 30, 5.0).status == "fail"
    dev = {"total_mib": 3000, "granted_mib": 2304, "error": "torch.OutOfMemoryError: x"}
    assert J.judge_mem_device("m", 1, dev, 3000, 256).status == "ok"
    assert J.judge_mem_device("m", 1, {**dev, "granted_mib": 3072}, 3000, 256).status == "fail"
    assert J.judge_mem_device("m", 1, {**dev, "error": "RuntimeError"}, 3000, 256).status == "fail"
    slow = {"rc": 0, "secs": 61.0, "nproc": 2, "ranks": [{"ok": True, "uuid": "a"}, {"ok": True, "uuid": "b"}]}
    assert J.judge_allreduce(slow, slow)[1].status == "fail"
    same_card = {**slow, "secs": 9.0, "ranks": [{"ok": True, "uuid": "a"}, {"ok": True, "uuid": "a"}]}
    assert J.judge_allreduce(same_card, same_card)[1].status == "fail"
    assert J.exit_code([J.skip("x", 3, "y")]) == 1
    assert J.uuid_key("GPU-ABC") == J.uuid_key("abc") == "abc"
