"""The export directory's manifest, and the ExecuTorch import check (no torch import here, so the
CLI can validate an export before loading anything)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_robot.errors import ConfigError

MANIFEST = "manifest.json"
FORMAT = "dflash-robot-executorch/1"
INSTALL_HINT = ("ExecuTorch is not installed; install the optional extra: pip install 'dflash-robot[executorch]' "
                "(executorch 1.5.1, which pairs with torch 2.13)")


def require_executorch() -> None:
    try:
        import executorch  # noqa: F401
        from executorch.runtime import Runtime  # noqa: F401
    except ImportError as e:
        raise ConfigError(INSTALL_HINT) from e


def read_manifest(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    f = p / MANIFEST
    if not p.is_dir() or not f.is_file():
        raise ConfigError(f"{p} is not an ExecuTorch export directory (no {MANIFEST}); "
                          "make one with `dflash-robot export executorch`")
    try:
        m = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from e
    if m.get("format") != FORMAT:
        raise ConfigError(f"{f}: format {m.get('format')!r}, expected {FORMAT!r}")
    for name in ("target.pte", "draft.pte"):
        if not (p / name).is_file():
            raise ConfigError(f"{p / name} is missing")
    return m
