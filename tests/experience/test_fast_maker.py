"""FastExperienceMaker on the real vLLM engine (CPU): a mixed text/image/video batch end to end."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor

from mmrlhf.algorithms.kl import FixedKLController
from mmrlhf.data.processor import MultimodalDataProcessor
from mmrlhf.experience.fast_maker import FastExperienceMaker
from mmrlhf.experience.kinds.single_turn import PromptMismatchError
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout.types import PromptTooLongError, SamplingSettings
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE
from maker_helpers import RecordingReward, mixed_batch, reward_engine

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
N = 3


@pytest.fixture(scope="module")
def parts():
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    path = str(tiny_model_dir("qwen2_vl"))
    adapter, processor = get_adapter(path), AutoProcessor.from_pretrained(path)
    actor = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    ref = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMEngine(path, adapter, max_model_len=1024)
    return path, adapter, processor, actor, ref, engine


def _maker(parts, fn, **overrides):
    path, adapter, processor, actor, ref, engine = parts
    settings = ExperienceSettings(n_samples_per_prompt=N, micro_batch_size=4, need_reference=True,
                                  kl_in_reward=True, compute_entropy=True, **overrides)
    return FastExperienceMaker(actor, engine, MultimodalDataProcessor(processor, 2048, adapter), reward_engine(fn),
                               processor.tokenizer, settings, SamplingSettings(max_new_tokens=12, seed=0),
                               initial_model=ref, kl_controller=FixedKLController(0.05))


def test_mixed_batch_end_to_end(parts):
    path, adapter, processor, *_ = parts
    fn = RecordingReward()
    prompts, images, videos, refs, labels = mixed_batch()
    exps = _maker(parts, fn).make_experience_list(prompts, images=images, videos=videos, references=refs,
                                                  labels=labels)
    assert [e.sequences.shape[0] for e in exps] == [4, 4, 4, 3]  # 15 samples, micro-batches of 4
    expected = MultimodalDataProcessor(processor, 2048, adapter).process_multimodal_batch(
        prompts, images, refs, n_samples_per_prompt=N, all_videos=videos, all_labels=labels)
    k = 0
    for e in exps:
        b, a = e.action_log_probs.shape
        for tensor in (e.base_action_log_probs, e.advantages, e.returns, e.kl, e.action_entropy, e.action_mask):
            assert tensor.shape == (b, a)
        assert torch.equal(e.action_mask.sum(1), e.info["response_length"])
        assert torch.equal(e.attention_mask.sum(1), e.info["total_length"])
        assert torch.all(e.advantages[~e.action_mask] == 0) and torch.all(e.kl[~e.action_mask] == 0)
        for i in range(b):
            p = len(expected.all_prompt_token_ids[k])
            row = e.sequences[i][e.attention_mask[i].bool()]
            assert row[:p].tolist() == expected.all_prompt_token_ids[k]  # prompt exactly as processed
            got, want = e.vision_inputs(i), expected.all_vision_inputs[k]
            assert set(got) == {key for key in want if key in got} and set(got) <= set(want)
            for key in got:
                assert torch.equal(got[key], want[key]), (k, key)
            assert e.image_num[i] == expected.all_images_num[k] and e.video_num[i] == expected.all_videos_num[k]
            n_img = int((e.mm_token_type_ids[i] == 1).sum())
            grid = got.get("image_grid_thw")
            assert n_img == (0 if grid is None else int(adapter.tokens_per_grid(grid).sum()))
            k += 1
    # GRPO groups (n consecutive samples of one prompt) have zero-sum advantages.
    seq_adv = torch.cat([(e.advantages.sum(1) / e.action_mask.sum(1).clamp(min=1)) for e in exps])
    assert torch.allclose(seq_adv.view(-1, N).sum(1), torch.zeros(len(prompts)), atol=1e-4)
    # Rule rewards saw the response text only, never the prompt.
    seen = [r for call in fn.calls for r in call["responses"]]
    assert len(seen) == 15 and not any("What color" in r or "<|im_start|>" in r for r in seen)
    info = exps[0].info["batch"]
    assert info["samples"] == 15 and info["skipped_prompts"] == 0
    assert info["engine_logprob_diff/max"] < DEFAULT_TOLERANCE
    assert {"time/generate", "time/actor", "time/reference", "time/reward", "time/total"} <= set(info)
    assert "reward/parity/mean" in info and 0 <= info["truncation_rate"] <= 1


def test_packed_log_probs_equal_padded(parts):
    prompts, images, videos, refs, labels = mixed_batch()
    padded = _maker(parts, RecordingReward()).make_experience_list(prompts, images=images, videos=videos,
                                                                    references=refs)
    packed = _maker(parts, RecordingReward(), packing=True).make_experience_list(
        prompts, images=images, videos=videos, references=refs)
    for a, b in zip(padded, packed):
        assert b.packed_seq_lens is not None and b.sequences.shape[0] == 1
        assert torch.equal(a.action_mask, b.action_mask)
        m = a.action_mask
        assert torch.allclose(a.action_log_probs[m], b.action_log_probs[m], atol=1e-5)
        assert torch.allclose(a.base_action_log_probs[m], b.base_action_log_probs[m], atol=1e-5)
        assert torch.allclose(a.advantages, b.advantages, atol=1e-5)


def test_too_long_prompt_is_skipped_and_counted_or_errors(parts):
    engine = parts[-1]
    prompts = ["<image>What color is the square?", " ".join(["red"] * 1100), "Describe the picture."]
    from PIL import Image

    images = [[Image.new("RGB", (56, 56), (255, 0, 0))], None, None]
    maker = _maker(parts, RecordingReward())
    exps = maker.make_experience_list(prompts, images=images)
    info = exps[0].info["batch"]
    assert info["skipped_prompts"] == 1 and info["samples"] == 2 * N
    assert sum(e.sequences.shape[0] for e in exps) == 2 * N
    engine.prompt_too_long = "error"
    try:
        with pytest.raises(PromptTooLongError, match="request 1"):
            maker.make_experience_list(prompts, images=images)
    finally:
        engine.prompt_too_long = "skip"


def test_engine_prompt_mismatch_is_an_error_naming_the_sample(parts):
    maker = _maker(parts, RecordingReward())
    real = maker.engine

    class Shifted:
        def generate(self, requests, settings):
            result = real.generate(requests, settings)
            result.outputs[1].prompt_token_ids = result.outputs[1].prompt_token_ids[1:]
            return result

    maker.engine = Shifted()
    with pytest.raises(PromptMismatchError, match=f"record 1, sample {N}:"):
        maker.make_experience_list(["Describe it.", "What color is the square?"])
    with pytest.raises(PromptMismatchError, match=f"record 1 \\(id='colour-7'\\), sample {N}:"):
        maker.make_experience_list(["Describe it.", "What color is the square?"], record_ids=["a-1", "colour-7"])
    with pytest.raises(TypeError, match="unknown generation argument"):
        _maker(parts, RecordingReward()).make_experience_list(["hi"], temprature=0.5)


def test_left_truncated_prompt_reaches_the_engine_as_processed(parts):
    """The engine gets the processor's (truncated) ids, not the original text: no mismatch, same prompt."""
    from PIL import Image

    from mmrlhf.config.data import DataConfig

    path, adapter, processor, actor, ref, engine = parts
    config = DataConfig(prompt_max_len=40, prompt_overflow="truncate_left")
    dp = MultimodalDataProcessor(processor, 40, adapter, data_config=config)
    maker = _maker(parts, RecordingReward())
    maker.data_processor = dp
    long_prompt = "<image>" + " ".join(["red green blue"] * 30) + " What color is the square?"
    exps = maker.make_experience_list([long_prompt], images=[[Image.new("RGB", (56, 56), (255, 0, 0))]])
    info = exps[0].info["batch"]
    assert info["truncated_prompts"] == 1 and info["samples"] == N
    e = exps[0]
    prompt_len = int(e.attention_mask[0].sum()) - int(e.info["response_length"][0])
    assert prompt_len <= 40
    grid = e.vision_inputs(0)["image_grid_thw"]
    assert int((e.mm_token_type_ids[0] == 1).sum()) == int(adapter.tokens_per_grid(grid).sum())


