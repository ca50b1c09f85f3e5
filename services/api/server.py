"""Serving the door with uvicorn (``python -m services.api``)."""

from __future__ import annotations

from services.api.router import create_app
from services.api.settings import ApiSettings
from services.common.app import setup_logging
from services.common.settings import load_settings


def bounded_http_protocol(max_head_bytes: int, max_headers: int) -> type:
    """uvicorn's httptools protocol with bounds on a request's head: at most ``max_head_bytes`` of
    request target and header lines (names, values and their separators, bytes) and at most
    ``max_headers`` header lines; past either the connection is answered ``431 Request Header Fields
    Too Large`` (RFC 6585, section 5) and closed, before the application sees the request.

    httptools (llhttp) has no such bound of its own and uvicorn sets none (its h11 backend's
    ``h11_max_incomplete_event_size`` does not apply to httptools). Header bytes that have not
    ended yet are bounded by the raw bytes received since the head began (httptools keeps an
    unfinished header in memory), so a head that never ends is refused once it passes the bound.
    """
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0     # url + header bytes of this request's head, from the parser
            self._head_raw = 0       # bytes received while this head had not ended
            self._in_head = True
            self._head_error: str | None = None

        def data_received(self, data: bytes) -> None:
            counted = self._in_head
            super().data_received(data)
            if counted and self._in_head and not self._head_error and not self.transport.is_closing():
                self._head_raw += len(data)
                if self._head_raw > max_head_bytes:
                    self._refuse_head(f"request head over {max_head_bytes} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes, self._in_head, self._head_error = 0, True, None

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._count(len(url))

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            if len(self.headers) > max_headers:
                self._head_error = f"more than {max_headers} header lines"
                raise ValueError(self._head_error)  # httptools stops parsing; send_400_response answers
            self._count(len(name) + len(value) + 4)  # "name: value\r\n"

        def on_headers_complete(self) -> None:
            self._in_head, self._head_raw = False, 0
            super().on_headers_complete()

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > max_head_bytes:
                self._head_error = f"request head over {max_head_bytes} bytes"
                raise ValueError(self._head_error)

        def send_400_response(self, msg: str) -> None:
            if self._head_error is None:
                super().send_400_response(msg)
            else:
                self._refuse_head(self._head_error)

        def _refuse_head(self, why: str) -> None:
            self._head_error = why
            self.logger.info("refused a request head from %s: %s", self.client, why)
            body = f"431 Request Header Fields Too Large: {why}".encode("ascii")
            status = STATUS_LINE.get(431) or b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            head = [status]
            for name, value in self.server_state.default_headers:
                head.extend([name, b": ", value, b"\r\n"])
            head += [b"content-type: text/plain; charset=utf-8\r\n",
                     b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                     b"connection: close\r\n\r\n", body]
            self.transport.write(b"".join(head))
            self.transport.close()

    return BoundedHttpToolsProtocol


def serve(settings: ApiSettings | None = None) -> None:
    """Run the door with uvicorn until SIGTERM (blocking). At the signal, event streams and
    long-polls end at once (:meth:`~services.api.clients.Clients.begin_close`); other requests
    get uvicorn's graceful shutdown (``shutdown_timeout_s``). Request heads are bounded
    (:func:`bounded_http_protocol`)."""
    import uvicorn

    s = settings or load_settings(ApiSettings)
    setup_logging("api", s.telemetry.log_level)
    app = create_app(s)
    clients = app.state.clients

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # uvicorn's SIGTERM/SIGINT handler
            super().handle_exit(sig, frame)
            clients.begin_close()

    # the client address (per-client upload slots) is X-Forwarded-For's when the peer is a listed proxy
    config = uvicorn.Config(app, host=s.http_host, port=s.http_port, loop="uvloop",
                            http=bounded_http_protocol(s.http_max_head_bytes, s.http_max_headers),
                            access_log=False, log_config=None, timeout_graceful_shutdown=int(s.shutdown_timeout_s),
                            proxy_headers=True, forwarded_allow_ips=s.http_forwarded_allow_ips)
    Server(config).run()
