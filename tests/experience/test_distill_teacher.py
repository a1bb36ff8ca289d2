"""On-policy distillation through the experience maker: the teacher is built from ``model.teacher``, scores the
student's samples (images included) in the scoring forwards, and its advantage reaches the experiences."""

from __future__ import annotations

import contextlib
import math
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from mmrlhf.config import build_config
from mmrlhf.experience.builder import build_experience_maker, build_teacher
from mmrlhf.models.adapters import get_adapter
from mmrlhf.testing.tiny_models import tiny_model_dir


def _config(student, teacher, trainer=None, **algorithm):
    return build_config({
        "trainer": trainer or {},
        "model": {"pretrain": str(student), "teacher": str(teacher), "dtype": "float32"},
        "data": {"prompt_max_len": 256},
        "rollout": {"engine": "transformers", "n_samples_per_prompt": 2, "max_new_tokens": 4, "max_model_len": 512,
                    "micro_rollout_batch_size": 3, "seed": 4},
        "reward": {"label_map": {"colour": {"type": "function", "function": "exact_match"}},
                   "recipe": {"colour": [["colour", 1.0]]}},
        "algorithm": {"advantage_estimator": "distill", "distill_coef": 1.0, **algorithm},
    })


def _experiences(cfg):
    stack = build_experience_maker(cfg, device="cpu")
    img = Image.new("RGB", (56, 56), (255, 0, 0))
    exps = stack.maker.make_experience_list(["<image>What color is the square?", "Name a colour."],
                                            images=[[img], None], references=["red", "blue"],
                                            labels=["colour", "colour"])
    return stack, exps


def _uniform_teacher(tmp_path, scale=0.0):
    """A copy of the tiny student whose head is scaled by ``scale``. 0 (the default): every logit 0, so it scores
    each allowed token -log(number of allowed tokens), whatever the context; a large scale: the student's
    distribution sharpened (the tiny random student is close to uniform, so it differs from either)."""
    src = tiny_model_dir("qwen2_vl")
    dst = tmp_path / f"teacher_head_x{scale:g}"
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * scale
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_teacher_equal_to_the_student_gives_zero_advantage():
    student = tiny_model_dir("qwen2_vl")
    stack, exps = _experiences(_config(student, student))
    assert stack.teacher is not None and stack.teacher is not stack.actor
    for e in exps:
        assert e.action_mask.any()
        torch.testing.assert_close(e.advantages, torch.zeros_like(e.advantages), rtol=0, atol=1e-5)
    assert abs(exps[0].info["batch"]["distill/reverse_kl"]) < 1e-5


@pytest.mark.parametrize("layout", [{"shared_prompt": False}, {"packing_samples": True, "shared_prompt": False},
                                    {"shared_prompt": True}],
                         ids=["padded", "packed", "shared_prompt"])
def test_a_different_teacher_gives_its_log_ratio_with_the_expected_sign(tmp_path, layout):
    """Whatever layout the scoring forwards use, the teacher scores the same tokens as the student."""
    teacher = _uniform_teacher(tmp_path)
    stack, exps = _experiences(_config(tiny_model_dir("qwen2_vl"), teacher, layout))
    assert stack.maker.settings.packing == bool(layout.get("packing_samples"))
    assert stack.maker.settings.shared_prompt == layout["shared_prompt"]
    allowed = stack.teacher.model.get_output_embeddings().weight.shape[0] - len(stack.teacher.excluded_token_ids)
    uniform = -math.log(allowed)
    signs = set()
    for e in exps:  # image and text prompts alike
        m = e.action_mask
        want = (uniform - e.action_log_probs) * m  # the oracle: teacher minus student, per token
        torch.testing.assert_close(e.advantages, want, rtol=0, atol=1e-4)
        # teacher more likely than the student -> positive; less likely -> negative
        more = (uniform > e.action_log_probs) & m
        assert (e.advantages[more] > 0).all() and (e.advantages[m & ~more] < 0).all()
        signs |= {bool(x) for x in more[m]}
    assert signs == {True, False}  # both cases occurred in the batch


