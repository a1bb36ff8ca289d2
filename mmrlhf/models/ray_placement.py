"""Where the Ray mode keeps each model: pure predicates of a run's config, read by the launchers (which process
builds what), the experience maker's builder and the memory plan (what a rollout actor's GPU holds).

``distributed.scoring`` decides it. ``trainer`` makes the whole experience on the trainer actors
(:func:`experiences_on_trainers`). ``auto`` does the same wherever the rollout side would read the old policy itself
(:func:`policy_scoring_blockers`: a KL term in the reward, a critic, ...), and else lets the rollout actors make the
experiences while the trainer actors re-score what nothing there reads (:func:`policy_on_trainers`,
:func:`reference_on_trainers`, :func:`teacher_on_trainers`); either way no scoring copy sits beside an engine, except
with LoRA (the copy merges the adapters the trainers send) and a transformers engine (it generates with its own
module). ``rollout`` scores everything on the rollout actors. :func:`rollout_actor_models` names what a rollout actor
then holds beside its engine. docs/distributed.md, "Where the Ray mode scores".
"""

from __future__ import annotations

from typing import Any


def experiences_on_trainers(config: Any) -> bool:
    """Whether, in the Ray mode, the trainer actors make the experiences: the rollout actors generate and reward
    only and send the step's rows, and every trainer rank runs the experience maker's second stage on its groups with
    the sharded policy, reference, teacher and critic, the step's shaping statistics and running state (reward
    normalisation, the adaptive KL coefficient) taken over the trainer ranks, as torchrun ranks take them; the
    rollout actors then hold their engine alone (no scoring copy, reference, teacher or critic). Always with
    ``distributed.scoring: trainer`` (refused with vLLM's own LoRA, ``model.lora.sync: vllm_lora``: the trainers send
    merged layers); with ``auto`` where the rollout side would otherwise read the old policy
    (:func:`policy_scoring_blockers`), except with LoRA and a transformers engine (:func:`_auto_keeps_copy`)."""
    scoring = config.distributed.scoring
    if scoring == "auto":
        return not _auto_keeps_copy(config) and bool(policy_scoring_blockers(config))
    if scoring != "trainer":
        return False
    if config.model.lora.rank and config.model.lora.sync == "vllm_lora":
        raise ValueError("distributed.scoring=trainer sends the engines merged LoRA layers: set model.lora.sync=merged "
                         "(or distributed.scoring=auto, whose rollout actors load the adapter from their policy copy)")
    return True


def _auto_keeps_copy(config: Any) -> bool:
    """Where ``auto`` keeps the rollout actors' own policy module even though the rollout side reads the old policy:
    with LoRA the trainers send the adapters alone (megabytes, where merged layers are most of the model) and the
    copy merges them into its engine; a transformers engine generates with that module anyway. (The memory plan
    counts the copy and offers ``distributed.scoring=trainer`` where it does not fit.)"""
    return bool(config.model.lora.rank) or config.rollout.engine != "vllm"


def _reference_for_the_loss_only(config: Any) -> bool:
    """The reference serves the KL loss only (``algorithm.kl_loss_coef > 0`` with ``kl_reward_coef == 0``), so
    nothing the rollout actors compute (the shaped rewards, the advantages) reads it; not with LoRA, whose reference
    is the rollout actor's own policy copy with its adapters off (no memory)."""
    a = config.algorithm
    return a.kl_loss_coef > 0 and a.kl_reward_coef == 0 and not config.model.lora.rank


def reference_on_trainers(config: Any) -> bool:
    """Whether, in the Ray mode with the rollout actors making the experiences, the trainer actors score the
    reference (sharded with the policy) beside them: where it serves the KL loss only
    (:func:`_reference_for_the_loss_only`). A KL term in the reward keeps it with the experience maker (its shaping
    needs it); where the trainers make the experiences their maker holds it (:func:`experiences_on_trainers`)."""
    return _reference_for_the_loss_only(config) and not experiences_on_trainers(config)


def teacher_on_trainers(config: Any) -> bool:
    """Whether, in the Ray mode with the rollout actors making the experiences, the trainer actors score the
    distillation teacher (sharded with the policy): where it serves the loss term only (``algorithm.distill_loss_coef
    > 0`` with ``distill_coef == 0``); the distillation advantage (``distill_coef > 0``) is shaped by the experience
    maker, which then holds it."""
    a = config.algorithm
    return bool(config.model.teacher) and a.distill_loss_coef > 0 and a.distill_coef == 0 \
        and not experiences_on_trainers(config)


