"""A small threaded WSGI server: ``/metrics`` from the registry, ``/health`` for container checks."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


def make_app(registry: CollectorRegistry) -> WsgiApp:
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/health":
            # Liveness of the exporter itself; Redis being down is reported in /metrics instead.
            return _text(start_response, "200 OK", "ok\n")
        return _text(start_response, "404 Not Found", "not found: try /metrics or /health\n")

    return app


def _text(start_response: Callable, status: str, body: str) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [body.encode()]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, fmt: str, *args: object) -> None:
        # Prometheus scrapes every 15 s; one access line each would drown the service's own log.
        log.debug("%s " + fmt, self.address_string(), *args)


def stop_event_on_signals() -> threading.Event:
    """An event set by SIGTERM (what ``docker stop`` sends) or SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    return stop


def serve(app: WsgiApp, host: str, port: int, stop: threading.Event) -> None:
    """Serve until ``stop`` is set, then close the socket."""
    server = make_server(host, port, app, server_class=_ThreadingServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="exporter-http", daemon=True)
    thread.start()
    log.info("exporter: serving /metrics and /health on %s:%d", host, port)
    stop.wait()
    log.info("exporter: stopping")
    server.shutdown()
    server.server_close()
