"""Text around the token loop: incremental detokenization and stop strings.

`TextStream.push(ids)` takes the tokens one decode step committed and returns the text that
became final: it holds back an incomplete UTF-8 sequence (the tokenizer decodes it as
U+FFFD) and any tail that could still grow into a stop string. Decoding re-reads only a
short window (the tokens since the last emitted boundary), never the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already in self._decoded
        self._read = 0
        self._decoded = ""  # final text decoded so far (stop strings not yet applied)
        self.emitted = 0  # characters of self._decoded handed out
        self.stopped = False  # a stop string was found; nothing more will be emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: Sequence[int]) -> str:
        """-> the text delta that is now final (possibly '')."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._decoded += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """-> whatever was held back, at the end of generation."""
        if self.stopped:
            return ""
        rest = self._decode(self.ids[self._prefix:])
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        if len(rest) > len(prefix_text):
            self._decoded += rest[len(prefix_text):]
            self._prefix = self._read = len(self.ids)
        return self._emit(final=True)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._decoded[:self.emitted]

    def _emit(self, final: bool) -> str:
        text = self._decoded
        for s in self.stop:  # the earliest stop string wins
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                text = text[:at]
                self.stopped = True
        end = len(text)
        if not self.stopped and not final:
            end -= self._held(text)
        end = max(end, self.emitted)
        delta = text[self.emitted:end]
        self.emitted = end
        if self.stopped:
            self._decoded = text
        return delta

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
