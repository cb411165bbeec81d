"""Stop strings over streamed text.

Text arrives in pieces (one per detokenized token) and a stop string may span
several pieces. :class:`StopStringMatcher` emits what is certainly not part of a
stop string and holds back the longest tail that is still the beginning of one.
When a stop string completes, the output ends just before it (the stop string itself
is excluded, as in the OpenAI API and vLLM's default).

Why searching only the held tail plus the new piece is enough: the held tail is the
longest suffix of everything seen that is a proper prefix of some stop string, so a
stop string that began inside already-emitted text would have made a longer tail be
held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import SamplingParamsError

__all__ = ["StopCheck", "StopStringMatcher", "find_stop", "partial_stop_length"]


def find_stop(text: str, stops: Sequence[str]) -> Optional[tuple[int, str]]:
    """The earliest stop string in ``text``: ``(start index, stop)``, or ``None``.

    Ties at one start index go to the stop listed first.
    """
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest


@dataclass
class StopCheck:
    """Result of :meth:`StopStringMatcher.feed`.

    - ``text``: text safe to emit now (``str``, possibly empty).
    - ``stopped``: a stop string was completed; ``text`` ends right before it.
    - ``stop``: the stop string matched, or ``None``.
    """

    text: str
    stopped: bool = False
    stop: Optional[str] = None


class StopStringMatcher:
    """Incremental stop-string detection for one stream of text.

    Usage: call :meth:`feed` with each new piece of text; emit ``check.text``; once
    ``check.stopped``, end the request. When the request ends for another reason
    (EOS, length), call :meth:`flush` and emit what it returns. When two stop strings
    start at the same place, the one completed first in the stream is reported (the
    emitted text is the same either way).
    """

    def __init__(self, stop: Sequence[str] = ()):
        """Watch for the strings in ``stop`` (a single ``str`` is accepted).

        Raises:
            SamplingParamsError: a stop string is empty or not a string.
        """
        stops = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stops):
            raise SamplingParamsError(f"stop strings must be non-empty strings, got {stops!r}")
        self.stops = stops
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None

    @property
    def held(self) -> str:
        """Text received but not yet emitted (it may start a stop string)."""
        return self._held

    def feed(self, new_text: str) -> StopCheck:
        """Add the next piece of text; return what may be emitted and whether a stop hit.

        After a stop, further calls return an empty, stopped :class:`StopCheck`.
        """
        if self.stopped:
            return StopCheck("", True, self.matched)
        if not self.stops:
            return StopCheck(new_text)
        buffer = self._held + new_text
        hit = find_stop(buffer, self.stops)
        if hit is not None:
            self.stopped, self.matched, self._held = True, hit[1], ""
            return StopCheck(buffer[: hit[0]], True, hit[1])
        keep = partial_stop_length(buffer, self.stops)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return StopCheck(buffer[: len(buffer) - keep])

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text (``""`` after a stop)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


def emit_token(
    detok, matcher: StopStringMatcher, token: int, stop_ids, out_of_room: bool
) -> tuple[str, Optional[str]]:
    """Turn one sampled token into the text to emit and a finish reason.

    Order of checks (vLLM's): a stop token id (or EOS) ends the request and its text is
    not emitted; otherwise the token is detokenized and stop strings are matched (a hit
    trims the text at the stop string); otherwise ``out_of_room`` (``max_tokens`` reached
    or the context full) ends it with ``"length"``, flushing held-back text.

    Args:
        detok: a :class:`~mlx_ferrum.tokenizer.StreamingDetokenizer`, or None (ids only).
        matcher: the request's stop-string matcher.
        token: the sampled token id.
        stop_ids: ids that end the request.
        out_of_room: no further token may follow this one.

    Returns:
        ``(text, reason)`` with ``reason`` in ``None``, ``"stop"``, ``"length"``.
    """
    if token in stop_ids:
        if detok is None:
            return "", "stop"
        return matcher.feed(detok.finalize()).text + matcher.flush(), "stop"
    text = ""
    if detok is not None:
        check = matcher.feed(detok.add_token(token))
        text = check.text
        if check.stopped:
            return text, "stop"
    if not out_of_room:
        return text, None
    if detok is not None:
        tail = matcher.feed(detok.finalize())
        text += tail.text
        if tail.stopped:
            return text, "stop"
        text += matcher.flush()
    return text, "length"
