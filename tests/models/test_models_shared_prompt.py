"""The grouped (shared-prompt) layout scores exactly what the per-sample packed layout scores: log-probs, entropy,
values and parameter gradients (vision tower included), per family and per prompt kind (text, one image, two
images, video), with groups of uneven response lengths, samples of one group scattered through the batch, a
masked sample in the loss, and rows split by a token budget. All float32, tolerance 1e-5 (measured ~1e-6).

The hybrid families (``qwen3_5``, ``qwen3_5_moe``: Gated DeltaNet layers, which read no mask) run each prompt once
through their recurrent layers and continue every response from the prompt's state: the same checks hold for them,
on a copy whose recurrent layers forget slowly (``slow_decay``: the tiny models' own forget their state at the next
token, which would leave the state's hand-over untested).

Controls that must fail: siblings allowed to see each other, responses positioned as if they followed one another in
the row instead of each continuing from the prompt, and (hybrids) responses continuing from a zero convolution tail
or a zero recurrent state instead of the prompt's.
"""

from __future__ import annotations

import pytest
import torch
from models_testing import random_value_head, slow_decay

from mmrlhf.algorithms.losses import policy_loss
from mmrlhf.experience.grouped import build_grouped_samples, group_by_prompt
from mmrlhf.experience.samples import build_packed_samples
from mmrlhf.models import linear_attention, shared_prompt
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.attention import base_implementation
from mmrlhf.models.batch import GroupedSamples
from mmrlhf.models.critic import CriticVL
from mmrlhf.testing.tolerances import assert_close_at_scale, close_at_scale

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"]
HYBRIDS = ["qwen3_5", "qwen3_5_moe"]
ATOL = 1e-5  # fp32 vs fp32, different summation order only
CAUGHT = 1e-3  # a control must move some log-prob at least this much
LENGTHS = [[5, 1, 9], [3, 7, 2], [8, 4, 6], [2, 9, 5]]  # per prompt kind: its samples' response lengths
_SLOW: dict = {}


@pytest.fixture()
def bundles(bundles):
    """The session's bundles, the hybrids' as slow-decay copies (made once)."""

    class _View:
        def __getitem__(self, family):
            if family not in HYBRIDS:
                return bundles[family]
            if family not in _SLOW:
                _SLOW[family] = slow_decay(bundles[family])
            return _SLOW[family]

    return _View()


def _pieces(bundle, seed: int = 0):
    """Every default case (text, one image, two images, video) sampled 3 times with uneven responses, the samples
    of one prompt scattered through the batch (interleaved by case). Returns prompts, responses, vision, kinds."""
    g = torch.Generator().manual_seed(seed)
    vocab = bundle.model.config.get_text_config().vocab_size
    banned = set(bundle.adapter.vision_special_token_ids()) | {bundle.eos_id}
    prompts, responses, vision, kinds = [], [], [], []
    names = ["text", "one_image", "two_images", "video"]
    for j in range(3):
        for c, name in enumerate(names):
            n = LENGTHS[c][j]
            toks = [t for t in torch.randint(0, vocab, (n + 8,), generator=g).tolist() if t not in banned][:n]
            if j == 1:
                toks[-1] = bundle.eos_id
            prompts.append(bundle.prompt_ids[c])
            vision.append(bundle.vision[c])
            responses.append(toks)
            kinds.append(name)
    return prompts, responses, vision, kinds


def _built(bundle, layout: str, max_row_tokens: int | None = None):
    prompts, responses, vision, _ = _pieces(bundle)
    kw = dict(pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=bundle.eos_id, adapter=bundle.adapter,
              vision=vision)
    if layout == "grouped":
        return build_grouped_samples(prompts, responses, max_row_tokens=max_row_tokens, **kw)
    return build_packed_samples(prompts, responses, **kw)


def _score(bundle, built, **kw):
    with torch.no_grad():
        return ActorVL(bundle.model, bundle.adapter, chunk_size=5)(built.samples, vision_extra=built.vision_extra,
                                                                  **kw)


