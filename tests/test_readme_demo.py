"""scripts/check_readme_demo.py finds the README's demo block, tells a stale one
from a current one, and --update rewrites just that block (the demo itself,
6 minutes, is not run here)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "check_readme_demo", ROOT / "scripts" / "check_readme_demo.py"
)
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def _quoted(readme: Path) -> str:
    first, end = check.find_block(readme.read_text(encoding="utf-8"))
    return "".join(readme.read_text(encoding="utf-8").splitlines(True)[first:end])


def test_the_readme_quotes_a_demo_block():
    block = _quoted(ROOT / "README.md")

    assert block.startswith("test loss ") and "greedy completion of" in block


def test_a_stale_block_is_reported_and_updated(tmp_path, capsys):
    readme = tmp_path / "README.md"
    original = (ROOT / "README.md").read_text(encoding="utf-8")
    readme.write_text(original, encoding="utf-8")
    printed = tmp_path / "demo.txt"
    new = _quoted(ROOT / "README.md").replace("test loss ", "test loss 9", 1)
    printed.write_text(new, encoding="utf-8")
    argv = ["--readme", str(readme), "--output", str(printed)]

    assert check.main(argv) == 1
    assert "+test loss 9" in capsys.readouterr().out
    assert readme.read_text(encoding="utf-8") == original  # untouched
    assert check.main([*argv, "--update"]) == 0
    assert _quoted(readme) == new
    after = readme.read_text(encoding="utf-8")
    assert after.replace(new, "") == original.replace(_quoted(ROOT / "README.md"), "")
    assert check.main(argv) == 0
