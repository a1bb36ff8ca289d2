"""Log-prob agreement bound between the rollout engine and a float32 transformers forward (no heavy imports:
the CLI reads it at start-up)."""

from __future__ import annotations

# bf16 engine vs fp32 forward on the tiny models: max |d logprob| <= 0.005 measured for every family (Qwen2-VL,
# Qwen2.5-VL, Qwen3-VL) and case (text, one image, two images, video); a vision-layout error moves it by ~0.07.
DEFAULT_TOLERANCE = 0.02
