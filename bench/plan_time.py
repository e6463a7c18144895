"""How long ``aisyn split plan`` takes on the reference's largest plan (issue
37, item 8): the 200B plan of ``bench/scale.py`` (16 x 80 GB for the data
party, 61 x 80 GB for the compute party), run as a user runs it, in its own
process (imports included), until its last line is printed. Goal: <= 10 s.

    python bench/plan_time.py            # the seconds, and the lines printed
    python bench/plan_time.py --runs 3   # the fastest of 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

COMMAND = [
    *("split", "plan", "--model", "200B"),
    *("--party", "A:1:16x80GB", "--party", "B:8:61x80GB"),
    *("--batch-size", "128", "--micro-batch-size", "16", "--schedule", "window"),
]
GOAL_S = 10.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="report the fastest")
    args = ap.parse_args()
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    times, out = [], ""
    for _ in range(args.runs):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "aisyn.cli", *COMMAND],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
        )
        times.append(time.perf_counter() - start)
        out = done.stdout
    best = min(times)
    print(f"aisyn {' '.join(COMMAND)}")
    print(
        f"plan 200B (16 + 61 ranks): {best:.2f} s to the last line "
        f"(fastest of {args.runs}; goal <= {GOAL_S:.0f} s: "
        f"{'met' if best <= GOAL_S else 'missed'}), {len(out.splitlines())} lines"
    )


if __name__ == "__main__":
    main()
