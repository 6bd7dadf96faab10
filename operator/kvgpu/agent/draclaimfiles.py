"""The node's files of one prepared ResourceClaim (the DRA plugin's I/O,
:mod:`kvgpu.agent.draplugin`).

Under ``<state_dir>/claims/<claim UID>/``:

- ``claim``: the claim string (mode 0444), mounted read-only on ``/etc/kvgpu/claim``: the shim
  reads it and nothing else (env a tenant sets is ignored, docs/shim.md "Input");
- ``region/``: the claim's region directory (mode 0777: the containers' users are not known
  when the kubelet prepares a claim; only containers of this claim mount it), read-write on
  ``/var/run/kvgpu``: every container of the claim shares its one quota;
- ``prepared.json``: the checkpoint (claim, devices, CDI IDs), written last, so that unprepare
  works after an agent or kubelet restart and a second prepare answers the same.

And ``<cdi_dir>/gpu.kvgpu.io-<claim UID>.json``, the CDI spec, written after the claim file
(never a CDI device without its claim file) and removed first.

A claim of MIG devices (:class:`~kvgpu.dra.claims.PreparedMig`) has only the checkpoint (``"mig":
true``) and a CDI spec: each device gets its parent's ``/dev/nvidia<minor>`` and its instance's
two ``/dev/nvidia-caps`` nodes, the spec the control nodes, the driver folders and
``NVIDIA_VISIBLE_DEVICES=<MIG UUIDs>``: no shim, no ``ld.so.preload``, no claim file, no region.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgpu.core import claimstr, keys
from kvgpu.dra import cdi
from kvgpu.dra.claims import PreparedClaim

from . import devicespecs, mps
from .allocation import installed_shim, shim_mounts, stub_driver_env
from .pluginconfig import PluginConfig, PluginError

CHECKPOINT = "prepared.json"
CLAIM_FILE = "claim"
REGION_DIR = "region"


@dataclass(frozen=True, slots=True)
class ClaimSource:
    """One device as the kubelet is told it (``Device`` of the DRA API)."""

    requests: tuple[str, ...]
    pool: str
    device: str
    share_id: str | None
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Prepared:
    """What the checkpoint holds of a prepared claim."""

    uid: str
    claim: str  # "" for a MIG claim
    devices: tuple[ClaimSource, ...]
    mig: bool = False


def _component(uid: str) -> str:
    if not uid or uid in (".", "..") or "/" in uid or "\0" in uid:
        raise ValueError(f"claim UID {uid!r} is not one path component")
    return uid


def _mounts(pb_mounts: list[Any]) -> list[cdi.Mount]:
    return [cdi.Mount(m.host_path, m.container_path, bool(m.read_only)) for m in pb_mounts]


class ClaimFiles:
    """Writes, reads and removes the files of prepared claims (module docstring). ``cfg``: the
    device plugin's settings (shim mounts, device nodes, driver folder, schedule, MPS root)."""

    def __init__(self, state_dir: str, cdi_dir: str, cfg: PluginConfig) -> None:
        self.root = Path(state_dir) / "claims"
        self.cdi_dir = Path(cdi_dir)
        self.cfg = cfg

    def dir(self, uid: str) -> Path:
        return self.root / _component(uid)

    def spec_path(self, uid: str) -> Path:
        return self.cdi_dir / cdi.spec_file_name(uid)

    def load(self, uid: str) -> Prepared | None:
        """The checkpoint of ``uid``, or ``None`` if it was not prepared (or its files are gone)."""
        path = self.dir(uid) / CHECKPOINT
        if not path.exists() or not self.spec_path(uid).exists():
            return None
        d = json.loads(path.read_text())
        mig = bool(d.get("mig"))
        if not mig and not (self.dir(uid) / CLAIM_FILE).exists():
            return None
        devs = tuple(ClaimSource(tuple(x["requests"]), x["pool"], x["device"], x.get("shareID"), tuple(x["cdi"]))
                     for x in d["devices"])
        return Prepared(d["uid"], d["claim"], devs, mig)

    def _edits(self, p: PreparedClaim, d: Path) -> tuple[list[cdi.DeviceNode], list[cdi.Mount], dict[str, str]]:
        cards = [x.card for x in p.devices]
        shim = installed_shim(self.cfg)
        mounts = _mounts(shim_mounts(self.cfg, shim))
        mounts.append(cdi.Mount(str(d / CLAIM_FILE), keys.CONTAINER_CLAIM_FILE))
        mounts.append(cdi.Mount(str(d / REGION_DIR), keys.CONTAINER_REGION_DIR, read_only=False))
        env = {keys.ENV_VISIBLE: ",".join(c.uuid for c in cards), keys.ENV_CLAIM: p.claim,
               "KVGPU_DRA_CLAIM": f"{p.namespace}/{p.name}"}
        if shim is not None:
            env["KVGPU_SHIM_FILE"] = shim.name
        if self.cfg.sched_dir:
            Path(self.cfg.sched_dir).mkdir(mode=0o755, parents=True, exist_ok=True)
            mounts.append(cdi.Mount(self.cfg.sched_dir, keys.CONTAINER_SCHED_DIR))
        nodes: list[cdi.DeviceNode] = []
        if self.cfg.device_specs:
            card_paths = {f"/dev/nvidia{devicespecs.card_minor(c)}" for c in cards}
            specs = devicespecs.device_specs(cards, self.cfg.dev_root, self.cfg.host_dev_root)
            nodes = [cdi.DeviceNode(s.container_path, s.host_path) for s in specs if s.container_path not in card_paths]
            driver = devicespecs.driver_mounts(self.cfg.driver_root)
            mounts += _mounts(driver)
            if driver and self.cfg.ld_library_path:
                env["LD_LIBRARY_PATH"] = devicespecs.LD_LIBRARY_PATH
        if self.cfg.stub_driver_env:
            env.update(stub_driver_env(cards))
        cs = claimstr.decode(p.claim)
        if cs.mode == "mps":
            pipe = mps.pipe_dir(self.cfg.mps_root, cs.devices[0].uuid)
            why = mps.check_ready(self.cfg.mps_root, cs.devices[0].uuid)
            if why is not None:
                raise PluginError(f"the MPS control daemon of card {cs.devices[0].uuid} is not ready: {why} "
                                  f"({self.cfg.mps_root})")
            env.update(mps.client_env(cs))
            mounts.append(cdi.Mount(str(pipe), keys.CONTAINER_MPS_DIR))
        return nodes, mounts, env

    def _card_nodes(self, p: PreparedClaim) -> dict[str, list[cdi.DeviceNode]]:
        if not self.cfg.device_specs:
            return {x.device: [] for x in p.devices}
        host = Path(self.cfg.host_dev_root or self.cfg.dev_root)
        return {x.device: [cdi.DeviceNode(f"/dev/nvidia{devicespecs.card_minor(x.card)}",
                                          str(host / f"nvidia{devicespecs.card_minor(x.card)}"))]
                for x in p.devices}

    def _mig_spec(self, p: PreparedClaim) -> dict[str, Any]:
        """The CDI spec of a MIG claim (module docstring)."""
        host = Path(self.cfg.host_dev_root or self.cfg.dev_root)
        devices = {x.device: [cdi.DeviceNode(n, str(host / n.removeprefix("/dev/"))) for n in x.edits.device_nodes]
                   if self.cfg.device_specs else [] for x in p.mig}
        env = {"NVIDIA_VISIBLE_DEVICES": ",".join(x.uuid for x in p.mig), "KVGPU_DRA_CLAIM": f"{p.namespace}/{p.name}"}
        nodes: list[cdi.DeviceNode] = []
        mounts: list[cdi.Mount] = []
        if self.cfg.device_specs:
            specs = devicespecs.mig_device_specs((), self.cfg.dev_root, self.cfg.host_dev_root)
            nodes = [cdi.DeviceNode(s.container_path, s.host_path) for s in specs]
            driver = devicespecs.driver_mounts(self.cfg.driver_root)
            mounts = _mounts(driver)
            if driver and self.cfg.ld_library_path:
                env["LD_LIBRARY_PATH"] = devicespecs.LD_LIBRARY_PATH
        return cdi.claim_spec(p.uid, devices, nodes, mounts, env)

    def _write_mig(self, p: PreparedClaim, d: Path) -> Prepared:
        _atomic_json(self.spec_path(p.uid), self._mig_spec(p), 0o644)
        devs = tuple(ClaimSource(x.requests, x.pool, x.device, None, (cdi.device_id(p.uid, x.device),)) for x in p.mig)
        _checkpoint(d, p, devs, mig=True)
        return Prepared(p.uid, "", devs, mig=True)

    def write(self, p: PreparedClaim) -> Prepared:
        """Write the claim's files (claim file, region, CDI spec, checkpoint). Raises ``OSError``,
        :class:`PluginError` (shim not installed, MPS daemon missing), ``ValueError`` (a name CDI
        refuses); nothing is left behind on failure."""
        d = self.dir(p.uid)
        try:
            d.mkdir(parents=True, exist_ok=True)
            if p.mig:
                self.cdi_dir.mkdir(parents=True, exist_ok=True)
                return self._write_mig(p, d)
            claim = d / CLAIM_FILE
            tmp = d / (CLAIM_FILE + ".tmp")
            tmp.write_text(p.claim)
            tmp.chmod(0o444)
            os.replace(tmp, claim)
            region = d / REGION_DIR
            region.mkdir(exist_ok=True)
            region.chmod(0o777)
            nodes, mounts, env = self._edits(p, d)
            spec = cdi.claim_spec(p.uid, self._card_nodes(p), nodes, mounts, env)
            self.cdi_dir.mkdir(parents=True, exist_ok=True)
            _atomic_json(self.spec_path(p.uid), spec, 0o644)
            devs = tuple(ClaimSource(x.requests, x.pool, x.device, x.share_id, (cdi.device_id(p.uid, x.device),))
                         for x in p.devices)
            _checkpoint(d, p, devs)
        except BaseException:
            self.remove(p.uid)
            raise
        return Prepared(p.uid, p.claim, devs)

    def remove(self, uid: str) -> bool:
        """Remove the claim's CDI spec, then its directory; returns whether anything was there."""
        spec, d = self.spec_path(uid), self.dir(uid)
        found = spec.exists() or d.exists()
        spec.unlink(missing_ok=True)
        if d.exists():
            shutil.rmtree(d)
        return found

    def prepared_uids(self) -> list[str]:
        """The claim UIDs with files on the node."""
        return sorted(p.name for p in self.root.iterdir()) if self.root.is_dir() else []


def _checkpoint(d: Path, p: PreparedClaim, devs: tuple[ClaimSource, ...], mig: bool = False) -> None:
    """Write the claim's checkpoint (mode 0600: the agent's own record, trusted by its loops)."""
    _atomic_json(d / CHECKPOINT, {"uid": p.uid, "claim": p.claim, "namespace": p.namespace, "name": p.name,
                                  "mig": mig,
                                  "devices": [{"requests": list(x.requests), "pool": x.pool,
                                               "device": x.device, "shareID": x.share_id,
                                               "cdi": list(x.cdi_ids)} for x in devs]}, 0o600)


def _atomic_json(path: Path, obj: Any, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.chmod(mode)
    os.replace(tmp, path)
