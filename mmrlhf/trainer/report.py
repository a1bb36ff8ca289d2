"""What a person looks at to judge an RL run: a PNG of the training curves (:mod:`mmrlhf.trainer.curves`) and an HTML
page of one step's rollouts (here).

Why both: the curves say *that* something changed (reward flat, KL climbing, responses growing, entropy
collapsing, fewer and fewer GRPO groups with any reward variance, the early warning of a collapse); the rollout
page says *why*, by showing what the policy actually wrote for which image and how each answer was scored.

The HTML page is one self-contained file (images embedded as base64 PNG data URIs, inline CSS, no JavaScript, no
external resource) so it can be copied off a cluster, attached to an issue or opened offline. All text is escaped:
model output is untrusted and a response containing ``<script>`` must show as text. Both writers go through a
temp file and ``os.replace`` so a viewer polling the file never sees half of it.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from PIL import Image

from mmrlhf.agents.types import BUDGET_ENDINGS, Trajectory
from mmrlhf.trainer.tracking import atomic_write

# The largest side of an embedded image, in pixels: what the page shows (a producer shrinks report images to it
# before they travel, mmrlhf.trainer.reporting.compact).
MAX_IMAGE_SIDE = 384
# Metrics shown first in the HTML header (any others given follow in name order).
KEY_METRICS = ("reward/mean", "eval/reward/mean", "kl/mean", "response_length/mean", "policy/entropy",
               "groups/with_variance_frac")


@dataclass
class ReportSample:
    """One rollout sample as shown in the report."""

    prompt: str
    response: str
    reward: float | None
    advantage: float | None
    images: list = field(default_factory=list)
    """PIL images of the prompt (may be empty)."""
    parts: dict[str, float | None] = field(default_factory=dict)
    """Named reward parts (``None``: the part did not apply to this sample)."""
    label: str | None = None
    reference: str | None = None
    group: int | None = None
    """Group id (the samples of one prompt, for GRPO); ``None`` samples are shown last, ungrouped."""
    valid: bool = True
    """False for samples masked out of the loss (e.g. a reward failure); they are marked as such."""
    trajectory: Trajectory | None = None
    """A multi-turn sample's exchange: its card shows the turns (assistant text and calls, tool text, images and
    errors) and how it ended, in place of ``response``. ``None``: a single-turn sample."""
    notes: dict[str, str] = field(default_factory=dict)
    """Texts reward sources attached to this sample, by ``source/note`` (e.g. ``judge/text``, the judge's reply)."""


_CSS = """
body{font-family:system-ui,sans-serif;margin:16px;background:#f6f6f4;color:#222}
h1{font-size:20px;margin:0 0 6px} h2{font-size:16px;margin:0 0 8px}
table.m{border-collapse:collapse;font-size:13px;margin:6px 0 12px} table.m td{padding:2px 10px 2px 0}
.group{background:#fff;border:1px solid #ccc;border-radius:6px;padding:10px;margin:0 0 16px}
.group.flat{border-color:#b9770e} .warn{color:#9a5b00;font-weight:600}
.ctx{display:flex;gap:12px;align-items:flex-start;margin:0 0 8px}
.imgs img{max-width:384px;max-height:384px;min-width:96px;image-rendering:pixelated;border:1px solid #999;
 margin:0 6px 6px 0;vertical-align:top}
.samples{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:8px}
.sample{border:1px solid #ddd;border-radius:4px;padding:6px;background:#fcfcfc}
.sample.masked{background:repeating-linear-gradient(45deg,#f1f1f1,#f1f1f1 8px,#e4e4e4 8px,#e4e4e4 16px);
 border:2px dashed #7b241c;color:#555}
.badge{display:inline-block;background:#7b241c;color:#fff;font-size:11px;font-weight:700;padding:1px 6px;
 border-radius:3px;margin-right:6px}
pre{white-space:pre-wrap;word-break:break-word;margin:2px 0 6px;font-size:13px;background:#f0f0ee;padding:4px}
.k{color:#666;font-size:12px} .pos{color:#1e8449;font-weight:600} .neg{color:#a93226;font-weight:600}
table.parts{font-size:12px;border-collapse:collapse} table.parts td{padding:0 8px 0 0}
"""
# Added to the page only when a sample has turns, so a single-turn page stays exactly as it was.
_TURN_CSS = """
.turns{list-style:none;padding:0;margin:4px 0 6px}
.turn{border-left:3px solid #999;padding:2px 0 2px 6px;margin:0 0 4px}
.turn.assistant{border-color:#2e86c1} .turn.tool{border-color:#7d8c8d;background:#f4f6f6}
.turn.tool.failed{border-color:#a93226;background:#fbeeee}
.turn .imgs img{max-width:min(384px,100%)}
.calls{font-size:12px;margin:0 0 4px} code.call{background:#eaf2f8;padding:0 4px;margin-right:6px;overflow-wrap:anywhere}
.badge.err{background:#a93226} .summary{font-size:12px;margin:2px 0 4px} .ending.budget{color:#9a5b00;font-weight:700}
"""


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    value = float(value)
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _image_uri(image: Any, where: str, max_side: int, cache: dict[int, str]) -> str:
    """A PIL image as a ``data:image/png;base64`` URI, downscaled to at most ``max_side`` pixels a side."""
    if id(image) in cache:
        return cache[id(image)]
    if not isinstance(image, Image.Image):
        raise TypeError(f"{where}: images must be PIL images, got {type(image).__name__}")
    img = image if image.mode in ("RGB", "RGBA", "L", "LA") else image.convert("RGBA" if "A" in image.mode else "RGB")
    if max(img.size) > max_side:
        img = img.copy()
        img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    cache[id(image)] = uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    return uri


def _reward_html(s: ReportSample) -> str:
    adv = "" if s.advantage is None else ("pos" if s.advantage > 0 else "neg" if s.advantage < 0 else "")
    parts = "".join(f"<tr><td>{_e(k)}</td><td>{_e(_fmt(v))}</td></tr>" for k, v in s.parts.items())
    notes = "".join(f'<div class="k">{_e(k)}</div><pre class="note">{_e(v)}</pre>' for k, v in s.notes.items())
    return (f'<div><span class="k">reward</span> <b>{_e(_fmt(s.reward))}</b> &nbsp; <span class="k">advantage</span> '
            f'<span class="{adv}">{_e(_fmt(s.advantage))}</span></div>'
            + (f'<table class="parts">{parts}</table>' if parts else "") + notes)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _call_html(call: Any) -> str:
    """``name({"arg": ...})``: a call as the tool received it (arguments re-serialised, not the raw text)."""
    args = json.dumps(call.arguments, ensure_ascii=False, default=str)
    return f'<code class="call">{_e(call.name)}({_e(args)})</code>'


def _turns_html(t: Trajectory, turn_uris: list[list[str]]) -> str:
    """A trajectory turn by turn, with a one-line summary (turns, tool calls, errors, how it ended)."""
    errors = t.errors
    kinds = ", ".join(f"{_e(k)} &times;{errors.count(k)}" for k in dict.fromkeys(errors))
    ending = f'<span class="ending{" budget" if t.ended in BUDGET_ENDINGS else ""}">{_e(t.ended)}</span>'
    summary = (f'<div class="summary">{_plural(t.num_turns, "turn")}, {_plural(t.num_tool_calls, "tool call")}, '
               f'{_plural(len(errors), "error")}{f" ({kinds})" if kinds else ""}; ended: {ending}</div>')
    items = []
    for j, (turn, uris) in enumerate(zip(t.turns, turn_uris)):
        if turn.role == "assistant":
            calls = "".join(_call_html(c) for c in turn.calls)
            items.append(f'<li class="turn assistant"><div class="k">{j}. assistant</div>'
                         f'<pre class="turn-text">{_e(turn.text)}</pre>'
                         + (f'<div class="calls"><span class="k">calls</span> {calls}</div>' if calls else "") + "</li>")
        else:
            badges = "".join(f'<span class="badge err">{_e(k)}</span>' for k in turn.errors)
            imgs = ('<div class="imgs">' + "".join(f'<img src="{u}" alt="turn {j} image {k}">' for k, u in
                                                   enumerate(uris)) + "</div>") if uris else ""
            items.append(f'<li class="turn tool{" failed" if turn.errors else ""}"><div class="k">{j}. tool '
                         f'({_e(f"{turn.latency_s:.2f}")} s)</div>{badges}{imgs}'
                         f'<pre class="turn-text">{_e(turn.text)}</pre></li>')
    return f'{summary}<ol class="turns">{"".join(items)}</ol>'


def _trajectory_uris(s: ReportSample, where: str, max_side: int, cache: dict[int, str]) -> list[list[str]]:
    """Data URIs of each turn's images (empty for assistant turns); a malformed trajectory is an error naming it."""
    t = s.trajectory
    if t is None:
        return []
    if not isinstance(t, Trajectory):
        raise TypeError(f"{where}: trajectory must be a mmrlhf.agents.types.Trajectory, got {type(t).__name__}")
    out = []
    for j, turn in enumerate(t.turns):
        if turn.role not in ("assistant", "tool"):
            raise ValueError(f"{where} turn {j}: role must be 'assistant' or 'tool', got {turn.role!r}")
        out.append([_image_uri(im, f"{where} turn {j}", max_side, cache) for im in turn.images])
    return out


def _context_html(prompt: str | None, uris: list[str] | None, label: str | None, reference: str | None) -> str:
    """Images, prompt, label and reference (each only when given)."""
    out = []
    if uris:
        out.append('<div class="imgs">' + "".join(
            f'<img src="{u}" alt="image {j}">' for j, u in enumerate(uris)) + "</div>")
    text = []
    if prompt is not None:
        text.append(f'<div class="k">prompt</div><pre class="prompt">{_e(prompt)}</pre>')
    if label is not None:
        text.append(f'<div><span class="k">label</span> {_e(label)}</div>')
    if reference is not None:
        text.append(f'<div class="k">reference</div><pre class="reference">{_e(reference)}</pre>')
    if text:
        out.append("<div>" + "".join(text) + "</div>")
    return f'<div class="ctx">{"".join(out)}</div>' if out else ""


def write_rollout_report(samples: Sequence[ReportSample], out_html: str | Path, *, step: int, title: str = "",
                         metrics: Mapping[str, float] | None = None, max_image_side: int = MAX_IMAGE_SIDE) -> Path:
    """Write one self-contained HTML page of ``samples`` grouped by group id; returns its path.

    Within a group, the prompt, images, label and reference are shown once when every sample shares them (GRPO:
    n answers to one prompt), else per sample. A group whose rewards are all equal is flagged: it has no reward
    variance, so GRPO learns nothing from it. ``max_image_side`` bounds the embedded images (pixels a side).
    A multi-turn sample (``trajectory`` set) shows its turns in place of the response: each assistant turn's text
    and calls, each tool turn's text, images (embedded like the prompt's) and error kinds, and how it ended.
    """
    cache: dict[int, str] = {}
    uris = [[_image_uri(im, f"sample {i} (group {s.group})", max_image_side, cache) for im in s.images]
            for i, s in enumerate(samples)]
    turn_uris = [_trajectory_uris(s, f"sample {i} (group {s.group})", max_image_side, cache)
                 for i, s in enumerate(samples)]
    groups: dict[int | None, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group, []).append(i)
    order = sorted((g for g in groups if g is not None)) + ([None] if None in groups else [])

    metrics = dict(metrics or {})
    key = [k for k in KEY_METRICS if k in metrics]
    rest = sorted(k for k in metrics if k not in KEY_METRICS)
    n_masked = sum(not s.valid for s in samples)
    head = [f"<h1>{_e(title or 'Rollout report')} &mdash; step {int(step)}</h1>",
            f'<div class="k">{len(samples)} samples, {len(order)} groups, {n_masked} masked</div>']

    def table(names: list[str]) -> str:
        return '<table class="m">' + "".join(
            f"<tr><td>{_e(k)}</td><td><b>{_e(_fmt(metrics[k]))}</b></td></tr>" for k in names) + "</table>"

    if key:
        head.append(table(key))
    if rest:  # the full list stays one click away, so the samples start on the first screen
        head.append(f"<details><summary>all {len(rest)} other metrics</summary>{table(rest)}</details>")

    body = []
    for g in order:
        idx = groups[g]
        members = [samples[i] for i in idx]
        shared = {
            "prompt": len({s.prompt for s in members}) == 1,
            "images": len({tuple(uris[i]) for i in idx}) == 1,
            "label": len({s.label for s in members}) == 1,
            "reference": len({s.reference for s in members}) == 1,
        }
        rewards = [s.reward for s in members if s.valid and s.reward is not None and math.isfinite(s.reward)]
        flat = g is not None and len(rewards) > 1 and max(rewards) == min(rewards)
        first = members[0]
        header = f"<h2>{'ungrouped' if g is None else f'group {g}'}</h2>"
        if rewards:
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
            header += f'<div class="k">valid rewards: mean {_fmt(mean)}, std {_fmt(std)}, n {len(rewards)}</div>'
        if flat:
            header += '<div class="warn">no reward variance in this group (all rewards equal)</div>'
        header += _context_html(first.prompt if shared["prompt"] else None, uris[idx[0]] if shared["images"] else None,
                                first.label if shared["label"] else None,
                                first.reference if shared["reference"] else None)
        cards = []
        for i, s in zip(idx, members):
            marker = '<span class="badge">MASKED</span><span class="k">valid=False: not in the loss</span>' \
                if not s.valid else ""
            ctx = _context_html(None if shared["prompt"] else s.prompt, None if shared["images"] else uris[i],
                                None if shared["label"] else s.label, None if shared["reference"] else s.reference)
            shown = (_turns_html(s.trajectory, turn_uris[i]) if s.trajectory is not None else
                     f'<div class="k">response</div><pre class="response">{_e(s.response)}</pre>')
            cards.append(f'<div class="sample{"" if s.valid else " masked"}" id="sample-{i}">'
                         f'<div class="k">sample {i}</div>{marker}{ctx}{shown}'
                         f"{_reward_html(s)}</div>")
        body.append(f'<section class="group{" flat" if flat else ""}">{header}'
                    f'<div class="samples">{"".join(cards)}</div></section>')

    css = _CSS + (_TURN_CSS if any(s.trajectory is not None for s in samples) else "")
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title or 'Rollout report')} - step {int(step)}</title><style>{css}</style></head>"
            f"<body>{''.join(head)}{''.join(body)}</body></html>\n")
    return atomic_write(out_html, page)
