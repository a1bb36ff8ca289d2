"""The block-sparse attention path of packed and grouped rows (:mod:`mmrlhf.models.attention`).

On the CPU: the block mask's tile lists equal the dense rule tile by tile (FlexAttention's eager CPU kernel reads
only the mask function, so the tile lists are checked on their own, with a control that corrupts one tile), and
the actor's FlexAttention forward equals the dense path per family and prompt kind (text, one image, two images,
video) in the packed and grouped layouts, float32, with a control that lets siblings see each other. The kernel
choice is one function (``auto``: flex on CUDA, dense elsewhere). On a GPU (``gpu`` marker): the compiled kernel,
which does skip tiles, forward and backward against the dense path.
"""

from __future__ import annotations

import pytest
import torch
from models_testing import load_bundle

from mmrlhf.experience.grouped import build_grouped_samples
from mmrlhf.experience.samples import build_packed_samples
from mmrlhf.models import attention
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.attention import BLOCK, PADDING, block_mask, dense_from_block_mask, resolve_masked_attention
from mmrlhf.testing.tolerances import assert_close_at_scale, assert_no_farther

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
ATOL = 1e-5  # fp32 vs fp32: another kernel, another summation order
CAUGHT = 1e-3  # a control must move some log-prob at least this much
LENGTHS = [[5, 1, 9], [3, 7, 2], [8, 4, 6], [2, 9, 5]]  # per prompt kind: its samples' response lengths
KINDS = ["text", "one_image", "two_images", "video"]


def _rule(segments: torch.Tensor, causal: bool = True) -> torch.Tensor:
    idx = torch.arange(segments.shape[1])
    return attention.allowed(segments[:, :, None], segments[:, None, :], idx[None, :, None], idx[None, None, :],
                             causal)


def _packed_segments(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]  # [1, T] 1-based


def _grouped_segments(prompt: int, responses: list[int], width: int) -> torch.Tensor:
    row = [0] * prompt + [k + 1 for k, n in enumerate(responses) for _ in range(n)]
    return torch.tensor(row + [PADDING] * (width - len(row)))


CASES = {
    "packed_uneven": _packed_segments([100, 150, 50, 3, 400]),
    "packed_exact_tiles": _packed_segments([128, 256, 128]),
    "packed_many_short": _packed_segments([7] * 60),
    "grouped_rows": torch.stack([_grouped_segments(300, [40, 200, 9], 700),
                                 _grouped_segments(129, [1, 2, 300], 700)]),
}


@pytest.mark.parametrize("causal", [True, False])  # the decoder's rows; the vision tower's segments
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk_tokens", [1 << 26, 1])  # one pass; one query tile at a time
def test_block_mask_tiles_equal_the_dense_rule(case, chunk_tokens, causal):
    segments = CASES[case]
    mask = block_mask(segments, causal=causal, chunk_tokens=chunk_tokens)
    assert torch.equal(dense_from_block_mask(mask, segments, causal), _rule(segments, causal))


def test_vision_segments_come_from_the_varlen_boundaries():
    cu = torch.tensor([0, 3, 3, 7, 9], dtype=torch.int32)  # an empty segment in the middle
    seg = attention.segments_from_cu_seqlens(cu, 9)
    assert seg.tolist() == [[1, 1, 1, 3, 3, 3, 3, 4, 4]]


def test_tiles_the_mask_hides_are_skipped_and_inner_tiles_run_unmasked():
    segments = _packed_segments([256] * 8)  # 8 samples of two tiles each
    mask = block_mask(segments)
    partial, full = int(mask.kv_num_blocks.sum()), int(mask.full_kv_num_blocks.sum())
    assert (partial, full) == (16, 8)  # per sample: 2 diagonal tiles (partial), 1 tile below them (full)
    assert partial + full < 16 * 17 // 2 / 4  # a causal dense row would list 136 tiles


def test_a_wrong_tile_list_is_caught():
    """Control: the tile check sees a partial tile listed as full (the compiled kernel would skip its mask)."""
    from torch.nn.attention.flex_attention import BlockMask

    segments = CASES["packed_uneven"]
    good = block_mask(segments)
    full_num = good.full_kv_num_blocks.clone()
    full_idx = good.full_kv_indices.clone()
    qb = 2  # a query tile with a partial tile to promote
    kb = int(good.kv_indices[0, 0, qb, 0])
    full_idx[0, 0, qb, int(full_num[0, 0, qb])] = kb
    full_num[0, 0, qb] += 1
    bad = BlockMask.from_kv_blocks(good.kv_num_blocks, good.kv_indices, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                   mask_mod=good.mask_mod, seq_lengths=good.seq_lengths)
    assert not torch.equal(dense_from_block_mask(bad, segments), _rule(segments))


