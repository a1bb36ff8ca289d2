"""What every converter shares: reading a published file, naming a bad row, storing images, writing and checking
the JSONL.

Why one module: the converters differ only in which columns of a published dataset hold the question, the
image(s) or video and the answer. Everything else (where extracted images go, how a bad row is reported, that the
output loads through :class:`~mmrlhf.data.datasets.PromptDataset`) must behave the same for all of them, so it
lives here once and each converter is a thin ``row -> record`` function.

The output is the project's prompt-record format (docs/data.md): one JSON object per line with ``id``,
``prompt`` (plain text, one ``<image>`` / ``<video>`` placeholder per item), ``images`` / ``videos`` (file paths,
or ``data:`` URIs with ``images="inline"``), ``label`` (selects the reward recipe) and ``reference`` (the
ground-truth answer).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal, Optional

from mmrlhf.data.errors import DataError, SkipLog

ImageMode = Literal["files", "inline"]
OPTION_LETTERS = "ABCDEFGHIJ"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_IMAGE_FORMATS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff"}


@dataclass
class Row:
    """One published row being converted: the values, and where it came from (for messages)."""

    values: dict
    index: int
    source: str

    @property
    def record_id(self) -> Any:
        for key in ("id", "idx", "pid", "qid", "question_id", "sample_id"):
            value = self.values.get(key)
            if value is not None:
                return value
        return None

    def fail(self, message: str, field: str) -> DataError:
        """A :class:`DataError` naming this row, the field and the input file."""
        return DataError(message, reason="bad_record", index=self.index, record_id=self.record_id, field=field,
                         file=self.source)

    def get(self, *names: str, required: bool = True) -> Any:
        """The first of ``names`` present with a non-empty value (published datasets rename columns between
        releases: ``problem`` / ``question``); a missing required one is an error listing the names tried."""
        for name in names:
            value = self.values.get(name)
            if value is not None and not (isinstance(value, str) and not value.strip()):
                return value
        if required:
            present = ", ".join(sorted(map(str, self.values))) or "none"
            raise self.fail(f"missing or empty (columns present: {present})", " / ".join(names))
        return None

    def text(self, *names: str) -> str:
        value = self.get(*names)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise self.fail(f"expected text, got {type(value).__name__}", " / ".join(names))
        return str(value).strip()


@dataclass
class MediaStore:
    """Turns image items of a published row into values the prompt loader reads.

    ``files`` (default) writes each image's bytes once to ``<output folder>/images/`` under a content hash and
    refers to it by a path relative to the JSONL (the loader resolves it against the JSONL's folder, so the output
    folder can be moved as a whole); ``inline`` keeps the bytes in the JSONL as ``data:`` URIs (one self-contained
    file, about 4/3 the image bytes). Paths in the published data resolve against ``media_root``.
    """

    output_dir: str
    mode: ImageMode = "files"
    media_root: Optional[str] = None
    written: set = field(default_factory=set)

    def image(self, item: Any, row: Row, field: str) -> str:
        """One image item: ``{"bytes", "path"}`` (how ``datasets`` / Parquet exports store images), raw bytes, or
        a path. The header is read (not the pixels) so a corrupt image fails here, naming its row."""
        data: Optional[bytes] = None
        path: Optional[str] = None
        if isinstance(item, dict):
            data, path = item.get("bytes"), item.get("path")
            if data is None and not path:
                raise row.fail("image entry has neither bytes nor a path", field)
        elif isinstance(item, (bytes, bytearray, memoryview)):
            data = bytes(item)
        elif isinstance(item, str):
            path = item
        else:
            raise row.fail(f"unsupported image entry of type {type(item).__name__}", field)
        if data is None:
            return self._referenced(path, row, field, _image_format)
        fmt = _image_format(data, row, field)
        if self.mode == "inline":
            return f"data:image/{fmt};base64,{base64.b64encode(data).decode('ascii')}"
        name = f"images/{hashlib.sha1(data).hexdigest()[:20]}.{fmt}"
        if name not in self.written:
            target = os.path.join(self.output_dir, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.exists(target):
                with open(target, "wb") as f:
                    f.write(data)
            self.written.add(name)
        return name

    def video(self, item: Any, row: Row, field: str) -> str:
        """A video file path from the published data, resolved against ``media_root`` and checked to exist."""
        if not isinstance(item, str):
            raise row.fail(f"expected a video file path, got {type(item).__name__}", field)
        return self._referenced(item, row, field, None)

    def _referenced(self, path: str, row: Row, field: str, check: Optional[Callable]) -> str:
        if path.startswith(("http://", "https://")):
            raise row.fail(f"{path!r} is a URL; download the media and pass --media-root", field)
        resolved = path if os.path.isabs(path) else os.path.join(self.media_root or ".", path)
        if not os.path.isfile(resolved):
            raise row.fail(f"file {resolved!r} not found (relative paths resolve against --media-root "
                           f"{self.media_root or '.'!r})", field)
        if check is not None:
            with open(resolved, "rb") as f:
                check(f.read(), row, field)
        return os.path.abspath(resolved)


def _image_format(data: bytes, row: Row, field: str) -> str:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = image.format
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise row.fail(f"image bytes do not decode: {exc}", field) from exc
    if fmt not in _IMAGE_FORMATS:
        raise row.fail(f"image format {fmt!r} is not one of {', '.join(_IMAGE_FORMATS)}", field)
    return _IMAGE_FORMATS[fmt]


# ---- text helpers shared by converters ------------------------------------------------------------------------
def place_items(text: str, count: int, placeholder: str, row: Row, field: str) -> str:
    """``text`` with exactly one ``placeholder`` per item: kept as published when it already has them (geometry3k
    writes ``<image>`` into the problem), prepended when it has none, an error when the counts disagree."""
    found = text.count(placeholder)
    if found == count:
        return text
    if found == 0:
        return placeholder * count + text
    raise row.fail(f"the text has {found} {placeholder!r} placeholder(s) for {count} item(s)", field)


def unwrap_answer(text: str) -> str:
    """``"<answer> 3 </answer>"`` -> ``"3"`` (R1-style releases wrap the solution in answer tags)."""
    found = _ANSWER_TAG.findall(text)
    return (found[-1] if found else text).strip()


def option_lines(options: Any, row: Row, field: str) -> tuple[list[str], str]:
    """Options as published (a list of texts, maybe already lettered ``"A. cat"``) -> their bare texts and the
    lettered block ``"A. cat\\nB. dog"`` appended to the question."""
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except json.JSONDecodeError as exc:
            raise row.fail(f"options are a string that is not a JSON list: {exc}", field) from exc
    if not isinstance(options, (list, tuple)) or not options:
        raise row.fail(f"expected a non-empty list of options, got {type(options).__name__}", field)
    if len(options) > len(OPTION_LETTERS):
        raise row.fail(f"{len(options)} options; at most {len(OPTION_LETTERS)} are supported", field)
    bare = []
    for k, option in enumerate(options):
        text = str(option).strip()
        prefix = re.match(rf"^\(?{OPTION_LETTERS[k]}[.):]\s*", text)
        bare.append(text[prefix.end():] if prefix else text)
    return bare, "\n".join(f"{OPTION_LETTERS[k]}. {text}" for k, text in enumerate(bare))


def is_ascii_whole_number(text: str) -> bool:
    """``0-9`` digits only. ``str.isdigit`` also accepts superscripts (``"²"``: ``int`` then raises) and other
    scripts' digits (``"٣"``), which a rule reward comparing the model's ASCII answer would never match."""
    return bool(re.fullmatch(r"[0-9]+", text))


def answer_letter(answer: str, options: list[str], row: Row, field: str) -> str:
    """The option letter the published answer means: a letter (``"B"``, ``"(B)"``, ``"B. dog"``), an option's
    index, or an option's text; anything else is an error (a reward would be computed against nothing)."""
    text = unwrap_answer(str(answer))
    letters = OPTION_LETTERS[: len(options)]
    match = re.fullmatch(rf"\(?([{letters}])\)?(?:[.:]\s*.*)?", text, re.DOTALL)
    if match:
        return match.group(1)
    if is_ascii_whole_number(text) and int(text) < len(options):
        return letters[int(text)]
    folded = [o.casefold() for o in options]
    if text.casefold() in folded:
        return letters[folded.index(text.casefold())]
    raise row.fail(f"answer {text!r} is neither an option letter ({', '.join(letters)}) nor one of the options",
                   field)