def test_reward_normalisation_whitening_and_state(parts):
    prompts, images, videos, refs, labels = mixed_batch()
    maker = _maker(parts, RecordingReward(), reward_normalization=True, advantage_whitening=True)
    exps = maker.make_experience_list(prompts, images=images, videos=videos, references=refs)
    adv = torch.cat([e.advantages[e.action_mask] for e in exps])
    assert abs(float(adv.mean())) < 1e-4 and abs(float(adv.std(unbiased=False)) - 1) < 1e-2
    info = exps[0].info["batch"]
    assert {"reward_running_mean", "advantage_mean", "advantage_std"} <= set(info)
    state = maker.state_dict()
    assert set(state) == {"calls", "kl_controller", "reward_norm"}
    fresh = _maker(parts, RecordingReward(), reward_normalization=True)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def test_engine_matches_actor_before_and_after_a_weight_sync(parts):
    """The rollout's own check (engine vs actor log-probs on the sampled tokens) across a policy update."""
    from mmrlhf.testing.weights import perturb_

    path, adapter, processor, _, ref, engine = parts
    actor = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    maker = _maker(parts, RecordingReward())
    maker.actor = actor
    prompts, images, videos, refs, _ = mixed_batch()
    gap = lambda: maker.make_experience_list(prompts, images=images, videos=videos)[0].info["batch"][  # noqa: E731
        "engine_logprob_diff/max"]
    assert gap() < DEFAULT_TOLERANCE
    perturb_(actor.model)
    assert gap() > DEFAULT_TOLERANCE  # the engine still serves the old policy
    engine.update_weights(actor.model.state_dict().items())
    assert gap() < DEFAULT_TOLERANCE
    engine.update_weights(ActorVL.from_pretrained(path, dtype=torch.float32).model.state_dict().items())  # restore


