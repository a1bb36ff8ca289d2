"""How far training moved a model, and how two runs' updates agree: compares saved Hugging Face model folders.

    python -m mmrlhf.testing.updates INITIAL_MODEL RUN_A_MODEL [RUN_B_MODEL]

prints, for each run, the fraction of the initial weights' elements that changed, and with two runs how their
updates (run - initial) agree. Used to measure the bf16-compute check of docs/gpu.md ("fp32 master weights") and by
its test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved model folder (all ``*.safetensors`` shards), as float64 on the CPU."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        out.update({k: v.double() for k, v in load_file(str(shard)).items()})
    if not out:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return out


def moved_fraction(initial: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> float:
    """Fraction of all weight elements whose value differs from the initial one."""
    _check_names(initial, trained)
    moved = sum(int((trained[k] != v).sum()) for k, v in initial.items())
    return moved / sum(v.numel() for v in initial.values())


def update_agreement(initial: dict[str, torch.Tensor], a: dict[str, torch.Tensor],
                     b: dict[str, torch.Tensor]) -> dict[str, float]:
    """How update ``a - initial`` agrees with the reference update ``b - initial``, over all weights: ``rel_error``
    = ||du_a - du_b|| / ||du_b|| (scale-free: 0 is equal, 1 is as far as no update at all), ``cosine`` and
    ``norm_ratio`` = ||du_a|| / ||du_b||."""
    _check_names(initial, a)
    _check_names(initial, b)
    da = torch.cat([(a[k] - v).flatten() for k, v in initial.items()])
    db = torch.cat([(b[k] - v).flatten() for k, v in initial.items()])
    nb = float(db.norm())
    if nb == 0.0:
        raise ValueError("the reference run did not move at all: nothing to compare against")
    return {"rel_error": float((da - db).norm()) / nb,
            "cosine": float(torch.dot(da, db)) / max(float(da.norm()) * nb, 1e-300),
            "norm_ratio": float(da.norm()) / nb}


def _check_names(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> None:
    if x.keys() != y.keys():
        raise ValueError(f"the folders hold different tensors: {sorted(set(x) ^ set(y))[:5]}")


def main(argv: list[str]) -> None:
    if len(argv) not in (2, 3):
        raise SystemExit(__doc__)
    initial = load_weights(argv[0])
    runs = [load_weights(f) for f in argv[1:]]
    for folder, run in zip(argv[1:], runs):
        print(f"{folder}: {moved_fraction(initial, run):.4%} of the weights moved")
    if len(runs) == 2:
        agree = update_agreement(initial, runs[0], runs[1])
        print("update of the first vs the second: " + ", ".join(f"{k} {v:.4g}" for k, v in agree.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
