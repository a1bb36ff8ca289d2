"""The shipped recipes (examples/*.yaml) as tests see them: what each header says, and ONE "tiny" override that
turns any recipe into a 2-step CPU run on a tiny model of the recipe's family and synthetic data prepared by the
recipe's own preparation command.

(A uniquely named module, not conftest.py, so that other test folders' helpers cannot shadow it.)
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mmrlhf.config import build_config
from mmrlhf.testing import published_data
from mmrlhf.testing.tiny_models import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# Every recipe that trains on prepared data; the toy recipe makes its prompts on the fly (tests/trainer covers it).
RECIPES = sorted(p for p in EXAMPLES.glob("*.yaml") if "prompt_data" in p.read_text())

# The model family of a recipe, read from its model.pretrain path (longest match first: "Qwen2.5-VL" before "Qwen2-VL").
# The MoE names first: "Qwen3-VL-30B-A3B" is not the dense "Qwen3-VL".
FAMILIES = (("qwen2.5-vl", "qwen2_5_vl"), ("qwen2-vl", "qwen2_vl"), ("qwen3-vl-30b-a3b", "qwen3_vl_moe"),
            ("qwen3-vl", "qwen3_vl"), ("qwen3.5-35b-a3b", "qwen3_5_moe"), ("qwen3.5", "qwen3_5"))

# Converter name -> (synthetic published data, the --media-root it needs relative to its folder, or None).
SYNTHETIC = {
    "geometry3k": (published_data.geometry3k, None),
    "clevr_count": (published_data.clevr_count, "images"),
    "multi_image": (published_data.multi_image, None),
    "video_qa": (published_data.video_qa, "videos"),
    # two rows: a V* row and a ThinkLite row, so the one step of 2 prompts holds both labels
    "deepeyes": (functools.partial(published_data.deepeyes, n=2), None),
    "open_vqa": (published_data.open_vqa, None),
}


@dataclass
class Recipe:
    path: Path
    data: dict  # the YAML as written
    header: str  # the leading comment block

    @classmethod
    def load(cls, path: Path) -> "Recipe":
        text = path.read_text()
        header = "".join(f"{line}\n" for line in itertools.takewhile(lambda s: s.startswith("#"), text.splitlines()))
        return cls(path, yaml.safe_load(text), header)

    @property
    def family(self) -> str:
        name = Path(self.data["model"]["pretrain"]).name.lower()
        for marker, family in FAMILIES:
            if marker in name:
                return family
        raise AssertionError(f"{self.path.name}: no known family in model.pretrain {name!r}")

    def prepare_commands(self) -> list[list[str]]:
        """The ``python -m mmrlhf.data.prepare ...`` commands of the header (continuation lines joined)."""
        joined = re.sub(r"\\\n#\s*", " ", self.header)
        return [shlex.split(m.group(1)) for m in re.finditer(r"python -m mmrlhf\.data\.prepare (.+)", joined)]


def train_commands(recipe: Recipe) -> list[list[str]]:
    """The ``mmrlhf train examples/...`` commands of the header (continuation lines joined), as arguments from the
    recipe's path on."""
    joined = re.sub(r"\\\n#\s*", " ", recipe.header)
    return [shlex.split(m.group(1)) for m in re.finditer(r"mmrlhf train (examples/\S+\.yaml.*)", joined)]


def prepare_synthetic(recipe: Recipe, folder: Path) -> Path:
    """Synthetic published data for the recipe's converter, converted by the header's first preparation command
    (its converter and options; input, output and media root point into ``folder``)."""
    from mmrlhf.data.prepare.__main__ import build_parser
    from mmrlhf.data.prepare import prepare

    args = build_parser().parse_args(recipe.prepare_commands()[0])
    make, media = SYNTHETIC[args.name]
    source, _ = make(folder / "raw")
    out = folder / "prepared" / "train.jsonl"
    prepare(args.name, [str(source)], str(out), images=args.images, on_bad_record=args.on_bad_record,
            media_root=str(source.parent / media) if media else None)
    return out


