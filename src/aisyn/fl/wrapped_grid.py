"""``WrappedGrid``: a Flower ``Grid`` in front of another, which a strategy (or
Flower's SecAgg+ workflow) uses as the Grid itself. The exchanges it is for
(``handles``) take its own path (``exchange``); every other exchange, and every
other call (node IDs, the run, creating messages), passes through to ``grid``.

The server's wrappers: ``chunked_grid.ChunkedGrid`` (the model chunk by chunk),
``secure.SecAggPlusGrid`` (a train round as SecAgg+) and the screen of its
masked vectors.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid


class WrappedGrid:
    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        messages = list(messages)
        if not messages or not self.handles(messages):
            return self.grid.send_and_receive(messages, timeout=timeout)
        return self.exchange(messages, timeout)

    def handles(self, messages: list[Message]) -> bool:
        """Whether this exchange (never empty) takes this Grid's own path."""
        raise NotImplementedError

    def exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """This Grid's own path: the replies to ``messages``."""
        raise NotImplementedError
