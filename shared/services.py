"""The one table of service commands: docker-compose.yml and ``make demo`` both run exactly these.

Each entry is the argv after the ``draftline`` console script. ``draftline serve <name>`` imports
``services.<name>.main`` and calls its ``main()``.
"""

from __future__ import annotations

SERVICE_NAMES = ("inference", "controller", "generator", "extractor", "trainer", "exporter")
# The services that are RQ workers: their health is their registration in Redis (``draftline worker-health``).
WORKER_ROLES = ("generator", "extractor", "trainer")

SERVICE_COMMANDS: dict[str, list[str]] = {name: ["draftline", "serve", name] for name in SERVICE_NAMES}
