"""Multi-turn rollouts in the experience maker's row form: the tool contexts a step's trajectories start from, and
:class:`~mmrlhf.experience.rollout.Rollout` rows built from the turn loop's trajectories.

A trajectory is one row: its FIRST prompt (shared by its group, so the shared-prompt layout still encodes it once)
and everything after it as the response, with a policy mask (1 policy token, 0 observation token), the engine's
log-probs on policy tokens, the vision tensors of the prompt's images followed by every tool image in order, and
(``rollout.routing_replay``) the experts the engine routed each token to, stitched turn by turn.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from mmrlhf.agents.loop_types import AgentResult, EncodedImage
from mmrlhf.agents.types import ToolContext
from mmrlhf.experience.rollout import Rollout


def tool_contexts(batch: Any, n: int, data_processor: Any, adapter: Any, *, prompts: Sequence[Any],
                  images: Sequence[Any] | None, videos: Sequence[Any] | None, references: Sequence[Any] | None,
                  labels: Sequence[Any] | None, record_ids: Sequence[Any] | None,
                  base_dirs: Sequence[str | None] | None,
                  extras: Sequence[Mapping[str, Any]] | None = None) -> list[ToolContext]:
    """One :class:`ToolContext` per kept prompt of ``batch``: its record (the standard fields and its ``extras``,
    the row's other columns), the folder its relative paths are relative to, its ORIGINAL images at full
    resolution (a zoom tool crops these), the sizes the model saw them at (from their ``grid_thw``) and the
    family's box space. Per prompt, not per sample: its trajectories share the context's record."""
    contexts = []
    patch = adapter.patch_size
    for k in range(0, len(batch), n):
        i = batch.all_positions[k]  # the prompt's position in the caller's lists
        raw = list(images[i]) if images is not None and images[i] is not None else []
        base = base_dirs[i] if base_dirs is not None else None
        originals = data_processor.original_images(raw, base) if raw else []
        grid = batch.all_vision_inputs[k].get("image_grid_thw")
        sizes = [] if grid is None else [(int(g[2]) * patch, int(g[1]) * patch) for g in grid.reshape(-1, 3)]
        record = {"prompt": prompts[i], "reference": references[i] if references is not None else None,
                  "label": labels[i] if labels is not None else None,
                  "id": record_ids[i] if record_ids is not None else None}
        if extras is not None and extras[i]:
            record = with_extras(record, extras[i], batch.describe_sample(k))
        contexts.append(ToolContext(record=record, images=originals,
                                    videos=list(videos[i]) if videos is not None and videos[i] else [],
                                    model_image_sizes=sizes, box_space=adapter.box_space, data_dir=base))
    return contexts


def with_extras(standard: dict[str, Any], extras: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The standard fields and the extra columns in one dict. An extra column named like a standard field (a
    ``label`` column while ``data.label_key`` reads another) would hide one of the two from the tools: refused."""
    clash = sorted(set(standard) & set(extras))
    if clash:
        raise ValueError(f"{where}: column(s) {clash} clash with the standard record field(s) of that name that "
                         f"tools read ({', '.join(standard)}); rename the column(s) or point data.*_key at them")
    return {**standard, **extras}


def encoder_of(data_processor: Any):
    """The turn loop's image encoder over the data processor (:meth:`process_images`)."""
    def encode(images: list[Any]) -> list[EncodedImage]:
        return [EncodedImage(e["image"], e["pixel_values"], e["image_grid_thw"], e["tokens"])
                for e in data_processor.process_images(images)]

    return encode


def rows_from_trajectories(batch: Any, result: AgentResult) -> Rollout:
    """The trajectories as rows (sample order), with the batch's per-sample text, labels and references."""
    cols: dict[str, list] = {name: [] for name in (
        "sample_index", "group", "prompt_ids", "response_ids", "engine_logprobs", "finished", "vision", "prompts",
        "labels", "references", "images", "record_ids", "policy_masks", "trajectories")}
    for s in result.samples:
        k = s.sample_index
        cols["sample_index"].append(k)
        cols["group"].append(s.group)
        cols["prompt_ids"].append(list(s.prompt_ids))
        cols["response_ids"].append(list(s.response_ids))
        cols["engine_logprobs"].append(s.engine_logprobs)
        cols["finished"].append(s.finished)
        cols["vision"].append(s.vision)
        cols["prompts"].append(batch.all_prompts[k])
        cols["labels"].append(batch.all_labels[k])
        cols["references"].append(batch.all_references[k])
        cols["images"].append(list(s.images))
        cols["record_ids"].append(batch.all_record_ids[k])
        cols["policy_masks"].append(list(s.policy_mask))
        cols["trajectories"].append(s.trajectory)
    routed = [s.routed_experts for s in result.samples]
    if any(r is not None for r in routed):  # rollout.routing_replay: every trajectory's, or a bug
        if any(r is None for r in routed):
            raise ValueError("routed experts came back for some trajectories only")
        cols["routed_experts"] = routed
    versions = [s.token_versions for s in result.samples]
    if any(v is not None for v in versions):  # rollout.partial: every trajectory's, or a bug
        if any(v is None for v in versions):
            raise ValueError("token versions came back for some trajectories only")
        cols["token_versions"] = versions
    return Rollout(**cols)


def zero_out_of_budget(result: Any, trajectories: Sequence[Any]) -> None:
    """``agent.out_of_budget_reward: zero``: the trajectories a budget ended (max turns, context, a turn's length
    limit) get reward 0 (they stay in the step, valid, so GRPO still learns that running out is worse than
    answering); counted as ``reward/out_of_budget_zeroed/count``. In place on the reward result."""
    import torch

    over = torch.tensor([t.out_of_budget for t in trajectories], dtype=torch.bool)  # [N]
    result.rewards[over] = 0.0
    result.metrics["reward/out_of_budget_zeroed/count"] = float(over.sum())


def tool_bonus_at(step: int, bonus: float, steps: int | None) -> float:
    """``agent.tool_bonus`` of the step that trains after ``step`` finished steps: ``bonus`` annealed linearly over
    ``steps`` steps (``bonus`` at step 0, exactly 0 from ``step >= steps`` on, so exactly the first ``steps`` steps
    pay one); ``steps`` None: ``bonus`` at every step."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if steps is None or bonus == 0:
        return float(bonus)
    if steps < 1:
        raise ValueError(f"tool_bonus_steps must be >= 1 or None, got {steps}")
    return float(bonus) * max(0.0, 1.0 - step / steps)


def tool_bonus_rewards(trajectories: Sequence[Any], value: float) -> Any:
    """``[N]`` float32: ``value`` for each trajectory that made at least one tool call answered without an error (a
    call whose tool raised, timed out or returned a refused image does not count; a malformed block never became a
    call) and then answered, 0 for the others. A trajectory a budget ended (``out_of_budget``: it called until
    ``max_turns``, ran out of context) gets nothing: paying it would teach calling instead of answering. The
    exploration term of ``agent.tool_bonus`` (docs/agents.md, "Interaction collapse")."""
    import torch

    from mmrlhf.rewards.agent import successful_tool_calls

    called = torch.tensor([successful_tool_calls(t) > 0 and not t.out_of_budget for t in trajectories],
                          dtype=torch.bool)  # [N]
    return called.float() * float(value)