def test_calls_draw_fresh_samples_and_resume_reproduces_them(parts):
    """Each call samples a fresh stream (seed advances per call); restoring state_dict replays a call exactly."""
    prompts = ["Describe the picture in one sentence.", "Name a colour."]
    maker = _maker(parts, RecordingReward())
    ids = lambda exps: [e.sequences[i][e.attention_mask[i].bool()].tolist()  # noqa: E731
                        for e in exps for i in range(e.sequences.shape[0])]
    state = maker.state_dict()
    first = ids(maker.make_experience_list(prompts))
    second = ids(maker.make_experience_list(prompts))
    assert first != second
    maker.load_state_dict(state)
    assert ids(maker.make_experience_list(prompts)) == first


def test_scoring_follows_the_call_temperature(parts):
    """Old log-probs are taken at the temperature the call sampled with, and the engine reports log-probs of the
    distribution it sampled from, so the engine/actor comparison holds at every temperature."""
    maker = _maker(parts, RecordingReward())
    hot = maker.make_experience_list(["Name a colour."], temperature=1.0)
    cool = maker.make_experience_list(["Name a colour."], temperature=0.5, seed=0)
    assert hot[0].info["batch"]["engine_logprob_diff/max"] < DEFAULT_TOLERANCE
    assert cool[0].info["batch"]["engine_logprob_diff/max"] < DEFAULT_TOLERANCE
    e = cool[0]
    m = e.action_mask
    assert torch.allclose(e.rollout_log_probs[m], e.action_log_probs[m], atol=DEFAULT_TOLERANCE)
    rescored = maker.actor(_rebuild(maker, e), temperature=0.5).log_probs
    assert torch.allclose(rescored[e.action_mask], e.action_log_probs[e.action_mask], atol=1e-5)


def _rebuild(maker, e):
    from mmrlhf.models.batch import SamplesVL

    return SamplesVL(sequences=e.sequences, attention_mask=e.attention_mask, action_mask=e.action_mask,
                     num_actions=e.action_mask.shape[1], packed_seq_lens=None,
                     response_length=e.info["response_length"], total_length=e.info["total_length"],
                     mm_token_type_ids=e.mm_token_type_ids, image_num=e.image_num, video_num=e.video_num)


