"""``mmrlhf config show RECIPE --plan``: the memory plan on the command line (text and JSON), and its errors."""

from __future__ import annotations

import json

import pytest

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


LARGE = [("examples/grpo_geometry3k_qwen2_5_vl_32b.yaml", "qwen2_5_vl_32b", 8),
         ("examples/grpo_geometry3k_qwen2_5_vl_72b.yaml", "qwen2_5_vl_72b", 16)]
RECIPES = {"32B recipe": LARGE[0][0], "72B recipe": LARGE[1][0]}


def _gpu_md() -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "docs" / "gpu.md").read_text()


def _section(doc: str) -> str:
    return doc.split("## The plan at 32B and 72B", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("recipe,shape,ranks", LARGE, ids=["32b", "72b"])
def test_docs_gpu_md_shows_the_32b_and_72b_plans_as_the_command_prints_them(recipe, shape, ranks, capsys):
    """docs/gpu.md's section "The plan at 32B and 72B" holds these commands' output: regenerate it on a change."""
    argv = ["config", "show", recipe, "--plan", "--shape", shape, "--gpu-memory", "80", "--ranks", str(ranks),
            "--gpus-per-node", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out.rstrip("\n")
    assert out.count("fits in 80.0") == 1 and "\nfits: " in out  # one GPU kind, and the plan fits
    assert f"$ mmrlhf {' '.join(argv)}\n{out}\n```" in _section(_gpu_md()), "regenerate the block in docs/gpu.md"


def test_docs_gpu_md_table_of_large_launches_is_the_plans():
    """Every row of the section's table (recipe, shape, overrides, GPUs) against the plan computed now, and the
    sentence on 72B over 32 GPUs."""
    import re

    from mmrlhf.config import load_config
    from mmrlhf.models.memory.advice import memory_plan
    from mmrlhf.models.memory.plan import GIB

    section = _section(_gpu_md())
    rows = [r for r in section.splitlines() if r.startswith("| Qwen")]
    assert len(rows) >= 8
    for row in rows:
        model, overrides, gpus, peak, host = [c.strip() for c in row.strip("|").split("|")]
        recipe = RECIPES[next(k for k in RECIPES if k in model)]
        shape = re.search(r"--shape (\w+)", model).group(1) if "--shape" in model else LARGE[recipe == LARGE[1][0]][1]
        words = re.findall(r"[\w.]+=\w+", overrides)
        plan = memory_plan(load_config(recipe, words), shape=shape, gpu_gib=80, ranks=int(gpus), gpus_per_node=8,
                           suggest=False)
        shown = f"{plan.launch.peak / GIB:.1f} GiB"
        assert peak == (shown if plan.launch.fits else f"does not fit ({shown})"), row
        assert host == (f"{plan.launch.host_per_node / GIB:.1f} GiB" if plan.launch.host_per_node else "none"), row
    # 72B: on 32 GPUs without offload it fits, its float32 states halved; on 16 it does not, and the plan says why
    config = load_config(LARGE[1][0], ["distributed.offload=none"])
    four = memory_plan(config, shape="qwen2_5_vl_72b", gpu_gib=80, ranks=32, gpus_per_node=8, suggest=False)
    two = memory_plan(config, shape="qwen2_5_vl_72b", gpu_gib=80, ranks=16, gpus_per_node=8)
    states = sum(v for k, v in four.launch.gpus[0].phases["step"].items() if k.startswith("actor "))
    assert four.launch.fits and not two.launch.fits
    assert (f"{four.launch.peak / GIB:.1f} GiB per GPU at the update, its 67.9 GiB of float32 states halved to "
            f"{states / GIB:.1f} GiB per rank") in " ".join(section.split())
    assert f"does not ({two.launch.peak / GIB:.1f} GiB at the update)" in " ".join(section.split())
    assert {"distributed.offload=params", "model.lora.rank=64"} <= {o for f in two.fixes for o in f.overrides}


def test_gpus_per_node_places_the_engine_groups_and_goes_with_plan(capsys):
    argv = ["config", "show", LARGE[0][0], "--plan", "--shape", "qwen2_5_vl_32b", "--gpu-memory", "80", "--ranks", "8",
            "--json"]
    assert main([*argv, "--gpus-per-node", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert main([*argv, "--gpus-per-node", "2"]) == 0  # engines of 4 GPUs cannot sit on nodes of 2
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and any("one node of 2 GPUs" in p for p in data["launch"]["problems"])
    assert data["verdict"].startswith("does not start")
    assert main(["config", "show", RECIPE, "--gpus-per-node", "8"]) == 2
    assert "--plan" in capsys.readouterr().err