def test_mixed_with_grpo_adds_the_term_and_logs_it(tmp_path):
    teacher = _uniform_teacher(tmp_path)
    student = tiny_model_dir("qwen2_vl")
    cfg = _config(student, teacher, advantage_estimator="grpo", distill_coef=0.5)
    stack, exps = _experiences(cfg)
    info = exps[0].info["batch"]
    assert "distill/reverse_kl" in info and "time/teacher" in info
    assert stack.maker.settings.distill_coef == 0.5


def test_the_teacher_must_be_of_the_students_family():
    cfg = _config(tiny_model_dir("qwen2_vl"), tiny_model_dir("qwen2_5_vl"))
    with pytest.raises(ValueError, match="same family"):
        build_teacher(cfg, get_adapter(str(tiny_model_dir("qwen2_vl"))), torch.device("cpu"))


# ---- the top-k loss term (algorithm.distill_loss_coef): the teacher's record, and the term in the update ----------

LAYOUTS = {"padded": {"shared_prompt": False}, "packed": {"packing_samples": True, "shared_prompt": False},
           "shared_prompt": {"shared_prompt": True}}


def _loss_config(teacher, layout, k=4):
    """The loss term alone: no distillation advantage, and a zero task advantage (so the policy loss has no
    gradient and what trains is the term)."""
    return _config(tiny_model_dir("qwen2_vl"), teacher, LAYOUTS[layout], distill_coef=0.0, distill_loss_coef=1.0,
                   distill_topk=k)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_teachers_top_k_is_recorded_for_image_prompts(tmp_path, layout):
    """A uniform teacher (zeroed head) gives every allowed token -log(allowed): its top-k log-probs are exactly
    that on every response position, with k distinct allowed ids, and 0 off the mask."""
    stack, exps = _experiences(_loss_config(_uniform_teacher(tmp_path), layout, k=4))
    assert stack.maker.settings.distill_topk == 4 and stack.teacher is not None
    excluded = set(stack.teacher.excluded_token_ids)
    allowed = stack.teacher.model.get_output_embeddings().weight.shape[0] - len(excluded)
    assert any(e.image_num and max(e.image_num) > 0 for e in exps)  # the image prompt went through
    for e in exps:
        lp, ids, m = e.teacher_topk_log_probs, e.teacher_topk_ids, e.action_mask
        assert lp.shape == ids.shape == (*m.shape, 4) and ids.dtype == torch.int32
        torch.testing.assert_close(lp[m], torch.full_like(lp[m], -math.log(allowed)), rtol=0, atol=1e-5)
        assert (lp[~m] == 0).all() and (ids[~m] == 0).all()
        picked = ids[m]  # [n, k]
        assert not set(picked.flatten().tolist()) & excluded
        assert all(len(set(row)) == 4 for row in picked.tolist())
        torch.testing.assert_close(e.advantages, torch.zeros_like(e.advantages), rtol=0, atol=0)


class _GradProbe:
    """A stepper that takes no step: it records the gradient norm of each optimiser step and clears it."""

    def __init__(self, params):
        from mmrlhf.parallel.world import single

        self.params = [p for p in params if p.requires_grad]
        self.world, self.skipped_total, self.lr, self.norms = single(), 0, 0.0, []

    def step(self, finite):
        norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in self.params if p.grad is not None)))
        for p in self.params:
            p.grad = None
        self.norms.append(norm)
        return norm, True

    def computing(self):  # no compute copy: the forwards run on the model's own weights
        return contextlib.nullcontext()

    def release(self):
        pass