def policy_scoring_blockers(config: Any) -> list[str]:
    """What makes a Ray rollout actor read the old-policy log-probs (or entropies) itself, so that it must hold a
    scoring copy of the policy beside its engine: one reason per setting (empty: nothing on the rollout side reads
    them). Rewards, dynamic sampling, the whitening and normalisation of the shaping and the step reports read
    rewards and masks only; the policy entropy and ``high_entropy_top_p`` are the trainer's (the items carry the
    entropies), and so is the rollout correction (engine log-probs against the old ones)."""
    from mmrlhf.models.truncation import Truncation

    a, r, m = config.algorithm, config.rollout, config.model
    found = []
    if r.engine != "vllm":
        found.append(f"rollout.engine={r.engine}: it generates with the copy itself")
    if m.lora.rank:
        found.append("model.lora.rank > 0: the engine's adapters or merged layers come from the copy")
    if a.kl_reward_coef > 0:  # (a KL loss's reference alone moves to the trainers; with LoRA it is the copy's)
        found.append("algorithm.kl_reward_coef > 0: the reward's KL term reads them")
    if a.distill_coef > 0:
        found.append("algorithm.distill_coef > 0: the distillation advantage reads them")
    if a.advantage_estimator == "gae":
        found.append("algorithm.advantage_estimator=gae: the critic's values are scored beside them")
    if r.routing_replay != "none":
        found.append(f"rollout.routing_replay={r.routing_replay}: the expert-routing metrics read the copy's routing")
    if config.agent.enabled:
        found.append("agent: the per-turn engine divergence of agent rows reads them")
    if r.temperature > 0 and r.logprob_mode == "sampled" and \
            Truncation(top_k=r.top_k, top_p=r.top_p, min_p=r.min_p).active:
        found.append("a truncating sampler scored as sampled (rollout.top_k / top_p / min_p): the shaping's token "
                     "mask drops the tokens outside the copy's kept set")
    return found


def policy_on_trainers(config: Any) -> bool:
    """Whether, in the Ray mode with ``distributed.scoring: auto``, the trainer actors compute the old-policy
    log-probs and entropies of the rollout actors' experiences with the sharded policy before the update, the rollout
    actors holding no scoring copy of the policy: where :func:`policy_scoring_blockers` finds nothing (``rollout``
    keeps the copy; where something reads them, the trainers make the whole experience instead,
    :func:`experiences_on_trainers`).
    Exact: at ``distributed.max_staleness`` 0 the trainer's weights before the update are the behaviour policy's
    (the copy held the same); at >= 1 the trainer replaced the copy's log-probs with its own already (the PPO
    ratio's old policy)."""
    if config.distributed.scoring != "auto":
        return False
    return not policy_scoring_blockers(config)


ROLLOUT_MODELS = ("policy", "reference", "teacher", "critic")  # what a rollout actor may score with


def rollout_actor_models(config: Any) -> tuple[str, ...]:
    """The models (of :data:`ROLLOUT_MODELS`) each Ray rollout actor scores with: none where the trainer actors make
    the experiences; a transformers engine's ``policy`` is the module it generates with (no second copy). Never
    raises (the launchers refuse a config :func:`experiences_on_trainers` refuses)."""
    d, a, m = config.distributed, config.algorithm, config.model
    if d.scoring == "trainer" or experiences_on_trainers(config):
        return ()
    out = []
    if not policy_on_trainers(config):  # (a transformers engine's: the module it generates with, scoring too)
        out.append("policy")
    if (a.kl_loss_coef > 0 or a.kl_reward_coef > 0) and not (m.lora.rank and not m.reference) \
            and not reference_on_trainers(config):
        out.append("reference")  # (LoRA without model.reference: the copy with its adapters off, no memory)
    if m.teacher and (a.distill_coef > 0 or a.distill_loss_coef > 0) and not teacher_on_trainers(config):
        out.append("teacher")
    if a.advantage_estimator == "gae":
        out.append("critic")
    return tuple(out)
