"""The Conv3d patch-embedding check (:mod:`mmrlhf.testing.patch_embed`, the doctor's ``environment/patch_embed``
row): the matmul form computes what the conv computes (the yardstick, and the known workaround), and the warning
logic on injected timings (no timing is asserted)."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.testing import doctor
from mmrlhf.testing import patch_embed as pe
from mmrlhf.testing.tolerances import assert_close_at_scale, close_at_scale


def test_the_matmul_form_equals_the_conv():
    g = torch.Generator().manual_seed(0)
    shape = pe.QWEN2_5_VL_7B
    weight = torch.randn(64, shape.in_channels, shape.temporal, shape.patch, shape.patch,
                         generator=g)  # [E, C, T, P, P]
    bias = torch.randn(64, generator=g)
    x = torch.randn(37, shape.patch_numel, generator=g)  # [N, C*T*P*P]
    for b in (None, bias):  # Qwen2 / 2.5-VL have no bias, Qwen3-VL has one
        conv = pe.patch_embed_conv(weight, x, b)  # [N, E]
        assert conv.shape == (37, 64)
        # fp32 sums of 1,176 products in two kernels' orders: sized by the output's scale
        assert_close_at_scale(pe.patch_embed_as_linear(weight, x, b), conv, rtol=1e-5, scale_tol=1e-6)
    # control: the patch flattened in another order (time before channels) is a different product
    swapped = weight.transpose(1, 2).contiguous()  # [E, T, C, P, P]
    assert not close_at_scale(pe.patch_embed_as_linear(swapped, x), pe.patch_embed_conv(weight, x),
                              rtol=1e-5, scale_tol=1e-6)


def test_a_timing_has_what_the_warning_reads():
    t = pe.patch_embed_timing("cpu", torch.float32, patches=8, repeats=1, rounds=1,
                              shape=pe.PatchEmbedShape(embed_dim=32))
    assert t["conv_ms"] > 0 and t["matmul_ms"] > 0 and t["ratio"] == t["conv_ms"] / t["matmul_ms"]
    assert (t["device"], t["dtype"], t["patches"], t["cudnn"]) == ("cpu", "float32", 8, None)
    assert t["shape"]["embed_dim"] == 32 and t["torch"] == torch.__version__


def _timing(ratio: float, *, device="cuda:0", torch_version="2.11.0+cu130", cudnn=91300) -> dict:
    return {"conv_ms": 0.2 * ratio, "matmul_ms": 0.2, "ratio": ratio, "device": device, "dtype": "bfloat16",
            "patches": 4096, "shape": vars(pe.QWEN2_5_VL_7B), "torch": torch_version, "cudnn": cudnn}


@pytest.mark.parametrize("version,cudnn,slow", [
    ("2.9.0+cu128", 91002, True), ("2.9.0", 91500, True), ("2.9.0", 90700, False),  # 2.9.0: any cuDNN >= 9.8
    ("2.9.1+cu128", 91002, True), ("2.9.1+cu130", 91300, True), ("2.9.1", 91500, False),  # 2.9.1: 9.8-9.14
    ("2.8.0+cu128", 91002, False), ("2.10.0", 91002, False), ("2.11.0+cu130", 91300, False),
    ("2.9.1", None, False), ("not a version", 91002, False),
])
def test_known_slow_releases(version, cudnn, slow):
    assert pe.known_slow_release(version, cudnn) is slow


def test_the_warning_names_the_release_and_the_fix():
    assert pe.patch_embed_warning(_timing(26.0)) is None  # cuDNN's bf16 conv on an H200 (measured)
    assert pe.patch_embed_warning(_timing(50.0, device="cpu", cudnn=None)) is None  # the CPU: information only
    known = pe.patch_embed_warning(_timing(5678.0, torch_version="2.9.1+cu128", cudnn=91002))
    assert "torch 2.9.1+cu128, cuDNN 9.10.2" in known and "5678.0x" in known
    assert "upgrade torch to 2.10 or later" in known and "#174051" in known
    other = pe.patch_embed_warning(_timing(pe.SLOW_RATIO))  # a new release, slow all the same
    assert "torch 2.11.0+cu130, cuDNN 9.13.0" in other and "upgrade torch" in other and "2.10" not in other


@pytest.mark.parametrize("ratio,status", [(26.0, "pass"), (5678.0, "fail")])  # cuDNN on / off, measured
def test_the_doctor_row_follows_the_warning(monkeypatch, ratio, status):
    monkeypatch.setattr(pe, "patch_embed_timing", lambda *a, **k: _timing(ratio, torch_version="2.9.0", cudnn=91002))
    row = doctor.check_patch_embed(torch.device("cuda", 0))
    assert (row.name, row.status, row.value, row.unit) == ("environment/patch_embed", status, ratio,
                                                            "x conv / matmul time")
    assert ("upgrade torch to 2.10" in row.reason) is (status == "fail") and row.details["cudnn"] == 91002
