"""Log-prob agreement bounds between the rollout engine and a float32 transformers forward (no heavy imports:
the CLI reads them at start-up)."""

from __future__ import annotations

# bf16 engine vs fp32 forward on the tiny models: max |d logprob| <= 0.005 measured for every family and case
# except Qwen3-VL video, where vLLM and transformers agree on the prompt tokens and grids but differ slightly in
# the video vision path (mean 0.005-0.01, max 0.02-0.07 over seeds; present even for a 2-frame static video, so
# not a temporal-position issue). Known gap, documented in docs/environment.md; it gets a looser bound.
DEFAULT_TOLERANCE = 0.02
KNOWN_LOOSER_TOLERANCE = {("qwen3_vl", "video"): 0.1}


def tolerance_for(family: str, case: str, default: float = DEFAULT_TOLERANCE) -> float:
    return max(default, KNOWN_LOOSER_TOLERANCE.get((family, case), default))
