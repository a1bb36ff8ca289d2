"""Which samples share a forward: micro-batches planned from what each sample costs, not from how many there are.

Why: a micro-batch of four samples with 896 px images holds ~4x the work of four with 224 px images, so a count of
samples bounds neither memory nor time per forward. Here a micro-batch is bounded by a **cost**: the decoder
positions its layout computes (padding included) plus the vision patch rows its images and videos send through the
vision tower (the product of each ``grid_thw``, before the spatial merge). Pure planning: numbers in, index lists
out; no model, no tensor, no config object (the builders pass plain values; the experience layer turns samples into
:class:`SampleCost` s).

Cost of one micro-batch, per layout (exactly the tensors the builders in ``mmrlhf.experience`` lay out):

- ``packed``: every sample's prompt + response back to back (the sum);
- ``padded``: ``B x (longest prompt + longest response)`` (left-padded prompts, right-padded responses);
- ``grouped`` (shared prompt): ``rows x widest row``, each row one prompt (its patches once) and the responses that
  fit ``max_row_tokens``, so siblings that share a micro-batch pay their prompt once.

Planning one mini-batch with a budget (:func:`pack`): the samples form units (one sample; in the grouped layout the
members of one prompt group, cut only where the group alone would exceed the budget), units are placed longest first
into the first micro-batch they fit (first-fit decreasing: few micro-batches). A unit over the budget on its own (one
sample larger than the budget) gets a micro-batch to itself: counted, not an error. Two units of one group never
share a micro-batch: the builder would merge their rows into a layout the plan did not cost.

Several ranks (:func:`plan_micro_batches`): every forward is collective under FSDP, so the ranks first agree on the
number of micro-batches (the most any rank needs), then each rank deals its units into exactly that many
(:func:`balance`: longest first, each to the micro-batch it leaves cheapest, the classic LPT rule for balanced
loads; Karmarkar-Karp's differencing needs additive costs and cannot respect the budget unit by unit, so it is not
used), sorted heaviest first so the ranks' k-th forwards carry similar loads. A rank with fewer units than forwards
runs padding micro-batches (empty lists here).

The sample count and the token budget: ``tokens=None`` is the count split (consecutive chunks of ``samples``, as the
trainer always did). An integer budget REPLACES the count: micro-batches hold as many samples as fit (a count cap
would cap the gain: the point is fewer forwards where samples are small). ``auto`` keeps the count as the memory
reference: per mini-batch the budget is the costliest micro-batch the count split would run (the most over ranks),
and the count split is kept when packing would not save a forward, so ``auto`` never raises the peak and never adds
a forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from mmrlhf.config.budget import Budget, check_budget

logger = logging.getLogger(__name__)

LAYOUTS = ("padded", "packed", "grouped")


@dataclass(frozen=True)
class SampleCost:
    """What one sample costs a forward. ``group``: in the grouped layout, samples with equal keys share a prompt
    (ids and pixels: the builder puts them in one row); ignored by the other layouts."""

    prompt_tokens: int  # decoder tokens of the prompt (vision pads included)
    response_tokens: int
    prompt_patches: int = 0  # vision patch rows of the prompt's images and videos
    response_patches: int = 0  # of images inside the response (multi-turn observations)
    group: Hashable | None = None

    @property
    def alone(self) -> int:
        """The sample's cost in a micro-batch of its own (any layout)."""
        return self.prompt_tokens + self.response_tokens + self.prompt_patches + self.response_patches


@dataclass(frozen=True)
class Layout:
    """The forward layout whose tensors the cost counts; ``max_row_tokens``: the grouped layout's longest row."""

    kind: str = "packed"
    max_row_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ValueError(f"unknown layout {self.kind!r}; known: {LAYOUTS}")


def row_widths(prompt: int, responses: Sequence[int], max_row_tokens: int | None) -> list[int]:
    """Decoder tokens of each grouped row of one prompt and its ``responses`` (the rule of
    ``mmrlhf.experience.grouped``: a row takes responses while they fit ``max_row_tokens``, at least one)."""
    rows, used, n = [], prompt, 0
    for r in responses:
        if n and max_row_tokens is not None and used + r > max_row_tokens:
            rows.append(used)
            used, n = prompt, 0
        used, n = used + r, n + 1
    rows.append(used)
    return rows


