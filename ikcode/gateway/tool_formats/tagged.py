"""Text with calls between an opening and a closing marker, as it streams.

Text outside the markers passes through at once, except a tail that could be the start of an
opening marker. Inside, the call's text goes to a body parser as it arrives (less a tail that
could start the closing marker), which emits the call's events; a body that never became a call
comes back out as the raw text, so a confused model produces a readable answer: at once where the
body can tell it is no call (`no_call`), else at its closing marker or the reply's end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ikcode.gateway.tool_formats.base import ParseEvent, TextPiece


class CallBody(Protocol):
    def feed(self, text: str) -> list[ParseEvent]: ...

    def close(self, closed: bool) -> list[ParseEvent] | None:
        """The call's last events (closed: its closing marker arrived), or None: it was no call."""
        ...

    # Optional, `no_call`: True once the body's text can no longer become a call (read with
    # getattr; a body without it is held until its closing marker or the reply's end).


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class TaggedCallParser:
    def __init__(self, open_marker: str, close_marker: str, new_body: Callable[[], CallBody]):
        self.open_marker, self.close_marker, self.new_body = open_marker, close_marker, new_body
        self._buf = ""
        self._body: CallBody | None = None
        self._raw = ""  # the current call's text, shown as text if it turns out to be no call

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while True:
            if self._body is None:
                at = self._buf.find(self.open_marker)
                if at < 0:
                    keep = partial_suffix(self._buf, self.open_marker)
                    ready, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                    if ready:
                        out.append(TextPiece(ready))
                    return out
                if at:
                    out.append(TextPiece(self._buf[:at]))
                self._buf = self._buf[at + len(self.open_marker) :]
                self._body, self._raw = self.new_body(), ""
                continue
            at = self._buf.find(self.close_marker)
            if at < 0:
                keep = partial_suffix(self._buf, self.close_marker)
                chunk, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                self._raw += chunk
                out += self._body.feed(chunk)
                if getattr(self._body, "no_call", False):
                    # A stray opening marker: its text streams now, not at the reply's end (a
                    # stop sequence in it then ends generation at once), and what follows is
                    # read as text again.
                    out.append(TextPiece(self.open_marker + self._raw))
                    self._body, self._raw = None, ""
                    continue
                return out
            chunk, self._buf = self._buf[:at], self._buf[at + len(self.close_marker) :]
            self._raw += chunk
            out += self._body.feed(chunk)
            if getattr(self._body, "in_string", False):  # the marker is a JSON string's text
                self._raw += self.close_marker
                out += self._body.feed(self.close_marker)
                continue
            out += self._close(closed=True)

    def finish(self) -> list[ParseEvent]:
        buf, self._buf = self._buf, ""
        if self._body is None:
            return [TextPiece(buf)] if buf else []
        self._raw += buf
        return self._body.feed(buf) + self._close(closed=False)

    def _close(self, closed: bool) -> list[ParseEvent]:
        assert self._body is not None
        events, self._body = self._body.close(closed), None
        if events is not None:
            return events
        return [TextPiece(self.open_marker + self._raw + (self.close_marker if closed else ""))]
