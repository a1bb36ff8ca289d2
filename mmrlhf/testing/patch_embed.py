"""Is this machine's Conv3d vision patch embedding slow? A timing of the Qwen-VL patch embedding against the same
product written as a matmul, and the warning the doctor (and the trainer benchmark) print when the conv lags.

Why: the Qwen-VL vision towers embed each patch with an ``nn.Conv3d`` whose stride equals its kernel (Qwen2.5-VL-7B:
3 -> 1280 channels, kernel 2 x 14 x 14), and some torch releases run that convolution on a slow path on CUDA:

* torch 2.9.0 stopped using cuDNN for 3-D convolutions in bfloat16 / float16 with a kernel larger than 1 when cuDNN
  is 9.8 or newer (pytorch/pytorch#163581, a workaround for wrong bf16 results, #163539), falling back to ATen's
  own kernels (``slow_conv_dilated3d`` / vol2col): 4x slower 3-D convs under AMP (#166122), 10-20x slower vision
  forwards of Qwen3-VL (#174051), and far more memory;
* torch 2.9.1 limits that to cuDNN 9.8-9.14 (a runtime version check), but its wheels ship cuDNN 9.10 (CUDA 12.8)
  or 9.13 (CUDA 13.0): still the slow path unless a cuDNN >= 9.15 is installed beside it;
* #174051 reports it resolved from torch 2.10 on. The project allows ``torch>=2.6``, so 2.9.x installs are possible.

It is CUDA / cuDNN specific and hits half precision only; float32 and the CPU are not affected by it (the CPU's own
Conv3d is slower than its matmul at this shape too, a fact of its kernels, not of a torch release: quoted as
information, never as a failure). With stride == kernel the convolution IS a linear layer on flattened patches
(:func:`patch_embed_as_linear`, checked equal in the tests), which is the workaround other frameworks applied and the
yardstick here: a healthy cuDNN conv costs a few times to a few tens of times that matmul, the slow path thousands of
times (:data:`SLOW_RATIO`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

# conv time / matmul time at or above which the doctor warns on an accelerator. Measured on an H200, torch 2.11.0 with
# cuDNN 9.19, 4,096 and 16,384 patches: bf16 26x with cuDNN (0.55 ms against 0.021 ms: cuDNN's conv is slower than
# the GEMM at this shape, but the call is short), 5,700-7,900x with cuDNN switched off as the affected releases do
# (121 ms per 4,096 patches); float32 1.3-1.5x with cuDNN, 450x without. 100 sits between, with margins of 4x and 57x.
SLOW_RATIO = 100.0


@dataclass(frozen=True)
class PatchEmbedShape:
    """A Qwen-VL vision patch embedding: ``Conv3d(in_channels, embed_dim, kernel=stride=(temporal, patch, patch))``."""

    in_channels: int = 3
    temporal: int = 2  # temporal_patch_size
    patch: int = 14  # patch_size
    embed_dim: int = 1280  # Qwen2.5-VL-7B's vision width

    @property
    def patch_numel(self) -> int:
        """Values per flattened patch (C * T * P * P)."""
        return self.in_channels * self.temporal * self.patch * self.patch


QWEN2_5_VL_7B = PatchEmbedShape()


def patch_embed_conv(weight: torch.Tensor, patches: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The model's way: patches [N, C*T*P*P] viewed as [N, C, T, P, P], ``conv3d`` with weight [E, C, T, P, P] and
    stride == kernel -> [N, E]."""
    e, c, t, p, q = weight.shape
    out = F.conv3d(patches.view(-1, c, t, p, q), weight, bias, stride=(t, p, q))  # [N, E, 1, 1, 1]
    return out.view(-1, e)