def _group_key(costs: Sequence[SampleCost], i: int) -> Hashable:
    key = costs[i].group
    return ("sample", i) if key is None else ("group", key)


def micro_batch_cost(costs: Sequence[SampleCost], items: Sequence[int], layout: Layout) -> int:
    """The cost of the micro-batch ``items`` (in this order) as ``layout`` lays it out: decoder positions (padding
    included) plus vision patch rows. 0 for no item."""
    if not items:
        return 0
    c = [costs[i] for i in items]
    if layout.kind == "packed":
        return sum(s.alone for s in c)
    if layout.kind == "padded":
        width = max(s.prompt_tokens for s in c) + max(s.response_tokens for s in c)
        return len(c) * width + sum(s.prompt_patches + s.response_patches for s in c)
    members: dict[Hashable, list[int]] = {}
    for i in items:
        members.setdefault(_group_key(costs, i), []).append(i)
    rows, width, patches = 0, 0, 0
    for group in members.values():
        first = costs[group[0]]
        widths = row_widths(first.prompt_tokens, [costs[i].response_tokens for i in group], layout.max_row_tokens)
        rows, width = rows + len(widths), max(width, *widths)
        patches += len(widths) * first.prompt_patches + sum(costs[i].response_patches for i in group)
    return rows * width + patches


@dataclass(frozen=True)
class _Unit:
    """Samples that travel together, summarised for the per-layout cost."""

    items: tuple[int, ...]
    group: Hashable
    rows: int  # rows of the layout (padded / packed: 1 per sample)
    width: int  # widest row (grouped)
    prompt: int  # longest prompt (padded)
    response: int  # longest response (padded)
    tokens: int  # decoder tokens without padding
    patches: int
    cost: int  # alone in a micro-batch


def _unit(costs: Sequence[SampleCost], items: Sequence[int], layout: Layout) -> _Unit:
    c = [costs[i] for i in items]
    if layout.kind == "grouped":
        widths = row_widths(c[0].prompt_tokens, [s.response_tokens for s in c], layout.max_row_tokens)
        rows, width = len(widths), max(widths)
        tokens = sum(widths)
        patches = rows * c[0].prompt_patches + sum(s.response_patches for s in c)
    else:
        rows, width, tokens = len(c), 0, sum(s.prompt_tokens + s.response_tokens for s in c)
        patches = sum(s.prompt_patches + s.response_patches for s in c)
    group = _group_key(costs, items[0]) if layout.kind == "grouped" else ("sample", items[0])
    return _Unit(tuple(items), group, rows, width, max(s.prompt_tokens for s in c),
                 max(s.response_tokens for s in c), tokens, patches, micro_batch_cost(costs, items, layout))


def units(costs: Sequence[SampleCost], items: Sequence[int], layout: Layout, budget: int) -> list[_Unit]:
    """The units of ``items``: one per sample, or in the grouped layout one per prompt group (members in order),
    cut where adding the next member would take the unit over ``budget``."""
    if layout.kind != "grouped":
        return [_unit(costs, [i], layout) for i in items]
    members: dict[Hashable, list[int]] = {}
    for i in items:
        members.setdefault(_group_key(costs, i), []).append(i)
    out: list[_Unit] = []
    for group in members.values():
        current: list[int] = []
        for i in group:
            if current and micro_batch_cost(costs, current + [i], layout) > budget:
                out.append(_unit(costs, current, layout))
                current = []
            current.append(i)
        out.append(_unit(costs, current, layout))
    return out


