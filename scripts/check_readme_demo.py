#!/usr/bin/env python
"""Check the README's ``aisyn demo`` figures against what the demo prints.

    python scripts/check_readme_demo.py            # run the demo (~6 min), diff
    python scripts/check_readme_demo.py --update   # ... and rewrite the README block
    python scripts/check_readme_demo.py --output demo.txt [--update]
                                                   # a saved stdout instead of a run

The README quotes the demo's stdout in the fenced block that starts with
``test loss``. The demo runs in a temporary folder; its run path is shown as
the README's ``runs/demo`` (the demo's default ``--out``). Exit status: 0 when
the block matches (or was updated), 1 when it differs (the diff is printed).
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = "```"
FIRST_LINE = "test loss "  # how the demo's block begins
DEFAULT_OUT = "runs/demo"


def find_block(text: str) -> tuple[int, int]:
    """(first, end) line indices of the demo block's body in ``text``."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip() == FENCE and lines[i + 1].startswith(FIRST_LINE):
            for j in range(i + 1, len(lines)):
                if lines[j].strip() == FENCE:
                    return i + 1, j
            break
    raise SystemExit(
        f"{README}: no fenced block starting with {FIRST_LINE!r} (the demo's output)"
    )


def run_demo(extra: list[str]) -> str:
    """The demo's stdout, its temporary run path shown as ``runs/demo``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "demo")
        proc = subprocess.run(
            [sys.executable, "-m", "aisyn.cli", "demo", "--out", out, *extra],
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"aisyn demo failed (exit {proc.returncode})")
        return proc.stdout.replace(out, DEFAULT_OUT)


def compare(readme: Path, output: str, *, update: bool) -> int:
    text = readme.read_text(encoding="utf-8")
    first, end = find_block(text)
    lines = text.splitlines(keepends=True)
    quoted = [line.rstrip("\n") for line in lines[first:end]]
    printed = output.rstrip("\n").splitlines()
    if quoted == printed:
        print(f"{readme.name}: the demo block matches the demo's output")
        return 0
    sys.stdout.writelines(
        line + "\n"
        for line in difflib.unified_diff(
            quoted, printed, "README.md (quoted)", "aisyn demo (printed)", lineterm=""
        )
    )
    if not update:
        print(f"{readme.name}: the demo block is stale; rerun with --update")
        return 1
    lines[first:end] = [line + "\n" for line in printed]
    tmp = readme.with_name(readme.name + ".tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, readme)  # a reader never sees half a README
    print(f"{readme.name}: demo block updated (check the prose around it)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--update", action="store_true", help="rewrite the README block")
    p.add_argument(
        "--output", type=Path, help="compare this saved demo stdout instead of a run"
    )
    p.add_argument("--readme", type=Path, default=README, help="the README to check")
    p.add_argument(
        "demo_args",
        nargs=argparse.REMAINDER,
        help="after --: flags for aisyn demo (the README quotes the defaults)",
    )
    args = p.parse_args(argv)
    extra = [a for a in args.demo_args if a != "--"]
    if args.output is not None:
        output = args.output.read_text(encoding="utf-8")
    else:
        output = run_demo(extra)
    return compare(args.readme, output, update=args.update)


if __name__ == "__main__":
    sys.exit(main())
