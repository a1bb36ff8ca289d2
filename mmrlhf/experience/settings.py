"""Plain settings of the experience maker, and the one function that derives them from the config tree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ExperienceSettings:
    """What the experience maker needs to know, as plain values (the maker never sees the config tree)."""

    n_samples_per_prompt: int = 8
    micro_batch_size: int = 8  # samples per actor / reference / critic forward (bounds memory)
    # rollout.max_tokens_per_micro_batch: None splits the forwards by micro_batch_size, "auto" or a budget by cost
    # (mmrlhf.parallel.micro_batches); the experiences keep chunks of micro_batch_size either way
    max_tokens_per_micro_batch: int | str | None = None
    packing: bool = False  # packed layout (no padding) for the forwards
    shared_prompt: bool = False  # grouped layout (each prompt once per row) for the forwards; wins over packing
    shared_prompt_max_tokens: int | None = None  # longest grouped row (None: a whole group per row)
    advantage_estimator: str = "grpo"  # registry name or "module:function"
    advantage_params: Mapping[str, Any] = field(default_factory=dict)  # estimator keyword arguments
    kl_estimator: str = "k1"  # KL folded into the reward
    kl_in_reward: bool = False  # fold -coef * KL into the token rewards (coef from the controller)
    need_reference: bool = False  # compute reference log-probs (KL in the reward, or a KL loss later)
    # on-policy distillation: weight of the teacher's per-token advantage (mmrlhf.algorithms.distill); 0 = off, and
    # then no teacher forward runs
    distill_coef: float = 0.0
    # on-policy distillation loss term (algorithm.distill_loss_coef > 0): the teacher's top-k log-probs and ids kept
    # per response position for the update (mmrlhf.algorithms.distill_topk); 0 = none recorded
    distill_topk: int = 0
    compute_entropy: bool = False  # per-token entropy (high-entropy filtering, logging)
    # False: no policy forward here, the experiences carry no old log-probs or entropies (a Ray rollout actor whose
    # trainer actors score the policy: mmrlhf.models.ray_placement.policy_on_trainers); the actor is shapes only
    score_policy: bool = True
    routing_metrics: bool = False  # rollout.routing_replay != none: log expert load and engine/trainer agreement
    overlong_buffer_len: int = 0  # DAPO overlong penalty buffer (0 = off)
    overlong_penalty_factor: float = 1.0
    reward_normalization: bool = False  # running mean/std normalisation of sequence rewards (state in the maker)
    reward_combination: str = "sum"  # sum | per_component: recipe terms z-scored within their group first
    reward_component_eps: float = 1e-6  # added to each term's group std (per_component)
    reward_clip: float | None = None
    advantage_whitening: bool = False  # whiten advantages over the rollout's response tokens
    advantage_clip: float | None = None
    check_prompt_ids: bool = True  # the engine's prompt ids must equal the processor's (vision layout check)
    logprob_mode: str = "sampled"  # sampled: score under the sampler's truncation; full: untruncated (rollout.*)
    # agent.tool_bonus / tool_bonus_steps: exploration bonus of trajectories that called a tool, annealed by step
    tool_bonus: float = 0.0
    tool_bonus_steps: int | None = None

    @property
    def teacher_needed(self) -> bool:
        """The teacher runs in the scoring forwards: for the distillation advantage, the top-k record, or both."""
        return self.distill_coef > 0 or self.distill_topk > 0


def experience_settings(algorithm: Any, rollout: Any, trainer: Any, *, attn_implementation: str = "sdpa",
                        multi_turn: bool = False, masked_kernel: str = "dense",
                        agent: Any = None) -> ExperienceSettings:
    """Derive :class:`ExperienceSettings` from the ``algorithm``, ``rollout`` and ``trainer`` sections
    (``attn_implementation``: ``model.attn_implementation``, and ``masked_kernel``: ``model.masked_attention``
    resolved for the trainer's device, which decide ``trainer.shared_prompt: auto``).

    ``multi_turn`` (``agent`` configured): ``trainer.shared_prompt: auto`` is off (see ``resolve_shared_prompt``).
    ``agent``: the ``agent`` section, whose ``tool_bonus`` the shaping adds (None: no bonus)."""
    from mmrlhf.models.shared_prompt import resolve_shared_prompt

    params: dict[str, Any] = {}
    name = algorithm.advantage_estimator
    if name == "gae":
        params.update(gamma=algorithm.gamma, lam=algorithm.lam)
    elif name in ("grpo", "group_norm"):
        params.update(eps=algorithm.advantage_eps, norm_by_std=algorithm.norm_by_std)
    elif name in ("reinforce", "reinforce++", "reinforce_baseline"):
        params.update(gamma=algorithm.gamma)
    elif name == "cpgd":
        params.update(weight=algorithm.cpgd_weight, eps=algorithm.advantage_eps)
    params.update(algorithm.advantage_params)
    kl_in_reward = algorithm.kl_reward_coef > 0
    return ExperienceSettings(
        n_samples_per_prompt=rollout.n_samples_per_prompt,
        micro_batch_size=rollout.micro_rollout_batch_size,
        max_tokens_per_micro_batch=rollout.max_tokens_per_micro_batch,
        packing=trainer.packing_samples,
        shared_prompt=resolve_shared_prompt(trainer.shared_prompt, attn_implementation, rollout.n_samples_per_prompt,
                                            multi_turn=multi_turn, masked_kernel=masked_kernel),
        shared_prompt_max_tokens=trainer.shared_prompt_max_tokens,
        advantage_estimator=name,
        advantage_params=params,
        kl_estimator=algorithm.kl_estimator,
        kl_in_reward=kl_in_reward,
        need_reference=kl_in_reward or algorithm.kl_loss_coef > 0,
        distill_coef=algorithm.distill_coef,
        distill_topk=algorithm.distill_topk if algorithm.distill_loss_coef > 0 else 0,
        # Entropy of the old policy: high-entropy token selection needs it, and the trainer logs it (the earliest
        # sign of an entropy collapse); one extra reduction per scored token.
        compute_entropy=True,
        routing_metrics=rollout.routing_replay != "none",
        overlong_buffer_len=algorithm.overlong_buffer_len,
        overlong_penalty_factor=algorithm.overlong_penalty_factor,
        reward_normalization=algorithm.reward_normalization,
        reward_combination=algorithm.reward_combination,
        reward_component_eps=algorithm.advantage_eps,
        reward_clip=algorithm.reward_clip,
        # "batch" and "global" both pool the whole step's statistics (over every training rank: step_shaping).
        advantage_whitening=algorithm.advantage_whitening != "none",
        advantage_clip=algorithm.advantage_clip,
        logprob_mode=rollout.logprob_mode,
        tool_bonus=agent.tool_bonus if agent is not None else 0.0,
        tool_bonus_steps=agent.tool_bonus_steps if agent is not None else None,
    )
