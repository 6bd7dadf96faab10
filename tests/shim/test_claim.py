"""The C claim parser (vgpu_config.c) against the Python one (kvgpu.core.claimstr).

Property: for any string, both accept or both reject, and accepted strings give the same
claim, priority and devices. Plus the HAMi-core env contract and the precedence rules.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvgpu.core import claimstr

MIB = 1024 * 1024


def c_parse(core, text: str):
    cfg = core.ffi.new("struct vgpu_config *")
    rc = core.lib.vgpu_claim_parse(text.encode(), cfg)
    if rc != 0:
        return None, core.ffi.string(cfg.error).decode()
    devs = tuple(
        claimstr.ClaimDevice(core.ffi.string(cfg.dev[i].uuid).decode(), cfg.dev[i].mem_limit // MIB,
                             cfg.dev[i].cores)
        for i in range(cfg.ndev)
    )
    return claimstr.ClaimString(core.ffi.string(cfg.claim).decode(), cfg.priority, devs), ""


def py_parse(text: str):
    try:
        return claimstr.decode(text)
    except claimstr.ClaimStringError:
        return None


dns = st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,20}[a-z0-9])?", fullmatch=True)
uuids = st.from_regex(r"(GPU|MIG)-[0-9A-Za-z-]{1,40}", fullmatch=True)


@st.composite
def valid_claims(draw) -> str:
    n = draw(st.integers(1, 16))
    ids = draw(st.lists(uuids, min_size=n, max_size=n, unique=True))
    devs = [claimstr.ClaimDevice(u, draw(st.integers(1, 1 << 30)), draw(st.integers(0, 100))) for u in ids]
    c = claimstr.ClaimString(f"{draw(dns)}/{draw(dns)}", draw(st.sampled_from([0, 1])), tuple(devs))
    text = c.encode()
    fields = text.split(";")
    body = fields[1:]
    draw(st.randoms()).shuffle(body)  # order is free after "v1"
    return ";".join([fields[0], *body])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_claims())
def test_valid_claims_agree(core, text: str) -> None:
    py = py_parse(text)
    c, err = c_parse(core, text)
    assert py is not None
    assert c == py, err


# Strings made of the grammar's own characters: mostly invalid, some valid.
pieces = st.sampled_from(
    ["v1", ";", "claim=", "priority=", "dev=", "GPU-", "MIG-", ",", "/", "-", ".", "ns", "a",
     "0", "1", "100", "101", "3000", "0", "=", " ", "\n", "\t", "x", "Z", "gpu-", "1073741825"]
)


@settings(max_examples=1500, deadline=None)
@given(st.lists(pieces, max_size=24).map("".join))
def test_fuzzed_strings_agree(core, text: str) -> None:
    py = py_parse(text)
    c, err = c_parse(core, text)
    assert (py is None) == (c is None), (text, py, err)
    if py is not None:
        assert c == py


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127), max_size=80))
def test_arbitrary_ascii_agree(core, text: str) -> None:
    py = py_parse(text)
    c, _ = c_parse(core, text)
    assert (py is None) == (c is None), text
    if py is not None:
        assert c == py


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "v1"),
        ("v2;claim=a/b;dev=GPU-1,1,0", "v1"),
        ("v1;claim=a/b", "no dev"),
        ("v1;dev=GPU-1,1,0", "no claim"),
        ("v1;claim=a/b;dev=GPU-1,0,0", "memory 1..2^30"),
        ("v1;claim=a/b;dev=GPU-1,1,101", "cores 0..100"),
        ("v1;claim=a/b;dev=GPU-1,1", "<UUID>"),
        ("v1;claim=a/b;dev=GPU-1,x,1", "integers"),
        ("v1;claim=a/b;dev=GPU-1,1,1;dev=GPU-1,2,2", "twice"),
        ("v1;claim=a/b;priority=2;dev=GPU-1,1,1", "priority"),
        ("v1;claim=A/b;dev=GPU-1,1,1", "claim="),
        ("v1;claim=a/b;color=red;dev=GPU-1,1,1", "unknown field"),
    ],
)
def test_errors_name_the_field(core, text: str, needle: str) -> None:
    c, err = c_parse(core, text)
    assert c is None and needle in err
    assert py_parse(text) is None


@pytest.mark.parametrize(
    "text, expect",
    [("3000m", 3000 * MIB), ("3g", 3 << 30), ("3G", 3 << 30), ("1024k", 1 << 20), ("3145728000", 3145728000),
     ("0", 0), ("3000M ", 3000 * MIB), ("1Gi", None), ("1.5g", None), ("", None), ("m", None), ("-1m", None)],
)
def test_hami_memory_quantities(core, text: str, expect) -> None:
    out = core.ffi.new("uint64_t *")
    rc = core.lib.vgpu_parse_mem(text.encode(), out)
    assert (rc == 0) == (expect is not None)
    if expect is not None:
        assert out[0] == expect


def load(core, env: dict[str, str]):
    block = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()) + b"\0"
    cfg = core.ffi.new("struct vgpu_config *")
    core.lib.vgpu_py_config_load(cfg, block)
    return cfg


def test_claim_file_wins_over_env(core, tmp_path) -> None:
    f = tmp_path / "claim"
    f.write_text("v1;claim=ns/from-file;priority=0;dev=GPU-abc,512,20\n")
    cfg = load(core, {"KVGPU_CLAIM_FILE": str(f), "KVGPU_CLAIM": "garbage"})
    assert not cfg.broken and core.ffi.string(cfg.claim) == b"ns/from-file" and cfg.priority == 0
    assert cfg.dev[0].mem_limit == 512 * MIB and cfg.dev[0].cores == 20
    # file named but absent: the env var is used
    env = {"KVGPU_CLAIM_FILE": str(tmp_path / "nope"), "KVGPU_CLAIM": "v1;claim=a/b;dev=GPU-x,1,0"}
    cfg = load(core, env)
    assert not cfg.broken and core.ffi.string(cfg.claim) == b"a/b"


@pytest.mark.parametrize(
    "env",
    [{"KVGPU_CLAIM": ""}, {"KVGPU_CLAIM": "v1;claim=a/b"}, {"CUDA_DEVICE_MEMORY_LIMIT": "1Gi"},
     {"CUDA_DEVICE_MEMORY_LIMIT_1": "lots"}, {"CUDA_DEVICE_SM_LIMIT": "half"}],
)
def test_present_but_broken_fails_closed(core, env) -> None:
    cfg = load(core, env)
    assert cfg.broken == 1 and core.ffi.string(cfg.error)


def test_hami_env_contract(core) -> None:
    cfg = load(core, {"CUDA_DEVICE_MEMORY_LIMIT_0": "3000m", "CUDA_DEVICE_MEMORY_LIMIT_1": "2g",
                      "CUDA_DEVICE_SM_LIMIT": "30", "CUDA_TASK_PRIORITY": "0",
                      "GPU_CORE_UTILIZATION_POLICY": "force", "ACTIVE_OOM_KILLER": "false",
                      "LIBCUDA_LOG_LEVEL": "0", "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/x/y.cache"})
    assert not cfg.broken and cfg.source == 2 and cfg.priority == 0 and cfg.policy == 1
    assert cfg.dev[0].mem_limit == 3000 * MIB and cfg.dev[1].mem_limit == 2 << 30
    assert cfg.dev[0].cores == 30 and cfg.dev[1].cores == 30 and cfg.oom_killer == 0
    assert core.ffi.string(cfg.region_path) == b"/x/y.cache" and cfg.log_level == 0
    # SM limit 0 or >= 100 means none (HAMi)
    assert load(core, {"CUDA_DEVICE_SM_LIMIT": "100"}).dev[0].cores == 0


def test_disable_control_and_nothing(core) -> None:
    # HAMi-core's switch works for HAMi-style limits ...
    assert load(core, {"CUDA_DISABLE_CONTROL": "true", "CUDA_DEVICE_MEMORY_LIMIT": "1g"}).disabled == 1
    # ... but cannot lift a kvgpu claim (an image ENV could set it): the claim is still parsed.
    cfg = load(core, {"CUDA_DISABLE_CONTROL": "true", "KVGPU_CLAIM": "junk"})
    assert cfg.disabled == 0 and cfg.broken
    good = "v1;claim=ns/x;priority=1;dev=GPU-1,100,30"
    cfg = load(core, {"GPU_CORE_UTILIZATION_POLICY": "disable", "KVGPU_CLAIM": good})
    assert cfg.disabled == 0 and not cfg.broken and cfg.policy != 2 and cfg.dev[0].cores == 30
    cfg = load(core, {})
    assert cfg.source == 0 and not cfg.broken


def test_unsetting_the_claim_in_a_kvgpu_container_fails_closed(core) -> None:
    """`env -u KVGPU_CLAIM -u KVGPU_CLAIM_FILE` inside a container that has the claims volume
    must not run unlimited, not even with HAMi's variables or CUDA_DISABLE_CONTROL."""
    mount = {"@kvgpu-claim-mount": "/etc/kvgpu"}
    for extra in ({}, {"CUDA_DISABLE_CONTROL": "true"}, {"CUDA_DEVICE_MEMORY_LIMIT": "100g"}):
        cfg = load(core, {**mount, **extra})
        assert cfg.broken and cfg.disabled == 0, extra
        assert b"claims volume" in core.ffi.string(cfg.error)
    good = "v1;claim=ns/x;priority=1;dev=GPU-1,100,30"
    assert not load(core, {**mount, "KVGPU_CLAIM": good}).broken
    assert load(core, {}).source == 0  # no volume, no claim: not a kvgpu container


