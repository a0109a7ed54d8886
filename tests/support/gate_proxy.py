"""A forwarding proxy that lets a set number of POSTs through to a real server and holds every later one until
the test opens it: a test can then act (kill the engine) at a known point of a run instead of racing the
workers for it.

While its upstream is gone the proxy is gone too, as a killed server is: the request that met the dead
upstream has its connection closed with no reply, and the proxy's port refuses connections until the upstream
answers ``/health`` again, when it listens on the same port once more. So its clients see what they would
see without it: a reset for the request in flight, then a server that is down (and waited for), then back."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler

import httpx

from tests.support.relay import QuietServer, relay

FORWARDED_HEADERS = ("Content-Type", "X-Request-Id", "Authorization")
POLL_S = 0.1  # how often a proxy whose upstream is gone asks whether it is back


class GateProxy:
    def __init__(self, upstream: str, *, let_through: int) -> None:
        self.upstream, self.let_through = upstream.rstrip("/"), let_through
        self.posts = 0  # POSTs received, held ones included
        self.answered = 0  # POSTs the upstream answered
        self.outages = 0  # times the proxy stopped listening because its upstream was gone
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._gone = threading.Event()  # a handler found the upstream gone
        self._closing = threading.Event()
        self._server = self._listen(0)
        self.port = self._server.server_address[1]
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open(self) -> None:
        """Let every held POST and every later one through."""
        self._open.set()

    def _listen(self, port: int) -> QuietServer:
        server = QuietServer(("127.0.0.1", port), self._handler())
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return server

    def _watch(self) -> None:
        """Close the port while the upstream is gone; listen on it again once the upstream is healthy."""
        while not self._closing.is_set():
            if not self._gone.wait(timeout=POLL_S):
                continue
            self._server.shutdown()
            self._server.server_close()
            with self._lock:
                self.outages += 1
            while not self._closing.is_set() and not self._upstream_healthy():
                time.sleep(POLL_S)
            if self._closing.is_set():
                return
            self._gone.clear()
            self._server = self._listen(self.port)

    def _upstream_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.upstream}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._forward("GET", None)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with proxy._lock:
                    proxy.posts += 1
                    held = proxy.posts > proxy.let_through
                if held:
                    proxy._open.wait()
                if self._forward("POST", body):
                    with proxy._lock:
                        proxy.answered += 1

            def _forward(self, method: str, body: bytes | None) -> bool:
                headers = {k: self.headers[k] for k in FORWARDED_HEADERS if self.headers.get(k)}
                try:
                    answer = httpx.request(method, proxy.upstream + self.path, content=body, headers=headers,
                                           timeout=120)
                except httpx.TransportError:
                    self.close_connection = True  # as a killed server: no status line at all ...
                    proxy._gone.set()  # ... and no server on the port until the upstream is back
                    return False
                relay(self, answer)
                return True

            def log_message(self, *args: object) -> None:  # the test's output stays quiet
                pass

        return Handler

    def __enter__(self) -> GateProxy:
        self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._open.set()  # no handler thread stays parked on the gate
        self._watcher.join(timeout=10)
        try:
            self._server.shutdown()
        finally:
            self._server.server_close()
