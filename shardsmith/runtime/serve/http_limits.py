"""Connection limits for the HTTP server: stalled, truncated and surplus connections are closed.

uvicorn's h11 protocol closes an idle keep-alive connection (``timeout_keep_alive``) but waits
forever for a request that never completes: a client that opens a connection and sends half its
headers, or declares ``Content-Length: 100`` and sends 46 bytes, holds a socket (and, with enough
of them, the process's file descriptors) indefinitely. :class:`LimitedH11Protocol` adds:

======================  ================================================================  ==========
limit                   what happens past it                                              answer
======================  ================================================================  ==========
``header_timeout_s``    a request's headers not complete this long after the connection   408
                        opened, or after the first byte of a follow-up request
``body_timeout_s``      no byte of an incomplete request body for this long               408
(half-close)            the client shuts its sending side before the body is complete     400
``max_connections``     a connection opened while this many are open                      503
``keep_alive_s``        idle between requests on a kept-alive connection (uvicorn's)      (closed)
======================  ================================================================  ==========

Answers carry OpenAI's error body and ``Connection: close``; a request whose response has started
is only closed. A connection closed early ends its request in the engine as a client that went
away does. The response's bytes go out before the close (an asyncio transport flushes its buffer
first), so a client that half-closed still reads the 400.

Sources: uvicorn ``protocols/http/h11_impl.py`` (the protocol subclassed here, selected through
``uvicorn.Config(http=...)``); h11's states (``their_state`` ``SEND_BODY`` while a body is owed).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["DEFAULT_MAX_QUEUE", "DEFAULT_MAX_REQUEST_BYTES", "HTTPLimits", "LimitedH11Protocol", "limited_protocol"]

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a 128k-token prompt as text or token ids is ~1 MB of JSON; past it, 413
DEFAULT_MAX_QUEUE = 64  # requests waiting for a sequence slot; past it, 429

REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


@dataclass(frozen=True, slots=True)
class HTTPLimits:
    """Limits on client connections (seconds, connections).

    Attributes:
        header_timeout_s: time allowed for a request's headers.
        body_timeout_s: longest pause allowed inside a request body.
        keep_alive_s: an idle kept-alive connection is closed after this long.
        max_connections: open connections beyond this are answered 503 and closed.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 512

    def problems(self) -> list[str]:
        """What is out of range, one line per option, naming its CLI flag."""
        out = [f"{flag} must be more than 0 seconds, got {v}" for flag, v in (
            ("--header-timeout", self.header_timeout_s), ("--body-timeout", self.body_timeout_s),
            ("--keep-alive-timeout", self.keep_alive_s)) if not v > 0]
        if self.max_connections < 1:
            out.append(f"--max-connections must be at least 1, got {self.max_connections}")
        return out


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`HTTPLimits` (set on the class by :func:`limited_protocol`)."""

    limits: HTTPLimits = HTTPLimits()
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"the server holds its limit of {self.limits.max_connections} open connections "
                              f"(--max-connections); retry later")
            return
        self._arm(self.limits.header_timeout_s, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        waiting_for_headers = self.conn.their_state is h11.IDLE
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
        elif self.conn.their_state is h11.SEND_BODY:
            self._arm(self.limits.body_timeout_s, "body")  # re-armed on every byte of the body
        elif self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            if not waiting_for_headers or self._timer is None:  # a follow-up request's first bytes
                self._arm(self.limits.header_timeout_s, "headers")
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer for the idle connection
        if self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0]:
            return
        self._disarm()

    def eof_received(self) -> bool | None:
        """The client shut its sending side: a request it left incomplete gets a 400 it can still read."""
        if self.conn.their_state is h11.SEND_BODY:
            declared = dict(self.headers or []).get(b"content-length", b"?").decode("latin-1")
            self._refuse(400, f"the request body ended early: the client closed its side of the connection "
                              f"before sending the {declared} bytes its Content-Length declared")
        elif self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._refuse(400, "the request ended early: the client closed its side of the connection "
                              "inside the request's headers")
        return None  # asyncio closes the transport once the answer is written

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, what, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, what: str, seconds: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if what == "headers":
            msg = f"the request's headers were not complete within {seconds:g} s (--header-timeout)"
        else:
            msg = f"the request body paused for more than {seconds:g} s (--body-timeout)"
        self._refuse(408, msg)

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with OpenAI's error body unless a response has started, then close."""
        self._disarm()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the request's handler sees a client that went away
            self.cycle.message_event.set()
        started = self.cycle is not None and self.cycle.response_started
        if not started and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": status}}, ensure_ascii=True).encode("ascii")
            head = (f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("ascii")
            self.transport.write(head + body)
        self.transport.close()


def limited_protocol(limits: HTTPLimits) -> type[LimitedH11Protocol]:
    """A :class:`LimitedH11Protocol` subclass bound to ``limits`` (for ``uvicorn.Config(http=...)``)."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})