class _RecordingModel(torch.nn.Module):
    """A 'local reward model' that records the ids it was given and scores 1."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask, **vision):
        self.seen.extend(row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask))
        return torch.ones(input_ids.shape[0])


def test_local_and_text_reward_sources_see_the_same_truncated_prompt(parts):
    """One definition of the prompt a reward source sees: the ids the policy saw (local models) and their
    chat-templated text (rules and remote servers, which get RewardBatch.prompts): processing that text gives
    exactly the local model's prompt ids, also after left truncation."""
    from PIL import Image

    from mmrlhf.config.data import DataConfig
    from mmrlhf.rewards.engine import RewardComputationEngine
    from mmrlhf.rewards.local_model import LocalRewardModel
    from mmrlhf.rewards.sources import FunctionSource

    path, adapter, processor, *_ = parts
    fn, model = RecordingReward(), _RecordingModel()
    engine = RewardComputationEngine({"rule": FunctionSource(fn, name="rule"),
                                      "rm": LocalRewardModel(model, name="rm", device="cpu")},
                                     {}, default_recipe=[("rule", 1.0), ("rm", 1.0)])
    maker = _maker(parts, fn)
    maker.reward_engine = engine
    maker.data_processor = MultimodalDataProcessor(processor, 40, adapter, data_config=DataConfig(prompt_max_len=40))
    image = Image.new("RGB", (56, 56), (255, 0, 0))
    long_prompt = "<image>" + " ".join(["red green blue"] * 30) + " What color is the square?"
    rollout = maker.generate_rollout([long_prompt], images=[[image]], references=["red"])
    assert rollout.metrics["truncated_prompts"] == 1
    text = fn.calls[-1]["prompts"][0]
    assert "What color is the square?" in text and text.count("red green blue") < 30  # truncated text
    ids = processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    prompt_ids = rollout.rows.prompt_ids[0]
    assert ids == prompt_ids and model.seen[0][: len(prompt_ids)] == prompt_ids
    assert model.seen[0][len(prompt_ids):] == rollout.rows.response_ids[0]


def test_engine_errors_name_the_record(parts):
    engine = parts[-1]
    prompts = ["Describe the picture.", " ".join(["red"] * 1100)]
    maker = _maker(parts, RecordingReward())
    engine.prompt_too_long = "error"
    try:
        with pytest.raises(PromptTooLongError, match="record 'q-long'"):
            maker.make_experience_list(prompts, record_ids=["q-short", "q-long"])
    finally:
        engine.prompt_too_long = "skip"
    rollout = maker.generate_rollout(prompts, record_ids=["q-short", "q-long"])
    assert set(rollout.rows.record_ids) == {"q-short"} and rollout.metrics["skipped_prompts"] == 1


@pytest.mark.slow
def test_tied_embedding_model_through_the_maker_and_a_weight_sync():
    """Tied lm_head / embeddings (Qwen2-VL-2B, Qwen2.5-VL-3B): the maker's engine and actor agree before and after
    a weight update pushed by name (a missed tied head would leave the engine on the old policy)."""
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.testing.weights import perturb_

    path = str(tiny_model_dir("qwen2_vl", tied=True))
    adapter, processor = get_adapter(path), AutoProcessor.from_pretrained(path)
    actor = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    assert actor.model.get_output_embeddings().weight is actor.model.get_input_embeddings().weight
    engine = VLLMEngine(path, adapter, max_model_len=1024, dtype="float32")
    maker = FastExperienceMaker(actor, engine, MultimodalDataProcessor(processor, 2048, adapter),
                                reward_engine(RecordingReward()), processor.tokenizer,
                                ExperienceSettings(n_samples_per_prompt=2, micro_batch_size=4),
                                SamplingSettings(max_new_tokens=8, seed=0, temperature=0.7))
    prompts, images, videos, refs, _ = mixed_batch()
    gap = lambda: maker.make_experience_list(prompts, images=images, videos=videos)[0].info["batch"][  # noqa: E731
        "engine_logprob_diff/max"]
    try:
        assert gap() < 1e-4
        perturb_(actor.model)
        assert gap() > DEFAULT_TOLERANCE
        from mmrlhf.rollout.weight_sync import sync_weights

        sync_weights(actor.model, engine)
        assert gap() < 1e-4
    finally:
        engine.close()
