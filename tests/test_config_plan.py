"""``mmrlhf config show RECIPE --plan``: the memory plan on the command line (text and JSON), and its errors."""

from __future__ import annotations

import json

from mmrlhf.cli import main
from mmrlhf.testing.memory_check import compare_peak, memory_statistic

RECIPE = "examples/grpo_geometry3k_qwen2_5_vl_7b.yaml"


def test_plan_prints_the_tables_and_the_verdict(capsys):
    assert main(["config", "show", RECIPE, "--plan", "--shape", "qwen2_5_vl_7b", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    for text in ("parameters   8.29 B", "generate", "update", "actor AdamW moments (float32)", "torchrun over 4 GPUs",
                 "does not fit", "model.lora.rank=64"):
        assert text in out, text


def test_plan_overrides_change_it_and_json_round_trips(capsys):
    assert main(["config", "show", RECIPE, "model.lora.rank=64", "--plan", "--shape", "qwen2_5_vl_7b",
                 "--gpu-memory", "80", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["parameters"]["lora"] > 0 and data["verdict"].startswith("fits")
    assert json.loads(json.dumps(data)) == data


def test_plan_errors_name_the_key(capsys):
    assert main(["config", "show", "--plan"]) == 2
    assert "model.pretrain" in capsys.readouterr().err
    assert main(["config", "show", RECIPE, "--shape", "qwen2_5_vl_7b"]) == 2  # --shape without --plan
    assert "--plan" in capsys.readouterr().err


def test_the_doctor_row_compares_generically_and_skips_on_the_cpu():
    import torch

    from mmrlhf.testing import doctor

    assert memory_statistic(torch.device("cpu")) is None
    rows = doctor.check_memory_plan(doctor.DoctorOptions(device="cpu"))
    assert [(r.name, r.status) for r in rows] == [("memory_plan", "skip")] and "cpu" in rows[0].reason
    assert compare_peak(100, 110) == ("pass", 1.1)
    assert compare_peak(100, 130)[0] == "fail" and compare_peak(100, 70)[0] == "fail"  # controls, both sides


def test_docs_gpu_md_shows_the_plan_as_the_command_prints_it(capsys):
    """docs/gpu.md's 7B section is this command's output: a change to the plan must regenerate it."""
    from pathlib import Path

    argv = ["config", "show", RECIPE, "--plan", "--shape", "qwen2_5_vl_7b", "--gpu-memory", "80"]
    assert main(argv) == 0
    out = capsys.readouterr().out.rstrip("\n")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "gpu.md").read_text()
    assert f"$ mmrlhf {' '.join(argv)}\n{out}\n```" in doc, "regenerate the block in docs/gpu.md from the command"
