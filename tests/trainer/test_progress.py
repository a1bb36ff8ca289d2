"""The progress bar's text: the collapse warning, reward failures and skipped updates are visible."""

from __future__ import annotations

from mmrlhf.trainer.progress import postfix


def test_postfix_shows_the_key_metrics_in_order():
    text = postfix({"reward/mean": 0.5, "kl/mean": 0.01, "response_length/mean": 2.0,
                    "groups/with_variance_frac": 0.25, "time/step": 1.5, "policy/entropy": 3.2},
                   {"eval/reward/mean": 0.75})
    assert text.split() == ["reward=0.500", "eval=0.750", "kl=0.0100", "len=2.0", "var_groups=0.25", "ent=3.20",
                            "s/step=1.50"]


def test_postfix_flags_reward_failures_nonfinite_skips_and_empty_steps():
    assert "REWARD_MASKED=3" in postfix({"reward/mean": 0.1, "reward/failed_samples": 3.0})
    assert "REWARD_MASKED" not in postfix({"reward/mean": 0.1, "reward/failed_samples": 0.0})
    assert "NONFINITE_SKIPS=1" in postfix({"policy/skipped_steps": 1.0})
    assert "NO_UPDATE" in postfix({"train/empty_steps": 2.0})
    assert "NO_UPDATE" not in postfix({"train/empty_steps": 2.0, "policy/optimizer_steps": 1.0})
    assert "reward" not in postfix({"reward/mean": float("nan")})
