"""The transformers engine's sampling step: exactly what ``SamplingSettings`` says, one random stream per sample.

Why not transformers' own sampler: ``generate`` merges the checkpoint's ``generation_config.json`` into whatever
it is given (released Qwen2-VL / Qwen2.5-VL Instruct checkpoints ship ``repetition_penalty: 1.05`` and top-k /
top-p defaults), so rollouts would come from a distribution the actor never scores; and it draws every row from one
global random stream, so a sample depends on the batch it was generated in. Here ``generate`` runs greedy over a
fresh generation config with no processor of its own, and :class:`SettingsSampler`, its only logits processor,
does the sampling: it returns scores whose argmax is the token it drew, and records that token's log-prob.

The distribution is vLLM's (``vllm/v1/sample/sampler.py`` with ``logprobs_mode="processed_logprobs"``): float32
logits, forbidden tokens and (before ``min_new_tokens``) stop tokens removed, divided by the temperature, cut by
``min_p``, ``top_k`` and ``top_p`` exactly as the trainer's ``sampled`` log-probs cut them
(:mod:`mmrlhf.models.truncation`: vLLM's rules, with every token tied at a boundary kept); the reported log-prob is
the log-softmax over what is left. Greedy (temperature 0): the argmax, with the log-prob of the un-tempered,
untruncated (but forbidden-free) distribution.
"""

from __future__ import annotations

import torch

from mmrlhf.models.truncation import Truncation, truncate_logits
from mmrlhf.rollout.types import SamplingSettings


class SettingsSampler:
    """A ``generate`` logits processor that samples one token per row and forces it as the row's argmax.

    Args:
        settings: the call's sampling settings.
        forbidden: token ids never sampled.
        stop_ids: ids that end a response (masked until ``settings.min_new_tokens`` tokens exist).
        prompt_width: length of the (left-padded) prompt block; tokens beyond it are generated ones.
        seeds: one seed per row (row ``r`` draws from its own generator); ignored when greedy.
    """

    def __init__(self, settings: SamplingSettings, *, forbidden: list[int], stop_ids: list[int], prompt_width: int,
                 seeds: list[int]) -> None:
        self.settings = settings
        self.truncation = Truncation(top_k=settings.top_k, top_p=settings.top_p, min_p=settings.min_p)
        self.forbidden = torch.tensor(forbidden, dtype=torch.long)
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long)
        self.prompt_width = prompt_width
        self.seeds = list(seeds)
        self._generators: list[torch.Generator] | None = None
        self.logprobs: list[torch.Tensor] = []  # per step: [R] log-prob of the token drawn
        self.drawn: list[torch.Tensor] = []  # per step: [R] the token drawn (a finished row gets pad instead)

    def _rows_generators(self, device: torch.device) -> list[torch.Generator]:
        if self._generators is None:
            self._generators = [torch.Generator(device=device).manual_seed(s) for s in self.seeds]
        return self._generators

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # input_ids [R, L] (prompt block + generated so far), scores [R, V] the model's next-token logits
        logits = scores.float().clone()  # [R, V]
        logits[:, self.forbidden.to(logits.device)] = float("-inf")
        if input_ids.shape[1] - self.prompt_width < self.settings.min_new_tokens:
            logits[:, self.stop_ids.to(logits.device)] = float("-inf")
        if self.settings.temperature == 0:
            chosen = logits.argmax(dim=-1)  # [R]
        else:
            logits = truncate_logits(logits / self.settings.temperature, self.truncation)  # [R, V]
            probs = logits.softmax(dim=-1)  # [R, V]
            gens = self._rows_generators(probs.device)
            if len(gens) != probs.shape[0]:
                raise RuntimeError(f"sampler built for {len(gens)} rows, generate gave {probs.shape[0]}")
            chosen = torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(gens)])  # [R]
        self.drawn.append(chosen)
        if self.settings.logprobs:
            self.logprobs.append(logits.log_softmax(dim=-1).gather(-1, chosen[:, None])[:, 0])  # [R]
        forced = torch.full_like(scores, float("-inf"))  # [R, V]
        return forced.scatter_(1, chosen[:, None], 0.0)

    def stacked(self, steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[R, steps] tokens drawn and [R, steps] their log-probs (None unless requested); ``steps`` is the
        generated length, checked against the steps the sampler ran."""
        if len(self.drawn) != steps:
            raise RuntimeError(f"the sampler ran {len(self.drawn)} steps for {steps} generated tokens")
        drawn = torch.stack(self.drawn, dim=1).cpu()
        return drawn, (torch.stack(self.logprobs, dim=1).cpu() if self.settings.logprobs else None)
