"""A worker's inference endpoints as a setting names them: ``DRAFTLINE_INFERENCE_URL`` and
``DRAFTLINE_HIDDEN_STATES_URL`` hold one base URL or several, comma-separated (one inference server per GPU, or
per host). Which one a client asks next is ``runtime.endpoint_pool``'s business."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator



class EndpointListError(ValueError):
    """A list of inference endpoints that cannot be used: an empty entry, a non-HTTP URL, a repeat."""


def server_root(base_url: str) -> str:
    """The server root whether the setting names it or its ``/v1``."""
    return base_url.strip().rstrip("/").removesuffix("/v1")


def parse_endpoints(value: str) -> tuple[str, ...]:
    """The server roots of a comma-separated list of base URLs; raise ``EndpointListError`` naming the entry."""
    entries = [entry.strip() for entry in value.split(",")]
    roots: list[str] = []
    for number, entry in enumerate(entries, start=1):
        where = f"entry {number} of {len(entries)}" if len(entries) > 1 else "the URL"
        if not entry:
            raise EndpointListError(f"{where} is empty (expected base URLs separated by commas)")
        parts = urlsplit(entry)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointListError(f"{where} ({entry!r}) is not an http:// or https:// URL with a host")
        root = server_root(entry)
        if root in roots:
            raise EndpointListError(f"{where} ({entry!r}) repeats {root} (each server is listed once)")
        roots.append(root)
    return tuple(roots)


def endpoint_list(value: str) -> str:
    """Pydantic validator of an endpoint-list setting: checks it and keeps it as written, minus blanks."""
    parse_endpoints(value)
    return ",".join(entry.strip() for entry in value.split(","))


# A settings field naming one base URL or several, comma-separated.
EndpointList = Annotated[str, AfterValidator(endpoint_list)]
