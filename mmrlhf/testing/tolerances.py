"""Log-prob agreement bounds between a rollout engine and a float32 trainer-side forward (no heavy imports: the CLI
reads them at start-up). Both sides compute the log-probs of the distribution the engine sampled from: logits at
the sampling temperature, vision special tokens excluded (docs/rollout.md)."""

from __future__ import annotations

# bf16 engine vs fp32 forward on the tiny models (every family; text, one image, two images, video; 4 samples x 24
# tokens): max |d logprob| measured 0.0045 at temperature 1 and 0.012 at temperature 0.7 (bf16 logit noise is
# divided by the temperature, so this bound loosens as 1/T). A vision-layout error moves it by ~0.07; a trainer
# step the engine has not received (testing.weights.perturb_) by 0.09 to 0.2.
DEFAULT_TOLERANCE = 0.02

# fp32 engine vs fp32 forward (vLLM on the CPU or the transformers engine vs ActorVL), temperature 1 and 0.7, every
# case: measured <= 1.4e-6. Exception until the actor's Qwen2.5-VL video positions follow vLLM's rule (hardening
# issue, item 6): text after a Qwen2.5-VL video differs by ~1e-3.
FP32_TOLERANCE = 1e-4


# Float32 results of the same math summed in another order (two FSDP halves vs one batch, packed vs padded rows,
# chunked vs whole): each entry's error is a few ulps of the LARGEST terms summed into it, not of the entry itself,
# so an entry near zero can be off by far more than its own magnitude times rtol. The slack is therefore sized by the
# tensor's scale (its largest magnitude), never an absolute constant: measured, one of 65,536 entries of a merger
# gradient was off by 1.4e-6 (1.5e-3 of its own value) on an AVX-512 machine and not on an AVX2 one.
SUMMATION_RTOL = 1e-4  # per entry, of its own magnitude
SUMMATION_SCALE_TOL = 1e-5  # per entry, of the tensor's largest magnitude (measured worst: 6e-7, FSDP halves)


def scale_atol(expected, scale_tol: float = SUMMATION_SCALE_TOL) -> float:
    """An absolute tolerance for comparing with ``expected``: ``scale_tol`` of its largest magnitude (a tiny floor
    for an all-zero tensor, so that zeros must stay exact zeros up to denormals)."""
    return scale_tol * max(float(expected.detach().abs().max()) if expected.numel() else 0.0, 1e-30)


def assert_close_at_scale(actual, expected, *, rtol: float = SUMMATION_RTOL,
                          scale_tol: float = SUMMATION_SCALE_TOL, msg: str | None = None) -> None:
    """``|actual - expected| <= rtol * |expected| + scale_tol * max|expected|`` element-wise (``torch.testing``'s
    check with a scale-sized ``atol``), for float32 tensors computed in different summation orders."""
    import torch

    torch.testing.assert_close(actual, expected, rtol=rtol, atol=scale_atol(expected, scale_tol), msg=msg)


def close_at_scale(actual, expected, *, rtol: float = SUMMATION_RTOL, scale_tol: float = SUMMATION_SCALE_TOL) -> bool:
    """Whether :func:`assert_close_at_scale` would pass (for controls that must fail it)."""
    try:
        assert_close_at_scale(actual, expected, rtol=rtol, scale_tol=scale_tol)
    except AssertionError:
        return False
    return True


def assert_no_farther(actual, baseline, reference, *, factor: float = 2.0,
                      scale_tol: float = SUMMATION_SCALE_TOL, msg: str | None = None) -> None:
    """``actual`` is at most ``factor`` times as far from ``reference`` (the same math in float64) as ``baseline``
    (the trusted float32 path) is, plus ``scale_tol`` of the reference's scale: for two float32 paths whose own noise
    is larger than a summation-order bound (on CUDA, cuDNN runs float32 convolutions in TF32 by default: every
    float32 path of a vision tower is ~3e-4 of its scale from float64, measured on an H200)."""
    ref = reference.double()
    if not ref.numel():
        return
    top = max(float(ref.abs().max()), 1e-30)
    err = float((actual.double() - ref).abs().max())
    base = float((baseline.double() - ref).abs().max())
    bound = factor * base + scale_tol * top
    if err > bound:
        raise AssertionError(f"{msg + ': ' if msg else ''}max |actual - float64| {err:.3g} > {bound:.3g} ({factor:g} x "
                             f"the baseline's {base:.3g} + {scale_tol:g} of the scale {top:.3g})")
