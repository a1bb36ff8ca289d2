"""``NaiveExperienceMaker``: the experience pipeline on transformers ``generate`` (no vLLM), in PPO mode (critic
values, GAE with gamma and lambda) or GRPO mode (n samples per prompt, group-normalised rewards, KL penalty).

It is the reference path: same phases and outputs as :class:`FastExperienceMaker`, with the policy's own module
generating (so there is no weight sync), ``inference_batch_size`` prompts per ``generate`` call and
``logits_forward_batch_size`` samples per log-prob / value forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mmrlhf.experience.fast_maker import FastExperienceMaker
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.rollout.hf_engine import HFGenerateEngine
from mmrlhf.rollout.types import SamplingSettings

MODES = ("ppo", "grpo")


class NaiveExperienceMaker(FastExperienceMaker):
    """Args as :class:`FastExperienceMaker`, minus the engine, plus:

    mode: ``"ppo"`` (needs ``critic``; GAE with ``gamma`` / ``lam``, one sample per prompt unless settings say
        otherwise) or ``"grpo"`` (group-normalised advantages; ``n_samples_per_prompt`` from settings).
    inference_batch_size: prompts per ``generate`` call. logits_forward_batch_size: samples per forward.
    """

    def __init__(self, actor: Any, data_processor: Any, reward_engine: Any, tokenizer: Any,
                 settings: ExperienceSettings, sampling: SamplingSettings, *, mode: str = "grpo",
                 critic: Any = None, initial_model: Any = None, kl_controller: Any = None,
                 gamma: float = 1.0, lam: float = 0.95, inference_batch_size: int = 8,
                 logits_forward_batch_size: int = 8, max_model_len: int = 4096) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
        if mode == "ppo" and critic is None:
            raise ValueError("PPO mode needs a critic (values for GAE)")
        if mode == "ppo":
            settings = dataclasses.replace(settings, advantage_estimator="gae",
                                           advantage_params={"gamma": gamma, "lam": lam})
        elif settings.advantage_estimator == "gae":
            raise ValueError("GRPO mode uses a critic-free estimator; settings name 'gae'")
        settings = dataclasses.replace(settings, micro_batch_size=logits_forward_batch_size)
        eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        engine = HFGenerateEngine(actor.model, actor.adapter, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                                  max_model_len=max_model_len, batch_size=inference_batch_size, tokenizer=tokenizer)
        super().__init__(actor, engine, data_processor, reward_engine, tokenizer, settings, sampling,
                         initial_model=initial_model, critic=critic if mode == "ppo" else None,
                         kl_controller=kl_controller)
        self.mode = mode
