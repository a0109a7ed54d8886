"""A hidden-states endpoint that answers slowly: it forwards each request to a real server after a delay
and counts the requests per sample, so a test can kill an extract job between two of its samples."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler

import httpx

from tests.support.relay import QuietServer, relay


class SlowProxy:
    def __init__(self, upstream: str, *, delay_s: float) -> None:
        self.upstream, self.delay_s = upstream.rstrip("/"), delay_s
        self.requests: Counter[int] = Counter()  # sample id -> requests forwarded
        self._lock = threading.Lock()
        self._server = QuietServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with proxy._lock:
                    proxy.requests[int(json.loads(body)["metadata"]["sample_id"])] += 1
                time.sleep(proxy.delay_s)
                answer = httpx.post(proxy.upstream + self.path, content=body, timeout=60,
                                    headers={"Content-Type": "application/json"})
                relay(self, answer)

            def log_message(self, *args: object) -> None:  # the test's output stays quiet
                pass

        return Handler

    def __enter__(self) -> SlowProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
