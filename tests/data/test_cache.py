"""aisyn.data.cache: a cache several processes share builds each entry once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from aisyn.data.cache import write_atomic

# Waits at a barrier (so both processes ask for the entry at once), then asks
# for one cache entry whose build takes a second and says it ran.
CHILD = """
import sys, time
from pathlib import Path
from aisyn.testbed.inputs import _cached_data

shared, me = Path(sys.argv[1]), sys.argv[2]
(shared / f"ready-{me}").touch()
deadline = time.monotonic() + 60
while not (shared / "go").exists():
    if time.monotonic() > deadline:
        sys.exit("no go")
    time.sleep(0.01)

def build(path):
    with (shared / "builds").open("a") as f:
        f.write(me + "\\n")
    time.sleep(1.0)
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text("{}")

print(_cached_data("t", "news", ["key"], "building %s in %s", build))
"""


@pytest.mark.heavy
def test_two_processes_wanting_one_entry_build_it_once(tmp_path):
    env = {**os.environ, "AISYN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline, "the children never got ready"
            assert all(p.poll() is None for p in procs), procs[0].stderr.read()
            time.sleep(0.01)
        (tmp_path / "go").touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    # both got the one entry; one built it, the other waited for it
    assert len({o.strip() for o, _ in outs}) == 1
    assert len((tmp_path / "builds").read_text().split()) == 1


def test_an_atomic_write_leaves_the_whole_file_and_nothing_else(tmp_path):
    path = tmp_path / "entry.jsonl"
    write_atomic(path, "a\nb")
    write_atomic(path, b"c")  # replaces it
    assert path.read_bytes() == b"c"
    assert [p.name for p in tmp_path.iterdir()] == ["entry.jsonl"]
