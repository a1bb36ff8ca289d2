"""The quick start's toy recipe (``examples/grpo_toy_shapes_cpu.yaml``) as the suite's learning tests run it.

As shipped, a tiny random model first has to find the answer words at all: almost none of its two-token answers
starts with a colour, so the reward stays near 0.01 for some 60 steps before it learns which colour the image shows
(the quick start's curve). With the policy's vocabulary cut to the four answers and the end of turn
(``rollout.allowed_tokens``, exact in the engine and the trainer alike), that first phase is gone and only the visual
one is left: measured in one process (2026-11-29), greedy evaluation 1.0 at step 10 and 20 and a sampled reward of
0.03 -> 0.46 over the first ten steps. The launch-mode learning tests run this variant: what they check (that a mode learns, and learns
as one process does) needs the visual phase, not the search for the words, and a CI run has 30 minutes.
"""

from __future__ import annotations

from mmrlhf.tasks.shapes import COLOURS

#: Overrides of the toy recipe that restrict the policy to the colour task's answers and Qwen's end of turn.
ANSWER_WORDS_ONLY: tuple[str, ...] = (f"rollout.allowed_tokens=[{','.join(COLOURS)},\"<|im_end|>\"]",)