def _worst_by_kind(bundle, a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    kinds = _pieces(bundle)[3]
    diff = (a - b).abs().amax(dim=1)  # [B]
    out: dict[str, float] = {}
    for kind, d in zip(kinds, diff.tolist()):
        out[kind] = max(out.get(kind, 0.0), d)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_log_probs_and_entropy_match_packed_per_kind(bundles, family):
    bundle = bundles[family]
    grouped, packed = _built(bundle, "grouped"), _built(bundle, "packed")
    assert isinstance(grouped.samples, GroupedSamples) and grouped.samples.num_rows == 4  # one row per prompt
    a = _score(bundle, grouped, return_entropy=True, temperature=0.7)
    b = _score(bundle, packed, return_entropy=True, temperature=0.7)
    assert torch.equal(a.action_mask, b.action_mask)
    for name, x, y in (("log_probs", a.log_probs, b.log_probs), ("entropy", a.entropy, b.entropy)):
        worst = _worst_by_kind(bundle, x, y)
        assert set(worst) == {"text", "one_image", "two_images", "video"}
        assert max(worst.values()) <= ATOL, (name, worst)


@pytest.mark.parametrize("family", FAMILIES)
def test_values_match_packed(bundles, family):
    bundle = bundles[family]
    critic = CriticVL(ActorVL(bundle.model, bundle.adapter),
                      random_value_head(bundle.model.config.get_text_config().hidden_size))
    with torch.no_grad():
        va = critic(_built(bundle, "grouped").samples, vision_extra=_built(bundle, "grouped").vision_extra)
        packed = _built(bundle, "packed")
        vb = critic(packed.samples, vision_extra=packed.vision_extra)
    worst = _worst_by_kind(bundle, va, vb)
    assert max(worst.values()) <= ATOL, worst
    assert float(vb.abs().max()) > 1e-3  # the values are not trivially zero


def _grads(bundle, built, mask_out: int) -> dict[str, torch.Tensor]:
    """Gradients of a PPO loss with entropy bonus in which sample ``mask_out`` is masked out (the reward engine's
    invalid sample): it must leave the loss in every layout."""
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5)
    bundle.model.zero_grad(set_to_none=True)
    out = actor(built.samples, vision_extra=built.vision_extra, return_entropy=True)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(out.log_probs.shape, generator=g)
    mask = out.action_mask.clone()
    mask[mask_out] = False
    loss, _ = policy_loss("ppo", out.log_probs, out.log_probs.detach() + 0.05, adv, mask, clip_low=0.2,
                          clip_high=0.2, agg="token-mean", entropy=out.entropy, entropy_coef=0.01)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in bundle.model.named_parameters() if p.grad is not None}
    bundle.model.zero_grad(set_to_none=True)
    return grads


def _token_by_token_delta_rule(bundle, monkeypatch) -> None:
    """Hybrids: the recurrent layers' chunked delta rule swapped for the layer module's own token-by-token one.

    Why: the chunked rule (transformers' torch fallback, float32 inside whatever the input dtype) is ill-conditioned
    for the decay parameters' gradients (``A_log``, ``dt_bias``) and its error depends on where its 64-token chunks
    fall. A response continued from its prompt's state starts a chunk at its first token, the sample alone at the
    prompt's; measured on this batch (qwen3_5, layer 0, of their scale): the per-sample layout 2.9e-3 from the same
    rule in float64, the grouped one 2.9e-3 from it too, and 2.3e-7 from it with the chunked rule in float64. The
    token-by-token rule has no chunks: there the layouts agree to 1e-6, which is what this test can assert."""
    import sys

    for layer in linear_attention.recurrent_layers(bundle.model):
        module = sys.modules[type(layer).__module__]
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", module.torch_recurrent_gated_delta_rule)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_packed_with_a_masked_sample(bundles, family, monkeypatch):
    bundle = bundles[family]
    if family in HYBRIDS:
        _token_by_token_delta_rule(bundle, monkeypatch)
    masked = 5  # the one-image prompt's second sample
    ga, gb = _grads(bundle, _built(bundle, "grouped"), masked), _grads(bundle, _built(bundle, "packed"), masked)
    assert ga.keys() == gb.keys()
    assert any("visual" in n for n in ga) and any("lm_head" in n for n in ga)  # the vision tower is reached
    for name in gb:
        assert_close_at_scale(ga[name], gb[name], msg=name)  # fp32, another summation order
    # control: masking a different sample changes the gradient, so the masked one really left the loss
    other = _grads(bundle, _built(bundle, "grouped"), masked + 1)
    assert max(float((other[n] - ga[n]).abs().max()) for n in ga) > 1e-5
    assert not all(close_at_scale(other[n], ga[n]) for n in ga)


def test_row_budget_splits_groups_without_changing_results(bundles):
    bundle = bundles["qwen2_5_vl"]
    whole = _built(bundle, "grouped")
    longest_prompt = max(len(p) for p in _pieces(bundle)[0])
    split = _built(bundle, "grouped", max_row_tokens=longest_prompt + 10)
    assert split.samples.num_rows > whole.samples.num_rows
    assert int((split.samples.segment_ids != -1).sum(dim=1).max()) <= longest_prompt + 10 + 9  # >= 1 response
    a, b = _score(bundle, whole), _score(bundle, split)
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=ATOL)