def test_named_claim_file_that_is_missing_fails_closed(core) -> None:
    cfg = load(core, {"KVGPU_CLAIM_FILE": "/nonexistent/claim"})
    assert cfg.broken and b"does not exist" in core.ffi.string(cfg.error)
    good = "v1;claim=ns/x;priority=1;dev=GPU-1,100,30"
    cfg = load(core, {"KVGPU_CLAIM_FILE": "/nonexistent/claim", "KVGPU_CLAIM": good})
    assert not cfg.broken and cfg.dev[0].cores == 30  # the env copy of the same claim serves


# --------------------------------------------------------------------------- issue 14: forgery
# In a container the webhook mounts the container's own claim, read-only, at /etc/kvgpu/claim
# (the loader asks the getter for "@kvgpu-container-claim"; the real shim answers from the file
# system). From then on the process's env carries no authority. Before the fix, each of these
# forgeries was obeyed.

GRANTED = "v1;claim=team-a/job-main;priority=1;dev=GPU-1,1000,30"
FORGED = "v1;claim=team-a/job-main;priority=0;dev=GPU-1,100000,0"
OWN = "@kvgpu-container-claim"


def container_env(tmp_path, **env: str) -> dict[str, str]:
    own = tmp_path / "etc-kvgpu" / "claim"
    own.parent.mkdir(exist_ok=True)
    own.write_text(GRANTED)
    return {OWN: str(own), "@kvgpu-claim-mount": str(own.parent), **env}


