"""FSDP2 (fully_shard, 2 ranks, gloo on the CPU) gives the actor's and the critic's single-process numbers.

fsdp_worker.py runs under ``torchrun --nproc-per-node 2``: the actor and the critic are sharded by
``shard_for_training`` (every transformer block its own unit, the wrapper the root), each rank scores and
backpropagates its half of the mixed batch (text, images, video; padded and packed). Here one unsharded process
scores the whole batch: log-probs, entropy, values and hidden states must match per sample, and the all-gathered
gradients (FSDP averages over ranks) must match the gradient of the full-batch loss / world size, in fp32; so must
those of an actor checkpointed before it was sharded (``trainer.gradient_checkpointing``).
Controls: the gradient of one rank's half alone differs (so the comparison sees the reduction), the checkpointed
actor's blocks ran twice, and the wrong layout (the HF model sharded on its own) is refused with an error that names
the fix. The ranks run on the CPU (gloo, a CPU mesh) also where a GPU is visible: this is a CPU check.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models_testing import IMAGE_ROWS, TEXT_ROWS, built_batches, picked_batch, random_value_head, rank_range

from mmrlhf.models.actor import ActorVL, select_samples
from mmrlhf.models.critic import CriticVL
from mmrlhf.models.sharding import block_modules
from mmrlhf.testing.tolerances import assert_close_at_scale, close_at_scale

pytest.importorskip("torch.distributed.fsdp")

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
WORLD = 2
ATOL = 1e-5  # fp32 activations: the sharded and the unsharded forward do the same math (measured ~1e-7)
WORKER = Path(__file__).with_name("fsdp_worker.py")


@pytest.fixture(scope="module")
def fsdp_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(WORKER), "--out", str(out), *FAMILIES]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def _load(out: Path, family: str, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = torch.load(out / f"{family}.rank{rank}.pt", weights_only=True)
    return tensors, json.loads((out / f"{family}.rank{rank}.json").read_text())


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return out


def _assert_grads_match(sharded: dict[str, torch.Tensor], prefix: str, reference: dict[str, torch.Tensor]) -> float:
    got = {k[len(prefix):]: v for k, v in sharded.items() if k.startswith(prefix)}
    assert got.keys() == reference.keys()
    for name, g in reference.items():
        # fp32 gradients: the two halves are summed in another order (tolerance sized by each tensor's scale)
        assert_close_at_scale(got[name], g, msg=name)
    return max(float((got[n] - g).abs().max()) for n, g in reference.items())


def _actor_reference(bundle, built, rows: range | None = None):
    """Unsharded log-probs, entropy and gradients of (log-prob sum + 0.1 entropy sum) / WORLD over ``rows``."""
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5)
    samples, extra = built.samples, built.vision_extra
    if rows is not None:
        samples, extra = select_samples(samples, extra, rows)
    res = actor(samples, vision_extra=extra, return_entropy=True)
    ((res.log_probs.sum() + 0.1 * res.entropy.sum()) / WORLD).backward()
    return res.log_probs.detach(), res.entropy.detach(), _grads(actor)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_actor_and_critic_match_one_process(fsdp_out, bundles, family):
    bundle = bundles[family]
    ranks = [_load(fsdp_out, family, r) for r in range(WORLD)]
    built = built_batches(bundle)
    for layout in ("padded", "packed"):
        logp, ent, grads = _actor_reference(bundle, built[layout])
        assert any("visual" in n for n in grads) and any("lm_head" in n for n in grads)
        for rank, (res, _) in enumerate(ranks):
            rows = rank_range(logp.shape[0], rank, WORLD)
            mine = res[f"actor.{layout}.log_probs"]  # [b, A_r]
            width = mine.shape[1]
            torch.testing.assert_close(mine, logp[rows.start : rows.stop, :width], rtol=0, atol=ATOL)
            assert (logp[rows.start : rows.stop, width:] == 0).all()
            torch.testing.assert_close(res[f"actor.{layout}.entropy"], ent[rows.start : rows.stop, :width],
                                       rtol=0, atol=ATOL)
            _assert_grads_match(res, f"actor.{layout}.grad.", grads)
            if layout == "packed":  # trainer.gradient_checkpointing under FSDP2: the same numbers
                torch.testing.assert_close(res["actor_ckpt.packed.log_probs"], mine, rtol=0, atol=ATOL)
                _assert_grads_match(res, "actor_ckpt.packed.grad.", grads)

    # The public hidden_states of a sharded actor (registered as a forward method) gathers as forward does.
    plain = ActorVL(bundle.model, bundle.adapter)
    for rank, (res, _) in enumerate(ranks):
        rows = rank_range(built["packed"].samples.batch_size, rank, WORLD)
        samples, extra = select_samples(built["packed"].samples, built["packed"].vision_extra, rows)
        with torch.no_grad():
            ref = plain.hidden_states(samples, vision_extra=extra)
        torch.testing.assert_close(res["actor.hidden_states"], ref, rtol=0, atol=ATOL)

    # its own copy: a critic freezes its unused lm_head, and the bundle's model serves the actor tests too
    critic = CriticVL(ActorVL(copy.deepcopy(bundle.model), bundle.adapter),
                      random_value_head(bundle.model.config.get_text_config().hidden_size))
    samples, extra = built["padded"].samples, built["padded"].vision_extra
    values = critic(samples, vision_extra=extra)  # [B, A]
    (values.sum() / WORLD).backward()
    critic_grads = _grads(critic)
    assert "value_head.weight" in critic_grads and any("visual" in n for n in critic_grads)
    for rank, (res, _) in enumerate(ranks):
        rows = rank_range(values.shape[0], rank, WORLD)
        torch.testing.assert_close(res["critic.values"], values.detach()[rows.start : rows.stop], rtol=0, atol=ATOL)
        _assert_grads_match(res, "critic.grad.", critic_grads)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_controls(fsdp_out, bundles, family):
    bundle = bundles[family]
    res, meta = _load(fsdp_out, family, 0)
    # One rank's half alone gives other gradients: the match above needed the cross-rank reduction.
    _, _, half = _actor_reference(bundle, built_batches(bundle)["packed"], rank_range(8, 0, WORLD))
    worst = max(float((res[f"actor.packed.grad.{n}"] - g).abs().max()) for n, g in half.items())
    assert worst > 1e-3, worst
    # ... and the scale-sized tolerance of the match above is tight enough to see it
    assert not all(close_at_scale(res[f"actor.packed.grad.{n}"], g) for n, g in half.items())
    # The checkpointed actor really recomputed under FSDP2: its blocks' Linear layers ran twice per step.
    calls = meta["linear_calls"]
    assert calls["actor"]["packed"] > 0 and calls["actor_ckpt"]["packed"] == 2 * calls["actor"]["packed"], calls
    # The wrong layout is refused with the fix in the message (not a DTensor error deep in the model).
    if family == FAMILIES[0]:
        assert "shard_for_training" in meta["wrong_layout_error"], meta


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_the_decoder_layers_and_vision_blocks(bundles, family):
    model = bundles[family].model
    blocks = block_modules(model)
    config = model.config
    assert len(blocks) == config.get_text_config().num_hidden_layers + config.vision_config.depth
    owned = {id(p) for b in blocks for p in b.parameters()}
    root_owned = [n for n, p in model.named_parameters() if id(p) not in owned]
    # What stays with the root (the wrapper): embeddings, final norm, lm_head, the vision patch embed and merger.
    assert any("embed_tokens" in n for n in root_owned) and any("lm_head" in n for n in root_owned)
    assert any("merger" in n for n in root_owned) and not any(".layers." in n for n in root_owned)
    with pytest.raises(ValueError, match="no module of .* is one of the block classes"):
        block_modules(model, ["NoSuchBlock"])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_text_only_rank_beside_an_image_rank_trains_the_one_process_gradients(fsdp_out, bundles, family):
    """The training plan (the tower in the root unit) with rank 0's micro-batch text-only and rank 1's with images:
    the vision tower's parameters get a gradient on rank 1 alone, yet both ranks reduce-scatter them (a zero gradient
    on rank 0), so the step finishes and every gradient is one process's on both micro-batches. Before, rank 0 sent
    a smaller reduce-scatter than rank 1 expected and gloo aborted."""
    bundle = bundles[family]
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5)
    for rows in (TEXT_ROWS, IMAGE_ROWS):
        built = picked_batch(bundle, rows)
        (actor(built.samples, vision_extra=built.vision_extra).log_probs.sum() / WORLD).backward()
    reference = _grads(actor)
    tower, _ = bundle.adapter.vision_parts(bundle.model)
    in_tower = {id(p) for p in tower.parameters()}
    tower_names = {f"model.{n}" for n, p in bundle.model.named_parameters() if id(p) in in_tower}
    assert tower_names and tower_names <= reference.keys()  # the tower trained (rank 1's images)
    for rank in range(WORLD):
        sharded, _ = _load(fsdp_out, family, rank)
        _assert_grads_match(sharded, "mixed.grad.", reference)