def test_sibling_attention_is_caught(bundles, monkeypatch):
    """Control: a mask that lets a response see the responses before it in the row moves their log-probs."""
    bundle = bundles["qwen2_vl"]
    good = _score(bundle, _built(bundle, "grouped")).log_probs

    def plain_causal(segment_ids):
        length = segment_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
        return causal.expand(segment_ids.shape[0], -1, -1)

    monkeypatch.setattr(shared_prompt, "allowed_pairs", plain_causal)
    leaked = _score(bundle, _built(bundle, "grouped")).log_probs
    assert float((leaked - good).abs().max()) > CAUGHT


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("dropped", ["conv", "recurrent"])
def test_responses_from_a_zero_state_are_caught(bundles, family, dropped, monkeypatch):
    """Control (hybrids): recurrent layers whose responses start from a zero convolution tail, or from a zero
    delta-rule state, instead of their prompt's score differently, for every prompt kind."""
    from mmrlhf.models.gated_delta import MixerState

    bundle = bundles[family]
    built = _built(bundle, "grouped")
    good = _score(bundle, built).log_probs
    real = linear_attention.continued_forward

    def zeroed(layer, hidden, valid, start=None, keep_state=False):
        if start is not None:
            conv, state = start
            start = MixerState(torch.zeros_like(conv), state) if dropped == "conv" else \
                MixerState(conv, torch.zeros_like(state))
        return real(layer, hidden, valid, start, keep_state)

    monkeypatch.setattr(linear_attention, "continued_forward", zeroed)
    cold = _score(bundle, built).log_probs
    worst = _worst_by_kind(bundle, cold, good)
    assert min(worst.values()) > CAUGHT, worst


def test_row_positions_are_caught(bundles, monkeypatch):
    """Control: responses positioned one after the other along the row (as a plain sequence would) score differently
    from each continuing the prompt."""
    import mmrlhf.models.actor as actor_module

    bundle = bundles["qwen2_vl"]
    built = _built(bundle, "grouped")
    good = _score(bundle, built).log_probs
    real = actor_module.grouped_position_ids

    def along_the_row(adapter, samples, vision_extra=None):
        pos = real(adapter, samples, vision_extra)  # [3, G, L]
        after_prompt = samples.segment_ids > 0  # [G, L]
        start = torch.stack([pos[:, g, int(samples.prompt_lengths[g]) - 1] for g in range(pos.shape[1])], 1)  # [3,G]
        ramp = after_prompt.long().cumsum(1)  # [G, L] 1, 2, ... over all the row's responses
        return torch.where(after_prompt[None], start[:, :, None] + ramp[None], pos)

    monkeypatch.setattr(actor_module, "grouped_position_ids", along_the_row)
    moved = _score(bundle, built).log_probs
    assert float((moved - good).abs().max()) > CAUGHT


def test_eager_attention_gets_an_additive_mask():
    from models_testing import load_bundle

    bundle = load_bundle("qwen2_vl", attn_implementation="eager")
    assert base_implementation(bundle.model) == "eager"
    a = _score(bundle, _built(bundle, "grouped"))
    b = _score(bundle, _built(bundle, "packed"))
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=ATOL)


def test_unsupported_attention_is_refused_with_the_fix():
    segments = torch.tensor([[0, 0, 1, 2, -1]])
    with pytest.raises(ValueError, match="flash_attention_2.*shared_prompt=false"):
        shared_prompt.grouped_attention_mask(segments, "flash_attention_2", torch.float32)
    allowed = shared_prompt.allowed_pairs(segments)[0]
    assert allowed[3].tolist() == [True, True, False, True, False]  # prompt + itself, not its sibling
    assert allowed[4].tolist() == [False, False, False, False, True]  # padding sees itself only


def test_grouping_needs_equal_ids_and_equal_images():
    red = {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    blue = {"pixel_values": torch.zeros(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    groups = group_by_prompt([[1, 2], [1, 2], [1, 3], [1, 2], [1, 2]], [red, blue, red, red, {}])
    assert groups == [[0, 3], [1], [2], [4]]


def test_a_response_with_vision_tokens_is_refused(bundles):
    bundle = bundles["qwen2_vl"]
    prompts, responses, vision, _ = _pieces(bundle)
    responses[2] = [responses[2][0], bundle.adapter.image_token_id]
    with pytest.raises(ValueError, match="sample 2: its response holds image / video tokens"):
        build_grouped_samples(prompts, responses, pad_id=0, eos_id=bundle.eos_id, adapter=bundle.adapter,
                              vision=vision)


def test_auto_turns_on_only_where_it_is_exact_and_saves_work():
    resolve = shared_prompt.resolve_shared_prompt
    assert resolve("auto", "sdpa", 8) and resolve("auto", "eager", 2)
    assert not resolve("auto", "sdpa", 1)  # one sample per prompt: nothing to share
    assert not resolve("auto", "flash_attention_2", 8)  # the kernel reads no mask: per-sample layouts
    assert not resolve(False, "sdpa", 8) and resolve(True, "sdpa", 1)
    assert resolve("auto", "flash_attention_2", 8, masked_kernel="flex")  # block-sparse rows express the mask
    assert resolve(True, "flash_attention_2", 8, masked_kernel="flex")
    with pytest.raises(ValueError, match="trainer.shared_prompt=true needs model.attn_implementation"):
        resolve(True, "flash_attention_2", 8)
