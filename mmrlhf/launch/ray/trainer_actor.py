"""The trainer actor of the Ray mode: the policy (and critic) updaters of the single-process loop, fed with
experiences from the rollout actors, pushing each new version back to every rollout actor in chunks.

Before each update it re-scores the step's samples with its own policy (one no-grad forward). That forward is two
things: the engine-vs-trainer check of the weight sync (``engine_logprob_diff/trainer_*``: on a fresh experience the
engine sampled with the very weights the trainer holds, so the two log-probs must agree to float noise; a missed
sync shows as a large gap), and, with ``max_staleness >= 1``, the old-policy log-probs of the PPO ratio at the
trainer's current version, so that the rollout correction's importance weight ``pi_current / mu_engine`` covers
the versions the experience lags behind.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

TRAINER_NAME = "mmrlhf-trainer"


def trainer_name(index: int) -> str:
    return f"{TRAINER_NAME}-{index}"


class RayPolicyTrainer:
    """Trainer actor ``index`` (wrapped with ``ray.remote`` by the driver); only one is supported for now.
    ``push_weights=False`` bumps the rollout actors' version without sending any tensor: the control run of the
    sync check, never a user setting."""

    def __init__(self, config: dict[str, Any], index: int, threads: int, *, push_weights: bool = True) -> None:
        from transformers import AutoProcessor

        from mmrlhf.config import build_config
        from mmrlhf.devices import resolve_device
        from mmrlhf.experience.builder import load_model
        from mmrlhf.models.adapters import get_adapter
        from mmrlhf.rollout.base import forbidden_token_ids
        from mmrlhf.rollout.builder import sampling_settings
        from mmrlhf.trainer.builder import build_critic, build_updaters
        from mmrlhf.trainer.checkpoint import CheckpointManager
        from mmrlhf.trainer.optim import freeze_vision
        from mmrlhf.trainer.state import seed_everything

        torch.set_num_threads(threads)
        self.config = cfg = build_config(config)
        m, t, dist = cfg.model, cfg.trainer, cfg.distributed
        self.index, self.max_staleness, self.push_enabled = index, dist.max_staleness, push_weights
        seed_everything(t.seed)
        adapter = get_adapter(m.pretrain, m.family)
        device = resolve_device(t.device)
        actor = load_model(m, m.pretrain, adapter, trainable=True).to(device)  # float32 master, model.dtype compute
        freeze_vision(actor.model, adapter, tower=t.freeze_vision_tower, merger=t.freeze_merger)
        if m.lora.rank:  # the adapters train here; only they travel to the rollout actors (kind "lora")
            from mmrlhf.experience.builder import check_lora_settings
            from mmrlhf.models.lora import apply_lora

            check_lora_settings(cfg)
            apply_lora(actor, m.lora)
        self.weight_kind = "lora" if m.lora.rank else "full"
        # Score the distribution the engine samples from (the maker does the same to its own actor).
        actor.excluded_token_ids = forbidden_token_ids(adapter, sampling_settings(cfg.rollout))
        critic = build_critic(cfg) if cfg.algorithm.advantage_estimator == "gae" else None
        self.processor = AutoProcessor.from_pretrained(m.pretrain, trust_remote_code=m.trust_remote_code)
        self.policy, self.critic = build_updaters(cfg, actor, critic, pad_id=self.processor.tokenizer.pad_token_id)
        self.shuffle = torch.Generator().manual_seed(t.seed)
        self.checkpoints = CheckpointManager(Path(t.output_dir) / "checkpoints", t.keep_last)
        self.bucket_bytes = cfg.rollout.weight_sync_bucket_mb * 2**20
        self.version = 0
        self.holders: list[Any] = []

    def set_holders(self, holders: Sequence[Any]) -> None:
        """The rollout actors' handles, in share order (replaced when one is restarted)."""
        self.holders = list(holders)

    # ---- one step ----------------------------------------------------------------------------------------------
    def train_step(self, step: int, *payloads: dict[str, Any]) -> dict[str, Any]:
        """Update on the experiences of ``step`` (one payload per rollout actor, resolved from the object store),
        then push the new version to every rollout actor. Returns metrics and the consumed (share, samples)."""
        from mmrlhf.launch.ray.ledger import check_staleness
        from mmrlhf.experience.batching import split_experience
        from mmrlhf.trainer.policy_update import prepare_policy_targets

        t0 = time.perf_counter()
        if step != self.version:
            raise RuntimeError(f"trainer at version {self.version} asked to train step {step}")
        items, staleness, consumed, fresh = [], [], [], []
        temperatures = {p["temperature"] for p in payloads}
        if len(temperatures) != 1:
            raise ValueError(f"step {step}: experiences scored at different temperatures {sorted(temperatures)}")
        for p in payloads:
            s = check_staleness(self.version, p["version"], self.max_staleness)
            share_items = [it for exp in p["experiences"] for it in split_experience(exp)]
            if len(share_items) != p["samples"]:
                raise RuntimeError(f"step {step}, share {p['share']}: {p['samples']} samples announced, "
                                   f"{len(share_items)} in the experiences")
            items += share_items
            staleness.append(s)
            fresh += [s == 0] * len(share_items)
            consumed.append((p["share"], len(share_items)))
        temperature = temperatures.pop()
        metrics: dict[str, float] = {}
        with torch.no_grad():
            current = self._log_probs(items, temperature)  # list of [A_i]
        metrics.update(_sync_check(items, current, fresh))
        if self.max_staleness >= 1:
            for it, lp in zip(items, current):
                it.token["action_log_probs"] = lp
        metrics.update(prepare_policy_targets(items, self.policy.s))
        metrics.update(self.policy.update(items, temperature=temperature, generator=self.shuffle))
        if self.critic is not None:
            metrics.update(self.critic.update(items, generator=self.shuffle))
        self.version += 1
        metrics["time/update"] = time.perf_counter() - t0
        sync = self.push_weights()
        failed = sync.pop("failed")
        metrics.update(sync)
        return {"metrics": metrics, "consumed": consumed, "staleness": staleness, "version": self.version,
                "failed": failed}

    @torch.no_grad()
    def _log_probs(self, items: list[Any], temperature: float) -> list[torch.Tensor]:
        """[A_i] log-probs of each item's response under the current policy, in item order."""
        from mmrlhf.experience.batching import collate
        from mmrlhf.models.placement import to_host

        s, actor = self.policy.s, self.policy.actor
        actor.eval()
        out: list[torch.Tensor] = []
        for start in range(0, len(items), s.micro_batch_size):
            part = items[start: start + s.micro_batch_size]
            batch = collate(part, packed=s.packing, pad_id=self.policy.pad_id, adapter=actor.adapter,
                            shared_prompt=s.shared_prompt, max_row_tokens=s.shared_prompt_max_tokens)
            # the actor moves the CPU batch to its device; the log-probs join the items' CPU tensors
            lp = to_host(actor(batch.samples, vision_extra=batch.vision_extra, temperature=temperature).log_probs)
            out += [lp[i, : len(it.response_ids)].float() for i, it in enumerate(part)]  # [b, A] -> [A_i] each
        return out

    # ---- weights -----------------------------------------------------------------------------------------------
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What a rollout actor needs after an update: the trainable policy tensors (``policy.``) and the critic's
        (``critic.``), detached CPU tensors."""
        from mmrlhf.rollout.weight_sync import policy_weights

        named = [(f"policy.{n}", t.cpu()) for n, t in policy_weights(self.policy.actor.model)]
        if self.critic is not None:
            named += [(f"critic.{n}", p.detach().cpu()) for n, p in self.critic.critic.named_parameters()
                      if p.requires_grad]
        return named

    def push_weights(self, holders: Sequence[int] | None = None) -> dict[str, Any]:
        """Send the current version to the rollout actors ``holders`` (indices; default all) in buckets of
        ``rollout.weight_sync_bucket_mb``; each bucket is put in the object store once and read by every actor.
        Returns ``sync/*`` metrics and ``failed``: {index: error text} of actors that died during the push (the
        driver reports them and applies ``distributed.on_rollout_failure``)."""
        import ray

        from mmrlhf.launch.ray.runtime import describe_actor_error
        from mmrlhf.rollout.base import iter_buckets

        t0 = time.perf_counter()
        targets = range(len(self.holders)) if holders is None else list(holders)
        # The control of the sync check (push_weights=False) announces the new version with no tensors at all.
        named = self.named_weights() if self.push_enabled else []
        buckets = list(iter_buckets(iter(named), self.bucket_bytes)) or [[]]
        pending: dict[int, list[Any]] = {i: [] for i in targets}
        for b, bucket in enumerate(buckets):
            ref = ray.put(bucket)
            last = b == len(buckets) - 1
            for i in targets:
                pending[i].append(self.holders[i].update_experience_maker.remote(ref, version=self.version,
                                                                                  last=last, kind=self.weight_kind))
        failed: dict[int, str] = {}
        for i, refs in pending.items():
            try:
                ray.get(refs)
            except ray.exceptions.RayActorError as exc:
                failed[i] = describe_actor_error(exc)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return {"sync/seconds": time.perf_counter() - t0, "sync/megabytes": nbytes / 2**20,
                "sync/buckets": float(len(buckets)), "failed": failed}

    # ---- checkpoint --------------------------------------------------------------------------------------------
    def save(self, step: int) -> str:
        """The policy in Hugging Face format (``model/``; LoRA: merged, plus ``adapter/``), the critic and the
        optimiser states, as one process writes them."""
        import json

        from mmrlhf.trainer.checkpoint import write_policy_and_updaters

        def write(folder: Path) -> None:
            write_policy_and_updaters(folder, self.policy, self.critic, self.processor)
            state = {"trainer": {"step": step}, "policy_version": self.version, "launch": "ray",
                     "config": self.config.model_dump(mode="json")}
            (folder / "trainer_state.json").write_text(json.dumps(state, indent=1, default=float))

        return str(self.checkpoints.save(step, write))

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Trainable policy tensors (tests compare them with a rollout actor's copy)."""
        return {n[len("policy."):]: t.clone() for n, t in self.named_weights() if n.startswith("policy.")}


def _sync_check(items: Sequence[Any], current: Sequence[torch.Tensor], fresh: Sequence[bool]) -> dict[str, float]:
    """Mean / max |engine log-prob - trainer log-prob| over the response tokens of fresh (staleness 0) samples."""
    diffs = [(it.token["rollout_log_probs"] - lp).abs()[it.token["loss_mask"]]
             for it, lp, f in zip(items, current, fresh) if f and "rollout_log_probs" in it.token]
    if not diffs:
        return {}
    d = torch.cat(diffs)
    if not d.numel():
        return {}
    return {"engine_logprob_diff/trainer_mean": float(d.mean()), "engine_logprob_diff/trainer_max": float(d.max())}

