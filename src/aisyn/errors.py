"""Which exceptions are the user's to fix (one-line message) rather than bugs."""

from __future__ import annotations


class RunFailedError(RuntimeError):
    """A run ended without a result for a reason its message names (e.g. a
    federated run whose processes failed: see the log it points to)."""


# ValueError covers the project's own input errors (CorpusError, ShardError,
# TokenizerError, CheckpointError, ClozeError all derive from it); OSError covers
# missing files, existing outputs and busy ports.
_errors: list[type[BaseException]] = [
    ValueError,
    OSError,
    FloatingPointError,
    RunFailedError,
]
try:
    from aisyn.link.errors import LinkError

    _errors.append(LinkError)
except ImportError:  # the link package is optional at this layer
    pass

USER_ERRORS: tuple[type[BaseException], ...] = tuple(_errors)
