"""Build every model the tests cache (tests/support/tiny_target.py's cache), before pytest starts.

`make test` runs this as set-up, like the vLLM environment and the Docker images: a build is minutes of
one-thread training on a fresh machine (the rule target, tests/engines/target_rule.py, about ten on two
cores), and inside a test it would count against that test's time-out. On a machine that has them it
checks each entry's manifest and builds nothing. A fixture still builds a missing model itself, so a
single test run without `make` works, slowly the first time."""

from __future__ import annotations

import logging
import time

from tests.engines.target64 import cached_tiny64
from tests.engines.target_mla import cached_tiny_mla
from tests.engines.target_rule import cached_tiny_rule
from tests.engines.target_think import cached_tiny_think
from tests.support.smollm2_target import cached_smollm2
from tests.support.tiny_target import cache_root, cached_tiny_model

log = logging.getLogger("draftline.tests.cached_models")

BUILDERS = (cached_tiny_model, cached_tiny64, cached_tiny_mla, cached_tiny_think, cached_tiny_rule, cached_smollm2)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="cached-models: %(message)s")
    for build in BUILDERS:
        start = time.monotonic()
        path = build()
        log.info("%s in %.0f s", path, time.monotonic() - start)
    log.info("every test model is in %s", cache_root())


if __name__ == "__main__":
    main()
