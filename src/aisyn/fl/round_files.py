"""What a client keeps of its own between rounds, one file per round it trained.

A client is a fresh process each round (or a function call in an in-process
grid), so state that must outlive a round -- SCAFFOLD's control variate
``c_i``, a kept local optimizer's moments -- lives in the client's run folder,
``<folder>/<prefix>-RRRRR.safetensors``. A round reads the newest file of an
*earlier* round: a round redone after a resumed federation finds the state it
started from, not the one it wrote before the kill. The newest few are kept.
Nothing here leaves the client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from aisyn.data.cache import write_atomic_with
from aisyn.train import checkpoint as ckpt

#: files of each kind kept (a resumed round reads the one before it)
KEEP = 3


@dataclass(frozen=True)
class RoundFiles:
    folder: str  # in the client's run folder
    prefix: str

    def path(self, out: Path, server_round: int) -> Path:
        return Path(out) / self.folder / f"{self.prefix}-{server_round:05d}.safetensors"

    def _rounds(self, out: Path) -> list[int]:
        folder = Path(out) / self.folder
        name = re.compile(rf"{re.escape(self.prefix)}-(\d{{5}})\.safetensors")
        return sorted(
            int(m.group(1))
            for f in (folder.iterdir() if folder.is_dir() else ())
            if (m := name.fullmatch(f.name))
        )

    def latest_before(self, out: Path, server_round: int) -> Path | None:
        """The file of the latest round before ``server_round`` that this
        client trained (None if none)."""
        rounds = [r for r in self._rounds(out) if r < server_round]
        return self.path(out, rounds[-1]) if rounds else None

    def read_before(self, out: Path, server_round: int) -> tuple[Path, dict] | None:
        """The file ``latest_before`` names and its tensors, or None;
        ValueError naming the file when it is damaged (truncated, not
        safetensors)."""
        path = self.latest_before(out, server_round)
        if path is None:
            return None
        try:
            return path, ckpt.read_tensors(path)
        except ckpt.CheckpointError as e:
            raise ValueError(str(e)) from None

    def save(
        self, out: Path, server_round: int, tensors: dict[str, torch.Tensor]
    ) -> None:
        """Write the tensors after ``server_round`` (atomically), keep the
        newest ``KEEP``."""
        tensors = {n: t.contiguous() for n, t in tensors.items()}
        write_atomic_with(
            self.path(out, server_round), lambda tmp: save_file(tensors, str(tmp))
        )
        for old in self._rounds(out)[:-KEEP]:
            self.path(out, old).unlink()
