"""Streaming detokenisation: token ids in, complete characters out.

A character outside the SentencePiece vocabulary is spelled as byte pieces
(``<0xE9>``, ``<0xBC>``, ``<0x97>``), and a byte-level BPE (GPT-2, Qwen2) may
cut any multi-byte character across tokens, so a token stream can stop
mid-character; decoding it then gives U+FFFD, which a stream must not print
only to print the real character a token later. ``IncrementalDetokenizer``
holds such tokens back until their character is complete.
"""

from __future__ import annotations

from aisyn.data.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to

# A UTF-8 character has at most 4 bytes; tokens held longer than this cannot
# complete one, so they are genuinely invalid bytes and are let through.
_MAX_PENDING = 8
# Tokens already returned that the held ones are decoded after (at least the
# last piece's; see ``_decode_pending``).
_CONTEXT = 4


class IncrementalDetokenizer:
    """Feed token ids one by one with ``push``; each call returns the text that
    became complete (often "", for a word boundary or an unfinished character).
    ``flush`` returns whatever is still held at the end. The pieces returned
    concatenate to ``tokenizer.decode`` of all ids pushed.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pending: list[int] = []
        # The last pieces returned, each the tokens of one whole push result:
        # a piece cut in two could decode otherwise (byte runs).
        self._context: list[list[int]] = []

    def _decode_pending(self) -> str:
        # The held tokens are decoded after the last few returned ones and that
        # prefix's text cut off: some decoders read a token by its neighbour
        # (SentencePiece-style ones drop the word-boundary space of the first
        # token decoded), and PanGu's and byte-level BPE's decode character by
        # character, where this equals decoding the held tokens alone.
        if not self._context:
            return self.tokenizer.decode(self._pending)
        context = [t for piece in self._context for t in piece]
        prefix = self.tokenizer.decode(context)
        text = self.tokenizer.decode(context + self._pending)
        if prefix.endswith(REPLACEMENT) or not text.startswith(prefix):
            return self.tokenizer.decode(self._pending)
        return text[len(prefix) :]

    def push(self, token_id: int) -> str:
        self._pending.append(token_id)
        text = self._decode_pending()
        if text.endswith(REPLACEMENT) and len(self._pending) < _MAX_PENDING:
            return ""
        if text.endswith(REPLACEMENT):
            # Invalid bytes let through: the next tokens must not complete them.
            self._context = []
        else:
            self._context.append(self._pending)
            while sum(map(len, self._context)) > _CONTEXT and len(self._context) > 1:
                self._context.pop(0)
        self._pending = []
        return text

    def flush(self) -> str:
        text = self._decode_pending() if self._pending else ""
        self._pending.clear()
        self._context = []
        return text
