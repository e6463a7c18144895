"""A prepared data folder's life cycle, shared by token shards and SFT data.

A folder is built as ``OUT.partial`` and swapped in only when complete, so a
crash leaves the old folder (or nothing), never half of one. Its
``manifest.json`` names its format, which the reader checks first; its files'
SHA-256 are in the manifest; its tokenizer travels with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

from aisyn.validate import read_json

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.model"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def start_folder(out_dir: str | Path, overwrite: bool | None) -> tuple[Path, Path]:
    """(out, empty staging folder beside it); refuses a non-empty ``out``
    unless ``overwrite`` (None: the command offers no --overwrite)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        hint = "" if overwrite is None else " or pass --overwrite"
        raise FileExistsError(
            f"{out}: exists and is not empty; choose another --out{hint}"
        )
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return out, tmp


def seal_folder(tmp: Path, manifest: dict, tokenizer: Path) -> None:
    """Write the manifest and a copy of the tokenizer into ``tmp``."""
    shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False))


def finish_folder(tmp: Path, out: Path, manifest: dict, tokenizer: Path) -> None:
    """Seal ``tmp``, then make it ``out``."""
    seal_folder(tmp, manifest, tokenizer)
    publish_dir(tmp, out)


def publish_dir(tmp: Path, out: Path, old: Path | None = None) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing an old one only
    once the new one is complete (a crash leaves the old one or ``old``,
    by default ``out.old``)."""
    if out.exists():
        old = old or out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def read_manifest(
    data_dir: str | Path, fmt: str, error: type[ValueError], command: str
) -> dict:
    """The manifest of a folder ``aisyn COMMAND`` made in format ``fmt``;
    ``error`` naming the problem otherwise."""
    path = Path(data_dir) / MANIFEST
    if not Path(data_dir).is_dir():
        raise error(f"{data_dir}: data folder not found (run `aisyn {command}`)")
    if not path.is_file():
        raise error(f"{path}: no manifest; not a folder made by `aisyn {command}`")
    try:
        m = read_json(path, error=error)
    except ValueError as e:
        raise error(f"corrupt manifest: {e}") from None
    if m.get("format") != fmt:
        raise error(
            f"{path}: format {m.get('format')!r}, not {fmt!r} (`aisyn {command}`)"
        )
    return m


@dataclass
class PreparedSplit:
    """One split of a prepared folder, opened: what token shards and SFT data
    share (their own fields follow these)."""

    #: each kind's: its manifest's format, its error, the command that makes it
    FORMAT: ClassVar[str]
    ERROR: ClassVar[type[ValueError]]
    COMMAND: ClassVar[str]

    data_dir: Path
    split: str
    manifest: dict

    @classmethod
    def open(
        cls,
        data_dir: str | Path,
        split: str = "train",
        *,
        tokenizer_sha256: str | None = None,
        seq_len: int | None = None,
        verify: bool = True,
    ) -> Self:
        """Split ``split`` of the folder ``data_dir``; ``ERROR`` if the folder
        was made with another tokenizer than ``tokenizer_sha256`` or for
        sequences a model of ``seq_len`` cannot take, or (``verify``) a file's
        SHA-256 is not the manifest's. Each kind's ``_open`` does its checks
        once the manifest is read, with these arguments."""
        data_dir = Path(data_dir)
        m = read_manifest(data_dir, cls.FORMAT, cls.ERROR, cls.COMMAND)
        try:
            return cls._open(data_dir, m, split, tokenizer_sha256, seq_len, verify)
        except (KeyError, TypeError, AttributeError) as e:
            # a manifest from elsewhere (or edited) that lacks what was written
            raise cls.ERROR(
                f"{data_dir / MANIFEST}: corrupt manifest (bad or missing {e})"
            ) from None

    @property
    def seq_len(self) -> int:
        return self.manifest["seq_len"]

    @property
    def tokenizer_info(self) -> dict:
        return self.manifest["tokenizer"]
