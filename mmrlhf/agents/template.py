"""Observation tokens: the chat template's tool turn (or an environment's user turn), built as token ids and
appended to a trajectory whose earlier tokens are never re-tokenised.

Why not render the conversation again each turn: BPE does not round-trip (decoding the policy's tokens and encoding
them again can give other ids, so the trainer would score tokens the engine never sampled), templates may edit
history, and Qwen2/2.5-VL templates drop images from tool messages. So there is one explicit training form, Qwen's
hermes tool turn, for every Qwen-VL family::

    ...policy tokens</tool_call>  [<|im_end|> when the turn stopped at </tool_call>]
    \\n<|im_start|>user
    \\n<tool_response>\\n<|vision_start|><|image_pad|>*n<|vision_end|>...text\\n</tool_response>   (one per result)
    <|im_end|>\\n<|im_start|>assistant\\n

Consecutive tool results share ONE user turn (a template that opens a turn per result would disagree with the
model's own chat template). Images come first inside their result, then its text. An environment's observation is
a plain user turn (no ``<tool_response>`` wrapper). The ``\\n`` after ``<|im_end|>`` is the template's glue: it
belongs to the observation, so the policy's turn ends at its stop token exactly as the engine sampled it.

The template's strings and the results' text are tokenised together (special tokens split them, so a turn
boundary never merges with what is around it), then each image's pad token is expanded to the image's token count.
The results' text comes from the world and is escaped (:mod:`mmrlhf.agents.plain_text`): whatever it holds, it
becomes ordinary text ids, never a marker of the template, a vision token or any other added token of the
tokenizer, and text without such strings gets exactly the ids one render of the conversation gives. The tests
compare the incremental tokens with one render of the whole conversation by the tiny tool model's chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from mmrlhf.agents.plain_text import PlainTextEncoder
from mmrlhf.agents.types import ToolResult


@dataclass(frozen=True)
class HermesFormat:
    """The strings of the hermes tool turn (defaults: the Qwen chat format of Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""

    end_of_turn: str = "<|im_end|>"
    turn_start: str = "\n<|im_start|>user"
    response_open: str = "\n<tool_response>\n"
    response_close: str = "\n</tool_response>"
    next_turn: str = "<|im_end|>\n<|im_start|>assistant\n"
    env_turn_start: str = "\n<|im_start|>user\n"


class ObservationRenderer:
    """Token ids of observations for one tokenizer and model family.

    Args:
        tokenizer: the policy's tokenizer.
        adapter: the family's :class:`~mmrlhf.models.adapters.FamilyAdapter` (vision token ids).
        fmt: the turn strings (:class:`HermesFormat`).
    """

    def __init__(self, tokenizer: Any, adapter: Any, fmt: HermesFormat | None = None) -> None:
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.fmt = fmt or HermesFormat()
        start, pad, end = tokenizer.convert_ids_to_tokens(
            [adapter.vision_start_token_id, adapter.image_token_id, adapter.vision_end_token_id])
        self.vision_block = start + pad + end
        self.end_of_turn_id = int(tokenizer.convert_tokens_to_ids(self.fmt.end_of_turn))
        self.encoder = PlainTextEncoder(tokenizer)
        for environment in (False, True):  # the template's markers split as the tokenizer splits them
            pieces = self.pieces([ToolResult(text="ok", images=[None])], close_turn=True, environment=environment)
            whole = tokenizer("".join(text for text, _ in pieces), add_special_tokens=False)["input_ids"]
            if self.encoder.encode(pieces) != list(whole):
                raise ValueError("the observation's template strings do not split into the tokenizer's own tokens "
                                 "(an added token with strip or single-word rules?)")

    def pieces(self, results: Sequence[ToolResult], *, close_turn: bool, environment: bool = False
               ) -> list[tuple[str, bool]]:
        """The observation as ``(text, from_the_world)`` pieces: the template's strings (one vision block,
        unexpanded, per image) and each result's text, which is the world's."""
        f = self.fmt
        out: list[tuple[str, bool]] = [((f.end_of_turn if close_turn else "") +
                                        (f.env_turn_start if environment else f.turn_start), False)]
        for r in results:
            frame = "" if environment else f.response_open
            out += [(frame + self.vision_block * len(r.images), False), (r.text, True)]
            if not environment:
                out.append((f.response_close, False))
        out.append((f.next_turn, False))
        return [(text, external) for text, external in out if text]

    def text(self, results: Sequence[ToolResult], *, close_turn: bool, environment: bool = False) -> str:
        """The observation's text, one vision block (unexpanded) per image."""
        return "".join(text for text, _ in self.pieces(results, close_turn=close_turn, environment=environment))

    def tokens(self, results: Sequence[ToolResult], image_tokens: Sequence[int], *, close_turn: bool,
               environment: bool = False) -> list[int]:
        """Observation ids with every image's pad expanded to its token count (``image_tokens``, one per image of
        ``results`` in order); the results' text escaped (no added token can come from it). Raises when the ids do
        not hold one pad per image (a tokenizer that does not keep the vision block as its special tokens)."""
        ids = self.encoder.encode(self.pieces(results, close_turn=close_turn, environment=environment))
        pad = self.adapter.image_token_id
        found = sum(1 for t in ids if t == pad)
        if found != len(image_tokens):
            raise ValueError(f"observation holds {found} image pad tokens for {len(image_tokens)} images: the "
                             "tokenizer does not keep the vision block's special tokens")
        out: list[int] = []
        counts = iter(image_tokens)
        for t in ids:
            out.extend([pad] * int(next(counts)) if t == pad else [int(t)])
        return out

    def escapes(self, result: ToolResult) -> bool:
        """Whether ``result``'s text holds the string of an added token (escaped into plain text ids)."""
        return self.encoder.holds_markers(result.text)

    def ends_turn(self, token_id: int) -> bool:
        """Whether the policy's last token already closed its turn (else the observation closes it)."""
        return int(token_id) == self.end_of_turn_id
