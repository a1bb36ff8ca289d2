"""``mmrlhf doctor`` on the CPU: the command runs its CPU-possible checks, skips the GPU-only ones with the reason,
prints the table and writes it to doctor.md / doctor.json; a check that breaks is a failed row and a non-zero exit,
never a crash that hides the other rows."""

from __future__ import annotations

import json

import pytest

from mmrlhf.cli import main
from mmrlhf.rollout.vllm_setup import cpu_has_bf16_kernels
from mmrlhf.testing import doctor, doctor_bench


@pytest.mark.skipif(doctor.cuda_device("auto"), reason="checks the CPU behaviour (a GPU runs sleep on)")
def test_doctor_on_the_cpu_runs_the_cpu_checks_and_writes_the_table(tmp_path, capsys):
    rc = main(["doctor", "--device", "cpu", "--quick", "--engine", "transformers", "--steps", "2",
               "--only", "environment", "toy_run", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = {r["name"]: r for r in json.loads((tmp_path / "doctor.json").read_text())["results"]}
    assert list(rows) == ["environment", "environment/patch_embed", "toy_run/sleep_off", "toy_run/sleep_on"]
    assert rows["environment"]["status"] == "pass" and "no CUDA device" in rows["environment"]["reason"]
    # how this CPU's engine runs linear-attention layers
    assert ("bf16 through vLLM's kernels" if cpu_has_bf16_kernels() else "a bf16 engine serves float32") in \
        rows["environment"]["reason"]
    # and the trainer's (model.linear_attention_kernel: auto is the gather path without CUDA)
    assert "the trainer's linear-attention layers (Qwen3.5): torch (each sequence gathered into a padded batch" in \
        rows["environment"]["reason"]
    embed = rows["environment/patch_embed"]  # the CPU's ratio is information, never a failure
    assert embed["status"] == "pass" and embed["value"] > 0 and embed["details"]["device"] == "cpu"
    off = rows["toy_run/sleep_off"]
    assert off["status"] == "pass" and off["value"] > 0 and off["unit"] == "s/step"
    assert "2/2 steps on the transformers engine" in off["reason"]
    assert rows["toy_run/sleep_on"]["status"] == "skip" and "no CUDA device" in rows["toy_run/sleep_on"]["reason"]
    table = (tmp_path / "doctor.md").read_text()
    assert "| toy_run/sleep_off | pass |" in table and "| toy_run/sleep_on | skip |" in table
    assert "3 passed, 0 failed, 1 skipped" in table and "PASS  toy_run/sleep_off" in printed


def test_a_broken_check_is_a_failed_row_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(opts):
        raise RuntimeError("no NCCL here")

    def fine(opts):
        return [doctor.CheckResult("fine", "pass", 1.0, "x")]

    monkeypatch.setattr(doctor, "CHECKS", {"broken": broken, "fine": fine})
    results = doctor.run_checks(doctor.DoctorOptions(device="cpu"))
    assert [(r.name, r.status) for r in results] == [("broken", "fail"), ("fine", "pass")]
    assert "RuntimeError: no NCCL here" in results[0].reason
    with pytest.raises(ValueError, match="unknown check.*valid"):
        doctor.run_checks(doctor.DoctorOptions(), only=["nccl"])
    md, _ = doctor.write_report(results, tmp_path, {"device": "cpu"})
    assert "1 passed, 1 failed, 0 skipped" in md.read_text()


@pytest.mark.skipif(doctor.cuda_device("auto"), reason="checks the behaviour without an accelerator")
def test_gpu_without_an_accelerator_is_an_error_line(tmp_path, capsys):
    assert main(["doctor", "--gpu", "--only", "environment", "--out", str(tmp_path)]) == 2
    assert "error: --gpu, but torch finds no accelerator" in capsys.readouterr().err
    assert not (tmp_path / "doctor.json").exists()


@pytest.mark.slow
def test_the_trainer_benchmark_row_runs_the_small_shape_on_the_cpu(tmp_path):
    opts = doctor.DoctorOptions(device="cpu", quick=True, workdir=str(tmp_path))
    from mmrlhf.rollout.vllm_setup import cpu_has_bf16_kernels

    args = doctor_bench.trainer_bench_args(opts)
    assert args[:1] == ["--quick"]
    # float32 on a CPU that would emulate bf16 (a smoke run of the code, 8x faster there)
    assert (args[-2:] == ["--dtype", "float32"]) == (not cpu_has_bf16_kernels()), args
    [row] = doctor_bench._bench_trainer(opts)
    assert row.status == "pass", row.reason
    assert "of a" in row.reason and "TFLOP/s matmul" in row.reason  # the headline: best row's share of a matmul
    table = row.details["tables"][0]
    col = {name: i for i, name in enumerate(table["columns"])}
    layouts = {(r[col["group"]], r[col["layout"]], r[col["kernel"]]) for r in table["rows"]}
    assert layouts == {("img448", "padded", "dense"), ("img448", "packed", "dense"), ("img448", "grouped", "dense")}
    assert all(r[col["s"]] is not None and r[col["s"]] > 0 for r in table["rows"])  # every layout ran and was timed


@pytest.mark.vllm
@pytest.mark.skipif(doctor.cuda_device("auto"), reason="the CPU's float32 engine rows")
def test_doctor_engine_rows_cover_the_current_families_one_after_another(tmp_path, capsys):
    """``--family``: a row per family, each engine released before the next (a model with experts after a dense one
    once found vLLM's parallel groups built without an expert group); float32 on the CPU agrees to noise."""
    pytest.importorskip("vllm")
    rc = main(["doctor", "--device", "cpu", "--quick", "--only", "engine_logprobs", "--family", "qwen3_5",
               "qwen3_5_moe", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = {r["name"]: r for r in json.loads((tmp_path / "doctor.json").read_text())["results"]}
    assert list(rows) == ["engine_logprobs/qwen3_5", "engine_logprobs/qwen3_5_moe"]
    for row in rows.values():
        assert row["status"] == "pass" and row["value"] < 1e-4, row  # float32 engine vs float32 forward
