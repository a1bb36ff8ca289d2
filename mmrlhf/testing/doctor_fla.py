"""The doctor's ``fla`` rows: flash-linear-attention's variable-length kernel against the torch rule, in bf16 on
CUDA (the rule itself with its gradients and a control, then a tiny Qwen3.5's grouped forward and backward). Both
passing records the proof that lets ``model.linear_attention_kernel: auto`` pick fla on this machine
(:mod:`mmrlhf.testing.doctor_proofs`).

Bounds: fla's own tests hold its chunked kernels to an RMSE ratio of 0.005-0.02 against a float32 reference in
float16; bf16 keeps 3 fewer mantissa bits (8x coarser rounding), hence :data:`RULE_ERROR_BOUND`. The model row
measures the torch rule's own bf16 error as its yardstick. Neither bound has run on a GPU yet: the rows report every
number, and a failing row leaves ``auto`` on the torch rule, the exact path.
"""

from __future__ import annotations

import inspect
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

from mmrlhf.testing.doctor_proofs import guarded, settle_proof
from mmrlhf.testing.doctor_types import CheckResult, DoctorOptions, cuda_device

RULE_ERROR_BOUND = 0.05  # RMSE(fla - float32 torch rule) / RMSE(float32 torch rule), per tensor, bf16 inputs
RULE_TENSORS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")  # outputs, final states, gradients
GRAD_FACTOR = 3.0  # the model row: the varlen kernel's gradient error at most this many times the torch rule's ...
GRAD_FLOOR = 0.01  # ... in the same dtype, plus this (a ratio of norms)
FLA_DTYPE = "bfloat16"  # what the fla rows compute in: what a GPU run's layers hand the kernel


def error_ratio(got: Any, ref: Any) -> float:
    """RMSE of ``got - ref`` over the RMSE of ``ref`` (float64; 0 for two empty tensors): an error sized by the
    tensor's scale, as fla's own tests measure their kernels."""
    ref64, got64 = ref.double(), got.double()
    if not ref64.numel():
        return 0.0
    scale = float(ref64.pow(2).mean().sqrt())
    return float((got64 - ref64).pow(2).mean().sqrt()) / max(scale, 1e-30)


# ---- the rule ---------------------------------------------------------------------------------------------------
def rule_case(device: Any, dtype: Any, *, lengths: Sequence[int] = (23, 64, 90), heads: int = 2, dk: int = 32,
              dv: int = 32, seed: int = 0) -> dict[str, Any]:
    """Inputs of a variable-length delta rule as the layers hand them over (:func:`mmrlhf.models.gated_delta.
    varlen_forward`): q, k, v, beta in ``dtype``, the log decay g and the initial states float32 (the layer computes
    them so), a slow decay (0.9-0.99 per token) so the initial states reach every token, and the upstream gradients
    of the outputs and final states. Values are rounded to ``dtype`` here, so a float32 reference sees the same."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lengths), len(lengths)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    case = {
        "q": normal(1, t, heads, dk).to(dtype), "k": normal(1, t, heads, dk).to(dtype),
        "v": normal(1, t, heads, dv).to(dtype),
        "g": torch.rand(1, t, heads, generator=gen).mul(0.1).add(0.01).neg().log1p(),  # log of 0.89-0.99
        "beta": torch.rand(1, t, heads, generator=gen).to(dtype),
        "h0": normal(n, heads, dk, dv).mul(0.5), "do": normal(1, t, heads, dv), "dht": normal(n, heads, dk, dv),
        "cu": torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.long),
    }
    return {k: v.to(device) for k, v in case.items()}


def run_rule(rule: Callable[..., Any], case: Mapping[str, Any], dtype: Any) -> dict[str, Any]:
    """``rule``'s outputs, final states and the gradients of ``sum(o * do) + sum(ht * dht)`` to its inputs (the
    initial states' included: what a grouped forward sends back to its shared prompt), all as float32. q, k, v,
    beta enter in ``dtype``; g and the initial states in float32."""
    import torch

    low = {"q", "k", "v", "beta"}
    leaves = {name: case[name].detach().to(dtype if name in low else torch.float32).clone().requires_grad_()
              for name in ("q", "k", "v", "g", "beta", "h0")}
    out, final = rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], case["cu"], leaves["h0"],
                      True)
    ((out.float() * case["do"]).sum() + (final.float() * case["dht"]).sum()).backward()
    grads = {f"d{name}": (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).float()
             for name, leaf in leaves.items()}
    return {"o": out.detach().float(), "ht": final.detach().float(), **grads}


def torch_reference_rule() -> Callable[..., Any]:
    """The varlen rule computed by the torch chunked delta rule of transformers' Qwen3.5 module, one sequence at a
    time from its own initial state. Unwrapped: where fla is installed transformers routes that function to fla
    itself, and the reference must be the torch computation."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5

    chunked = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)

    def rule(q, k, v, g, beta, cu_seqlens, initial_state, output_final_state):
        outs, finals = [], []
        for i in range(len(cu_seqlens) - 1):
            a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            out, final = chunked(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                                 initial_state=None if initial_state is None else initial_state[i:i + 1],
                                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals) if output_final_state else None

    return rule


