"""Training-curve PNG and the self-contained rollout HTML report (escaping, images, masking, atomic writes, and
what a real browser shows)."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from mmrlhf.trainer.report import ReportSample, plot_curves, write_rollout_report

RED, BLUE = (255, 0, 0), (0, 0, 255)


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


# ---- curves ----------------------------------------------------------------------------------------------------

TAB_BLUE = (0x1F, 0x77, 0xB4)  # matplotlib's first line colour


def _blue_pixels_per_panel(png) -> list[int]:
    """Line pixels in each cell of the 2 x 3 grid, row-major."""
    im = Image.open(png).convert("RGB")
    w, h = im.size
    out = []
    for r in range(2):
        for c in range(3):
            cell = im.crop((c * w // 3, r * h // 2, (c + 1) * w // 3, (r + 1) * h // 2))
            out.append(sum(n for n, col in cell.getcolors(w * h) if col == TAB_BLUE))
    return out


def test_plot_curves_draws_logged_keys_and_says_not_logged_for_the_rest(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    texts: list[str] = []
    real_text = Axes.text

    def spy(self, x, y, s, *args, **kwargs):
        texts.append(s)
        return real_text(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(Axes, "text", spy)
    history = [{"step": s, "reward/mean": s / 10, "groups/with_variance_frac": 1 - s / 20} for s in range(20)]
    out = plot_curves(history, tmp_path / "curves.png", title="run")
    assert out == tmp_path / "curves.png"
    reward, kl, length, entropy, groups, _spare = _blue_pixels_per_panel(out)
    assert reward > 200 and groups > 200 and kl == length == entropy == 0
    assert sorted(t.split("\n")[0] for t in texts if "not logged" in t) == [
        "kl/mean", "policy/entropy", "response_length/mean"]


def test_plot_curves_skips_non_finite_values_and_handles_empty_history(tmp_path):
    history = [{"step": s, "kl/mean": v} for s, v in
               enumerate([0.1, float("nan"), None, 0.2, float("inf"), 0.3])]
    history += [{"step": 0, "policy/entropy": float("nan")}, {"step": 1, "policy/entropy": None}]
    out = plot_curves(history, tmp_path / "c.png")
    reward, kl, _length, entropy, _groups, _ = _blue_pixels_per_panel(out)
    assert kl > 100 and reward == entropy == 0
    assert Image.open(plot_curves([], tmp_path / "empty.png")).size == Image.open(out).size
    with pytest.raises(TypeError, match="row 1.*'kl/mean'"):
        plot_curves([{"step": 0, "kl/mean": 1.0}, {"step": 1, "kl/mean": "high"}], tmp_path / "x.png")


def test_plot_curves_never_touches_pyplot_or_a_gui_backend(tmp_path):
    code = ("import sys\nfrom mmrlhf.trainer.report import plot_curves\n"
            f"plot_curves([{{'step': 0, 'reward/mean': 1.0}}], {str(tmp_path / 'c.png')!r})\n"
            "assert 'matplotlib.pyplot' not in sys.modules\n")
    env = {**os.environ, "MPLBACKEND": "TkAgg"}  # a GUI backend that cannot start here
    env.pop("DISPLAY", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "c.png").exists()


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
