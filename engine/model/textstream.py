"""Incremental detokenisation with stop strings and stop token ids.

Text is released only once it can no longer become part of a stop string or of an unfinished
UTF-8 character, so a streamed response never shows text that the stop string later removes.
Each push re-decodes the request's output (O(output) per token); outputs are bounded by
max_tokens, and it keeps multi-token characters and merges exact.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TextStream:
    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        stop_token_ids: Collection[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._stop_ids = set(stop_token_ids)
        self._ids: list[int] = []
        self._sent = 0  # characters already released
        self.text = ""  # everything released so far
        self.stopped = False  # a stop string or stop token ended the output

    def push(self, token: int) -> str:
        """Add one generated token; return the newly releasable text (possibly empty)."""
        if self.stopped:
            return ""
        if token in self._stop_ids:
            self.stopped = True
            return ""
        self._ids.append(token)
        full = self._tokenizer.decode(self._ids)
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            return self._release(full, cut)
        end = len(full)
        if full.endswith("\ufffd"):  # an unfinished multi-byte character: wait for its bytes
            end -= 1
        return self._release(full, end - self._stop_prefix_held(full[:end]))

    def flush(self) -> str:
        """At the end of output: release whatever was held back for a stop string."""
        if self.stopped:
            return ""
        return self._release(self._tokenizer.decode(self._ids), None)

    def _release(self, full: str, end: int | None) -> str:
        end = len(full) if end is None else end
        delta = full[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        self.text += delta
        return delta

    def _first_stop(self, full: str) -> int | None:
        longest = max((len(s) for s in self._stop), default=0)
        start = max(0, self._sent - longest)
        found = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _stop_prefix_held(self, text: str) -> int:
        """Characters at the end of `text` that begin some stop string (held back)."""
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held