def without_initial_states(rule: Callable[..., Any]) -> Callable[..., Any]:
    """The control: ``rule`` with every sequence started from zero (a kernel that lost the prompts' states)."""
    def cold(q, k, v, g, beta, cu_seqlens, initial_state, output_final_state):
        return rule(q, k, v, g, beta, cu_seqlens, None, output_final_state)

    return cold


def rule_errors(got: Mapping[str, Any], ref: Mapping[str, Any]) -> dict[str, float]:
    """Per tensor of :data:`RULE_TENSORS`, :func:`error_ratio` of ``got`` against ``ref``."""
    return {name: error_ratio(got[name], ref[name]) for name in RULE_TENSORS}


def rule_verdict(errors: Mapping[str, float], control: Mapping[str, float],
                 bound: float = RULE_ERROR_BOUND) -> tuple[str, float, str]:
    """``(status, worst error, reason)``: every tensor within ``bound`` of the reference, and the control (initial
    states dropped) beyond it, so that the comparison could see a kernel that loses them."""
    worst = max(errors, key=lambda k: errors[k])
    control_worst = max(control.values())
    ok = errors[worst] <= bound < control_worst
    parts = ", ".join(f"{k} {v:.2g}" for k, v in errors.items())
    reason = (f"error / scale against the float32 torch rule: {parts}; worst {worst} {errors[worst]:.2g} must be <= "
              f"{bound}; control (initial states dropped) {control_worst:.2g} must exceed it")
    return ("pass" if ok else "fail"), errors[worst], reason


def rule_row(rule: Callable[..., Any], device: Any, dtype: Any, *, name: str = "fla/rule") -> CheckResult:
    """The varlen ``rule`` in ``dtype`` on ``device`` against the torch rule in float32, with its control."""
    import torch

    t0 = time.perf_counter()
    case = rule_case(device, dtype)
    ref = run_rule(torch_reference_rule(), case, torch.float32)
    errors = rule_errors(run_rule(rule, case, dtype), ref)
    control = rule_errors(run_rule(without_initial_states(rule), case, dtype), ref)
    status, worst, reason = rule_verdict(errors, control)
    lengths = torch.diff(case["cu"]).tolist()
    return CheckResult(name, status, worst, "worst error / scale", f"{len(lengths)} sequences {lengths}, {dtype}: "
                       + reason, time.perf_counter() - t0, details={"errors": errors, "control": control})