def assert_granted(core, cfg) -> None:
    assert not cfg.broken, core.ffi.string(cfg.error)
    assert cfg.container == 1 and core.ffi.string(cfg.claim) == b"team-a/job-main"
    assert cfg.ndev == 1 and cfg.dev[0].mem_limit == 1000 * MIB and cfg.dev[0].cores == 30
    assert cfg.priority == 1


def test_forged_env_claim_is_ignored_in_a_container(core, tmp_path) -> None:
    cfg = load(core, container_env(tmp_path, KVGPU_CLAIM=FORGED))
    assert_granted(core, cfg)
    assert cfg.env_ignored & 1  # logged once by the shim, never obeyed
    same = load(core, container_env(tmp_path, KVGPU_CLAIM=GRANTED + "\n"))
    assert_granted(core, same)
    assert same.env_ignored == 0  # the webhook's env copy of the same claim


def test_forged_claim_file_is_ignored_in_a_container(core, tmp_path) -> None:
    forged = tmp_path / "forged"
    forged.write_text(FORGED)
    cfg = load(core, container_env(tmp_path, KVGPU_CLAIM_FILE=str(forged), KVGPU_CLAIM=FORGED))
    assert_granted(core, cfg)
    assert cfg.env_ignored & 2


def test_sibling_containers_claim_file_is_ignored(core, tmp_path) -> None:
    """The old layout put every sliced container's file in /etc/kvgpu: pointing
    KVGPU_CLAIM_FILE at a sibling's (bigger) claim took its limits."""
    env = container_env(tmp_path)
    sibling = tmp_path / "etc-kvgpu" / "trainer"
    sibling.write_text("v1;claim=team-a/job-trainer;priority=0;dev=GPU-1,40000,100")
    cfg = load(core, {**env, "KVGPU_CLAIM_FILE": str(sibling)})
    assert_granted(core, cfg)


def test_container_claim_ignores_hami_disable_and_region_env(core, tmp_path) -> None:
    env = container_env(tmp_path, CUDA_DISABLE_CONTROL="true", CUDA_DEVICE_MEMORY_LIMIT="100g",
                        GPU_CORE_UTILIZATION_POLICY="disable", KVGPU_REGION_DIR="/tmp/mine",
                        CUDA_DEVICE_MEMORY_SHARED_CACHE="/tmp/mine.cache", KVGPU_SCHED_DIR="/tmp/s")
    cfg = load(core, env)
    assert_granted(core, cfg)
    assert cfg.disabled == 0 and cfg.policy != 2 and cfg.source == 1
    # one quota per container: the region is the webhook's mount, not the process's choice
    assert core.ffi.string(cfg.region_path) == b"/var/run/kvgpu/vgpu.region"
    assert core.ffi.string(cfg.sched_dir) == b"" and cfg.env_ignored & 4
    env["@kvgpu-container-sched"] = "/var/run/kvgpu-sched"
    assert core.ffi.string(load(core, env).sched_dir) == b"/var/run/kvgpu-sched"


def test_container_claim_unreadable_or_invalid_fails_closed(core, tmp_path) -> None:
    env = container_env(tmp_path, KVGPU_CLAIM=GRANTED)
    bad = load(core, {**env, OWN: str(tmp_path)})  # a directory: cannot be read
    assert bad.broken and b"claim file" in core.ffi.string(bad.error)
    (tmp_path / "etc-kvgpu" / "claim").write_text("v1;claim=team-a/job-main")
    bad = load(core, env)  # the env's valid copy does not rescue a broken file
    assert bad.broken and bad.container == 1


def test_without_the_container_file_the_env_contract_stays(core, tmp_path) -> None:
    """A host process (no /etc/kvgpu/claim): KVGPU_CLAIM and HAMi's variables as before."""
    cfg = load(core, {"KVGPU_CLAIM": GRANTED})
    assert not cfg.broken and cfg.container == 0 and cfg.dev[0].mem_limit == 1000 * MIB
    assert load(core, {"CUDA_DEVICE_MEMORY_LIMIT": "1g"}).source == 2
