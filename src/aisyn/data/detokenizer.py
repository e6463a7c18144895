"""Streaming detokenisation: token ids in, complete characters out.

A character outside the SentencePiece vocabulary is spelled as byte pieces
(``<0xE9>``, ``<0xBC>``, ``<0x97>``), so a token stream can stop mid-character;
decoding it then gives U+FFFD, which a stream must not print only to print the
real character a token later. ``IncrementalDetokenizer`` holds such tokens back
until their character is complete.
"""

from __future__ import annotations

from aisyn.data.tokenizer import PanguTokenizer

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to

# A UTF-8 character has at most 4 bytes; tokens held longer than this cannot
# complete one, so they are genuinely invalid bytes and are let through.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    """Feed token ids one by one with ``push``; each call returns the text that
    became complete (often "", for a word boundary or an unfinished character).
    ``flush`` returns whatever is still held at the end. The pieces returned
    concatenate to ``tokenizer.decode`` of all ids pushed.
    """

    def __init__(self, tokenizer: PanguTokenizer) -> None:
        self.tokenizer = tokenizer
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        self._pending.append(token_id)
        # PanguTokenizer.decode drops SentencePiece's word-boundary spaces and
        # maps characters one by one, so decoding the held tokens alone gives
        # the same text as decoding them after everything already returned.
        text = self.tokenizer.decode(self._pending)
        if text.endswith(REPLACEMENT) and len(self._pending) < _MAX_PENDING:
            return ""
        self._pending.clear()
        return text

    def flush(self) -> str:
        text = self.tokenizer.decode(self._pending) if self._pending else ""
        self._pending.clear()
        return text
