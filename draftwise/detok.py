"""Incremental detokenization for streaming: text deltas that never split a UTF-8 character and never
show the start of a stop string before it is known not to be one.

Decoding a token on its own is wrong for byte-level BPE (a character can span tokens) and for
SentencePiece (leading spaces depend on the previous token), so each delta is the difference between
decoding a short window of recent tokens with and without the new ones (the offsets technique of
HF text-generation-inference and vLLM). A delta ending in U+FFFD is an unfinished character: it waits
for the next token. The concatenated deltas equal ``output_text(seq)`` once the sequence has finished.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self.decode = decode
        self.stop = stop
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context that fixes how the first new token renders
        self.read_offset = 0  # tokens before this are already in ``text``
        self.text = ""  # decoded so far (complete characters only)
        self.sent = 0  # characters of ``text`` already handed out

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text that can be shown now."""
        self.ids.extend(new_ids)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(len(self.text) - self._held_back())

    def finish(self, final_text: str) -> str:
        """The sequence ended with ``final_text`` (already cut at a stop string): the rest of it."""
        if final_text.startswith(self.text[:self.sent]):
            out = final_text[self.sent:]
        else:  # should not happen; never repeat text the client has
            out = ""
        self.sent = len(final_text)
        self.text = final_text
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that could be the start of a stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:n]):
                    held = n
                    break
        return held

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out


class PieceStream:
    """A generation's text as it is produced, for ``SpeculativeDecoder.generate(on_text=...)``: after each
    step ``sink`` gets ``[(text, kind), ...]``, one piece per new token (``kind``: how the token was produced,
    as ``GenerationResult.kinds``; a token that completes no character, or whose text is held back as the
    possible start of a stop string, adds its text to a later piece). The pieces of a whole generation join
    to exactly ``GenerationResult.text``: the last step's tokens go through ``finish``, which cuts them at the
    stop string the decoder found there."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...],
                 sink: Callable[[list[tuple[str, str]]], None]):
        self.detok = IncrementalDetokenizer(decode, stop)
        self.sink = sink
        self.done = 0  # output tokens already pushed

    def step(self, ids: list[int], kinds: list[str]) -> None:
        """The output so far (a step that did not finish the sequence): its new tokens' pieces."""
        pieces = [(self.detok.push([t]), k) for t, k in zip(ids[self.done:], kinds[self.done:])]
        self.done = len(ids)
        self._send(pieces)

    def finish(self, ids: list[int], kinds: list[str], text: str) -> None:
        """The sequence ended with ``text`` (cut at a stop string where one matched): the rest of it."""
        start = self.detok.sent
        if not text.startswith(self.detok.text[:start]):  # never repeat or contradict what was sent
            return
        pieces, end = [], start
        for t, k in zip(ids[self.done:], kinds[self.done:]):
            piece = text[end:end + len(self.detok.push([t]))]  # the final text's own characters, to its cut
            pieces.append((piece, k))
            end += len(piece)
        if end < len(text):  # held back as a possible stop string's start, which it was not
            pieces.append((text[end:], kinds[-1] if kinds else "plain"))
        self.done = len(ids)
        self._send(pieces)

    def _send(self, pieces: list[tuple[str, str]]) -> None:
        pieces = [p for p in pieces if p[0]]
        if pieces:
            self.sink(pieces)
