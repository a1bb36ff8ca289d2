"""A mini-batch whose samples are all masked (count 0) takes no optimiser step: weights, Adam's state and the
schedule stay as they were (a zero-gradient Adam step would still move the weights through its momentum)."""

from __future__ import annotations

import torch

from mmrlhf.trainer.minibatch import GuardedStepper, run_minibatches
from mmrlhf.trainer.optim import build_optimizer, build_scheduler


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    sched = build_scheduler(opt, schedule="cosine", warmup_steps=0, total_steps=10, min_ratio=0.1)
    stepper = GuardedStepper(list(model.parameters()), opt, sched, max_grad_norm=1.0, max_consecutive=3,
                             name="policy")
    x = torch.randn(4, 4)

    def micro_loss(micro, denom):
        return model(x[micro]).sum() / max(denom, 1.0), {"pg_loss": 0.0}

    def run(counts):
        return run_minibatches(counts, batch_size=4, micro_size=2, epochs=1, generator=None, stepper=stepper,
                               micro_loss=micro_loss, prefix="policy/")

    # one real step first, so that Adam holds momentum a zero-gradient step would apply
    run([1.0, 1.0, 1.0, 1.0])
    return model, opt, stepper, run


def test_all_masked_minibatch_takes_no_step():
    model, opt, stepper, run = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    lr = stepper.lr
    metrics = run([0.0, 0.0, 0.0, 0.0])
    assert metrics["policy/optimizer_steps"] == 0 and metrics["policy/empty_minibatches"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(state[k], opt.state[model.weight][k]) for k in state)
    assert stepper.lr == lr and stepper.steps == 1


def test_control_a_step_with_zero_loss_still_moves_the_weights():
    model, _, stepper, run = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    # the old behaviour: a mini-batch counted as non-empty with a zero loss steps Adam on its momentum
    metrics = run_minibatches([1.0] * 4, batch_size=4, micro_size=2, epochs=1, generator=None, stepper=stepper,
                              micro_loss=lambda micro, denom: (0.0 * model(torch.ones(1, 4)).sum(), {}),
                              prefix="policy/")
    assert metrics["policy/optimizer_steps"] == 1 and metrics["policy/empty_minibatches"] == 0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
