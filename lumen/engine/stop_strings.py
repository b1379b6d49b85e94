"""Stop strings: streamed text -> text safe to print, holding back what could still become a stop string."""
from __future__ import annotations

from typing import NamedTuple, Sequence

from .sampling.sampler import SamplerError


class StopResult(NamedTuple):
    text: str      # safe to emit now
    stopped: bool  # a stop string was hit: stop generating, emit nothing after `text`


class StopChecker:
    """Hold back streamed text that could be the start of a stop string.

    `feed(chunk)` returns (text safe to emit now, stopped). A stop string split across chunks is never
    emitted: a tail of the text that is a prefix of some stop string waits for the next chunk. When a stop
    string appears, the text before its earliest occurrence is emitted and nothing after, ever. At the end of
    generation without a stop, `flush()` returns the held-back tail.
    """

    def __init__(self, stop: Sequence[str]):
        if isinstance(stop, str):
            raise SamplerError("stop must be a list of strings, not a string", param="stop")
        stop = list(stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise SamplerError(f"stop strings must be non-empty strings, got {s!r}", param="stop")
        self.stop = stop
        self.stopped = False
        self.matched: str | None = None              # the stop string that stopped it
        self._held = ""

    def feed(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        buf = self._held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            i, self.matched = min(hits)
            self.stopped, self._held = True, ""
            return StopResult(buf[:i], True)
        hold = 0                                     # longest tail of buf that starts some stop string
        for s in self.stop:
            for size in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:size]):
                    hold = size
                    break
        cut = len(buf) - hold
        self._held = buf[cut:]
        return StopResult(buf[:cut], False)

    def flush(self) -> str:
        """The held-back text, once generation ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