@dataclass
class _Bin:
    """A micro-batch being filled; its cost is the union of its units' layouts (units of one group never meet)."""

    layout: Layout
    units: list[_Unit] = field(default_factory=list)
    rows: int = 0
    width: int = 0
    prompt: int = 0
    response: int = 0
    tokens: int = 0
    patches: int = 0

    def cost_with(self, u: _Unit | None = None) -> int:
        """The cost with ``u`` added (None: as it is); -1 when ``u``'s group is already here."""
        if u is None:
            u = _Unit((), None, 0, 0, 0, 0, 0, 0, 0)
        elif any(v.group == u.group for v in self.units):
            return -1
        kind, rows, patches = self.layout.kind, self.rows + u.rows, self.patches + u.patches
        if kind == "packed":
            return self.tokens + u.tokens + patches
        if kind == "padded":
            return rows * (max(self.prompt, u.prompt) + max(self.response, u.response)) + patches
        return rows * max(self.width, u.width) + patches

    def add(self, u: _Unit) -> None:
        self.units.append(u)
        self.rows, self.width = self.rows + u.rows, max(self.width, u.width)
        self.prompt, self.response = max(self.prompt, u.prompt), max(self.response, u.response)
        self.tokens, self.patches = self.tokens + u.tokens, self.patches + u.patches

    @property
    def items(self) -> list[int]:
        return [i for u in self.units for i in u.items]


def _longest_first(us: list[_Unit]) -> list[_Unit]:
    return sorted(us, key=lambda u: (-u.cost, u.items[0]))


def pack(costs: Sequence[SampleCost], items: Sequence[int], layout: Layout, budget: int) -> list[list[int]]:
    """Few micro-batches of ``items``, none over ``budget`` unless it holds one unit larger than the budget:
    first-fit decreasing over the units."""
    bins: list[_Bin] = []
    for u in _longest_first(units(costs, items, layout, budget)):
        home = next((b for b in bins if 0 <= b.cost_with(u) <= budget), None)
        if home is None:
            home = _Bin(layout)
            bins.append(home)
        home.add(u)
    return [b.items for b in bins]


def balance(costs: Sequence[SampleCost], items: Sequence[int], layout: Layout, budget: int,
            count: int) -> list[list[int]]:
    """Exactly ``count`` micro-batches of ``items`` (empty ones when there are fewer units), none over ``budget``
    unless it holds one oversized unit, loads as even as the rule finds, heaviest first. ``count`` must be at
    least what :func:`pack` needs.

    Longest first, each unit to the micro-batch it leaves cheapest among those it fits (LPT); should that strand a
    unit, the first-fit plan is spread instead: its costliest micro-batch of several units is halved until there
    are ``count`` (a part of a micro-batch costs no more than the whole, so every part fits)."""
    us = _longest_first(units(costs, items, layout, budget))
    bins = [_Bin(layout) for _ in range(count)]
    for u in us:
        fits = [(b.cost_with(u), k) for k, b in enumerate(bins) if not b.units or 0 <= b.cost_with(u) <= budget]
        if not fits:
            bins = _spread(costs, items, layout, budget, count)
            break
        bins[min(fits)[1]].add(u)
    bins.sort(key=lambda b: -b.cost_with())
    return [b.items for b in bins]


def _spread(costs: Sequence[SampleCost], items: Sequence[int], layout: Layout, budget: int, count: int) -> list[_Bin]:
    firsts = pack(costs, items, layout, budget)
    if len(firsts) > count:
        raise ValueError(f"{len(firsts)} micro-batches are needed, {count} asked for")
    bins = []
    for part in firsts:
        b = _Bin(layout)
        for u in units(costs, part, layout, budget):
            b.add(u)
        bins.append(b)
    while len(bins) < count:
        several = [b for b in bins if len(b.units) > 1]
        if not several:
            bins.append(_Bin(layout))
            continue
        whole = max(several, key=lambda b: b.cost_with())
        bins.remove(whole)
        halves = [_Bin(layout), _Bin(layout)]
        for u in _longest_first(whole.units):
            min(halves, key=lambda h: h.cost_with(u)).add(u)
        bins += halves
    return bins


def count_split(items: Sequence[int], samples: int) -> list[list[int]]:
    """Consecutive chunks of ``samples`` items (the count split)."""
    return [list(items[s: s + samples]) for s in range(0, len(items), samples)]


@dataclass
class SplitPlan:
    """Micro-batches of each mini-batch of one rank (the same number of mini-batches, and of micro-batches in each,
    on every rank; an empty list is a padding micro-batch), with their costs and budgets."""

    micro_batches: list[list[list[int]]]
    costs: list[list[int]]  # per micro-batch (0: padding)
    budgets: list[int | None]  # per mini-batch: the budget in force (None: the count split ran)
    oversized: int = 0  # micro-batches of one unit larger than the budget

    @property
    def forwards(self) -> int:
        return sum(len(m) for m in self.micro_batches)