def tiny_config(recipe: Recipe, data_file: Path, out: Path, **reward_urls: dict[str, Any]):
    """The recipe with its model, data, sizes and engine shrunk to a 2-step CPU run; everything else (rewards,
    recipes, algorithm, packing, vision knobs) stays as the recipe has it. ``reward_urls``: remote source name ->
    fields to replace (the URL of a server started by the test)."""
    data = json.loads(json.dumps(recipe.data))  # a deep copy
    n = 1 if data["rollout"].get("n_samples_per_prompt", 8) == 1 else 2
    samples = 2 * n
    agent = data.get("agent") or {}
    tools = bool(agent.get("tools") or agent.get("environment"))  # tool-using recipes: the tool-calling tokenizer
    data["model"].update(pretrain=str(tiny_model_dir(recipe.family, tools=tools)), dtype="float32")
    if data["model"].get("teacher"):  # distillation: another tiny model of the family (same tokenizer) teaches
        data["model"]["teacher"] = str(tiny_model_dir(recipe.family, seed=1, tools=tools))
    data["data"].update(prompt_data=[str(data_file)], eval_data=[])
    # transformers engine: vLLM's start-up (~20 s a run on this CPU) buys nothing for a recipe test.
    data["rollout"].update(engine="transformers", dtype="auto", n_samples_per_prompt=n, max_new_tokens=4,
                           micro_rollout_batch_size=samples, seed=1)
    # ... which routes as the trainer does: routing replay needs vLLM (tests/launch runs it on the MoE families)
    data["rollout"]["routing_replay"] = "none"
    data["trainer"].update(rollout_batch_size=2, train_batch_size=samples, micro_train_batch_size=samples,
                           max_steps=2, warmup_steps=0, eval_steps=0, save_steps=100, report_steps=0,
                           output_dir=str(out), progress_bar=False, tensorboard=False, seed=3)
    # one process: a multi-GPU recipe's host offload is a launch choice (refused with the transformers engine), and
    # its engine's tensor parallelism needs the GPUs it names
    data.setdefault("distributed", {}).update(offload="none")
    data["rollout"]["tensor_parallel_size"] = 1
    if data.get("agent"):  # the trajectory budgets follow the shrunk engine: whole-trajectory context, per-turn cap
        data["agent"].update(max_context_tokens=None, max_new_tokens_per_turn=None)
    if data.get("algorithm", {}).get("dynamic_sampling"):
        data["algorithm"]["dynamic_sampling_max_extra_rounds"] = 0  # a random model's groups rarely vary
    for name, fields in reward_urls.items():
        data["reward"]["label_map"][name].update(fields)
    return build_config(data)


def launches(recipe: Recipe) -> list[tuple[int, int, list[str]]]:
    """The header's train commands as (ranks, GPUs per node, overrides): torchrun's ``--nnodes`` x
    ``--nproc-per-node`` (1 x 1 for a plain ``mmrlhf train``) and the ``key=value`` words after the recipe."""
    joined = re.sub(r"\\\n#\s*", " ", recipe.header)
    out = []
    for m in re.finditer(r"(torchrun [^\n]*?)?mmrlhf train (examples/\S+\.yaml[^\n]*)", joined):
        words = shlex.split(m.group(1) or "")
        per_node = int(words[words.index("--nproc-per-node") + 1]) if "--nproc-per-node" in words else 1
        nodes = int(words[words.index("--nnodes") + 1]) if "--nnodes" in words else 1
        out.append((nodes * per_node, per_node, [a for a in shlex.split(m.group(2))[1:] if "=" in a]))
    return out


def plan_command(recipe: Recipe) -> list[str] | None:
    """The header's ``mmrlhf config show ... --plan ...`` command, as arguments after ``mmrlhf`` (None: none)."""
    joined = re.sub(r"\\\n#\s*", " ", recipe.header)
    found = re.search(r"mmrlhf (config show examples/\S+\.yaml [^\n]*--plan[^\n]*)", joined)
    return shlex.split(found.group(1).split("`")[0]) if found else None


def remote_sources(recipe: Recipe) -> list[str]:
    return [name for name, src in recipe.data.get("reward", {}).get("label_map", {}).items()
            if isinstance(src, dict) and src.get("type") == "remote"]


def judge_sources(recipe: Recipe) -> list[str]:
    return [name for name, src in recipe.data.get("reward", {}).get("label_map", {}).items()
            if isinstance(src, dict) and src.get("type") == "judge"]


def tiny_judge_fields(model: Path) -> dict[str, Any]:
    """A recipe's judge, as the tiny override runs it: in process on the tiny keyword judge at ``model`` (CPU
    engine settings), its rubric, scoring and verdicts as the recipe has them."""
    return {"backend": "vllm", "model": str(model), "url": "", "max_tokens": 1, "sleep": False,
            "chat_template_kwargs": {},
            "engine": {"max_model_len": 2048, "dtype": "float32", "limit_mm_per_prompt": {"image": 1}}}


def server_command(recipe: Recipe) -> list[str]:
    """The first ``mmrlhf serve-reward`` command of the header, as arguments after ``serve-reward``."""
    joined = re.sub(r"\\\n#\s*", " ", recipe.header)
    found = re.search(r"mmrlhf serve-reward (.+)", joined)
    assert found, f"{recipe.path.name}: a recipe with a remote source must say how to start the server"
    return shlex.split(found.group(1))
