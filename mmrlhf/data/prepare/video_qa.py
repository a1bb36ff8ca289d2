"""Video question answering as published in JSON / JSONL releases: a video file path (``video`` / ``video_path``
/ ``path``, relative to the video folder), the question (``question`` / ``problem``), optional options
(``options`` / ``candidates`` / ``choices``) and the answer (``answer`` / ``solution``: a letter, an option's
index or text, or free text; ``<answer>`` tags are removed).

With options: label ``mcq`` and the answer's option letter as reference; without: label ``short``. The file must
exist at conversion time (a missing video would otherwise fail hundreds of steps into training). Frame sampling
(fps, frame counts, the token budget) is not baked in: the recipe's ``data.video_*`` keys decide it at load time.
"""

from __future__ import annotations

from mmrlhf.data.prepare.common import MediaStore, Row, answer_letter, option_lines, place_items, record, \
    unwrap_answer


def convert_row(row: Row, media: MediaStore) -> dict:
    video = media.video(row.get("video", "video_path", "path"), row, "video")
    question = place_items(row.text("question", "problem"), 1, "<video>", row, "question")
    options = row.get("options", "candidates", "choices", required=False)
    answer = row.text("answer", "solution")
    if options is None:
        return record(row, "video_qa", question, videos=[video], label="short", reference=unwrap_answer(answer))
    bare, block = option_lines(options, row, "options")
    return record(row, "video_qa", f"{question}\nOptions:\n{block}", videos=[video], label="mcq",
                  reference=answer_letter(answer, bare, row, "answer"))
