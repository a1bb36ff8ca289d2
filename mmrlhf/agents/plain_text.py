"""Token ids of text that comes from the world (a tool's result, an environment's observation), which can never be
one of the tokenizer's added or special tokens.

Why: a tool's text is data. A web page, an OCR result, a file or another model's output may hold the literal
strings of the chat template's markers (the end of a turn, a role header, a vision block, a tool-call tag).
Tokenised with the added vocabulary recognised, such a string becomes the marker's id, and the policy's sequence
then holds a forged turn boundary, a forged tool response or an image pad with no image behind it (the loop used
to stop with "observation holds 1 image pad tokens for 0 images"). The text must reach the model, so it is
*escaped*, not refused: it is encoded by the tokenizer's normaliser, pre-tokeniser and model alone, never through
its added vocabulary, so ``<|im_end|>`` in a tool's text becomes the ordinary ids of ``<``, ``|``, ``im``, ... and
decodes to the same characters. Refusing would make a tool fail on legitimate content (a page about chat
templates, a screenshot of a prompt) and teach the policy that such calls fail; the escaped ids cannot be
confused with the template's markers because they are other ids.

Text that holds no added-token string encodes to exactly the ids the tokenizer gives it (its added vocabulary only
splits a text at those strings), so an observation of clean text is unchanged, which the test comparing the
incremental observation tokens with one render of the whole conversation checks.

The template's own markers are split from the template's strings here too (:meth:`PlainTextEncoder.encode` takes
pieces marked as the template's or the world's): only the world's pieces are escaped.
"""

from __future__ import annotations

import re
from typing import Any, Sequence


class PlainTextEncoder:
    """Encodes text with the tokenizer's model only (no added or special token can come out).

    Args:
        tokenizer: a fast (``tokenizers``-backed) tokenizer; its added tokens (special or not) are the *reserved*
            ones.

    Raises ``TypeError`` for a tokenizer without a ``tokenizers`` backend, ``ValueError`` for one whose model can
    only write a reserved token's string as that token (both at construction: a run refuses to start rather than
    fail at a tool's answer).
    """

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} has no tokenizers backend: tool and environment text is "
                            "encoded without the added vocabulary, which needs a fast tokenizer")
        self.tokenizer = tokenizer
        self._backend = backend
        added = {int(i): str(t.content) for i, t in tokenizer.added_tokens_decoder.items()}
        self.reserved_ids = frozenset(added) | frozenset(int(i) for i in tokenizer.all_special_ids)
        self.marker_ids = {content: i for i, content in added.items() if content}
        # leftmost, then longest: the added vocabulary's own rule when two markers start at one place
        names = sorted(self.marker_ids, key=len, reverse=True)
        self._markers = re.compile("|".join(map(re.escape, names))) if names else None
        for content in self.marker_ids:  # every reserved string must be writable as plain text
            self.plain(content)

    # ---- the world's text ----------------------------------------------------------------------------------------
    def holds_markers(self, text: str) -> bool:
        """Whether ``text`` holds the string of an added token (it is escaped: see the module docstring)."""
        return bool(self._markers and self._markers.search(text))

    def plain(self, text: str) -> list[int]:
        """``text``'s ids from the normaliser, pre-tokeniser and model alone: never a reserved id."""
        backend = self._backend
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
        out: list[int] = []
        for piece in pieces:
            ids = [t.id for t in backend.model.tokenize(piece)]
            if self.reserved_ids.intersection(ids):  # the model's merges reach a reserved entry: spell it out
                ids = [t.id for ch in piece for t in backend.model.tokenize(ch)]
                if self.reserved_ids.intersection(ids):
                    raise ValueError(f"the tokenizer's model writes {piece!r} only with reserved tokens")
            out.extend(ids)
        return out

    # ---- the template's strings and the world's text together ----------------------------------------------------
    def encode(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Ids of ``pieces`` (``(text, from_the_world)``) concatenated: in the template's pieces every added
        token's string is that token; the world's pieces are plain text. Plain text between two markers is encoded
        as one run (the template's glue and the world's text together), as the tokenizer splits a whole string
        only at its markers."""
        units: list[int | str] = []  # a marker's id, or a run of plain text
        for text, external in pieces:
            spans = [(text, None)] if external or self._markers is None else self._split(text)
            for plain, marker in spans:
                if plain:
                    if units and isinstance(units[-1], str):
                        units[-1] += plain
                    else:
                        units.append(plain)
                if marker is not None:
                    units.append(self.marker_ids[marker])
        out: list[int] = []
        for unit in units:
            out.extend(self.plain(unit) if isinstance(unit, str) else [unit])
        return out

    def _split(self, text: str) -> list[tuple[str, str | None]]:
        """``(plain text before, marker or None)`` pairs covering ``text``."""
        spans, pos = [], 0
        for match in self._markers.finditer(text):
            spans.append((text[pos:match.start()], match.group(0)))
            pos = match.end()
        spans.append((text[pos:], None))
        return spans
