"""What a compute centre's sessions leave behind in its memory (issue 37,
item 18): the working memory a session's thread frees goes back to the OS
instead of staying in that thread's malloc arena, which made each more LoRA
tenant cost ten times what the planner counts (``bench/tenants.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A session's step in a process that has read a base: one big block freed
# (glibc then raises its mmap threshold to that size), then on a session's
# thread blocks of a MiB (activations, temporaries) between small ones that
# stay (adapter state, Python objects), and the big ones freed. Prints the
# MiB that freeing them gave back to the OS.
STEP = """
import sys, threading
from aisyn.split.centre.server import return_large_blocks_to_os

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

if sys.argv[1] == "serve" and not return_large_blocks_to_os():
    sys.exit("not pinned")
base = bytearray(16 << 20)
del base
returned = []

def session():
    kept, temporaries = [], []
    for _ in range(64):
        temporaries.append(bytearray(1 << 20))
        kept.append(bytearray(64 << 10))
    before = rss()
    temporaries.clear()
    returned.append((before - rss()) / 2**20)

thread = threading.Thread(target=session)
thread.start()
thread.join()
print(returned[0])
"""


def returned_mib(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", STEP, mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


@pytest.mark.heavy
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's allocator and /proc"
)
def test_a_sessions_freed_working_memory_goes_back_to_the_os():
    # glibc's own policy keeps all 64 MiB (the blocks are holes in the
    # thread's arena): what each tenant held for nothing
    assert returned_mib("default") < 16
    # the compute party's: every one of them is returned
    assert returned_mib("serve") >= 60


def test_split_serve_returns_freed_memory_before_it_loads_anything(
    tmp_path, monkeypatch, capsys
):
    """``aisyn split serve`` sets the policy first, before any session's
    thread (or the base) allocates; here it then stops at a bad tenants file."""
    import aisyn.split.centre.server as server
    from aisyn.cli import main

    calls = []
    monkeypatch.setattr(server, "return_large_blocks_to_os", lambda: calls.append(1))
    bad = tmp_path / "tenants.toml"
    bad.write_text("[tenant.a]\nweight = 1\n")
    argv = ["split", "serve", "--listen", "127.0.0.1:0", "--model", "200B"]
    assert main([*argv, "--insecure", "--tenants", str(bad)]) == 2
    assert "nothing identifies it" in capsys.readouterr().err
    assert calls == [1]