def patch_embed_as_linear(weight: torch.Tensor, patches: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product as one matmul: patches [N, C*T*P*P] @ weight.view(E, C*T*P*P).T -> [N, E]. Each output is
    the sum over one patch's values times one filter (the kernel covers the patch exactly, once), in the order the
    patch is flattened (channels, then time, rows, columns), which is the weight's own memory order."""
    return F.linear(patches, weight.reshape(weight.shape[0], -1), bias)


def _seconds_per_call(fn: Any, device: torch.device, repeats: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean time of ``repeats`` back-to-back calls (device work waited for)."""
    def sync() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times)


def patch_embed_timing(device: torch.device | str, dtype: torch.dtype, *, patches: int = 4096, repeats: int = 10,
                       rounds: int = 3, shape: PatchEmbedShape = QWEN2_5_VL_7B, seed: int = 0) -> dict[str, Any]:
    """Forward time of the patch embedding of ``patches`` patches (no bias, as in Qwen2 / Qwen2.5-VL) on ``device``
    in ``dtype``: as the model's ``conv3d`` and as the equivalent matmul, each warmed up first (cuDNN's algorithm
    choice, the allocator). Returns ``conv_ms``, ``matmul_ms``, ``ratio`` (conv / matmul) and what produced them:
    ``device``, ``dtype``, ``patches``, ``shape``, ``torch``, ``cudnn`` (None without cuDNN or off CUDA)."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape.embed_dim, shape.in_channels, shape.temporal, shape.patch, shape.patch,
                          generator=g) * 0.02).to(device, dtype)  # [E, C, T, P, P]
    x = torch.randn(patches, shape.patch_numel, generator=g).to(device, dtype)  # [N, C*T*P*P]
    timings = {}
    with torch.no_grad():
        for name, fn in (("conv", patch_embed_conv), ("matmul", patch_embed_as_linear)):
            call = lambda fn=fn: fn(weight, x)  # noqa: E731
            _seconds_per_call(call, device, repeats=1, rounds=2)  # warm-up
            timings[name] = _seconds_per_call(call, device, repeats=repeats, rounds=rounds) * 1e3
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" and torch.backends.cudnn.is_available() else None
    return {"conv_ms": timings["conv"], "matmul_ms": timings["matmul"], "ratio": timings["conv"] / timings["matmul"],
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "patches": patches,
            "shape": asdict(shape), "torch": torch.__version__, "cudnn": cudnn}


def _cudnn_text(version: int | None) -> str:
    """cuDNN's integer version (9.x: major * 10000 + minor * 100 + patch) as ``9.10.2``."""
    if version is None:
        return "none"
    return f"{version // 10000}.{version % 10000 // 100}.{version % 100}" if version >= 90000 else str(version)


def known_slow_release(torch_version: str, cudnn: int | None) -> bool:
    """Whether this torch + cuDNN is a release known to bypass cuDNN for half-precision 3-D convolutions: 2.9.0 with
    cuDNN >= 9.8, 2.9.1 (and later 2.9 patches) with cuDNN 9.8-9.14 (the module docstring has the sources)."""
    parts = torch_version.split("+")[0].split(".")
    try:
        major, minor, micro = int(parts[0]), int(parts[1]), int("".join(ch for ch in parts[2] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return False
    if (major, minor) != (2, 9) or cudnn is None or cudnn < 90800:
        return False
    return micro == 0 or cudnn < 91500


def patch_embed_warning(timing: dict[str, Any], *, slow_ratio: float = SLOW_RATIO) -> str | None:
    """The warning for a :func:`patch_embed_timing` result (None: nothing to say). An accelerator whose conv takes
    ``slow_ratio`` times the matmul's time or more gets the numbers, the torch (and cuDNN) version and the fix;
    a known slow release is named as such. The CPU is never warned about (see the module docstring)."""
    if timing["device"].startswith("cpu") or timing["ratio"] < slow_ratio:
        return None
    s, t = timing["shape"], timing
    what = (f"the vision patch embedding (Conv3d {s['in_channels']}->{s['embed_dim']}, kernel {s['temporal']}x"
            f"{s['patch']}x{s['patch']}, {t['patches']} patches, {t['dtype']}) takes {t['conv_ms']:.3g} ms on "
            f"{t['device']}, {t['ratio']:.1f}x the {t['matmul_ms']:.3g} ms of the same product as a matmul (torch "
            f"{t['torch']}, cuDNN {_cudnn_text(t['cudnn'])})")
    if known_slow_release(timing["torch"], timing["cudnn"]):
        return (f"{what}: this torch release bypasses cuDNN for half-precision 3-D convolutions (pytorch/pytorch"
                "#166122, #174051; 10-20x slower vision forwards): upgrade torch to 2.10 or later (on 2.9.1, a "
                "cuDNN >= 9.15 also restores it)")
    return (f"{what}: vision forwards will be slow; upgrade torch (the 2.9 releases are known to do this, pytorch/"
            "pytorch#174051) or its cuDNN")
