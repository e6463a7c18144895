"""Which exceptions are the user's to fix (one-line message) rather than bugs."""

from __future__ import annotations

from aisyn.link.errors import LinkError


class RunFailedError(RuntimeError):
    """A run ended without a result for a reason its message names (e.g. a
    federated run whose processes failed: see the log it points to)."""


# ValueError covers the project's own input errors (CorpusError, ShardError,
# TokenizerError, CheckpointError, ClozeError all derive from it); OSError covers
# missing files, existing outputs and busy ports; LinkError a peer that failed,
# refused or went away.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    OSError,
    FloatingPointError,
    RunFailedError,
    LinkError,
)
