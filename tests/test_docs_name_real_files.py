"""The architecture doc and the README's layout name files that exist: a
module moved or removed without its docs fails here, not in a reader's hands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "aisyn"
#: `a/b.py`, `b.py`, `link.proto` -- a file named in backquotes
FILE = re.compile(r"`((?:[a-z_0-9]+/)*[a-z_0-9]+\.(?:py|proto))`")
#: the layers table's packages: | what | `pkg`, `pkg2` | ...
PACKAGES = re.compile(r"^\| [^|]+ \| ((?:`[a-z_]+`(?:, )?)+) \|", re.M)


def named_files(doc: Path) -> set[str]:
    return set(FILE.findall(doc.read_text(encoding="utf-8")))


def exists(name: str) -> bool:
    """A path under the repository, under ``src/aisyn``, or (a bare file
    name, as a row about one package writes it) some file of ``src/aisyn``."""
    if (ROOT / name).exists() or (SRC / name).exists():
        return True
    return "/" not in name and any(SRC.rglob(name))


@pytest.mark.parametrize("doc", ["docs/architecture.md", "README.md"])
def test_every_file_a_doc_names_exists(doc):
    names = named_files(ROOT / doc)
    assert names, f"{doc} names no files: the pattern no longer matches"
    assert sorted(n for n in names if not exists(n)) == []


def test_every_package_of_the_layers_table_exists():
    text = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    packages = {
        p for row in PACKAGES.findall(text) for p in re.findall(r"`([a-z_]+)`", row)
    }
    assert {"train", "split", "fl", "splitfed", "link", "model"} <= packages
    missing = [
        p
        for p in sorted(packages)
        if not (SRC / p).is_dir() and not (SRC / f"{p}.py").is_file()
    ]
    assert missing == []


def test_every_module_the_readme_layout_names_exists():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = text[text.index("## Layout") :].split("```")[1]
    names = set(re.findall(r"\b([a-z_0-9]+\.py)\b", layout))
    folders = set(re.findall(r"^  ([a-z_]+)/ ", layout, re.M))
    assert {"guard.py", "federation.py", "consortium.py"} <= names
    assert sorted(n for n in names if not exists(n)) == []
    assert sorted(f for f in folders if not (SRC / f).is_dir()) == []
    # and every package of src/aisyn has its line
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(packages - folders) == []
