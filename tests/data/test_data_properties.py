"""Property tests: random mixes of text / image / video prompts and n keep order, counts and pixel rows."""

from __future__ import annotations

import pytest
import torch
from data_testing import solid_image, write_video
from hypothesis import given, settings
from hypothesis import strategies as st

KINDS = ("text", "image", "images", "video", "frames", "image+video")
SIZES = [(56, 56), (84, 56), (56, 112), (70, 98)]


@pytest.fixture(scope="session")
def video_file(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("prop") / "v.mp4", frames=5, fps=4, seed=9)


def _build(kinds, video_file, sizes):
    prompts, images, videos = [], [], []
    for i, kind in enumerate(kinds):
        size = sizes[i % len(sizes)]
        if kind == "text":
            prompts.append(f"question {i}"), images.append(None), videos.append(None)
        elif kind == "image":
            prompts.append(f"<image>q{i}"), images.append(solid_image(size, seed=i)), videos.append(None)
        elif kind == "images":
            prompts.append(f"<image>a<image>b{i}")
            images.append([solid_image(size, seed=i), solid_image(SIZES[0], seed=i + 100)]), videos.append(None)
        elif kind == "video":
            prompts.append(f"<video>v{i}"), images.append(None), videos.append(video_file)
        elif kind == "frames":
            prompts.append(f"<video>f{i}"), images.append(None)
            videos.append([[solid_image(size, seed=i + k) for k in range(3)]])
        else:
            prompts.append(f"<video><image>x{i}"), images.append([solid_image(size, seed=i)])
            videos.append([video_file])
    return prompts, images, videos


def _count(kind):
    return {"text": (0, 0), "image": (1, 0), "images": (2, 0), "video": (0, 1), "frames": (0, 1),
            "image+video": (1, 1)}[kind]


@settings(max_examples=40, deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6), n=st.integers(1, 4),
       sizes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=3))
def test_order_counts_and_pixel_rows(make_processor, hf_processor, video_file, kinds, n, sizes):
    prompts, images, videos = _build(kinds, video_file, sizes)
    refs = [f"ref-{i}" for i in range(len(kinds))]
    out = make_processor().process_multimodal_batch(prompts, images, refs, n_samples_per_prompt=n,
                                                    all_videos=videos, all_labels=list(range(len(kinds))))
    size = len(kinds)
    assert out.all_prompt_indices == [i for i in range(size) for _ in range(n)]
    assert out.all_references == [refs[i] for i in range(size) for _ in range(n)]
    assert out.all_labels == [i for i in range(size) for _ in range(n)]
    assert list(zip(out.all_images_num, out.all_videos_num)) == [_count(k) for k in kinds for _ in range(n)]

    merge = hf_processor.image_processor.merge_size ** 2
    image_pad, video_pad = hf_processor.image_token_id, hf_processor.video_token_id
    rows = {"pixel_values": 0, "pixel_values_videos": 0}
    for k, vision in enumerate(out.all_vision_inputs):
        for pix, grid_key, pad in (("pixel_values", "image_grid_thw", image_pad),
                                   ("pixel_values_videos", "video_grid_thw", video_pad)):
            grid = vision.get(grid_key, torch.zeros(0, 3, dtype=torch.long))
            n_rows = vision[pix].shape[0] if pix in vision else 0
            assert n_rows == int(grid.prod(-1).sum())
            assert out.all_prompt_token_ids[k].count(pad) == int(grid.prod(-1).sum()) // merge
            rows[pix] += n_rows

    # The batch processed ONCE by the HF processor (unique prompts, no expansion): n x its rows in total.
    vision_idx = [i for i, k in enumerate(kinds) if k != "text"]
    if not vision_idx:
        assert rows == {"pixel_values": 0, "pixel_values_videos": 0}
        return
    flat_images = [im for i in vision_idx for im in out.all_images[i * n]]
    flat_videos = [v.frames for i in vision_idx for v in out.all_videos[i * n]]
    kwargs = {"text": [out.all_prompts[i * n] for i in vision_idx], "add_special_tokens": False}
    if flat_images:
        kwargs["images"] = flat_images
    if flat_videos:
        kwargs["videos"], kwargs["do_sample_frames"] = flat_videos, False
    once = hf_processor(**kwargs)
    for pix in rows:
        assert rows[pix] == n * (once[pix].shape[0] if pix in once else 0)
    # and the per-sample slices, concatenated over the first copy of each prompt, ARE the batch tensors
    for pix in rows:
        if pix in once:
            firsts = [out.all_vision_inputs[i * n][pix] for i in vision_idx if pix in out.all_vision_inputs[i * n]]
            assert torch.equal(torch.cat(firsts), once[pix])


@settings(max_examples=30, deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6), n=st.integers(1, 3),
       bad=st.lists(st.booleans(), min_size=6, max_size=6))
def test_skip_mode_keeps_the_good_prompts_in_order(make_processor, video_file, kinds, n, bad):
    """Random prompts get an unreadable item: exactly those are skipped and counted; the rest stay in order."""
    prompts, images, videos = _build(kinds, video_file, SIZES)
    broken = b"not an image"
    expect_bad = []
    for i, kind in enumerate(kinds):
        hit = bad[i] and kind != "text"
        expect_bad.append(hit)
        if hit and kind in ("image", "images", "image+video"):
            images[i] = [broken] * len(images[i]) if isinstance(images[i], list) else broken
        elif hit:
            videos[i] = [[broken, broken]]
    proc = make_processor(on_bad_input="skip")
    out = proc.process_multimodal_batch(prompts, images, n_samples_per_prompt=n, all_videos=videos)
    good = [i for i, b in enumerate(expect_bad) if not b]
    assert out.all_prompt_indices == [i for i in good for _ in range(n)]
    assert [s.index for s in out.skipped] == [i for i, b in enumerate(expect_bad) if b]
    assert proc.skips.total == sum(expect_bad)