# ---- running a converter ----------------------------------------------------------------------------------------
Converter = Callable[[Row, MediaStore], dict]


@dataclass
class Summary:
    """What a conversion did: records written, rows skipped (by reason), where the output is."""

    output: str
    written: int
    skips: SkipLog

    def __str__(self) -> str:
        skipped = f", skipped {self.skips.total} ({dict(self.skips.counts)})" if self.skips.total else ""
        return f"wrote {self.written} records to {self.output}{skipped}"


def iter_rows(paths: Iterable[str], limit: Optional[int] = None) -> Iterator[Row]:
    """Rows of the published files (JSONL / JSON array / Parquet / ``save_to_disk`` folder), indexed across
    files, through the project's own reader (images stay encoded)."""
    from mmrlhf.data.datasets import read_rows

    index = 0
    for path in paths:
        for values in read_rows(path):
            if limit is not None and index >= limit:
                return
            yield Row(values, index, path)
            index += 1


def convert(converter: Converter, inputs: list[str], output: str, *, images: ImageMode = "files",
            media_root: Optional[str] = None, on_bad_record: Literal["error", "skip"] = "error",
            limit: Optional[int] = None, check: bool = True) -> Summary:
    """Convert ``inputs`` with ``converter`` into the JSONL ``output``; returns a :class:`Summary`.

    A bad row raises a :class:`DataError` naming its index, id, field and file; with ``on_bad_record="skip"`` it is
    left out, counted by reason and logged (logger ``mmrlhf.data``) instead. The output is written to a temporary
    file and renamed, so a failed run leaves no half-written dataset behind. With ``check`` the result is loaded
    back through :class:`~mmrlhf.data.datasets.PromptDataset` (placeholders vs items, per record).
    """
    if not inputs:
        raise ValueError("no input files given")
    out_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(out_dir, exist_ok=True)
    default_root = os.path.dirname(os.path.abspath(inputs[0]))
    store = MediaStore(out_dir, images, media_root if media_root is not None else default_root)
    skips = SkipLog(on_bad_record)
    written, seen_ids = 0, set()
    tmp = output + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in iter_rows(inputs, limit):
                try:
                    converted = converter(row, store)
                    if converted["id"] in seen_ids:
                        raise row.fail(f"duplicate id {converted['id']!r}", "id")
                except DataError as err:
                    skips.handle(err)
                    continue
                seen_ids.add(converted["id"])
                f.write(json.dumps(converted, ensure_ascii=False) + "\n")
                written += 1
        if written == 0:
            raise ValueError(f"no record converted from {', '.join(inputs)} (skipped: {dict(skips.counts)})")
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if check:
        check_output(output, written)
    return Summary(output, written, skips)


def check_output(path: str, expected: int) -> None:
    """Load ``path`` with the project's dataset loader under the default columns; every record must load."""
    from mmrlhf.config.data import DataConfig
    from mmrlhf.data.datasets import PromptDataset

    loaded = len(PromptDataset(path, DataConfig()))
    if loaded != expected:
        raise RuntimeError(f"{path}: wrote {expected} records but the loader read {loaded}")


def record(row: Row, prefix: str, prompt: str, *, images: Optional[list] = None, videos: Optional[list] = None,
           label: str, reference: Any) -> dict:
    """The output record: the published id when there is one, else ``<prefix>-<row index>``."""
    rid = row.record_id
    out = {"id": str(rid) if rid is not None else f"{prefix}-{row.index}", "prompt": prompt}
    if images:
        out["images"] = images
    if videos:
        out["videos"] = videos
    out["label"] = label
    out["reference"] = reference
    return out
