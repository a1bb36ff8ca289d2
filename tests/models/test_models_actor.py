"""ActorVL on a mixed batch (text, one image, two images, video; uneven responses, EOS / truncated):
padded == per-sample unbatched HF forward, packed == padded (float32, 1e-5), micro-batching changes nothing."""

from __future__ import annotations

import pytest
import torch
from models_testing import batch_pieces, reference_log_probs

from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.models.actor import ActorVL, response_index
from mmrlhf.models.logprobs import chunked_log_probs
from mmrlhf.models.positions import packed_position_ids
from mmrlhf.testing.tolerances import assert_close_at_scale

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
ATOL = 1e-5


def _batches(bundle):
    prompts, responses, vision, inputs = batch_pieces(bundle)
    kw = dict(pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=bundle.eos_id, adapter=bundle.adapter,
              vision=vision)
    return build_padded_samples(prompts, responses, **kw), build_packed_samples(prompts, responses, **kw), inputs


@pytest.fixture(scope="module", params=FAMILIES)
def scored(request, bundles):
    """family bundle, built batches and the actor's outputs for both layouts (computed once per family)."""
    bundle = bundles[request.param]
    padded, packed, inputs = _batches(bundle)
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5)
    with torch.no_grad():
        out_pad = actor(padded.samples, vision_extra=padded.vision_extra, return_entropy=True)
        out_pack = actor(packed.samples, vision_extra=packed.vision_extra, return_entropy=True)
    return bundle, actor, padded, packed, inputs, out_pad, out_pack


def test_padded_matches_per_sample_reference(scored):
    bundle, actor, padded, packed, inputs, out_pad, _ = scored
    s = padded.samples
    assert out_pad.log_probs.shape == s.action_mask.shape and out_pad.log_probs.dtype == torch.float32
    assert torch.equal(out_pad.action_mask, s.action_mask)
    a_max = s.action_mask.shape[1]
    for i, x in enumerate(inputs):
        n = int(s.response_length[i])
        response = s.sequences[i, -a_max:][:n].tolist()
        ref = reference_log_probs(bundle, x, response)  # [n]
        torch.testing.assert_close(out_pad.log_probs[i, :n], ref, rtol=0, atol=ATOL)
        assert (out_pad.log_probs[i, n:] == 0).all() and (out_pad.entropy[i, n:] == 0).all()
    assert (out_pad.entropy[s.action_mask] > 0).all()


def test_excluded_tokens_leave_the_distribution(scored):
    """By default the actor scores the distribution the engines sample from (vision special tokens removed);
    ``excluded_token_ids=()`` gives the plain policy, which differs by the removed probability mass (control)."""
    bundle, actor, padded, _, inputs, out_pad, _ = scored
    assert actor.excluded_token_ids == tuple(sorted(bundle.adapter.vision_special_token_ids()))
    plain_actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5, excluded_token_ids=())
    with torch.no_grad():
        plain = plain_actor(padded.samples, vision_extra=padded.vision_extra, return_entropy=True)
    s = padded.samples
    a_max = s.action_mask.shape[1]
    for i, x in enumerate(inputs):
        n = int(s.response_length[i])
        response = s.sequences[i, -a_max:][:n].tolist()
        torch.testing.assert_close(plain.log_probs[i, :n], reference_log_probs(bundle, x, response, excluded=()),
                                   rtol=0, atol=ATOL)
    m = s.action_mask
    gap = out_pad.log_probs[m] - plain.log_probs[m]  # log(1 / (1 - excluded mass)) > 0 on every token
    assert (gap > 1e-4).all()
    assert torch.isfinite(out_pad.entropy[m]).all() and (out_pad.entropy[m] < plain.entropy[m]).all()
    grad_actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5)
    out = grad_actor(padded.samples, vision_extra=padded.vision_extra, return_entropy=True)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    head = bundle.model.get_output_embeddings().weight.grad
    assert torch.isfinite(head).all()
    assert (head[list(actor.excluded_token_ids)] == 0).all()  # an impossible token gets no gradient
    bundle.model.zero_grad(set_to_none=True)


def test_packed_matches_padded(scored):
    *_, out_pad, out_pack = scored
    assert torch.equal(out_pack.action_mask, out_pad.action_mask)
    torch.testing.assert_close(out_pack.log_probs, out_pad.log_probs, rtol=0, atol=ATOL)
    torch.testing.assert_close(out_pack.entropy, out_pad.entropy, rtol=0, atol=ATOL)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_micro_batches_change_nothing(scored, layout):
    bundle, actor, padded, packed, inputs, out_pad, out_pack = scored
    built = padded if layout == "padded" else packed
    with torch.no_grad():
        out = actor(built.samples, vision_extra=built.vision_extra, return_entropy=True, micro_batch_size=3)
    torch.testing.assert_close(out.log_probs, out_pad.log_probs, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.entropy, out_pad.entropy, rtol=0, atol=ATOL)
    assert torch.equal(out.action_mask, out_pad.action_mask)


def test_packed_check_detects_cross_sample_attention(scored):
    """Sensitivity: the same packed forward with ONE causal mask over all samples (no block-diagonal) must differ,
    so test_packed_matches_padded really checks the isolation of packed samples."""
    bundle, actor, padded, packed, inputs, out_pad, _ = scored
    s = packed.samples
    pos = packed_position_ids(bundle.adapter, s, packed.vision_extra)[1:]  # [3, 1, T] M-RoPE only
    with torch.no_grad():
        hidden = bundle.model.base_model(
            input_ids=s.sequences, position_ids=pos, pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thws,
            pixel_values_videos=s.pixel_values_videos, video_grid_thw=s.video_grid_thws,
            mm_token_type_ids=s.mm_token_type_ids, use_cache=False,
        ).last_hidden_state  # [1, T, H]
        src, tgt, mask = response_index(s)
        logp, _ = chunked_log_probs(hidden[0][src], bundle.model.get_output_embeddings().weight,
                                    s.sequences[0][tgt])
    leaked = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
    assert (leaked - out_pad.log_probs).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen2_5_vl"])
def test_gradients_match_between_layouts(bundles, family):
    """Training path: d(sum of log-probs + entropy) / d(parameters) is the same for packed and padded batches."""
    bundle = bundles[family]
    padded, packed, _ = _batches(bundle)
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=4)
    grads = []
    for built in (padded, packed):
        bundle.model.zero_grad(set_to_none=True)
        out = actor(built.samples, vision_extra=built.vision_extra, return_entropy=True)
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in bundle.model.named_parameters() if p.grad is not None})
    bundle.model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    assert any("visual" in n for n in grads[0]) and any("lm_head" in n for n in grads[0])  # grads reach both ends
    for name in grads[0]:
        assert_close_at_scale(grads[1][name], grads[0][name], msg=name)  # fp32, another summation order


def test_packed_matches_padded_with_eager_attention():
    """The packed mask comes from transformers' own packing path, so it must hold for eager attention as well."""
    from models_testing import load_bundle

    bundle = load_bundle("qwen2_vl", attn_implementation="eager")
    assert bundle.model.config._attn_implementation == "eager"
    padded, packed, _ = _batches(bundle)
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=64)
    with torch.no_grad():
        a = actor(padded.samples, vision_extra=padded.vision_extra)
        b = actor(packed.samples, vision_extra=packed.vision_extra)
    torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=ATOL)
