"""Where derived artefacts (segmented text, base models) are memoised.

``$AISYN_CACHE`` if set, else ``~/.cache/aisyn``. Everything here can be deleted
at any time; it is rebuilt on demand.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    root = Path(os.environ.get("AISYN_CACHE") or Path.home() / ".cache" / "aisyn")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
