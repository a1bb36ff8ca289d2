"""``python -m mmrlhf.data.prepare NAME INPUT [INPUT ...] --output OUT.jsonl``: convert a published dataset."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from mmrlhf.data.errors import DataError
from mmrlhf.data.prepare import CONVERTERS, prepare


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mmrlhf.data.prepare",
        description="Convert a public dataset, as published, into the prompt-record JSONL that data.prompt_data "
        "reads. Converters: " + ", ".join(sorted(CONVERTERS)) + " (see each module's docstring for the columns "
        "it reads).")
    parser.add_argument("name", choices=sorted(CONVERTERS), help="dataset converter")
    parser.add_argument("inputs", nargs="+", help="published files: .parquet, .jsonl, .json, or a save_to_disk folder")
    parser.add_argument("--output", "-o", required=True, help="output JSONL; extracted images go next to it")
    parser.add_argument("--media-root", default=None,
                        help="folder that relative image / video paths in the input are relative to "
                             "(default: the first input's folder)")
    parser.add_argument("--images", choices=["files", "inline"], default="files",
                        help="embedded image bytes: write them to OUTPUT_DIR/images/ (files, default) or keep them "
                             "in the JSONL as data URIs (inline)")
    parser.add_argument("--on-bad-record", choices=["error", "skip"], default="error",
                        help="a malformed row: stop naming it (default), or skip it (counted and logged)")
    parser.add_argument("--limit", type=int, default=None, help="convert only the first N rows")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        summary = prepare(args.name, args.inputs, args.output, images=args.images, media_root=args.media_root,
                          on_bad_record=args.on_bad_record, limit=args.limit)
    except (DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
