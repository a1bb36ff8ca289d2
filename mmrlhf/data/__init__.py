"""Data pipeline: prompt datasets (JSONL / Parquet / ``datasets`` folders), vision loading with guard rails, and
:class:`MultimodalDataProcessor` (text and vision prompts -> per-sample ids, pixel values and grids, in order).

See ``docs/data.md`` for the record format and the configuration knobs.
"""

from mmrlhf.data.datasets import PromptDataset, read_rows
from mmrlhf.data.errors import DataError, Skipped, SkipLog
from mmrlhf.data.processor import MultimodalDataProcessor
from mmrlhf.data.prompts import PromptRenderer, count_slots
from mmrlhf.data.records import record_from_row
from mmrlhf.data.types import LoadedVideo, MultimodalBatch, PromptRecord
from mmrlhf.data.vision import VisionLoader, VisionSettings

__all__ = [
    "DataError",
    "LoadedVideo",
    "MultimodalBatch",
    "MultimodalDataProcessor",
    "PromptDataset",
    "PromptRecord",
    "PromptRenderer",
    "SkipLog",
    "Skipped",
    "VisionLoader",
    "VisionSettings",
    "count_slots",
    "read_rows",
    "record_from_row",
]
