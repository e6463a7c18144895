"""The process's file-descriptor limit, which a flood of idle connections
exhausts before anything else.

Many systems start processes with a soft limit of 1 024 descriptors though
the hard limit allows far more; a server that holds a thousand idle
connections there stops accepting anyone (gRPC's listener logs "File
descriptor limit reached" and retries; a thread calling ``accept`` fails). So
a server raises its soft limit towards the hard one, as far as what it means
to hold needs, and learns how much it may hold where that is not enough.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

#: descriptors left for everything else the process opens (files, sessions)
SPARE_FDS = 256


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: assume a modest process
        return 64


def ensure_fd_headroom(wanted: int, what: str) -> int:
    """Make room for ``wanted`` more descriptors beside those open now and
    :data:`SPARE_FDS` more (raising the soft limit if the hard one allows);
    returns how many of ``wanted`` fit (at least 2)."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = _open_fds()
    need = in_use + wanted + SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(hard, need)
        if raised > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            except (ValueError, OSError) as exc:
                log.debug("cannot raise the descriptor limit: %s", exc)
            else:
                log.info(
                    "raised this process's open-file limit from %d to %d for %s",
                    soft,
                    raised,
                    what,
                )
                soft = raised
    if soft == resource.RLIM_INFINITY:
        return wanted
    fits = soft - in_use - SPARE_FDS
    if fits < wanted:
        fits = max(2, fits)
        log.warning(
            "the open-file limit (%d; hard limit %s) leaves room for %d of the "
            "%d idle connections %s should withstand; raise it with `ulimit -n`",
            soft,
            "unlimited" if hard == resource.RLIM_INFINITY else hard,
            fits,
            wanted,
            what,
        )
        return fits
    return wanted