def _update(stack, exps, layout, direction):
    from mmrlhf.experience.batching import split_experience
    from mmrlhf.experience.rollout import ScoringDistribution
    from mmrlhf.trainer.policy_update import PolicyUpdater, PolicyUpdateSettings, prepare_policy_targets

    items = [it for e in exps for it in split_experience(e)]
    s = PolicyUpdateSettings(train_batch_size=len(items), micro_batch_size=3, shuffle=False,
                             packing=layout == "packed", distill_loss_coef=1.0, distill_loss_kl=direction)
    items, _ = prepare_policy_targets(items, s)
    probe = _GradProbe(stack.actor.parameters())
    metrics = PolicyUpdater(stack.actor, probe, s, pad_id=stack.maker.pad_id).update(
        items, distribution=ScoringDistribution(temperature=1.0), generator=None)
    return probe.norms, metrics


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_loss_term_and_its_gradient_vanish_when_the_teacher_is_the_student(tmp_path, layout):
    """Through the update (the student's log-probs gathered at the recorded ids from its own lm_head chunks): a
    teacher equal to the student gives a KL of ~0 and no gradient; a different teacher (the control) gives a
    positive KL and a gradient, in each direction."""
    student = tiny_model_dir("qwen2_vl")
    same_stack, same = _experiences(_loss_config(student, layout))
    other_stack, other = _experiences(_loss_config(_uniform_teacher(tmp_path, scale=30.0), layout))
    for direction in ("forward", "reverse"):
        norms, metrics = _update(same_stack, same, layout, direction)
        ctrl_norms, ctrl = _update(other_stack, other, layout, direction)
        assert len(norms) == len(ctrl_norms) == 1
        assert ctrl["policy/distill_topk_kl"] > 0.1 and ctrl_norms[0] > 0.1
        assert abs(metrics["policy/distill_topk_kl"]) < 1e-5 * ctrl["policy/distill_topk_kl"]
        assert norms[0] < 1e-4 * ctrl_norms[0]
        assert 0 < metrics["policy/distill_teacher_topk_mass"] < 1


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_students_gather_at_the_teachers_ids_in_one_forward_or_in_groups(layout):
    """With the teacher equal to the student, the student's log-probs gathered at the recorded ids are the recorded
    top-k log-probs, and its own top-k is the record; one forward or per-sample groups (``micro_batch_size``) give
    the same [B, A, k] tensors."""
    from mmrlhf.experience.batching import collate, split_experience

    stack, exps = _experiences(_loss_config(tiny_model_dir("qwen2_vl"), layout, k=3))
    items = [it for e in exps for it in split_experience(e)]
    batch = collate(items, packed=layout == "packed", pad_id=stack.maker.pad_id, adapter=stack.actor.adapter)
    ids, want = batch.token["teacher_topk_ids"], batch.token["teacher_topk_log_probs"]
    mask = batch.token["loss_mask"]
    with torch.no_grad():
        outs = [stack.actor(batch.samples, vision_extra=batch.vision_extra, topk=3, gather_ids=ids,
                            micro_batch_size=micro) for micro in (None, 1)]
    for out in outs:
        assert out.gathered_log_probs.shape == want.shape
        torch.testing.assert_close(out.gathered_log_probs[mask], want[mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(out.topk_log_probs[mask], want[mask], rtol=0, atol=1e-5)
        assert torch.equal(out.topk_ids[mask], ids[mask].long())
    for name in ("gathered_log_probs", "topk_log_probs"):
        torch.testing.assert_close(getattr(outs[1], name), getattr(outs[0], name), rtol=0, atol=1e-5)


def test_top_k_outputs_regroup_from_forwards_to_chunks_with_their_last_dimension():
    """A token budget may score other micro-batches than the experiences keep: [b, A, k] outputs move to their
    chunks row for row like the [b, A] ones, zero-padded along the positions only."""
    from mmrlhf.experience.scoring_split import regroup

    g = torch.Generator().manual_seed(0)
    parts = [{"lp": torch.randn(2, 3, generator=g), "top": torch.randn(2, 3, 4, generator=g)},
             {"lp": torch.randn(1, 5, generator=g), "top": torch.randn(1, 5, 4, generator=g)}]
    micros, chunks, widths = [[2, 0], [1]], [[0, 1], [2]], [5, 3]
    out = regroup(parts, micros, chunks, widths)
    rows = {2: (0, 0), 0: (0, 1), 1: (1, 0)}  # sample -> (forward, row)
    for c, (chunk, w) in enumerate(zip(chunks, widths)):
        assert out[c]["top"].shape == (len(chunk), w, 4)
        for j, sample in enumerate(chunk):
            f, r = rows[sample]
            for key in ("lp", "top"):
                src = parts[f][key][r]
                n = min(w, src.shape[0])
                assert torch.equal(out[c][key][j, :n], src[:n])
                assert (out[c][key][j, n:] == 0).all()
