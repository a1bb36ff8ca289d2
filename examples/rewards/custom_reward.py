"""A custom reward function to copy and adapt. Point config at it as ``examples/rewards/custom_reward.py:score``.

The contract: ``fn(responses, prompts, labels, references, **extra_columns)`` returns one entry per sample, in order:
a float, ``None`` ("does not apply to this sample"), or a dict of named parts with an ``overall`` part (the score
the recipe weighs; the other parts are logged as ``reward/<source>/<part>/mean``). Async functions work too.

Extra columns arrive as keyword arguments when the function names them (here ``max_words``): from
``RewardBatch.extra`` when you call the reward engine yourself, or from a request's ``extra`` on ``mmrlhf
serve-reward``. ``mmrlhf train`` hands rewards no dataset columns besides labels and references, so keep such
arguments optional, as ``max_words`` is. Images arrive as ``images`` (lists of PIL images) when the batch carries
them. Score the RESPONSE: the prompt is given for context, and reusing it for format checks would reward text the
policy never wrote.

Use it in a recipe as a function source (``reward.label_map.<name>: {type: function, function:
examples/rewards/custom_reward.py:score, options: {format_weight: 0.1}}``, a path relative to where you start
``mmrlhf train``), or serve it to several trainers:
``mmrlhf serve-reward --reward examples/rewards/custom_reward.py:score --options '{"format_weight": 0.0}'``
(examples/grpo_geometry3k_remote_reward.yaml). Served, it runs in the server's thread pool, so keep it free of
shared mutable state; there ``math_equal`` runs without math-verify's signal timeout (it needs the main thread).
"""

from __future__ import annotations

from mmrlhf.rewards.math_accuracy import math_equal
from mmrlhf.rewards.rules import is_think_answer_format


def score(responses, prompts, labels, references, max_words=None, format_weight=0.2):
    """Format + math accuracy + a length penalty, as named parts.

    ``max_words`` is an optional dataset column (one value per sample); ``format_weight`` is set in config
    (``options: {format_weight: 0.2}``).
    """
    out = []
    for i, (response, reference) in enumerate(zip(responses, references)):
        if reference is None:
            out.append(None)  # no ground truth: this reward does not apply
            continue
        fmt = 1.0 if is_think_answer_format(response) else 0.0
        acc = 1.0 if math_equal(response, reference) else 0.0
        limit = max_words[i] if max_words is not None else None
        too_long = 1.0 if limit is not None and len(response.split()) > limit else 0.0
        overall = format_weight * fmt + (1 - format_weight) * acc - 0.5 * too_long
        out.append({"overall": overall, "format": fmt, "accuracy": acc, "too_long": too_long})
    return out
