"""SAPO (arXiv 2511.20347): the loss against its formula written out here, its gradient (the plain policy gradient at
ratio 1, decaying and asymmetric away from it), a PPO control, and the loss selected from the config."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from algo_reference import ref_agg
from mmrlhf.algorithms.losses import policy_loss
from mmrlhf.algorithms.masked import AGG_MODES


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _ref_sapo_token(lp: float, old: float, a: float, tau_pos: float, tau_neg: float) -> float:
    """The paper's per-token objective, negated: ``-(4 / tau) sigmoid(tau (r - 1)) A``, tau by the sign of A."""
    tau = tau_pos if a > 0 else tau_neg
    r = math.exp(lp - old)
    return -(4.0 / tau) * _sigmoid(tau * (r - 1.0)) * a


def _batch(seed, b=5, a=7, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, a, generator=g, dtype=torch.float64) * 3
    logp = (old + spread * torch.randn(b, a, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(b, a, generator=g, dtype=torch.float64)
    adv[0] = adv[0].abs()  # a row of positive advantages only, and one of negative only
    adv[1] = -adv[1].abs()
    lengths = torch.randint(1, a + 1, (b,), generator=g)
    lengths[2] = 0  # an empty response
    mask = torch.arange(a).unsqueeze(0) < lengths.unsqueeze(1)
    return logp, old, adv, mask


def _sapo_grad(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, **params) -> torch.Tensor:
    """d loss / d logprob of one-token batches, each token alone (``[N]`` in, ``[N]`` out)."""
    lp = lp.detach().clone().requires_grad_(True)
    mask = torch.ones(lp.shape[0], 1, dtype=torch.bool)
    loss, _ = policy_loss("sapo", lp[:, None], old[:, None], adv[:, None], mask, agg="seq-mean-token-sum", **params)
    (grad,) = torch.autograd.grad(loss * lp.shape[0], lp)  # undo the mean over the N one-token responses
    return grad


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 3.0)])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_sapo_loss_matches_the_formula(seed, tau_pos, tau_neg, agg):
    logp, old, adv, mask = _batch(seed, spread=1.0)
    loss, metrics = policy_loss("sapo", logp, old, adv, mask, agg=agg, tau_pos=tau_pos, tau_neg=tau_neg)
    lp = logp.detach()
    per_tok = torch.tensor([[_ref_sapo_token(float(lp[i, t]), float(old[i, t]), float(adv[i, t]), tau_pos, tau_neg)
                             for t in range(lp.shape[1])] for i in range(lp.shape[0])], dtype=torch.float64)
    assert math.isclose(loss.item(), ref_agg(per_tok, mask, agg), rel_tol=1e-9, abs_tol=1e-12)
    # gate_weight_mean: mean over response tokens of 4 s (1 - s)
    ws = []
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t]:
                tau = tau_pos if adv[i, t] > 0 else tau_neg
                s = _sigmoid(tau * (math.exp(float(lp[i, t] - old[i, t])) - 1.0))
                ws.append(4 * s * (1 - s))
    assert math.isclose(float(metrics["gate_weight_mean"]), sum(ws) / len(ws), rel_tol=1e-9)


def test_sapo_defaults_are_the_papers():
    logp, old, adv, mask = _batch(0)
    default, _ = policy_loss("sapo", logp, old, adv, mask)
    explicit, _ = policy_loss("sapo", logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05)
    assert default.item() == explicit.item()
    other, _ = policy_loss("sapo", logp, old, adv, mask, tau_pos=1.0, tau_neg=1.0)
    assert other.item() != default.item()  # tau_neg acts


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_sapo_gradient_at_ratio_one_is_the_plain_policy_gradient(agg):
    _, old, adv, mask = _batch(4)
    logp = old.clone().requires_grad_(True)  # on-policy: every ratio is 1
    loss, metrics = policy_loss("sapo", logp, old, adv, mask, agg=agg)
    (grad,) = torch.autograd.grad(loss, logp)
    # the plain policy gradient of -A log pi, aggregated: -A / (number of response tokens), or for the sequence
    # mean -A / (n_i * number of non-empty responses)
    n_i = mask.sum(-1, keepdim=True).to(torch.float64)
    if agg == "token-mean":
        expected = -adv / mask.sum()
    else:
        expected = -adv / (n_i.clamp(min=1) * int((n_i > 0).sum()))
    expected = torch.where(mask, expected, torch.zeros_like(expected))
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert math.isclose(float(metrics["gate_weight_mean"]), 1.0, rel_tol=1e-12)


def test_sapo_gradient_decays_away_from_ratio_one_and_negative_advantages_decay_faster():
    log_r = torch.tensor([-3.0, -1.0, -0.3, 0.0, 0.3, 1.0, 3.0], dtype=torch.float64)
    old = torch.full_like(log_r, -1.0)
    r = log_r.exp()
    ones = torch.ones_like(log_r)
    g_pos = _sapo_grad(old + log_r, old, ones, tau_pos=1.0, tau_neg=2.0)  # A = +1: loss -f(r), gradient -w(r) r
    g_neg = _sapo_grad(old + log_r, old, -ones, tau_pos=1.0, tau_neg=2.0)  # A = -1: gradient +w(r) r
    w_pos, w_neg = -g_pos / r, g_neg / r  # the gate's weight on PPO's ratio-weighted gradient r A grad log pi
    for tau, w in ((1.0, w_pos), (2.0, w_neg)):
        s = torch.sigmoid(tau * (r - 1.0))
        torch.testing.assert_close(w, 4 * s * (1 - s), rtol=1e-12, atol=1e-15)
    mid = 3  # log r = 0
    assert w_pos[mid].item() == pytest.approx(1.0) and w_neg[mid].item() == pytest.approx(1.0)
    for w in (w_pos, w_neg):  # strictly decreasing as the ratio leaves 1, on either side
        assert (w[:mid].diff() > 0).all() and (w[mid:].diff() < 0).all()
    off = torch.arange(len(log_r)) != mid
    assert (w_neg[off] < w_pos[off]).all()  # the larger temperature decays faster
    # far off-policy the whole gradient fades (no cliff, but no runaway either): r = e^3 ~ 20 and r = e^-3 ~ 0.05
    assert abs(g_pos[-1].item()) < 0.01 and abs(g_pos[0].item()) < 0.2
    assert abs(g_neg[-1].item()) < abs(g_pos[-1].item())


