"""The Ray mode's bookkeeping as pure logic: the staleness gate, the produced / consumed ledger, the staleness
statistics and the refusals of what the mode does not support (no Ray needed; milliseconds)."""

from __future__ import annotations

import pytest

from mmrlhf.launch.ray.ledger import (
    ExperienceLedger,
    LedgerError,
    StaleExperienceError,
    StalenessStats,
    check_staleness,
    may_start_rollout,
    min_rollout_version,
)


def simulate(max_steps: int, k: int) -> list[int]:
    """The driver's schedule with instant rollouts: before training step t (the rollout side then holds version t),
    every step s <= t + k is started, at the version held then. Returns the staleness of each consumed step."""
    started: dict[int, int] = {}
    staleness = []
    for t in range(max_steps):
        for s in range(max_steps):
            if s not in started and may_start_rollout(s, t, k):
                started[s] = t
        staleness.append(check_staleness(t, started[t], k))
    return staleness


@pytest.mark.parametrize("k", [0, 1, 3])
def test_gate_bounds_staleness_and_uses_the_whole_budget(k):
    lags = simulate(12, k)
    assert max(lags) == k  # the gate lets rollouts run ahead as far as allowed ...
    assert all(0 <= s <= k for s in lags)  # ... and never further


def test_gate_versions():
    assert min_rollout_version(0, 2) == 0 and min_rollout_version(5, 2) == 3 and min_rollout_version(5, 0) == 5
    assert may_start_rollout(5, 4, 1) and not may_start_rollout(5, 3, 1)
    with pytest.raises(ValueError):
        min_rollout_version(-1, 0)


def test_check_staleness_refuses_too_old_and_future_experiences():
    assert check_staleness(7, 6, 1) == 1
    with pytest.raises(StaleExperienceError, match="max_staleness=1"):
        check_staleness(7, 5, 1)
    with pytest.raises(StaleExperienceError, match="never made"):
        check_staleness(3, 4, 1)


def test_ledger_counts_each_experience_once():
    led = ExperienceLedger()
    led.produce(0, 0, 8)
    led.produce(0, 1, 8)
    led.consume(0, 0, 8)
    with pytest.raises(LedgerError, match=r"consumed shares \[0\]"):
        led.check_step(0, 2)  # share 1 not consumed yet
    led.consume(0, 1, 8)
    assert led.check_step(0, 2) == {"ledger/produced": 16.0, "ledger/consumed": 16.0}
    with pytest.raises(LedgerError, match="delivered twice"):
        led.consume(0, 1, 8)
    with pytest.raises(LedgerError, match="produced twice"):
        led.produce(0, 0, 8)
    with pytest.raises(LedgerError, match="never produced"):
        led.consume(1, 0, 8)
    led.produce(1, 0, 8)
    with pytest.raises(LedgerError, match="8 samples produced, 7 consumed"):
        led.consume(1, 0, 7)
    with pytest.raises(LedgerError, match=r"never consumed .*\[\(1, 0\)\]"):
        led.check_all()
    led.consume(1, 0, 8)
    assert led.check_all() == (24, 24)


def test_staleness_stats():
    stats = StalenessStats()
    stats.add(0, 10)
    stats.add(1, 6)
    stats.add(1, 4)
    m = stats.metrics([1, 0])
    assert m["async/staleness_mean"] == 0.5 and m["async/staleness_max"] == 1.0
    assert m["async/staleness_count_0"] == 10.0 and m["async/staleness_count_1"] == 10.0


@pytest.mark.parametrize("override, key", [
    ({"distributed": {"backend": "ray", "num_trainer_actors": 5}}, "distributed.num_trainer_actors"),
    ({"distributed": {"backend": "ray", "max_staleness": 1}, "algorithm": {"rollout_correction": "none"}},
     "algorithm.rollout_correction"),
    ({"distributed": {"backend": "ray", "num_rollout_actors": 5}}, "distributed.num_rollout_actors"),
])
def test_unsupported_settings_are_refused_by_key(tmp_path, override, key):
    from mmrlhf.config import build_config
    from mmrlhf.launch.ray.driver import check_ray_config

    data = {"model": {"pretrain": str(tmp_path)}, "trainer": {"rollout_batch_size": 4},
            "distributed": {"backend": "ray"}}
    for section, values in override.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        check_ray_config(build_config(data))