def test_the_rule_is_the_dense_grouped_rule():
    from mmrlhf.models.shared_prompt import allowed_pairs

    segments = CASES["grouped_rows"]
    assert torch.equal(_rule(segments), allowed_pairs(segments))


def test_the_kernel_is_chosen_in_one_place():
    assert resolve_masked_attention("auto", "cpu", "sdpa") == "dense"
    assert resolve_masked_attention("auto", torch.device("cuda", 3), "sdpa") == "flex"
    assert resolve_masked_attention("auto", "cuda", "flash_attention_2") == "flex"
    assert resolve_masked_attention("auto", "cuda", "eager") == "dense"  # eager has no registered fallback
    assert resolve_masked_attention("dense", "cuda", "sdpa") == "dense"
    assert resolve_masked_attention("flex", "cpu", "sdpa") == "flex"  # forward-only use on the CPU
    with pytest.raises(ValueError, match="model.masked_attention=flex runs beside"):
        resolve_masked_attention("flex", "cuda", "eager")
    with pytest.raises(ValueError, match="model.masked_attention='sparse'"):
        resolve_masked_attention("sparse", "cuda", "sdpa")


def test_each_layout_gets_its_measured_kernel():
    rows = attention.rows_kernel
    assert rows("auto", "flex", "packed", "sdpa") == "flex"
    assert rows("auto", "flex", "grouped", "sdpa") == "dense"  # SDPA's masked kernel was as fast or faster
    assert rows("auto", "flex", "grouped", "flash_attention_2") == "flex"  # FA2 reads no mask: flex serves it
    assert rows("flex", "flex", "grouped", "sdpa") == "flex"  # an explicit choice wins
    assert rows("auto", "dense", "packed", "sdpa") == "dense" and rows("flex", "flex", "padded", "sdpa") == "dense"


def test_multi_turn_rows_share_their_prompt_where_the_block_sparse_path_runs():
    from mmrlhf.models.shared_prompt import resolve_shared_prompt

    assert resolve_shared_prompt("auto", "sdpa", 8, multi_turn=True, masked_kernel="flex")
    assert not resolve_shared_prompt("auto", "sdpa", 8, multi_turn=True, masked_kernel="dense")  # the CPU
    assert resolve_shared_prompt("auto", "sdpa", 8, multi_turn=False, masked_kernel="dense")


# ---- the actor ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def own_bundles():
    """Models of their own: installing the block-sparse function changes a model's decoder config."""
    cache: dict = {}

    def get(family):
        if family not in cache:
            cache[family] = load_bundle(family)
        return cache[family]

    return get


def _pieces(bundle, seed: int = 0):
    """Every prompt kind sampled 3 times with uneven responses, interleaved (as in test_models_shared_prompt)."""
    g = torch.Generator().manual_seed(seed)
    vocab = bundle.model.config.get_text_config().vocab_size
    banned = set(bundle.adapter.vision_special_token_ids()) | {bundle.eos_id}
    prompts, responses, vision, kinds = [], [], [], []
    for j in range(3):
        for c, name in enumerate(KINDS):
            n = LENGTHS[c][j]
            toks = [t for t in torch.randint(0, vocab, (n + 8,), generator=g).tolist() if t not in banned][:n]
            prompts.append(bundle.prompt_ids[c])
            vision.append(bundle.vision[c])
            responses.append(toks)
            kinds.append(name)
    return prompts, responses, vision, kinds


def _built(bundle, layout):
    prompts, responses, vision, _ = _pieces(bundle)
    kw = dict(pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=bundle.eos_id, adapter=bundle.adapter,
              vision=vision)
    build = build_grouped_samples if layout == "grouped" else build_packed_samples
    return build(prompts, responses, **kw)


@torch.no_grad()
def _score(bundle, built, kernel):
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5, masked_attention=kernel)
    return actor(built.samples, vision_extra=built.vision_extra, return_entropy=True, temperature=0.7)