def test_control_ppo_matches_sapo_only_on_policy():
    """The control: at ratio 1 PPO and SAPO have the same gradient; inside PPO's band but off ratio 1 they differ
    (PPO weights by r, SAPO by w(r) r), so the tests above are not passing for a loss that ignores the gate."""
    _, old, adv, mask = _batch(5)
    grads = {}
    for shift in (0.0, 0.1):
        for name in ("ppo", "sapo"):
            logp = (old + shift).requires_grad_(True)
            loss, _ = policy_loss(name, logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
            grads[name, shift] = torch.autograd.grad(loss, logp)[0]
    torch.testing.assert_close(grads["ppo", 0.0], grads["sapo", 0.0], rtol=1e-12, atol=1e-15)
    differ = (grads["ppo", 0.1] - grads["sapo", 0.1]).abs()[mask]
    assert (differ > 1e-6).all()


def test_sapo_rejects_a_non_positive_temperature_and_unknown_params():
    logp, old, adv, mask = _batch(0)
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        policy_loss("sapo", logp, old, adv, mask, tau_neg=0.0)
    with pytest.raises(ValueError, match="accepts"):
        policy_loss("sapo", logp, old, adv, mask, tau=1.0)


def test_sapo_selected_from_the_config_runs_through_the_policy_update(monkeypatch):
    """``algorithm.policy_loss=sapo`` with ``policy_loss_params`` -> the trainer's settings -> ``PolicyUpdater``:
    one SGD step (lr 1) on free log-probs moves them by minus the gradient of the configured SAPO loss. The
    collation and the forward are stand-ins; the loss call, its parameters and the aggregation are the trainer's."""
    import mmrlhf.trainer.policy_update as pu
    from mmrlhf.config import build_config
    from mmrlhf.experience.batching import TrainItem
    from mmrlhf.experience.rollout import ScoringDistribution
    from mmrlhf.trainer.builder import policy_update_settings
    from mmrlhf.trainer.minibatch import GuardedStepper

    config = build_config({}, ["algorithm.policy_loss=sapo", "algorithm.policy_loss_params.tau_neg=2.5",
                               "trainer.train_batch_size=4", "trainer.micro_train_batch_size=2"])
    s = policy_update_settings(config, "none")
    assert (s.loss, dict(s.loss_params)) == ("sapo", {"tau_neg": 2.5})

    logp, old, adv, mask = _batch(6, b=4, a=5, spread=0.4)
    mask[:, 0] = True  # every item holds a token
    items = [TrainItem(prompt_ids=[1], response_ids=[2] * 5, vision={}, vision_extra={},
                       token={"loss_mask": mask[i], "action_log_probs": old[i], "advantages": adv[i]},
                       info={"group": torch.tensor(i // 2)}) for i in range(4)]
    items, _ = pu.prepare_policy_targets(items, s)

    class FreeLogProbs(torch.nn.Module):  # the "policy": one free log-prob per response token
        adapter = None

        def __init__(self):
            super().__init__()
            self.lp = torch.nn.Parameter(logp.detach().clone())

        def forward(self, rows, **_):
            return SimpleNamespace(log_probs=self.lp[rows], entropy=None, outside=None, routing=None)

    def collate(chosen, **_):
        rows = [next(j for j, x in enumerate(items) if x is it) for it in chosen]
        return SimpleNamespace(samples=rows, vision_extra={},
                               token={k: torch.stack([it.token[k] for it in chosen]) for k in chosen[0].token})

    monkeypatch.setattr(pu, "collate", collate)
    monkeypatch.setattr(pu, "item_costs", lambda *a, **k: None)
    actor = FreeLogProbs()
    stepper = GuardedStepper(list(actor.parameters()), torch.optim.SGD(actor.parameters(), lr=1.0), None,
                             max_grad_norm=1e9, max_consecutive=3, name="policy")
    metrics = pu.PolicyUpdater(actor, stepper, s, pad_id=0).update(items, distribution=ScoringDistribution(),
                                                                     generator=None)
    assert metrics["policy/optimizer_steps"] == 1 and "policy/gate_weight_mean" in metrics

    lp = logp.detach().clone().requires_grad_(True)
    loss, _ = policy_loss("sapo", lp, old, adv, mask, agg=config.algorithm.loss_agg, tau_pos=1.0, tau_neg=2.5)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(actor.lp.detach(), logp.detach() - grad, rtol=1e-10, atol=1e-12)
    # the control: the default tau_neg would have moved the negative-advantage tokens differently
    loss_d, _ = policy_loss("sapo", lp, old, adv, mask, agg=config.algorithm.loss_agg)
    (grad_d,) = torch.autograd.grad(loss_d, lp)
    assert not torch.allclose(grad, grad_d)
