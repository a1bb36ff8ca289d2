"""The policy update: the loss named in the config (through ``POLICY_LOSSES``), its aggregation, the KL loss term,
the top-k distillation loss term, the entropy bonus, rollout correction and high-entropy token selection, over
shuffled mini-batches.

Before the update, :func:`prepare_policy_targets` decides per token, over the WHOLE step (both need batch-wide
statistics): which tokens the loss sees (the reward engine's mask, minus tokens rollout correction masks, minus
low-entropy tokens when ``high_entropy_top_p < 1``) and the importance weight of each (rollout correction). The
update then only reads them.

Gradient accumulation is exact: every micro-batch loss is divided by the mini-batch's aggregation count (tokens
for ``token-mean``, responses for the sequence modes), so the accumulated gradient equals the gradient of the
mini-batch's loss however it is split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from mmrlhf.algorithms.distill_topk import topk_kl, topk_metrics
from mmrlhf.algorithms.entropy import high_entropy_mask, masked_scores
from mmrlhf.algorithms.kl import kl_loss
from mmrlhf.algorithms.losses import policy_loss
from mmrlhf.algorithms.masked import agg_count, agg_loss
from mmrlhf.algorithms.moe import load_balancing_loss
from mmrlhf.algorithms.rollout_correction import rollout_correction
from mmrlhf.experience.batching import TrainItem, collate, group_keys
from mmrlhf.experience.costs import forward_layout, item_costs
from mmrlhf.experience.rescoring import ItemLayout, score_items, score_items_with_entropy
from mmrlhf.experience.rollout import ScoringDistribution
from mmrlhf.models.placement import to_device
from mmrlhf.parallel.micro_batches import Budget
from mmrlhf.parallel.world import World, single
from mmrlhf.trainer.minibatch import GuardedStepper, run_minibatches


@dataclass(frozen=True)
class PolicyUpdateSettings:
    """Plain values of the ``algorithm`` and ``trainer`` keys the policy update reads."""

    train_batch_size: int = 128
    micro_batch_size: int = 4
    ppo_epochs: int = 1
    loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_params: Mapping[str, Any] = field(default_factory=dict)  # dual_clip and policy_loss_params
    agg: str = "token-mean"
    norm_len: int | None = None
    entropy_coef: float = 0.0
    moe_aux_loss_coef: float = 0.0  # algorithm.moe_aux_loss_coef: the routers' load-balancing loss weight
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    # algorithm.distill_loss_coef / distill_loss_kl: the top-k distillation loss term (mmrlhf.algorithms.distill_topk)
    distill_loss_coef: float = 0.0
    distill_loss_kl: str = "forward"
    high_entropy_top_p: float = 1.0
    correction: str = "none"  # rollout correction: none | tis | mis
    correction_level: str = "token"
    correction_cap: float = 2.0
    correction_lower: float = 0.0
    packing: bool = False
    shared_prompt: bool = False  # grouped layout (each prompt once per row); wins over packing
    shared_prompt_max_tokens: int | None = None
    # trainer.max_tokens_per_micro_batch: None splits by micro_batch_size, "auto" or a budget by cost
    # (mmrlhf.parallel.micro_batches)
    max_tokens_per_micro_batch: Budget = None
    shuffle: bool = True


def _stack(items: Sequence[TrainItem], name: str) -> torch.Tensor:
    """[N, A] right-padded stack of one per-token field over items."""
    width = max(it.token["loss_mask"].shape[0] for it in items)
    return torch.stack([torch.nn.functional.pad(it.token[name].float(), (0, width - it.token[name].shape[0]))
                        for it in items])


@torch.no_grad()
def prepare_policy_targets(items: Sequence[TrainItem], s: PolicyUpdateSettings,
                           world: World | None = None) -> tuple[list[TrainItem], dict[str, float]]:
    """The items with their ``policy_loss_mask`` (the tokens the policy loss sees: ``loss_mask``, the valid response
    tokens, narrowed by rollout correction and entropy selection; not the multi-turn ``TrainItem.policy_mask`` of
    policy vs observation tokens, which ``loss_mask`` already holds) and ``is_weight`` (per token), as new items (the
    step's items stay as they came); and metrics.

    ``world``: the training ranks, each holding its share of the step's items (default: one process). The entropy
    selection ranks the tokens of the whole step: every rank's candidate entropies are gathered, so each rank keeps
    exactly the tokens of its share that one process would keep (collective when ``high_entropy_top_p < 1``)."""
    world = world or single()
    if not items and world.world_size == 1:
        return [], {}
    mask = _stack(items, "loss_mask").bool() if items else torch.zeros(0, 0, dtype=torch.bool)  # [N, A]
    metrics: dict[str, float] = {}
    weights = torch.ones_like(mask, dtype=torch.float32)  # [N, A]
    if items and all("rollout_log_probs" in it.token for it in items):
        weights, mask, m = rollout_correction(
            _stack(items, "action_log_probs"), _stack(items, "rollout_log_probs"), mask, mode=s.correction,
            level=s.correction_level, cap=s.correction_cap, lower=s.correction_lower)
        metrics.update({k: float(v) for k, v in m.items()})
    elif items and s.correction != "none":
        raise ValueError(f"rollout correction {s.correction!r} needs the engine's log-probs, and this rollout has none")
    if s.high_entropy_top_p < 1.0:
        if not all("action_entropy" in it.token for it in items):
            raise ValueError("high_entropy_top_p < 1 needs token entropies in the experience")
        entropy = _stack(items, "action_entropy") if items else torch.zeros(mask.shape)  # [N, A]
        step_scores = world.gather_objects(masked_scores(entropy, mask))  # every rank's candidates, in rank order
        mask = high_entropy_mask(entropy, mask, s.high_entropy_top_p, step_scores=step_scores, rank=world.rank)
        candidates = sum(int(x.numel()) for x in step_scores)  # the step's: the fraction is the same on every rank
        metrics["policy/high_entropy_kept_frac"] = math.ceil(s.high_entropy_top_p * candidates) / max(candidates, 1)
    width = [it.token["loss_mask"].shape[0] for it in items]  # A_i
    return [it.with_token(policy_loss_mask=mask[i, :a].clone(), is_weight=weights[i, :a].clone())
            for i, (it, a) in enumerate(zip(items, width))], metrics


class PolicyUpdater:
    """Runs the policy update of one step on an :class:`~mmrlhf.models.actor.ActorVL`."""

    def __init__(self, actor: Any, stepper: GuardedStepper, settings: PolicyUpdateSettings, *, pad_id: int) -> None:
        self.actor, self.stepper, self.s = actor, stepper, settings
        self.pad_id = pad_id

    def update(self, items: Sequence[TrainItem], *, distribution: ScoringDistribution,
               generator: torch.Generator | None) -> dict[str, float]:
        """One step's update. ``distribution``: the temperature and truncation the old log-probs were scored
        under; the new ones are scored under the same. A token outside the CURRENT policy's kept set (its
        truncated probability is 0) is masked out of the micro-batch's loss and counted
        (``policy/outside_kept_frac``)."""
        s = self.s
        need_ref = s.kl_loss_coef > 0
        distill = s.distill_loss_coef > 0
        if distill and items and "teacher_topk_ids" not in items[0].token:
            raise ValueError("algorithm.distill_loss_coef > 0 but the experience holds no teacher top-k (the maker "
                             "records it when its settings have distill_topk > 0: build it from the same config)")
        counts = [float(agg_count(it.token["policy_loss_mask"][None], s.agg)) for it in items]
        # The actor stays in eval mode: dropout would make the new log-probs differ from the old ones (scored
        # without it) for reasons that have nothing to do with the update, and break the ratio's meaning.
        self.actor.eval()

        def micro_loss(micro: list[int], denom: float) -> tuple[torch.Tensor, dict]:
            batch = collate([items[i] for i in micro], packed=s.packing, pad_id=self.pad_id,
                            adapter=self.actor.adapter, shared_prompt=s.shared_prompt,
                            max_row_tokens=s.shared_prompt_max_tokens)  # on the CPU; the actor moves it
            out = self.actor(batch.samples, vision_extra=batch.vision_extra, temperature=distribution.temperature,
                             truncation=distribution.truncation, return_entropy=s.entropy_coef > 0,
                             return_routing=s.moe_aux_loss_coef > 0,
                             gather_ids=batch.token["teacher_topk_ids"] if distill else None)
            tok = to_device(batch.token, out.log_probs.device)  # the loss's other inputs join the outputs
            mask = tok["policy_loss_mask"]
            outside = None
            if out.outside is not None:
                outside = out.outside & mask.bool()  # [b, A]
                mask = mask & ~outside
            loss, metrics = policy_loss(
                s.loss, out.log_probs, tok["action_log_probs"], tok["advantages"], mask, clip_low=s.clip_low,
                clip_high=s.clip_high, agg=s.agg, norm_len=s.norm_len, entropy=out.entropy,
                entropy_coef=s.entropy_coef, token_weights=tok["is_weight"], agg_denominator=denom,
                **dict(s.loss_params))
            if outside is not None:
                metrics["outside_kept_frac"] = float(outside.sum()) / max(float(tok["policy_loss_mask"].sum()), 1.0)
            if need_ref:
                kl, m = kl_loss(out.log_probs, tok["base_action_log_probs"], mask, estimator=s.kl_loss_estimator,
                                agg=s.agg, norm_len=s.norm_len, denominator=denom)
                loss = loss + s.kl_loss_coef * kl
                metrics.update(m)
            if distill:
                # the student's log-probs at the teacher's top-k ids, against the teacher's: on the policy loss's
                # tokens, aggregated as it is (the mini-batch's count), so accumulation stays exact
                per_token = topk_kl(out.gathered_log_probs, tok["teacher_topk_log_probs"], mask,
                                    direction=s.distill_loss_kl)  # [b, A]
                term = agg_loss(per_token, mask, s.agg, norm_len=s.norm_len, denominator=denom)
                loss = loss + s.distill_loss_coef * term
                metrics["distill_loss"] = float(term.detach())
                metrics.update(topk_metrics(per_token, tok["teacher_topk_log_probs"], mask))
            # pg_loss / entropy / kl_loss are this micro-batch's share of the mini-batch value: rescale to its mean
            share = sum(counts[i] for i in micro) / max(denom, 1.0)
            if s.moe_aux_loss_coef > 0:
                if out.routing is None or not out.routing.logits:
                    raise ValueError("algorithm.moe_aux_loss_coef > 0 needs a policy with routed experts")
                aux = load_balancing_loss(list(out.routing.logits.values()), out.routing.top_k,
                                          out.routing.token_mask)
                loss = loss + s.moe_aux_loss_coef * share * aux  # weighted like the micro-batch's policy loss
                metrics["moe_aux_loss"] = float(aux.detach())
            for key in ("pg_loss", "entropy", "kl_loss", "distill_loss"):
                if key in metrics:
                    metrics[key] = metrics[key] / max(share, 1e-12)
            return loss, metrics

        return run_minibatches(counts, batch_size=s.train_batch_size, micro_size=s.micro_batch_size,
                               epochs=s.ppo_epochs, generator=generator if s.shuffle else None, stepper=self.stepper,
                               micro_loss=micro_loss, prefix="policy/",
                               groups=group_keys(items),
                               costs=item_costs(items, adapter=self.actor.adapter, grouped=s.shared_prompt),
                               layout=forward_layout(packing=s.packing, shared_prompt=s.shared_prompt,
                                                     max_row_tokens=s.shared_prompt_max_tokens),
                               max_tokens=s.max_tokens_per_micro_batch)

    @torch.no_grad()
    def score(self, items: Sequence[TrainItem], distribution: ScoringDistribution, world: World | None = None, *,
              micro_batch_size: int, max_tokens: Budget) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """[A_i] log-probs of each item's response under this policy at ``distribution``, in item order, and [A_i]
        bool: the token lies outside this policy's kept set (all False untruncated).

        Why: the Ray trainers re-score what a rollout actor sampled in another process; the log-probs check the
        weight sync (``max_staleness = 0``) and are the PPO ratio's old policy (``>= 1``). The micro-batches are
        planned by cost under ``micro_batch_size`` and ``max_tokens`` (the rollout's scoring split,
        :mod:`mmrlhf.parallel.micro_batches`) and agreed over ``world`` (sharded forwards are collective:
        :mod:`mmrlhf.parallel.aligned`); a padding forward's result is dropped."""
        self.actor.eval()
        return score_items(self.actor, items, distribution, self.item_layout(), world,
                           micro_batch_size=micro_batch_size, max_tokens=max_tokens)

    def score_old(self, items: Sequence[TrainItem], distribution: ScoringDistribution, world: World | None = None,
                  *, micro_batch_size: int,
                  max_tokens: Budget) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`score` with each item's [A_i] entropy too: the old policy's log-probs and entropies where the
        trainer computes them before the update (Ray, :func:`~mmrlhf.models.ray_placement.policy_on_trainers`)."""
        self.actor.eval()
        return score_items_with_entropy(self.actor, items, distribution, self.item_layout(), world,
                                        micro_batch_size=micro_batch_size, max_tokens=max_tokens)

    def item_layout(self) -> ItemLayout:
        """How the forwards of this update lay out items (what another model scoring the same items follows)."""
        s = self.s
        return ItemLayout(pad_id=self.pad_id, packing=s.packing, shared_prompt=s.shared_prompt,
                          shared_prompt_max_tokens=s.shared_prompt_max_tokens)