@pytest.mark.parametrize("layout", ["packed", "grouped"])
@pytest.mark.parametrize("family", FAMILIES)
def test_flex_forward_equals_the_dense_path_per_kind(own_bundles, family, layout):
    bundle = own_bundles(family)
    built = _built(bundle, layout)
    dense = _score(bundle, built, "dense")
    flex = _score(bundle, built, "flex")
    assert attention.installed(bundle.model)
    kinds = _pieces(bundle)[3]
    for name, x, y in (("log_probs", flex.log_probs, dense.log_probs), ("entropy", flex.entropy, dense.entropy)):
        worst: dict[str, float] = {}
        for kind, d in zip(kinds, (x - y).abs().amax(dim=1).tolist()):
            worst[kind] = max(worst.get(kind, 0.0), d)
        assert set(worst) == set(KINDS)
        assert max(worst.values()) <= ATOL, (name, worst)


def test_the_install_points_the_decoder_and_the_vision_tower_at_their_kernels(own_bundles):
    """The padded layout gets no block mask (its decoder falls back to SDPA); its images go through the varlen
    vision kernel (here on the CPU: one batched SDPA call per segment length), which equals the per-segment loop it
    replaces (float32, another summation order). Control: a bucketing that lets windows and images see each other
    moves the log-probs."""
    from mmrlhf.experience.samples import build_padded_samples

    from mmrlhf.trainer.optim import freeze_vision

    bundle = load_bundle("qwen2_5_vl")  # not installed yet; window attention in its vision tower
    freeze_vision(bundle.model, bundle.adapter, tower=True, merger=False)  # the trainer's default
    prompts, responses, vision, _ = _pieces(bundle)
    built = build_padded_samples(prompts, responses, pad_id=bundle.processor.tokenizer.pad_token_id,
                                 eos_id=bundle.eos_id, adapter=bundle.adapter, vision=vision)
    before = _score(bundle, built, "dense").log_probs
    attention.install(bundle.model)
    attention.install(bundle.model)  # idempotent
    assert attention.installed(bundle.model) and attention.base_implementation(bundle.model) == "sdpa"
    assert bundle.model.config.vision_config._attn_implementation == attention.VISION_NAME
    after = _score(bundle, built, "flex").log_probs
    assert_close_at_scale(after, before)
    real = attention.length_buckets
    try:
        attention.length_buckets = lambda cu, length: real(cu[[0, -1]], length)  # one segment: all see all
        leaked = _score(bundle, built, "flex").log_probs
    finally:
        attention.length_buckets = real
    assert float((leaked - before).abs().max()) > CAUGHT


def _vision_grads(bundle, built, kernel):
    """Log-probs and every gradient of a PPO loss through a TRAINING vision tower, with the vision tower on its
    per-segment loop (``dense``) or the varlen function (``auto``: on the CPU, batched SDPA per segment length)."""
    from mmrlhf.algorithms.losses import policy_loss

    attention.uninstall(bundle.model)
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5, masked_attention=kernel)
    bundle.model.zero_grad(set_to_none=True)
    out = actor(built.samples, vision_extra=built.vision_extra)
    assert attention.vision_installed(bundle.model) == (kernel == "auto")
    adv = torch.randn(out.log_probs.shape, generator=torch.Generator().manual_seed(1))
    loss, _ = policy_loss("ppo", out.log_probs, out.log_probs.detach() + 0.05, adv, out.action_mask,
                          clip_low=0.2, clip_high=0.2, agg="token-mean")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in bundle.model.named_parameters() if p.grad is not None}
    bundle.model.zero_grad(set_to_none=True)
    attention.uninstall(bundle.model)
    return out.log_probs.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_the_batched_vision_path_trains_exactly_as_the_loop_on_the_cpu(own_bundles, family):
    """Every kind (text, image, two images, video) in one padded batch, the tower training: log-probs and every
    parameter gradient (the patch embedding's included) through the batched vision path equal the loop's at the
    suite's float32 tolerance; the control, segments that see each other, moves the tower's gradients."""
    from mmrlhf.experience.samples import build_padded_samples

    bundle = own_bundles(family)
    for p in bundle.model.parameters():
        p.requires_grad_(True)
    prompts, responses, vision, _ = _pieces(bundle)
    built = build_padded_samples(prompts, responses, pad_id=bundle.processor.tokenizer.pad_token_id,
                                 eos_id=bundle.eos_id, adapter=bundle.adapter, vision=vision)
    lp_loop, g_loop = _vision_grads(bundle, built, "dense")
    lp_batched, g_batched = _vision_grads(bundle, built, "auto")
    assert_close_at_scale(lp_batched, lp_loop, msg="log-probs")
    assert g_batched.keys() == g_loop.keys() and any("patch_embed" in n for n in g_loop)
    for name in g_loop:
        assert_close_at_scale(g_batched[name], g_loop[name], msg=name)
    real = attention.length_buckets
    try:
        attention.length_buckets = lambda cu, length: real(cu[[0, -1]], length)
        _, g_leaked = _vision_grads(bundle, built, "auto")
    finally:
        attention.length_buckets = real
    name = next(n for n in g_loop if "patch_embed" in n)
    assert float((g_leaked[name] - g_loop[name]).abs().max()) > 1e-3 * float(g_loop[name].abs().max())