# ---- a tiny Qwen3.5 ---------------------------------------------------------------------------------------------
@contextmanager
def torch_rule_in_layers(model: Any) -> Iterator[None]:
    """The gather path of ``model``'s recurrent layers through the torch delta rule (unwrapped, see
    :func:`torch_reference_rule`) inside the block, whatever transformers wired."""
    from mmrlhf.models.linear_attention import recurrent_layers

    modules = {sys.modules[type(layer).__module__] for layer in recurrent_layers(model)}
    saved = {m: m.torch_chunk_gated_delta_rule for m in modules}
    try:
        for m, fn in saved.items():
            m.torch_chunk_gated_delta_rule = inspect.unwrap(fn)
        yield
    finally:
        for m, fn in saved.items():
            m.torch_chunk_gated_delta_rule = fn


def grouped_batch(processor: Any, adapter: Any, *, seed: int = 0) -> Any:
    """Two text prompts with three responses each of uneven lengths (5 to 40 tokens), grouped: every response
    continues its prompt's recurrent state (:func:`mmrlhf.experience.grouped.build_grouped_samples`)."""
    import torch

    from mmrlhf.experience.grouped import build_grouped_samples

    tok = processor.tokenizer
    words = [i for i in tok("the red square is blue and the green circle is yellow")["input_ids"]]
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for p, length in enumerate((20, 33)):
        prompt = [words[int(i)] for i in torch.randint(len(words), (length,), generator=gen)]
        for r in range(3):
            prompts.append(prompt)
            responses.append([words[int(i)] for i in torch.randint(len(words), (5 + 12 * r + 3 * p,), generator=gen)])
    return build_grouped_samples(prompts, responses, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                                 adapter=adapter)


def slow_decay_(model: Any) -> None:
    """Make ``model``'s Gated DeltaNet layers forget slowly (per-token decay ~0.97-0.75), so a response's tokens
    depend on its prompt's recurrent state: the tiny model's random decay forgets it at the next token."""
    import torch

    from mmrlhf.models.linear_attention import recurrent_layers

    with torch.no_grad():
        for layer in recurrent_layers(model):
            layer.A_log.copy_(torch.linspace(0.02, 0.2, layer.A_log.numel()).log())


def _score(model: Any, adapter: Any, built: Any, kernel: str, dtype: Any) -> tuple[Any, Any]:
    """Log-probs [B, A] of ``built`` and every parameter's gradient of their sum (flattened, float64)."""
    import torch

    from mmrlhf.models.actor import ActorVL

    compute = None if dtype in (None, torch.float32) else dtype  # float32: the parameters' own dtype, no autocast
    actor = ActorVL(model, adapter, compute_dtype=compute, linear_attention_kernel=kernel)
    model.zero_grad(set_to_none=True)
    log_probs = actor(built.samples, vision_extra=built.vision_extra).log_probs
    (log_probs * _response_mask(built.samples, log_probs.shape).to(log_probs.device)).sum().backward()
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None]).cpu()
    model.zero_grad(set_to_none=True)
    return log_probs.detach().float().cpu(), grads


def _response_mask(samples: Any, shape: Sequence[int]) -> Any:
    """[B, A] bool: the positions of ``samples``' response tokens (and policy tokens only, where a mask says so)."""
    import torch

    mask = torch.arange(shape[1])[None, :] < samples.response_length.cpu()[:, None]
    if samples.action_mask is not None:
        mask = mask & samples.action_mask.cpu().bool()[:, : shape[1]]
    return mask


def model_verdict(lp_error: float, grad_error: float, grad_yardstick: float, *, lp_bound: float) -> tuple[str, str]:
    """``(status, reason)`` of the model row: log-probs within ``lp_bound`` of the float32 torch path, gradients no
    farther from it than :data:`GRAD_FACTOR` times the torch path's own in the same dtype plus :data:`GRAD_FLOOR`."""
    grad_bound = GRAD_FACTOR * grad_yardstick + GRAD_FLOOR
    ok = lp_error <= lp_bound and grad_error <= grad_bound
    reason = (f"max |dlogp| {lp_error:.2g} (must be <= {lp_bound}); gradient error / norm {grad_error:.2g} (must be "
              f"<= {GRAD_FACTOR:g} x the torch rule's {grad_yardstick:.2g} + {GRAD_FLOOR})")
    return ("pass" if ok else "fail"), reason