def plan_micro_batches(costs: Sequence[SampleCost], minis: Sequence[Sequence[int]], layout: Layout, *,
                       samples: int, tokens: Budget, world: Any = None) -> SplitPlan:
    """The micro-batches of the mini-batches ``minis`` (item indices into ``costs``, in the order the count split
    cuts) under the sample count ``samples`` and the budget ``tokens`` (module docstring). ``world``: the ranks
    (:class:`~mmrlhf.parallel.world.World`; collective: every rank calls this with its own items); None: one."""
    if world is None:
        from mmrlhf.parallel.world import single

        world = single()
    if samples < 1:
        raise ValueError(f"samples per micro-batch must be >= 1, got {samples}")
    tokens = check_budget(tokens, "max_tokens_per_micro_batch")
    n = int(world.all_max([float(len(minis))])[0])
    minis = [list(m) for m in minis] + [[] for _ in range(n - len(minis))]
    counted = [count_split(m, samples) for m in minis]
    count_k = [int(k) for k in world.all_max([float(len(c)) for c in counted])]
    if tokens is None:
        budgets: list[int | None] = [None] * n
    elif tokens == "auto":
        peaks = [max((micro_batch_cost(costs, m, layout) for m in c), default=0) for c in counted]
        budgets = [int(b) for b in world.all_max([float(p) for p in peaks])]
    else:
        budgets = [tokens] * n
    need = [len(pack(costs, m, layout, b)) if b is not None and m else 0 for m, b in zip(minis, budgets)]
    token_k = [int(k) for k in world.all_max([float(k) for k in need])]
    plan = SplitPlan([], [], [])
    for j, mini in enumerate(minis):
        if budgets[j] is None or (tokens == "auto" and token_k[j] >= count_k[j]):
            micros = counted[j] + [[] for _ in range(count_k[j] - len(counted[j]))]
            budget = None
        else:
            budget = budgets[j]
            micros = balance(costs, mini, layout, budget, token_k[j])
            plan.oversized += sum(1 for m in micros if micro_batch_cost(costs, m, layout) > budget)
        plan.micro_batches.append(micros)
        plan.costs.append([micro_batch_cost(costs, m, layout) for m in micros])
        plan.budgets.append(budget)
    if plan.oversized:
        logger.warning("%d micro-batch(es) hold one sample (or prompt group) larger than the token budget %s: each "
                       "runs alone (largest cost %d)", plan.oversized, max(b for b in plan.budgets if b is not None),
                       max(max(c, default=0) for c in plan.costs))
    return plan


def split_metrics(plan: SplitPlan, world: Any, prefix: str) -> dict[str, float]:
    """``prefix``-ed metrics of a plan over every rank (collective): ``micro_batches`` (forwards each rank runs,
    padding included; a mini-batch with nothing to train skips its planned ones),
    ``micro_batch_tokens_max`` / ``_mean`` (cost of the costliest / an average micro-batch, padding left out),
    ``micro_batch_rank_imbalance`` (the forwards' work as the ranks run them in lockstep, each forward as slow as
    its costliest rank, over the same work spread evenly: 1.0 is perfect, and always 1.0 on one rank),
    ``oversized_micro_batches`` (micro-batches of one sample over the budget, summed over ranks)."""
    flat = [float(c) for costs in plan.costs for c in costs]  # as many on every rank
    top, total = world.all_max(flat), world.all_sum(flat)
    real, oversized = world.all_sum([float(sum(1 for c in flat if c > 0)), float(plan.oversized)])
    work = sum(total)
    return {f"{prefix}micro_batches": float(plan.forwards),
            f"{prefix}micro_batch_tokens_max": max(top, default=0.0),
            f"{prefix}micro_batch_tokens_mean": work / real if real else 0.0,
            f"{prefix}micro_batch_rank_imbalance": sum(top) * world.world_size / work if work else 1.0,
            f"{prefix}oversized_micro_batches": oversized}
