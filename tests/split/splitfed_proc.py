"""A SplitFed consortium in its own process, for a test to kill:
``python splitfed_proc.py BASE OUT NAME=SFT_DIR ...`` runs the settings of
``test_splitfed_resume``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from test_splitfed_resume import settings  # noqa: E402

from aisyn.splitfed.run import run_splitfed  # noqa: E402

if __name__ == "__main__":
    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    parties = dict(arg.split("=", 1) for arg in sys.argv[3:])
    run_splitfed(base, parties, out, settings(), log_every=1)