def model_row(kernel: str, device: Any, dtype: Any, *, name: str = "fla/qwen3_5") -> CheckResult:
    """A tiny Qwen3.5 (slow decay) scoring grouped samples with ``kernel`` (``model.linear_attention_kernel``) in
    ``dtype``, against the gather path with the torch rule in float32; the same gather path in ``dtype`` is the
    yardstick of the dtype's own error. Log-probs and gradients (the prompts' through their responses' initial
    states)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.models.delta_kernels import rule_runs, varlen_rule
    from mmrlhf.testing.tiny_models import tiny_model_dir
    from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE, FP32_TOLERANCE

    t0 = time.perf_counter()
    rule = varlen_rule(kernel)
    if rule is None or not rule_runs(rule, dtype):
        return CheckResult(name, "fail", reason=f"{kernel!r} is no variable-length kernel for {dtype}: the grouped "
                           "forward would not run it")
    path = tiny_model_dir("qwen3_5")
    processor, adapter = AutoProcessor.from_pretrained(path), get_adapter(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).to(device)
    slow_decay_(model)
    built = grouped_batch(processor, adapter)  # on the host: the actor moves it to its device
    with torch_rule_in_layers(model):
        ref_lp, ref_g = _score(model, adapter, built, "torch", None)
        yard_lp, yard_g = _score(model, adapter, built, "torch", dtype)
    got_lp, got_g = _score(model, adapter, built, kernel, dtype)
    mask = _response_mask(built.samples, ref_lp.shape)
    lp_error = float((got_lp - ref_lp)[mask].abs().max())
    grad_error, yardstick = error_ratio(got_g, ref_g), error_ratio(yard_g, ref_g)
    lp_bound = FP32_TOLERANCE if dtype == torch.float32 else DEFAULT_TOLERANCE
    status, reason = model_verdict(lp_error, grad_error, yardstick, lp_bound=lp_bound)
    yard_lp_error = float((yard_lp - ref_lp)[mask].abs().max())
    return CheckResult(name, status, lp_error, "max |dlogp|",
                       f"{kernel} vs the torch rule in float32, {built.samples.batch_size} responses of "
                       f"{built.samples.num_rows} shared prompts, {dtype}: {reason}; the torch rule in {dtype}: "
                       f"max |dlogp| {yard_lp_error:.2g}", time.perf_counter() - t0,
                       details={"lp_error": lp_error, "grad_error": grad_error, "grad_yardstick": yardstick,
                                "yardstick_lp_error": yard_lp_error})


def check_fla(opts: DoctorOptions) -> list[CheckResult]:
    """``fla`` rows: flash-linear-attention's varlen kernel against the torch rule (the rule itself, then a tiny
    Qwen3.5's grouped forward and backward) in bf16 on CUDA; both passing records the proof that lets
    ``model.linear_attention_kernel: auto`` pick it on this machine (:mod:`mmrlhf.proofs`)."""
    from mmrlhf.models import delta_kernels

    names = ("fla/rule", "fla/qwen3_5")
    why = ("no CUDA device (fla's kernels are Triton programs for CUDA; the CPU uses the torch rule)"
           if not cuda_device(opts.device) else
           "flash-linear-attention not installed (pip install flash-linear-attention)"
           if not delta_kernels.fla_available() else None)
    if why is not None:
        return [CheckResult(n, "skip", reason=why) for n in names]
    import torch

    from mmrlhf.devices import resolve_device

    device, dtype = resolve_device(opts.device), getattr(torch, FLA_DTYPE)
    rows = [guarded("fla/rule", lambda: rule_row(delta_kernels.fla_rule(), device, dtype)),
            guarded("fla/qwen3_5", lambda: model_row("fla", device, dtype))]
    rows.append(settle_proof(delta_kernels.FLA_CHECK, delta_kernels.fla_fingerprint(device), rows))
    delta_kernels.auto_kernel.cache_clear()  # this process's auto now reads the new record
    return rows