def test_the_varlen_vision_path_serves_a_frozen_and_a_training_tower():
    """The flex switch installs the varlen vision function whether the tower trains or not (its gradients checked on
    a GPU against float64: docs/gpu.md, and the gpu-marked test below); dense actors never install anything."""
    from mmrlhf.trainer.optim import freeze_vision

    bundle = load_bundle("qwen2_vl")
    built = _built(bundle, "packed")
    attention.uninstall(bundle.model)
    assert not attention.vision_installed(bundle.model)
    _score(bundle, built, "flex")  # every parameter trains (a fresh model)
    assert attention.installed(bundle.model) and attention.vision_installed(bundle.model)
    attention.uninstall(bundle.model)
    freeze_vision(bundle.model, bundle.adapter, tower=True, merger=False)
    _score(bundle, built, "flex")
    assert attention.vision_installed(bundle.model)
    _score(bundle, built, "dense")  # dense actors never install anything
    assert attention.vision_installed(bundle.model)


def test_siblings_that_see_each_other_are_caught(own_bundles, monkeypatch):
    """Control: a mask function that lets every response see the row's earlier tokens moves the log-probs."""
    bundle = own_bundles("qwen2_vl")
    built = _built(bundle, "grouped")
    good = _score(bundle, built, "flex").log_probs

    def causal_only(seg_q, seg_k, q_idx, k_idx, causal=True):
        return (q_idx >= k_idx) if causal else real(seg_q, seg_k, q_idx, k_idx, causal)

    real = attention.allowed

    monkeypatch.setattr(attention, "allowed", causal_only)
    leaked = _score(bundle, built, "flex").log_probs
    assert float((leaked - good).abs().max()) > CAUGHT


# ---- on a GPU: the compiled kernel, forward and backward -------------------------------------------------------


def _grads(bundle, built, kernel):
    from mmrlhf.algorithms.losses import policy_loss

    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5, masked_attention=kernel)
    bundle.model.zero_grad(set_to_none=True)
    out = actor(built.samples, vision_extra=built.vision_extra, return_entropy=True)
    adv = torch.randn(out.log_probs.shape, generator=torch.Generator().manual_seed(1)).to(out.log_probs.device)
    loss, _ = policy_loss("ppo", out.log_probs, out.log_probs.detach() + 0.05, adv, out.action_mask,
                          clip_low=0.2, clip_high=0.2, agg="token-mean", entropy=out.entropy, entropy_coef=0.01)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in bundle.model.named_parameters() if p.grad is not None}
    bundle.model.zero_grad(set_to_none=True)
    return out.log_probs.detach(), grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tower", ["frozen", "trained"])  # the varlen vision path, without / with its backward
@pytest.mark.parametrize("layout", ["packed", "grouped"])
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_flex_forward_and_backward_equal_dense_on_cuda(family, layout, tower):
    from mmrlhf.trainer.optim import freeze_vision

    bundle = load_bundle(family)
    bundle.model.to("cuda")
    freeze_vision(bundle.model, bundle.adapter, tower=tower == "frozen", merger=False)
    built = _built(bundle, layout)
    lp_dense, g_dense = _grads(bundle, built, "dense")
    lp_flex, g_flex = _grads(bundle, built, "flex")
    assert attention.installed(bundle.model) and attention.vision_installed(bundle.model)
    assert_close_at_scale(lp_flex, lp_dense, msg="log-probs")
    assert g_flex.keys() == g_dense.keys() and any("lm_head" in n for n in g_dense)
    assert any("visual" in n for n in g_dense)  # the merger (and with a trained tower its blocks) get gradients
    # On CUDA both float32 paths are ~3e-4 of the scale from float64 (cuDNN's float32 convolutions run in TF32),
    # so they may differ by more than a summation-order bound: each gradient of the flex path must be no farther
    # from the float64 dense one than the float32 dense path is (measured on an H200: equal to 3 digits).
    attention.uninstall(bundle.model)
    bundle.model.double()
    _, g_ref = _grads(bundle, built, "dense")
    for name in g_dense:
        assert_no_farther(g_flex[name], g_dense[name], g_ref[name], msg=name)
