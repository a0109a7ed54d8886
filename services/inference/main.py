"""``draftline serve inference``: load settings, configure logging, serve the app."""

from __future__ import annotations

import uvicorn

from services.inference.app import create_app
from shared.settings import InferenceSettings, configure_logging, load_settings


def main() -> None:
    settings = load_settings(InferenceSettings)
    configure_logging(settings.log_level)
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())


if __name__ == "__main__":
    main()
