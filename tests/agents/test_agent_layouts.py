"""Multi-turn trajectories (observation images in the response) score the same in every layout, and as the
trajectory alone in one full forward: padded, packed and grouped (shared first prompt) log-probs of the policy
tokens agree at float32 summation tolerance, observation tokens are never scored, and a control with two
observation images swapped must fail."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.experience.grouped import build_grouped_samples
from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.models.actor import ActorVL
from mmrlhf.testing.tolerances import assert_close_at_scale, close_at_scale
from agent_testing import load_tools_model, multi_turn_pieces, reference_log_probs

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    model, processor, adapter, data = load_tools_model(request.param)
    return model, processor, adapter, data, multi_turn_pieces(processor, adapter, data)


def _score(actor, built):
    out = actor(built.samples, vision_extra=built.vision_extra)
    return out.log_probs, out.action_mask


def _builds(pieces, adapter, pad_id):
    common = dict(pad_id=pad_id, eos_id=(), adapter=adapter, vision=pieces.vision, response_masks=pieces.masks)
    return {
        "padded": build_padded_samples(pieces.prompt_ids, pieces.response_ids, **common),
        "packed": build_packed_samples(pieces.prompt_ids, pieces.response_ids, **common),
        "grouped": build_grouped_samples(pieces.prompt_ids, pieces.response_ids, **common),
    }


@torch.no_grad()
def test_every_layout_scores_the_trajectory_alone(setup):
    model, processor, adapter, _, pieces = setup
    actor = ActorVL(model, adapter)
    builds = _builds(pieces, adapter, processor.tokenizer.pad_token_id)
    assert int(builds["grouped"].samples.sequences.shape[0]) == 1  # the group shares its first prompt: one row
    refs = [reference_log_probs(model, adapter, p, r, m, v)
            for p, r, m, v in zip(pieces.prompt_ids, pieces.response_ids, pieces.masks, pieces.vision)]
    for name, built in builds.items():
        log_probs, mask = _score(actor, built)
        for i, (ref, m) in enumerate(zip(refs, pieces.masks)):
            expected_mask = torch.tensor(m, dtype=torch.bool)
            assert torch.equal(mask[i, : len(m)], expected_mask), f"{name}: sample {i} scores observation tokens"
            assert not mask[i, len(m):].any()
            got = log_probs[i, : len(m)][expected_mask]
            assert torch.isfinite(got).all()
            assert_close_at_scale(got, ref, msg=f"{name} layout, sample {i}")
            assert (log_probs[i, : len(m)][~expected_mask] == 0).all()  # observation tokens carry no log-prob


@torch.no_grad()
def test_swapped_observation_images_change_the_scores(setup):
    """Control: the same ids with the two images of the second observation swapped (same sizes in both orders is
    impossible here, so their grids swap too) must not pass the comparison."""
    model, processor, adapter, _, pieces = setup
    actor = ActorVL(model, adapter)
    v = dict(pieces.vision[0])
    grid = v["image_grid_thw"]
    rows = grid.prod(-1).tolist()
    parts = list(v["pixel_values"].split(rows))
    parts[2], parts[3] = parts[3], parts[2]
    swapped_grid = grid.clone()
    swapped_grid[[2, 3]] = grid[[3, 2]]
    tokens = adapter.tokens_per_grid(grid).tolist()
    if tokens[2] != tokens[3]:  # different token counts: the ids would disagree; swap pixels only, same grids
        parts = list(v["pixel_values"].split(rows))
        perturbed = parts[2] + 0.5
        parts[2] = perturbed
        swapped_grid = grid
    v["pixel_values"], v["image_grid_thw"] = torch.cat(parts), swapped_grid
    ref = reference_log_probs(model, adapter, pieces.prompt_ids[0], pieces.response_ids[0], pieces.masks[0],
                              pieces.vision[0])
    built = build_padded_samples(pieces.prompt_ids[:1], pieces.response_ids[:1], pad_id=0, eos_id=(),
                                 adapter=adapter, vision=[v], response_masks=pieces.masks[:1])
    log_probs, _ = _score(actor, built)
    mask = torch.tensor(pieces.masks[0], dtype=torch.bool)
    assert not close_at_scale(log_probs[0, : len(mask)][mask], ref)


def test_grids_must_match_the_pads_of_prompt_and_observations(setup):
    """A trajectory whose vision dict lacks an observation image is refused before any forward."""
    _, processor, adapter, _, pieces = setup
    v = dict(pieces.vision[0])
    grid = v["image_grid_thw"][:-1]
    v["image_grid_thw"] = grid
    v["pixel_values"] = v["pixel_values"][: int(grid.prod(-1).sum())]
    with pytest.raises(ValueError, match="image pad tokens"):
        build_padded_samples(pieces.prompt_ids[:1], pieces.response_ids[:1], pad_id=0, eos_id=(), adapter=adapter,
                             vision=[v], response_masks=pieces.masks[:1])


@torch.no_grad()
def test_block_sparse_rows_score_what_the_dense_rows_score(setup):
    """Multi-turn rows with tool images in the observations through the block-sparse path (FlexAttention's forward,
    the CPU's eager kernel) equal the dense path, packed and grouped; a control where every response of the
    grouped row sees its siblings must fail."""
    from mmrlhf.models import attention

    model, processor, adapter, _, pieces = setup
    builds = _builds(pieces, adapter, processor.tokenizer.pad_token_id)
    assert any(int(t) == 1 for t in builds["grouped"].samples.mm_token_type_ids[0][
        builds["grouped"].samples.segment_ids[0] > 0])  # observation images inside the responses
    for name in ("packed", "grouped"):
        dense, _ = _score(ActorVL(model, adapter, masked_attention="dense"), builds[name])
        flex, mask = _score(ActorVL(model, adapter, masked_attention="flex"), builds[name])
        assert_close_at_scale(flex[mask], dense[mask], msg=name)
    real = attention.allowed
    try:
        attention.allowed = lambda seg_q, seg_k, q, k, causal=True: (
            ((q >= k) & (seg_q >= 0) & (seg_k >= 0) | (q == k)) if causal else real(seg_q, seg_k, q, k, causal))
        leaked, mask = _score(ActorVL(model, adapter, masked_attention="flex"), builds["grouped"])
    finally:
        attention.allowed = real
    assert not close_at_scale(leaked[mask], dense[mask])
