"""The code a target directory ships, run only when the operator allows it (``DRAFTLINE_TRUST_REMOTE_CODE``).

Some targets' tokenizer or model is Python inside the model directory, named by ``auto_map`` in
``tokenizer_config.json`` or ``config.json``: Kimi-K2.5's tokenizer is ``tokenization_kimi.py`` over
tiktoken. transformers runs such code only when called with ``trust_remote_code=True``; with ``False`` it
raises a bare ``ValueError``, and with the argument left out it first asks on stdin, which a worker
does not have. Every draftline loader of the target therefore passes the setting explicitly, through
``load_from_target``, which turns the refusal into ``RemoteCodeRefused`` naming the setting.

Nothing heavy is imported here: the caller passes its loader (``AutoTokenizer.from_pretrained``, …).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from shared.atomic import read_json
from shared.errors import RemoteCodeRefused

SETTING = "DRAFTLINE_TRUST_REMOTE_CODE"
CODE_CONFIGS = ("tokenizer_config.json", "config.json")

T = TypeVar("T")


def shipped_code(model_dir: Path) -> list[str]:
    """``"<config file>: <Auto class> -> <module.Class>"`` for each ``auto_map`` entry of the directory."""
    found = []
    for name in CODE_CONFIGS:
        try:
            auto_map = read_json(Path(model_dir) / name).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        for auto_class, reference in auto_map.items():
            found.append(f"{name}: {auto_class} -> {reference}")
    return found


def load_from_target(load: Callable[..., T], model_dir: Path, *, trust_remote_code: bool, **kwargs: object) -> T:
    """``load(model_dir, trust_remote_code=trust_remote_code, **kwargs)``; RemoteCodeRefused where it fails
    without trust and the directory ships code of its own."""
    try:
        return load(model_dir, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as exc:
        code = shipped_code(model_dir)
        if trust_remote_code or not code:
            raise
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RemoteCodeRefused(
            f"{model_dir} loads through code of its own ({'; '.join(code)}), which draftline runs only with "
            f"{SETTING}=true: set it for a target directory you trust (transformers: {first_line})"
        ) from None
