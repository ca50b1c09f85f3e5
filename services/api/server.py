"""Serving the door with uvicorn (``python -m services.api``)."""

from __future__ import annotations

from services.api.router import create_app
from services.api.settings import ApiSettings
from services.common.app import setup_logging
from services.common.settings import load_settings


def serve(settings: ApiSettings | None = None) -> None:
    """Run the door with uvicorn until SIGTERM (blocking). At the signal, event streams and
    long-polls end at once (:meth:`~services.api.clients.Clients.begin_close`); other requests
    get uvicorn's graceful shutdown (``shutdown_timeout_s``)."""
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
    config = uvicorn.Config(app, host=s.http_host, port=s.http_port, loop="uvloop", http="httptools",
                            access_log=False, log_config=None, timeout_graceful_shutdown=int(s.shutdown_timeout_s),
                            proxy_headers=True, forwarded_allow_ips=s.http_forwarded_allow_ips)
    Server(config).run()
