"""``algorithm``: advantage estimator, KL and policy-loss settings (names resolve through the registries)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mmrlhf.config.base import Section


class AlgorithmConfig(Section):
    """Advantages, KL, shaping and losses. The experience maker reads the estimator, KL-in-reward, shaping and
    whitening keys; the trainer reads the policy-loss, value-loss, KL-loss, entropy, rollout-correction and
    dynamic-sampling keys."""

    advantage_estimator: str = "grpo"
    """Registered advantage estimator name, or ``package.module:function``."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount factor."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    """GAE lambda."""
    advantage_eps: float = Field(default=1e-6, gt=0.0)
    """Added to the group std before dividing (``grpo``, ``cpgd``); zero-variance groups give 0 regardless."""
    norm_by_std: bool = True
    """``grpo``: divide by the group std (False gives Dr. GRPO's mean-only centring)."""
    cpgd_weight: Literal["std", "clip_filter"] = "std"
    """``cpgd``: z-score by the group std, or centre and up-weight informative groups (capped at 3x)."""
    advantage_params: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the advantage estimator (e.g. for a user-registered one)."""

    distill_coef: float = Field(default=0.0, ge=0.0)
    """On-policy distillation (docs/algorithms.md): weight of the teacher's per-token advantage
    ``log pi_teacher - log pi_student`` (the negative reverse-KL estimate on the student's own tokens), ADDED to the
    estimator's advantage before whitening and clipping; 0 disables it. Needs ``model.teacher``. With
    ``advantage_estimator: distill`` the task advantage is 0 (distillation alone); with ``grpo`` etc. the two mix."""
    distill_loss_coef: float = Field(default=0.0, ge=0.0)
    """On-policy distillation as a loss term (docs/algorithms.md): weight of the per-token KL between the student
    and the teacher over the teacher's ``distill_topk`` most likely tokens plus one bucket for the rest of the mass,
    at every response position the student sampled, ADDED to the policy loss and aggregated like it
    (``loss_agg``). It reads the teacher's whole top-k distribution, not only the sampled token, so it trains a
    student that rarely samples the teacher's tokens. 0 disables it. Needs ``model.teacher``; combines with
    ``distill_coef`` and with any advantage estimator (``distill``: the loss term alone)."""
    distill_topk: int = Field(default=16, ge=1)
    """Teacher tokens kept per response position for ``distill_loss_coef`` (their log-probs and ids, ``[B, A, k]``
    per step, recorded at scoring time); the rest of the teacher's mass counts as one outcome."""
    distill_loss_kl: Literal["forward", "reverse"] = "forward"
    """Direction of the ``distill_loss_coef`` term: ``forward`` KL(teacher || student), the supervised-KD gradient
    ``p_student - p_teacher`` on the teacher's tokens (strong where the student gives them almost nothing);
    ``reverse`` KL(student || teacher), mode-seeking, its gradient proportional to the student's own probability."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator of the per-token penalty folded into the reward (k1 sums to the sequence log-ratio)."""
    kl_reward_coef: float = Field(default=0.0, ge=0.0)
    """Initial coefficient of the KL penalty in the reward; 0 disables it."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """``fixed`` keeps ``kl_reward_coef``; ``adaptive`` steers it towards ``kl_target`` (Ziegler et al.)."""
    kl_target: float = Field(default=6.0, gt=0.0)
    """Adaptive controller: target per-response KL (nats)."""
    kl_horizon: int = Field(default=10000, ge=1)
    """Adaptive controller: horizon in samples (larger = slower coefficient changes)."""
    kl_loss_coef: float = Field(default=0.0, ge=0.0)
    """Coefficient of the KL loss term (GRPO style); 0 disables it. Can be combined with the reward penalty."""
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of the loss term (k3: unbiased and non-negative)."""

    overlong_buffer_len: int = Field(default=0, ge=0)
    """DAPO overlong penalty: length of the linear ramp before the maximum response length; 0 disables it."""
    overlong_penalty_factor: float = Field(default=1.0, ge=0.0)
    """DAPO overlong penalty at (and beyond) the maximum response length."""
    reward_normalization: bool = False
    """Normalise rewards by running mean/std over training (checkpointed with the trainer). Not the per-group,
    per-term normalisation: that is ``reward_combination: per_component``."""
    reward_combination: Literal["sum", "per_component"] = "sum"
    """How a sample's recipe terms make its reward. ``sum``: ``sum_c w_c s_c`` of the raw scores. ``per_component``
    (GDPO): each term z-scored within the sample's group first, ``sum_c w_c (s_c - mean_g) / (std_g +
    advantage_eps)`` (0 where the term is constant in the group; a term a sample has no score for is left out of the
    statistics and adds 0), so a term with a large spread (a 0/1 format check) cannot drown the others. The overlong
    penalty and the agent's tool bonus are two more such terms, weighted by their own size (the penalty's factor,
    the bonus); reward normalisation, clipping and the estimator follow; dynamic sampling filters on the recipe's
    terms; evaluation reports the raw sum. GDPO's own advantage: ``norm_by_std: false`` with
    ``advantage_whitening: batch`` (docs/algorithms.md says why ``grpo``'s group std would partly undo the
    weights)."""
    reward_clip: float | None = Field(default=None, gt=0.0)
    """Clip rewards to ``[-reward_clip, reward_clip]``; None disables it."""
    advantage_whitening: Literal["none", "batch", "global"] = "none"
    """Extra advantage whitening over the response tokens. ``batch`` and ``global`` are the same: both whiten with
    the statistics of the whole step (every micro-batch, and every training rank's samples)."""
    advantage_clip: float | None = Field(default=None, gt=0.0)
    """Clip advantages to ``[-advantage_clip, advantage_clip]``; None disables it."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards do not vary (no GRPO signal) and sample more prompts until
    ``trainer.rollout_batch_size`` informative groups are gathered (only those are scored and trained on)."""
    dynamic_sampling_max_extra_rounds: int = Field(default=3, ge=0)
    """Extra sampling rounds allowed per step before training on a partially filled batch."""
    dynamic_sampling_tol: float = Field(default=0.0, ge=0.0)
    """A group is kept when its reward spread (max - min) exceeds this."""

    rollout_correction: Literal["auto", "none", "tis", "mis"] = "auto"
    """Importance-sampling correction between the engine's sampling distribution and the trainer's old policy:
    ``tis`` weights each token (or response) by ``min(pi_old / pi_engine, cap)``, ``mis`` drops those whose ratio
    leaves ``[rollout_correction_lower, cap]``; ``auto`` picks ``tis`` whenever the engine and the trainer run
    different kernels: a vLLM engine on a GPU always (vLLM's kernels are not transformers', even in the same dtype),
    and on the CPU unless both ``rollout.dtype`` and ``model.dtype`` are float32 (measured to agree to ~1e-6);
    ``none`` for the transformers engine, which is the actor's own module."""
    rollout_correction_level: Literal["token", "sequence", "geometric"] = "token"
    """Ratio per token, per response (product of token ratios) or per response as the geometric mean of its token
    ratios (length-normalised)."""
    rollout_correction_cap: float = Field(default=2.0, gt=0.0)
    """Upper bound of the importance ratio (TIS truncation / MIS rejection threshold)."""
    rollout_correction_lower: float = Field(default=0.0, ge=0.0)
    """MIS: ratios below this are rejected too (0 keeps every low ratio)."""

    policy_loss: str = "ppo"
    """Registered policy loss name (``ppo``, ``gspo``, ``cispo``, ``cpgd``, ``sapo``), or
    ``package.module:function``."""
    clip_low: float = Field(default=0.2, ge=0.0)
    """Lower ratio clip: the ratio is bounded below by ``1 - clip_low`` (>= 1 means no lower bound for cispo/cpgd)."""
    clip_high: float = Field(default=0.2, ge=0.0)
    """Upper ratio clip: ``1 + clip_high`` (DAPO clip-higher: 0.28 with clip_low 0.2; GSPO: ~4e-4)."""
    dual_clip: float | None = Field(default=None, gt=1.0)
    """``ppo`` dual clip constant c > 1 capping the loss of negative-advantage tokens at ``-c A``; None disables."""
    policy_loss_params: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the policy loss: ``drift_coef`` (cpgd, default 0); ``tau_pos`` / ``tau_neg``
    (sapo: the gate's temperatures for positive / negative advantages, default 1.0 / 1.05, the paper's; larger
    decays the update of off-policy tokens faster); a user loss's own. An unknown name is refused when the trainer is
    built, with the loss's parameters listed."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses are reduced (see docs/algorithms.md for the length weighting of each)."""
    loss_agg_norm_len: int | None = Field(default=None, ge=1)
    """Constant divisor of ``seq-mean-token-sum-norm``; None uses the padded length of each batch."""
    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Entropy bonus coefficient (adds ``-coef * entropy`` to the policy loss); 0 disables it."""
    high_entropy_top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Train only on this fraction of response tokens with the highest entropy (0.2 in arXiv 2506.01939); 1 = all."""
    moe_aux_loss_coef: float = Field(default=0.0, ge=0.0)
    """Mixture-of-experts policies: weight of the router's load-balancing loss (Switch Transformer's
    ``E * sum_e f_e P_e``, as transformers computes it, over the routed layers and the batch's real tokens) added to
    the policy loss. 0 (the default) leaves it out: RL fine-tuning starts from a balanced router and the loss
    would pull the policy away from the reward for balance's sake; turn it on (e.g. 0.001, pre-training's value)
    only where ``moe/load_imbalance`` grows. Logged as ``policy/moe_aux_loss``."""
    value_clip: float | None = Field(default=0.2, gt=0.0)
    """Critic (``gae``): clip range of the value update around the old values; None disables clipping."""
    value_loss_coef: float = Field(default=0.5, ge=0.0)
    """Critic (``gae``): weight of the value loss."""

    @property
    def distilling(self) -> bool:
        """A teacher is read: the distillation advantage, the loss term, or both."""
        return self.distill_coef > 0 or self.distill_loss_coef > 0

    @model_validator(mode="after")
    def _check_adaptive(self) -> "AlgorithmConfig":
        if self.kl_controller == "adaptive" and self.kl_reward_coef == 0.0:
            raise ValueError("kl_controller 'adaptive' needs kl_reward_coef > 0 (a zero coefficient never moves)")
        if self.advantage_estimator == "distill" and not self.distilling:
            raise ValueError("advantage_estimator 'distill' (distillation alone: the task advantage is 0) needs "
                             "algorithm.distill_coef > 0 or algorithm.distill_loss_coef > 0, or nothing would train")
        if self.rollout_correction_lower >= self.rollout_correction_cap:
            raise ValueError(f"rollout_correction_lower ({self.rollout_correction_lower}) must be below "
                             f"rollout_correction_cap ({self.rollout_correction_cap})")
        return self
