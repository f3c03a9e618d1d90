"""Connection limits uvicorn's httptools server lacks, enforced in its protocol class.

uvicorn with httptools buffers a header of any size (llhttp hands a header value over only once it
has all of it), waits forever for headers and bodies, and accepts connections until file
descriptors run out. `limited_protocol` returns a subclass of its `HttpToolsProtocol` that adds:

- a cap on the request line and headers (431), counted as bytes are fed to the parser, so no more
  than the cap plus one socket read is ever held;
- a deadline for the headers from the connection's start or the request's first byte (408);
- a minimum body rate, checked once per `body_timeout` window while the server waits for it (408);
- a cap on open connections: past it a request is answered 503, and past the overflow above it a
  connection is dropped at once, so descriptors stay bounded whatever the clients do;
- protocol errors (malformed request line, bad Content-Length) answered in the gateway's JSON.

Refusals are written straight to the transport in the caller's wire format, followed by a lingering
close: the server stops writing, discards what the client still sends for a moment, then closes, so
the client reads the reply instead of a reset.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from flashstack.gateway import chat
from flashstack.gateway.config import ServerConfig
from flashstack.gateway.core import ErrorKind, GatewayError

if TYPE_CHECKING:
    from flashstack.gateway.tls import ServerTLS

log = logging.getLogger("flashstack.gateway")

# After a refusal: how long, and how many bytes, the server keeps reading and discarding so that the
# client finishes its write and reads the reply (closing with unread data sends a TCP reset).
LINGER_SECONDS = 2.0
LINGER_BYTES = 1024 * 1024
# Descriptors kept for everything but client connections (upstream pools, database, logs, certs),
# and per client connection: its socket plus, while a request is in flight, one upstream socket.
FD_RESERVE = 256
FDS_PER_CONNECTION = 2


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The server section's limits, as the protocol enforces them."""

    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    body_min_rate: float
    max_connections: int
    overflow: int  # connections above max_connections still accepted, to be told 503

    @classmethod
    def from_config(
        cls, server: ServerConfig, descriptors_for: int | None = None
    ) -> ConnectionLimits:
        """The server's limits; with `descriptors_for`, the connections shrunk to fit that many."""
        cap = server.max_connections
        overflow = max(64, cap // 8)
        if descriptors_for is not None and descriptors_for < cap + overflow:
            cap = max(1, descriptors_for * 8 // 9)
            overflow = max(0, descriptors_for - cap)
        return cls(
            server.max_header_bytes,
            server.header_timeout,
            server.body_timeout,
            server.body_min_rate,
            cap,
            overflow,
        )

    @property
    def body_window_bytes(self) -> int:
        return max(1, int(self.body_min_rate * self.body_timeout))


def uvicorn_options(server: ServerConfig, tls: ServerTLS | None = None) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config` that serve with these limits (and `tls`, started)."""
    wanted = ConnectionLimits.from_config(server)
    limits = ConnectionLimits.from_config(
        server, fit_descriptor_limit(wanted.max_connections + wanted.overflow)
    )
    protocol = limited_protocol(limits)
    options: dict[str, Any] = {"http": protocol, "timeout_keep_alive": server.keep_alive_timeout}
    if tls is not None:
        options |= tls.uvicorn_options(protocol)
    return options


def fit_descriptor_limit(connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE to what `connections` need; return how many fit if it cannot."""
    need = FD_RESERVE + FDS_PER_CONNECTION * connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < need:
        fit = max(1, (soft - FD_RESERVE) // FDS_PER_CONNECTION)
        log.warning(
            "server.max_connections needs %d file descriptors but the limit (ulimit -n) is %d: "
            "serving at most %d connections; raise the limit or lower server.max_connections",
            need,
            soft,
            fit,
        )
        return fit
    return connections


def limited_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class with `limits` enforced."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol plus header, timeout and connection limits; see the module docstring."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between requests or inside a request's line and headers
        self._head_bytes = 0  # fed to the parser since the current head began
        self._heads_done = 0  # headers completed on this connection
        self._body_pending = False  # headers complete, body not yet
        self._window_bytes = 0  # body bytes in the current body_timeout window
        self._timer: asyncio.TimerHandle | None = None
        self._over_capacity = False
        self._refused = False
        self._discarded = 0

    # ---- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        open_now = len(self.connections)
        if open_now > self.limits.max_connections + self.limits.overflow:
            self._refused = True
            transport.abort()  # past the overflow a reply is not worth a descriptor
            return
        self._over_capacity = open_now > self.limits.max_connections
        self._arm(self.limits.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._discard(len(data))
            return
        if not self._in_head:
            self._window_bytes += len(data)
            super().data_received(data)
        else:
            self._feed_head(data)
        if self._body_pending and self._timer is None and not self._refused:
            self._arm(self.limits.body_timeout, self._body_window_ended)

    def _feed_head(self, data: bytes) -> None:
        """Feed at most the head's remaining budget; a head still open past it is a 431."""
        room = self.limits.max_header_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            # Armed only for a head that one read did not complete: most requests
            # never need the timer.
            if (
                self._in_head
                and self._head_bytes
                and self._timer is None
                and self._idle()
                and not self._refused
            ):
                self._arm(self.limits.header_timeout, self._head_timed_out)
            return
        heads_done = self._heads_done
        super().data_received(data[:room])
        if self.transport.is_closing() or self._refused:
            return
        if self._heads_done == heads_done:
            self._refuse(
                GatewayError(
                    ErrorKind.REQUEST_TOO_LARGE,
                    status=431,
                    message=f"request line and headers are larger than the gateway's limit of "
                    f"{self.limits.max_header_bytes} bytes (server.max_header_bytes)",
                )
            )
            return
        super().data_received(data[room:])

    # ---- parser callbacks ----------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._heads_done += 1
        self._body_pending = True
        self._window_bytes = 0
        self._disarm()
        if self._over_capacity:
            self._refuse(
                GatewayError(
                    ErrorKind.OVERLOADED,
                    status=503,
                    retry_after=1,
                    message="the gateway is serving its maximum of "
                    f"{self.limits.max_connections} connections (server.max_connections); "
                    "retry shortly",
                )
            )
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes, self._body_pending = True, 0, False
        if self._timer is not None and not self._refused:
            self._disarm()
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._body_pending and not self.transport.is_closing():
            # Answered before the body was read (a 413, say): nobody will read the rest.
            self._disarm()
            self._linger()

    def send_400_response(self, msg: str) -> None:
        # Called from uvicorn's `except httptools.HttpParserError`; the parser's reason says more.
        exc = sys.exc_info()[1]
        reason = f": {exc}" if isinstance(exc, httptools.HttpParserError) and str(exc) else ""
        self._refuse(
            GatewayError(
                ErrorKind.INVALID_REQUEST,
                f"malformed HTTP request{reason}; check the request line, header syntax and "
                "Content-Length",
            )
        )

    # ---- timers --------------------------------------------------------------------------------

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, delay: float, callback: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._head_bytes == 0:  # an idle connection: close without a word, as keep-alive does
            self.transport.close()
            return
        self._refuse(
            GatewayError(
                ErrorKind.TIMEOUT,
                status=408,
                message=f"request headers did not arrive within {self.limits.header_timeout:g} s "
                "(server.header_timeout)",
            )
        )

    def _body_window_ended(self) -> None:
        self._timer = None
        if not self._body_pending:
            return
        cycle = self.cycle
        # Not the client's fault: we stopped reading (the app is behind) or owe it a 100 Continue.
        excused = self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue)
        if excused or self._window_bytes >= self.limits.body_window_bytes:
            self._window_bytes = 0
            self._arm(self.limits.body_timeout, self._body_window_ended)
            return
        self._refuse(
            GatewayError(
                ErrorKind.TIMEOUT,
                status=408,
                message=f"request body arrived slower than {self.limits.body_min_rate:g} bytes/s "
                f"over {self.limits.body_timeout:g} s (server.body_min_rate, server.body_timeout)",
            )
        )

    # ---- refusing ------------------------------------------------------------------------------

    def _refuse(self, err: GatewayError) -> None:
        """Answer `err` (unless a response has begun), end the request, close lingering."""
        self._refused = True
        self._disarm()
        cycle = self.cycle  # on a keep-alive connection, maybe the previous request's, complete
        in_flight = cycle is not None and not cycle.response_complete
        if in_flight:
            # the app's receive() sees a disconnect, its sends are dropped
            cycle.disconnected = True
            cycle.message_event.set()
        if not (in_flight and cycle.response_started):
            self.transport.write(self._error_bytes(err))
        self._linger()

    def _linger(self) -> None:
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def _discard(self, n: int) -> None:
        self._discarded += n
        if self._discarded > LINGER_BYTES:
            self.transport.close()

    def _error_bytes(self, err: GatewayError) -> bytes:
        body = orjson.dumps(self._wire().error_json(err))
        head = [STATUS_LINE[err.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\nconnection: close\r\n",
        ]
        if err.retry_after:
            head += [b"retry-after: ", str(round(err.retry_after)).encode(), b"\r\n"]
        head += [b"\r\n", body]
        return b"".join(head)

    def _wire(self) -> chat.WireFormat:
        """The caller's wire format from what was parsed so far (the gateway's `_wire_of`)."""
        url = getattr(self, "url", b"") or b""
        if url.startswith(b"/v1/messages") or any(
            n == b"anthropic-version" for n, _ in self.headers or ()
        ):
            return chat.ANTHROPIC
        return chat.OPENAI
