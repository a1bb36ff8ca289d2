"""Training-curve PNG and the self-contained rollout HTML report (escaping, images, masking, atomic writes, and
what a real browser shows)."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess

import pytest
from PIL import Image

from mmrlhf.agents.types import ToolCall, Trajectory, TurnRecord
from mmrlhf.trainer.curves import plot_curves
from mmrlhf.trainer.report import _CSS, ReportSample, write_rollout_report

RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 160, 0)


def _sample(response: str, *, group: int | None = 0, colour=RED, size=(64, 64), **kw) -> ReportSample:
    base = dict(prompt="<image>What colour is the square?", reward=1.0, advantage=0.5,
                images=[Image.new("RGB", size, colour)] if colour else [], parts={"accuracy": 1.0}, label="colour",
                reference="red", group=group)
    base.update(kw)
    return ReportSample(response=response, **base)


def _data_images(page: str) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(b64)))
            for b64 in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


# ---- HTML (no browser) -----------------------------------------------------------------------------------------


def test_all_text_is_escaped(tmp_path):
    evil = '<script>alert("x")</script> & <b>bold</b>'
    s = _sample(evil, prompt=f"prompt {evil}", reference=f"ref {evil}", label="<i>lab</i>",
                parts={"<img src=x>": 0.5})
    page = write_rollout_report([s], tmp_path / "r.html", step=3, title="<h1>t</h1>",
                                metrics={"<k>": 1.0}).read_text()
    assert "<script" not in page and "<b>bold" not in page and "<i>lab" not in page and "<img src=x>" not in page
    assert "<h1>t</h1>" not in page and "<k>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in page


def test_masked_samples_carry_a_visible_marker(tmp_path):
    samples = [_sample("kept"), _sample("masked one", valid=False, reward=None, advantage=None), _sample("kept 2")]
    page = write_rollout_report(samples, tmp_path / "r.html", step=1).read_text()
    cards = dict((int(i), cls) for cls, i in re.findall(r'<div class="sample( masked)?" id="sample-(\d+)">', page))
    assert cards == {0: "", 1: " masked", 2: ""}
    card1 = page.split('id="sample-1"')[1].split('id="sample-2"')[0]
    assert "MASKED" in card1 and page.count(">MASKED<") == 1
    assert "1 masked" in page


def test_images_embed_as_png_of_the_right_colour_bounded_in_size(tmp_path):
    samples = [_sample("a", group=0, colour=RED, size=(1000, 500)), _sample("b", group=1, colour=BLUE, size=(40, 30))]
    page = write_rollout_report(samples, tmp_path / "r.html", step=1, max_image_side=256).read_text()
    imgs = _data_images(page)
    assert [im.size for im in imgs] == [(256, 128), (40, 30)]  # downscaled, aspect kept; small ones untouched
    assert [im.convert("RGB").getcolors() for im in imgs] == [[(256 * 128, RED)], [(40 * 30, BLUE)]]
    # Self-contained: every src is a data URI, nothing is fetched, no script.
    assert all(src.startswith("data:") for src in re.findall(r'src="([^"]*)"', page))
    assert "http://" not in page and "https://" not in page and "<link" not in page and "url(" not in page


def test_group_context_is_shown_once_and_groups_are_ordered(tmp_path):
    red = Image.new("RGB", (32, 32), RED)
    same = [_sample(f"answer {i}", group=5, images=[red]) for i in range(4)]
    mixed = [_sample("x", group=2, prompt="first prompt"), _sample("y", group=2, prompt="second prompt")]
    loose = [_sample("no group", group=None, colour=None)]
    page = write_rollout_report(loose + same + mixed, tmp_path / "r.html", step=1).read_text()
    assert page.index("group 2") < page.index("group 5") < page.index("ungrouped")
    group5 = page.split("<h2>group 5</h2>")[1].split("</section>")[0]
    assert group5.count("What colour is the square?") == 1 and len(_data_images(group5)) == 1
    group2 = page.split("<h2>group 2</h2>")[1].split("</section>")[0]
    assert "first prompt" in group2 and "second prompt" in group2


def test_groups_without_reward_variance_are_flagged(tmp_path):
    flat = [_sample("a", group=0, reward=1.0), _sample("b", group=0, reward=1.0),
            _sample("bad", group=0, reward=0.0, valid=False)]  # masked samples do not count
    varied = [_sample("c", group=1, reward=1.0), _sample("d", group=1, reward=0.0)]
    page = write_rollout_report(flat + varied, tmp_path / "r.html", step=1).read_text()
    g0 = page.split("<h2>group 0</h2>")[1].split("</section>")[0]
    g1 = page.split("<h2>group 1</h2>")[1].split("</section>")[0]
    assert "no reward variance" in g0 and "no reward variance" not in g1


def test_header_shows_step_and_metrics(tmp_path):
    metrics = {"zzz/other": 2.0, "reward/mean": 0.123456, "kl/mean": float("nan")}
    page = write_rollout_report([_sample("a")], tmp_path / "r.html", step=42, metrics=metrics).read_text()
    assert "step 42" in page and "0.1235" in page and "nan" in page
    assert page.index("reward/mean") < page.index("kl/mean") < page.index("zzz/other")  # key metrics first


def test_a_non_image_is_an_error_naming_the_sample(tmp_path):
    with pytest.raises(TypeError, match=r"sample 1 \(group 0\).*PIL"):
        write_rollout_report([_sample("a"), _sample("b", images=["/tmp/x.png"])], tmp_path / "r.html", step=1)
    assert not (tmp_path / "r.html").exists()


# ---- multi-turn samples ----------------------------------------------------------------------------------------


def _zoom_then_fail() -> Trajectory:
    """Three assistant turns: a zoom that returns one image, a calculator call that fails, the answer."""
    return Trajectory(turns=[
        TurnRecord("assistant", "Let me zoom in first.", calls=[ToolCall("zoom", {"box": [0, 0, 10, 10]})]),
        TurnRecord("tool", "zoomed on the top-left corner", images=[Image.new("RGB", (50, 40), GREEN)],
                   latency_s=0.25),
        TurnRecord("assistant", "Now count the pixels.", calls=[ToolCall("calculator", {"expression": "10*10"})]),
        TurnRecord("tool", "Error: the call is not valid JSON", errors=["bad_json"]),
        TurnRecord("assistant", "The square is green."),
    ], final_answer="The square is green.", ended="answer")


def _zoom_out_of_turns() -> Trajectory:
    """One call that returns two images (one too large for the page), then a turn the budget cut."""
    return Trajectory(turns=[
        TurnRecord("assistant", "Zoom on both halves.", calls=[ToolCall("zoom", {"box": [0, 0, 5, 10]}),
                                                               ToolCall("zoom", {"box": [5, 0, 10, 10]})]),
        TurnRecord("tool", "two crops", images=[Image.new("RGB", (1000, 500), BLUE),
                                                Image.new("RGB", (30, 30), GREEN)], latency_s=1.5),
        TurnRecord("assistant", "Still thinking about"),
    ], final_answer="Still thinking about", ended="max_turns")


def _multi_turn_samples() -> list[ReportSample]:
    red = Image.new("RGB", (64, 64), RED)  # one prompt image, shared by the group
    return [_sample(t.final_answer, group=0, images=[red], trajectory=t)
            for t in (_zoom_then_fail(), _zoom_out_of_turns())]


def _card(page: str, i: int) -> str:
    return page.split(f'id="sample-{i}"')[1].split('id="sample-')[0]


def test_multi_turn_samples_show_every_turn_in_order_with_tool_images_errors_and_ending(tmp_path):
    samples = _multi_turn_samples()
    page = write_rollout_report(samples, tmp_path / "r.html", step=5, max_image_side=256).read_text()
    group = page.split("<h2>group 0</h2>")[1]
    assert group.count("What colour is the square?") == 1  # the prompt is still shown once per group

    # Every turn's text, in order, in its own card; the raw response block is replaced by the turns.
    for i, s in enumerate(samples):
        card = _card(page, i)
        positions = [card.index(f'<pre class="turn-text">{t.text}</pre>') for t in s.trajectory.turns]
        assert positions == sorted(positions) and len(positions) == len(s.trajectory.turns)
        assert card.count('<li class="turn ') == len(s.trajectory.turns)
        assert 'class="response"' not in card
    first, second = _card(page, 0), _card(page, 1)
    assert 'zoom({&quot;box&quot;: [0, 0, 10, 10]})' in first and 'calculator({&quot;expression&quot;' in first
    assert second.count('<code class="call">zoom(') == 2

    # One embedded image per prompt image (once per group) and per tool image, bounded like the prompt's.
    assert [im.size for im in _data_images(page)] == [(64, 64), (50, 40), (256, 128), (30, 30)]
    assert [im.convert("RGB").getpixel((5, 5)) for im in _data_images(page)] == [RED, GREEN, BLUE, GREEN]
    assert len(_data_images(first)) == 1 and len(_data_images(second)) == 2

    # Error kinds are marked on the failing tool turn only; the ending and the per-sample line are shown.
    assert first.count('<span class="badge err">bad_json</span>') == 1
    failed = first.split('<li class="turn tool failed">')[1].split("</li>")[0]
    assert "Error: the call is not valid JSON" in failed and "zoomed" not in failed
    assert "badge err" not in second and "failed" not in second
    assert '3 turns, 2 tool calls, 1 error (bad_json &times;1); ended: <span class="ending">answer</span>' in first
    assert '2 turns, 2 tool calls, 0 errors; ended: <span class="ending budget">max_turns</span>' in second


def test_multi_turn_text_is_escaped(tmp_path):
    evil = '<script>alert("x")</script> & <b>bold</b>'
    escaped = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;"
    t = Trajectory(turns=[
        TurnRecord("assistant", f"call {evil}", calls=[ToolCall("<img src=x>", {"q": "</pre><i>arg</i>"})]),
        TurnRecord("tool", f"result {evil}", errors=["<u>kind</u>"]),
        TurnRecord("assistant", f"answer {evil}"),
    ], final_answer=f"answer {evil}", ended="<em>end</em>")
    page = write_rollout_report([_sample("x", trajectory=t)], tmp_path / "r.html", step=1).read_text()
    for raw in ("<script", "<b>bold", "<img src=x>", "<i>arg", "<u>kind", "<em>end"):
        assert raw not in page
    for text in (f"call {escaped}", f"result {escaped}", f"answer {escaped}", "&lt;img src=x&gt;(",
                 "&lt;/pre&gt;&lt;i&gt;arg&lt;/i&gt;", "&lt;u&gt;kind&lt;/u&gt;", "&lt;em&gt;end&lt;/em&gt;"):
        assert text in page


def test_a_single_turn_report_has_no_turn_markup(tmp_path):
    single = [_sample("a"), _sample("b", group=1)]
    page = write_rollout_report(single, tmp_path / "r.html", step=1).read_text()
    assert f"<style>{_CSS}</style>" in page  # the style sheet as before: no turn rules added
    assert 'class="turn' not in page and 'class="summary"' not in page and "ended:" not in page
    assert page.count('<pre class="response">') == 2
    # Control: the same page with one multi-turn sample does carry the turn markup and its rules.
    mixed = write_rollout_report([single[0], _sample("c", group=1, trajectory=_zoom_then_fail())],
                                 tmp_path / "m.html", step=1).read_text()
    assert f"<style>{_CSS}</style>" not in mixed and ".turns{" in mixed
    assert 'class="turn' in mixed and "ended:" in mixed and mixed.count('<pre class="response">') == 1


def test_a_malformed_trajectory_is_an_error_naming_the_sample_and_turn(tmp_path):
    bad_image = _zoom_then_fail()
    bad_image.turns[1].images = ["/tmp/crop.png"]
    with pytest.raises(TypeError, match=r"sample 1 \(group 0\) turn 1.*PIL"):
        write_rollout_report([_sample("a"), _sample("b", trajectory=bad_image)], tmp_path / "r.html", step=1)
    bad_role = Trajectory(turns=[TurnRecord("user", "hi")])
    with pytest.raises(ValueError, match=r"sample 0 \(group 0\) turn 0.*'user'"):
        write_rollout_report([_sample("a", trajectory=bad_role)], tmp_path / "r.html", step=1)
    with pytest.raises(TypeError, match=r"sample 0 .*Trajectory, got dict"):
        write_rollout_report([_sample("a", trajectory={"turns": []})], tmp_path / "r.html", step=1)
    assert not (tmp_path / "r.html").exists()


class _Tokenizer:
    def __init__(self):
        self.decoded: list[list[int]] = []

    def batch_decode(self, ids, skip_special_tokens):
        self.decoded.extend(ids)
        return [f"decoded {x}" for x in ids]


def _scored(n: int, **extra):
    import torch

    from mmrlhf.experience.rollout import Rollout, ScoredRollout
    from mmrlhf.rewards.types import RewardResult
    from mmrlhf.rollout.types import SamplingSettings

    prompt_image = Image.new("RGB", (16, 16), RED)
    cols = dict(sample_index=list(range(n)), group=[0] * n, prompt_ids=[[1]] * n,
                response_ids=[[10 + i] for i in range(n)], engine_logprobs=[None] * n, finished=[True] * n,
                vision=[{}] * n, prompts=["<image>What colour?"] * n, labels=[None] * n, references=["green"] * n,
                images=[[prompt_image] for _ in range(n)], record_ids=[None] * n)
    cols.update(extra)
    rewards = RewardResult(rewards=torch.ones(n), valid=torch.ones(n, dtype=torch.bool), sources={}, parts={},
                           metrics={})
    return ScoredRollout(Rollout(**cols), rewards, SamplingSettings()), prompt_image


def test_step_reporter_fills_turns_from_a_multi_turn_rollout(tmp_path):
    from mmrlhf.trainer.reporting import StepReporter

    trajectories = [_zoom_then_fail(), _zoom_out_of_turns()]
    tool_images = [[im for t in traj.turns for im in t.images] for traj in trajectories]
    rollout, prompt_image = _scored(2, policy_masks=[[1, 0], [1, 0]], trajectories=trajectories)
    for row, tools in zip(rollout.rows.images, tool_images):
        row.extend(tools)  # a multi-turn row holds the prompt's images, then the tool images in order
    tok = _Tokenizer()
    samples = StepReporter(tmp_path, tok).samples(rollout, [])
    assert [s.trajectory for s in samples] == trajectories
    assert [s.response for s in samples] == ["The square is green.", "Still thinking about"]
    assert all(s.images == [prompt_image] for s in samples)  # tool images are shown in the turns, not twice
    assert tok.decoded == []  # the decoded ids would mix in the observations
    page = write_rollout_report(samples, tmp_path / "r.html", step=1).read_text()
    assert len(_data_images(page)) == 1 + 3 and page.count("What colour?") == 1

    # Control: a single-turn rollout reports the decoded responses and no turns.
    single, _ = _scored(2)
    plain = StepReporter(tmp_path, _Tokenizer()).samples(single, [])
    assert [s.trajectory for s in plain] == [None, None]
    assert [s.response for s in plain] == ["decoded [10]", "decoded [11]"]

    # A row with fewer images than its trajectory returned is an error naming the sample.
    short, _ = _scored(1, policy_masks=[[1, 0]], trajectories=[_zoom_out_of_turns()])
    with pytest.raises(ValueError, match=r"sample 0: the trajectory returned 2 tool images but the row holds 1"):
        StepReporter(tmp_path, _Tokenizer()).samples(short, [])


def test_report_samples_travel_to_another_process_as_the_page_shows_them(tmp_path):
    """What a Ray rollout actor sends on a report step: the samples built where the rollout is, made compact (images
    no larger than the page draws them, a shared prompt image sent once, a trajectory without its free-form info),
    pickled. The page written from them is the page written in place."""
    import pickle

    import torch

    from mmrlhf.trainer.reporting import compact, report_samples

    trajectories = [_zoom_then_fail(), _zoom_out_of_turns()]
    for t in trajectories:
        t.info["environment"] = {"state": list(range(1000))}  # not shown: stays behind
    rollout, prompt_image = _scored(2, policy_masks=[[1, 0], [1, 0]], trajectories=trajectories)
    big = Image.new("RGB", (900, 600), RED)  # a prompt image larger than the page shows
    for row, t in zip(rollout.rows.images, trajectories):
        row[:] = [big] + [im for turn in t.turns for im in turn.images]
    rollout.rewards.notes["judge/text"] = ["yes <it is green>", None]
    rollout.rewards.parts["judge/score"] = torch.tensor([1.0, float("nan")])
    samples = report_samples(rollout, [], _Tokenizer(), groups=8)
    travelled = pickle.loads(pickle.dumps(compact(samples)))

    assert [s.notes for s in travelled] == [{"judge/text": "yes <it is green>"}, {}]
    assert [s.parts for s in travelled] == [{"judge/score": 1.0}, {"judge/score": None}]
    assert [len(s.trajectory.turns) for s in travelled] == [5, 3] and all(not s.trajectory.info for s in travelled)
    assert travelled[0].images[0] is travelled[1].images[0]  # one prompt image for the group, sent once
    assert travelled[0].images[0].size == (384, 256) and big.size == (900, 600)  # shrunk a copy, not the rollout's
    tool_sizes = [im.size for s in travelled for t in s.trajectory.turns for im in t.images]
    assert tool_sizes == [(50, 40), (384, 192), (30, 30)]
    assert [t.info for t in trajectories] == [{"environment": {"state": list(range(1000))}}] * 2  # rollout untouched
    here = write_rollout_report(samples, tmp_path / "here.html", step=4).read_text()
    there = write_rollout_report(travelled, tmp_path / "there.html", step=4).read_text()
    assert there == here and "yes &lt;it is green&gt;" in there and there.count('class="turn tool') == 3


def _fail_replace(monkeypatch):
    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)


def test_writes_are_atomic(tmp_path, monkeypatch):
    html_path, png_path = tmp_path / "r.html", tmp_path / "c.png"
    write_rollout_report([_sample("old")], html_path, step=1)
    plot_curves([{"step": 0, "reward/mean": 0.0}], png_path)
    before = html_path.read_bytes(), png_path.read_bytes()
    _fail_replace(monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        write_rollout_report([_sample("new")], html_path, step=2)
    with pytest.raises(OSError, match="disk full"):
        plot_curves([{"step": 0, "reward/mean": 5.0}, {"step": 1, "reward/mean": 1.0}], png_path)
    assert (html_path.read_bytes(), png_path.read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.png", "r.html"]  # no temp files left


# ---- a real browser --------------------------------------------------------------------------------------------


def _chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("needs a Chromium binary to render the report: `apt-get install -y chromium` (Debian/Ubuntu)")
    return binary


def _chromium_run(binary: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--force-device-scale-factor=1", "--hide-scrollbars",
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _pixels_of(png, colour) -> int:
    im = Image.open(png).convert("RGB")
    return sum(n for n, c in im.getcolors(im.size[0] * im.size[1]) if c == colour)


def test_chromium_renders_the_images_and_responses(tmp_path):
    binary = _chromium()
    samples = [_sample("The square is red.", group=0, colour=RED, size=(120, 120)),
               _sample('It is <script>document.title="pwned"</script> crimson', group=0, colour=RED, size=(120, 120),
                       reward=0.0, advantage=-0.5),
               _sample("Blue, I think.", group=1, colour=BLUE, size=(100, 100), valid=False)]
    for s in samples[:2]:
        s.images = samples[0].images  # one prompt, two answers: the image is shown once for the group
    page = write_rollout_report(samples, tmp_path / "report.html", step=7, title="browser check")
    no_images = write_rollout_report([_sample(s.response, colour=None) for s in samples], tmp_path / "bare.html",
                                     step=7)

    shot = tmp_path / "shot.png"
    _chromium_run(binary, tmp_path, f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri())
    assert _pixels_of(shot, RED) >= 0.95 * 120 * 120 and _pixels_of(shot, BLUE) >= 0.95 * 100 * 100
    control = tmp_path / "control.png"
    _chromium_run(binary, tmp_path, f"--screenshot={control}", "--window-size=1200,1400", no_images.as_uri())
    assert _pixels_of(control, RED) == 0 and _pixels_of(control, BLUE) == 0

    dom = _chromium_run(binary, tmp_path, "--dump-dom", page.as_uri()).stdout
    assert "The square is red." in dom and "Blue, I think." in dom and "MASKED" in dom
    assert "&lt;script&gt;document.title=\"pwned\"&lt;/script&gt; crimson" in dom  # shown as text ...
    assert "<script" not in dom and "<title>browser check - step 7</title>" in dom  # ... never run


def test_chromium_renders_the_turns_and_tool_images(tmp_path):
    binary = _chromium()
    samples = _multi_turn_samples()
    page = write_rollout_report(samples, tmp_path / "turns.html", step=2)
    shot = tmp_path / "turns.png"
    _chromium_run(binary, tmp_path, f"--screenshot={shot}", "--window-size=1400,1600", page.as_uri())
    # The tool images are drawn: 50x40 + 30x30 green, and the 1000x500 blue one scaled into its card.
    assert _pixels_of(shot, GREEN) >= 0.95 * (50 * 40 + 30 * 30) and _pixels_of(shot, BLUE) > 100 * 50
    dom = _chromium_run(binary, tmp_path, "--dump-dom", page.as_uri()).stdout
    texts = [t.text for s in samples for t in s.trajectory.turns]
    assert all(t in dom for t in texts) and "bad_json" in dom and "max_turns" in dom
