"""Log-prob agreement bounds between a rollout engine and a float32 trainer-side forward (no heavy imports: the CLI
reads them at start-up). Both sides compute the log-probs of the distribution the engine sampled from: logits at
the sampling temperature, vision special tokens excluded (docs/rollout.md)."""

from __future__ import annotations

# bf16 engine vs fp32 forward on the tiny models (every family; text, one image, two images, video; 4 samples x 24
# tokens): max |d logprob| measured 0.0045 at temperature 1 and 0.012 at temperature 0.7 (bf16 logit noise is
# divided by the temperature, so this bound loosens as 1/T). A vision-layout error moves it by ~0.07; a trainer
# step the engine has not received (testing.weights.perturb_) by 0.09 to 0.2.
DEFAULT_TOLERANCE = 0.02

# fp32 engine vs fp32 forward (vLLM on the CPU or the transformers engine vs ActorVL), temperature 1 and 0.7, every
# case: measured <= 1.4e-6. Exception until the actor's Qwen2.5-VL video positions follow vLLM's rule (hardening
# issue, item 6): text after a Qwen2.5-VL video differs by ~1e-3.
FP32_TOLERANCE = 1e-4
