"""What the test proxies share: an HTTP server that stays quiet about connections a test breaks on purpose,
and the relay of an upstream answer back to the client."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class QuietServer(ThreadingHTTPServer):
    """Handler threads die with the test; HTTPServer already rebinds a port it just closed."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client killed mid-request, or a connection closed unanswered, is the point, not a failure


def relay(handler: BaseHTTPRequestHandler, answer: httpx.Response) -> None:
    """Send ``answer`` (status, content type and body) to ``handler``'s client."""
    handler.send_response(answer.status_code)
    handler.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
    handler.send_header("Content-Length", str(len(answer.content)))
    handler.end_headers()
    handler.wfile.write(answer.content)
