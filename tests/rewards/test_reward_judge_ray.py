"""The judge on its own Ray actor (``backend: ray``): the named actor's engine scores through the same source as
the other backends, is shared by every caller (two sources here, and a scoring task in another process), and the
judge's text per sample survives the trip. Control: the same actor with a rubric that shows only the answer's
length (so the requests still differ, and are all sent) cannot tell right from wrong. The actor's request merging
is checked without Ray (:class:`MergingRunner`)."""

from __future__ import annotations

import asyncio
import sys

import pytest
from PIL import Image

from mmrlhf.rewards.judge.ray_actor import MergingRunner

PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What color is the square?<|im_end|>\n"
          "<|im_start|>assistant\n")
RED = Image.new("RGB", (56, 56), (255, 0, 0))


def test_merging_runner_merges_the_calls_that_wait_and_splits_the_replies():
    seen: list[list[str]] = []

    async def run(items):
        seen.append(list(items))
        await asyncio.sleep(0.05)
        if "bad" in items:
            raise RuntimeError("engine failed")
        return [item.upper() for item in items]

    async def main():
        runner = MergingRunner(run)
        first = asyncio.ensure_future(runner(["a"]))
        await asyncio.sleep(0.01)  # the first call is running: the next two wait and go together
        second, third = runner(["b", "c"]), runner(["d"])
        out = await asyncio.gather(first, second, third)
        # a bad request merged with a good one: the merged call fails, each caller is run alone again
        busy = asyncio.ensure_future(runner(["e"]))
        await asyncio.sleep(0.01)
        failed = await asyncio.gather(busy, runner(["bad"]), runner(["f"]), return_exceptions=True)
        return out, failed, runner

    out, failed, runner = asyncio.run(main())
    assert out == [["A"], ["B", "C"], ["D"]]
    assert seen[:2] == [["a"], ["b", "c", "d"]]
    assert seen[2:] == [["e"], ["bad", "f"], ["bad"], ["f"]]
    assert failed[0] == ["E"] and isinstance(failed[1], RuntimeError) and failed[2] == ["F"]
    assert (runner.calls, runner.runs) == (6, 6)


def _batch(responses, images):
    from mmrlhf.rewards.types import RewardBatch

    n = len(responses)
    return RewardBatch(responses=list(responses), prompts=[PROMPT] * n, labels=["vqa"] * n, references=[None] * n,
                       images=images)


def _score_in_another_process(judge: dict, responses: list[str]) -> tuple[list[float], int]:
    """A caller in a Ray worker process: its own reward engine, the same judge actor (found by name)."""
    from mmrlhf.config.reward import RewardConfig
    from mmrlhf.rewards.engine import RewardComputationEngine

    engine = RewardComputationEngine.from_config(RewardConfig(label_map={"judge": judge},
                                                              recipe={"vqa": [("judge", 1.0)]}))
    result = engine.compute(_batch(responses, None))
    import os

    return result.sources["judge"].tolist(), os.getpid()


@pytest.mark.slow
def test_judge_on_its_own_ray_actor_is_shared_and_scores_the_right_answer_higher(tmp_path):
    import ray
    from judge_testing import build_keyword_judge

    from mmrlhf.config.reward import RewardConfig
    from mmrlhf.rewards.engine import RewardComputationEngine
    from mmrlhf.rewards.judge.ray_actor import judge_actor_name, start_judge_actors
    from mmrlhf.testing.tiny_models import tiny_model_dir

    model = build_keyword_judge(tiny_model_dir("qwen2_vl"), tmp_path / "judge", good="red", bad="blue", gain=2.0)
    judge = {"type": "judge", "backend": "ray", "model": str(model), "max_tokens": 1, "actor_cpus": 1,
             "engine": {"max_model_len": 2048, "dtype": "float32", "limit_mm_per_prompt": {"image": 1}}}
    blind = {**judge, "rubric": "Question: {{ question }}\nThe answer has {{ answer|length }} letters.\n"
                                "Is the answer correct? yes or no."}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker cannot import this test module
    try:
        # As the Ray driver does: the actor first (engine loaded), then every caller finds it by name.
        [created] = start_judge_actors(RewardConfig(label_map={"judge": judge}, recipe={"vqa": [("judge", 1.0)]}))
        # Two sources of one run, both named "judge" in their configs' label maps: one actor, one engine.
        engine = RewardComputationEngine.from_config(RewardConfig(label_map={"judge": judge},
                                                                  recipe={"vqa": [("judge", 1.0)]}))
        control = RewardComputationEngine.from_config(RewardConfig(label_map={"judge": blind},
                                                                   recipe={"vqa": [("judge", 1.0)]}))
        data = _batch(["<think>is it blue?</think>red", "blue", "red", "blue"], [[], [], [RED], [RED]])
        result = engine.compute(data)
        scores = result.sources["judge"].tolist()
        hidden = control.compute(data).sources["judge"].tolist()
        print(f"\nray actor judge (red right): {scores}; answer hidden: {hidden}")
        assert result.valid.all(), result.metrics
        assert scores[0] > 0.5 > scores[1] and scores[2] > 0.5 > scores[3]
        assert scores[0] - scores[1] > 0.2
        assert abs(hidden[0] - hidden[1]) < 1e-6 and abs(hidden[2] - hidden[3]) < 1e-6
        assert result.notes["judge/text"] == ["yes", "no", "yes", "no"]  # the judge's text comes back per sample

        remote = ray.remote(num_cpus=1)(_score_in_another_process)
        other, pid = ray.get(remote.remote(judge, ["red", "blue"]))
        stats = ray.get(ray.get_actor(judge_actor_name("judge")).stats.remote())
        assert ray.get(created.stats.remote())["pid"] == stats["pid"]  # the driver's actor served every caller
        print(f"another process ({pid}): {other}; actor stats: {stats}")
        assert other[0] > 0.5 > other[1]
        assert pid != stats["pid"] and stats["calls"] == 3  # this process's two sources + the other process
    finally:
        ray.shutdown()
