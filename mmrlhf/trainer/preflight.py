"""Refusals that the config and the data already tell, made before any model loads.

Why here and not where the refusal used to come from: loading a 30B policy (and its reference, engine and critic)
takes minutes and a machine's memory, only for a check that needed nothing of it. Each check reads what it needs
without weights: the family from ``model.family`` or the model's ``config.json``
(:func:`~mmrlhf.models.adapters.family_class`), the LoRA targets on an empty meta-device copy of the model
(:func:`~mmrlhf.models.lora.planned_targets`), the videos of the prompt data from its rows, undecoded. The late
checks stay where they were as the last guard (a generated record past the first step's, a caller that builds its
models itself).

- **Video prompts in a multi-turn run of a family that sends them as text** (Qwen3-VL and the families built on
  it, :attr:`~mmrlhf.models.adapters.FamilyAdapter.video_token_prompts`): an agent's turns go to the engine as token
  ids, and such a family's video expansion interleaves timestamp text with the pads. The prompt files are scanned
  (training, and evaluation when it runs); a generator's records of the first step (and of the evaluation) are made
  and looked at. The error names the record, the field and the file.
- **LoRA targets** (``model.lora.*``): the targets resolved on the empty model, so a routed-expert MLP, a name that
  matches nothing, the output head or an empty vision part is refused naming the key before the weights load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping

from mmrlhf.config.schema import MMRLHFConfig
from mmrlhf.data.errors import DataError


def check_before_models(config: MMRLHFConfig) -> None:
    """Every check of this module; raises ``ValueError`` naming the key (and the record) of the first refusal."""
    check_lora_targets(config)
    check_agent_videos(config)
    check_scoring_placement(config)


def check_scoring_placement(config: MMRLHFConfig) -> None:
    """Refuse ``distributed.scoring=trainer`` in the Ray mode with a setting its trainer-made experiences cannot
    serve (:func:`~mmrlhf.models.ray_placement.experiences_on_trainers`: vLLM's own LoRA)."""
    if config.distributed.backend == "ray":
        from mmrlhf.models.ray_placement import experiences_on_trainers

        experiences_on_trainers(config)


def check_lora_targets(config: MMRLHFConfig) -> list[str]:
    """The layers LoRA will adapt (empty without LoRA, or where the model has no local ``config.json`` to read: its
    load reports that itself); raises as :func:`~mmrlhf.models.lora.resolve_target_modules` does."""
    m = config.model
    if not m.lora.rank or not (Path(m.pretrain) / "config.json").is_file():
        return []
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.models.lora import planned_targets

    return planned_targets(m.pretrain, get_adapter(m.pretrain, m.family), m.lora,
                           trust_remote_code=m.trust_remote_code)


def check_agent_videos(config: MMRLHFConfig) -> None:
    """Refuse a prompt with videos in a multi-turn (agent) run of a family whose video prompts go to the engine as
    text only, naming the first such record."""
    from mmrlhf.models.adapters import family_class

    m, d, t = config.model, config.data, config.trainer
    cls = family_class(m.pretrain, m.family) if config.agent.enabled and m.pretrain else None
    if cls is None or cls.video_token_prompts:
        return
    read = f" (model.family=auto: read from {m.pretrain}/config.json)" if m.family == "auto" else ""
    why = (f"an agent run (agent.tools / agent.environment) sends the engine token ids, and the {cls.family} family"
           f"{read} can send prompts with videos only as text (their expansion interleaves timestamps with the pads): "
           "use image inputs for this family's agent runs, or leave this data to a single-turn run")
    evaluates = bool(t.eval_steps)
    for path in [*d.prompt_data, *(d.eval_data if evaluates else [])]:
        _refuse_videos(_file_rows(path), d, why, path)
    if d.generator:
        splits = [("train", t.rollout_batch_size)] + ([("eval", d.eval_size)] if evaluates and not d.eval_data else [])
        for split, count in splits:
            _refuse_videos(_generated_rows(d, split, count), d, why, f"{d.generator}[{split}]")


def _file_rows(path: str) -> Iterator[tuple[int, dict]]:
    """``(row number, row)`` of one prompt source, as read (undecoded)."""
    from mmrlhf.data.datasets import read_rows

    return enumerate(read_rows(path))


def _generated_rows(d: Any, split: str, count: int) -> Iterator[tuple[int, dict]]:
    """``(index, row)`` of a generator's first ``count`` records of ``split`` (the records a fresh run reads first);
    a row that is no dict is left to the prompt stream, which names it."""
    from mmrlhf.data.stream import GeneratedPrompts

    source = GeneratedPrompts(d.generator, d, split=split, options=d.generator_options)
    for i in range(count):
        row = source.fn(i, split=split, **source.options)
        if isinstance(row, Mapping):
            yield i, dict(row)


def _refuse_videos(rows: Iterator[tuple[int, dict]], columns: Any, why: str, source: str) -> None:
    from mmrlhf.data.records import row_videos

    for index, row in rows:
        if row_videos(row, columns):
            field = columns.video_key if row.get(columns.video_key) else columns.prompt_key  # a column, or parts
            raise DataError(why, reason="video_in_agent_run", index=index, record_id=row.get(columns.id_key),
                            field=field, file=source)
