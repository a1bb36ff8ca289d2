"""Small synthetic datasets shaped like the public releases the recipes train on, for tests and offline demos.

Each writer builds a few rows in the column layout the real release publishes (Parquet with image bytes, JSON with
image or video paths) under a folder, with random-noise images and tiny videos made here, and returns the path to
hand to ``python -m mmrlhf.data.prepare`` plus the rows it wrote (what a test expects back). Nothing is downloaded.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image


def png_bytes(seed: int, size: tuple[int, int] = (56, 56)) -> bytes:
    """A random-noise RGB PNG (different seeds give different pixels)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_video(path: Path, frames: int = 8, size: tuple[int, int] = (56, 56), fps: int = 4, seed: int = 0) -> Path:
    """A small mpeg4 clip of random frames (PyAV); ``frames=0`` writes a valid file with no frame."""
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        container.start_encoding()  # writes the header even when no frame follows (the zero-frame case)
        for _ in range(frames):
            array = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def geometry3k(folder: Path, n: int = 4) -> tuple[Path, list[dict]]:
    """``train.parquet`` like the hub's geometry3k: ``images`` (list of ``{bytes, path}``), ``problem`` with its
    ``<image>`` marker, ``answer`` (plain numbers and LaTeX)."""
    answers = ["3", "\\frac{2}{3}", "2\\sqrt{3}", "60", "12.5", "7"]
    rows = [{"images": [{"bytes": png_bytes(k, (56 + 28 * (k % 2), 56)), "path": f"geo_{k}.png"}],
             "problem": f"<image>Find x in the figure number {k}. Round to the nearest tenth.",
             "answer": answers[k % len(answers)]} for k in range(n)]
    folder.mkdir(parents=True, exist_ok=True)
    return _write_parquet(rows, folder / "train.parquet"), rows


def clevr_count(folder: Path, n: int = 4) -> tuple[Path, list[dict]]:
    """``train.json`` like R1-style CLEVR counting releases: a JSON array of ``{image, problem, solution}`` with
    image paths relative to an ``images/`` folder and the count wrapped in ``<answer>`` tags."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(n):
        name = f"CLEVR_train_{k:06d}.png"
        (folder / "images" / name).write_bytes(png_bytes(100 + k, (84, 56)))
        rows.append({"image": name, "problem": "How many items are there in the image?",
                     "solution": f"<answer> {k + 2} </answer>"})
    path = folder / "train.json"
    path.write_text(json.dumps(rows))
    return path, rows


def multi_image(folder: Path, n: int = 4) -> tuple[Path, list[dict]]:
    """``test.parquet`` like multi-image benchmarks: numbered ``image_1`` .. ``image_3`` columns of ``{bytes, path}``
    (``image_3`` empty on odd rows), ``question``, ``choices`` and an ``answer`` given as ``"(B)"``."""
    rows = []
    for k in range(n):
        row = {"idx": f"mi-{k}", "question": "Which image is brighter?", "choices": ["the first", "the second"],
               "answer": "(A)" if k % 2 else "(B)"}
        for j in range(3):
            keep = j < 2 or k % 2 == 0
            row[f"image_{j + 1}"] = {"bytes": png_bytes(200 + 10 * k + j), "path": None} if keep else None
        rows.append(row)
    folder.mkdir(parents=True, exist_ok=True)
    return _write_parquet(rows, folder / "test.parquet"), rows


def video_qa(folder: Path, n: int = 3) -> tuple[Path, list[dict]]:
    """``train.jsonl`` like video-QA releases: ``video`` (a path relative to a ``videos/`` folder), ``question``,
    ``options`` (bare texts) and the ``answer`` as an option's text."""
    (folder / "videos").mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(n):
        name = f"clip_{k}.mp4"
        write_video(folder / "videos" / name, frames=6 + 2 * k, seed=k)
        options = ["a ball rolls", "a door opens", "nothing moves"]
        rows.append({"qid": f"v{k}", "video": name, "question": "What happens in the video?", "options": options,
                     "answer": options[k % 3]})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def open_vqa(folder: Path, n: int = 4) -> tuple[Path, list[dict]]:
    """``val.parquet`` like lmms-lab/COCO-Caption2017: ``question_id``, ``image`` (``{bytes, path}``), ``question``
    (the captioning instruction; empty on odd rows, as in a caption set without one) and ``answer`` (a list of
    captions, one on the last row)."""
    colours = ["red", "blue", "green", "yellow"]
    rows = []
    for k in range(n):
        colour = colours[k % len(colours)]
        captions = [f"A {colour} square on a plain background.", f"A {colour} block seen from above."]
        rows.append({"question_id": f"{k:012d}.jpg", "image": {"bytes": png_bytes(300 + k), "path": f"{k}.jpg"},
                     "question": None if k % 2 else "Provide a one-sentence caption for the provided image.",
                     "answer": captions[:1] if k == n - 1 else captions})
    folder.mkdir(parents=True, exist_ok=True)
    return _write_parquet(rows, folder / "val.parquet"), rows


DEEPEYES_SYSTEM = ("You are a helpful assistant.\n\n# Tools\n<tools>\n{\"type\": \"function\", \"function\": "
                   "{\"name\": \"image_zoom_in_tool\", \"parameters\": {\"bbox_2d\": \"...\"}}}\n</tools>")
DEEPEYES_INSTRUCTION = ("\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  "
                        "<think>...</think>  <tool_call>...</tool_call> (if tools needed)  <answer>...</answer> ")


def deepeyes(folder: Path, n: int = 6) -> tuple[Path, list[dict]]:
    """``train.parquet`` in the row layout of DeepEyes-Datasets-47k (verl's): ``prompt`` (a system message with the
    tool schema written out, then ``<image>\\n{question}`` plus, in the tool rows, DeepEyes' format instruction),
    ``images`` (list of ``{bytes, path}``), ``reward_model`` (``{ground_truth, style}``), ``data_source``
    (``vstar`` / ``thinklite_eureka`` / ``chart``, in turn: any two rows hold both labels), ``env_name``, ``ability``, ``extra_info``. The system
    text is shortened, and the ThinkLite rows' own wording is a stand-in."""
    kinds = [("vstar", "What is the colour of the umbrella?\n(A) red\n(B) blue", "B"),
             ("thinklite_eureka", "Find the area of the shaded triangle.", "6"),
             ("chart", "What is the highest value in the bar chart?", "42")]
    rows = []
    for k in range(n):
        source, question, answer = kinds[k % len(kinds)]
        tool_row = source != "thinklite_eureka"
        user = f"<image>\n{question}" + (DEEPEYES_INSTRUCTION if tool_row else "")
        rows.append({
            "data_source": source,
            "prompt": [{"content": DEEPEYES_SYSTEM if tool_row else "You are a helpful assistant.",
                        "role": "system"}, {"content": user, "role": "user"}],
            "images": [{"bytes": png_bytes(300 + k, (112, 84)), "path": None}],
            "ability": "math" if not tool_row else "vl_chart" if source == "chart" else "vqa",
            "env_name": "visual_toolbox_v2" if tool_row else "",
            "reward_model": {"ground_truth": answer, "style": "model"},
            "extra_info": {"answer": answer, "index": k, "question": question, "split": "train"},
        })
    folder.mkdir(parents=True, exist_ok=True)
    return _write_parquet(rows, folder / "train.parquet"), rows
