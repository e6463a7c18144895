"""Where derived artefacts (segmented text, base models) are memoised.

``$AISYN_CACHE`` if set, else ``~/.cache/aisyn``. Everything here can be deleted
at any time; it is rebuilt on demand. Several processes may share it (two
comparisons, an audit beside a comparison, two test workers): an entry is
written whole under a name of its own and renamed into place, and an entry
built at length is built under a lock, once.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir(*parts: str) -> Path:
    root = Path(os.environ.get("AISYN_CACHE") or Path.home() / ".cache" / "aisyn")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: Path, data: str | bytes) -> None:
    """``data`` into ``path``, whole or not at all: through a temporary file
    of this writer's own (a fixed ``.tmp`` name is one two writers of the
    same entry would share: one renames the other's half-written file)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    write_atomic_with(path, lambda tmp: tmp.write_bytes(raw))


def write_atomic_with(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` into a temporary file of this writer's own, renamed to
    ``path`` once written (for writers that take a file name, such as
    safetensors' ``save_file``, which would otherwise build the bytes in
    memory first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def building(entry: Path) -> Iterator[None]:
    """Hold ``entry``'s build lock: of the processes that want an entry not
    yet built, the first builds it and the others wait, then find it built
    (without it each built its own in one staging folder, removing the
    other's). The caller checks for the finished entry inside the lock."""
    lock = entry.with_name(entry.name + ".lock")
    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another process is building it; waiting", entry)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock
