"""``aisyn demo`` can be resumed: an interrupted demo goes on from its last
checkpoint and prints what an uninterrupted one prints; a finished one re-run
prints its results without training again."""

from __future__ import annotations

import functools
import json

import pytest

from aisyn.cli import main

SMALL = ["--steps", "6", "--max-docs", "150"]
# A model whose steps take milliseconds (the demo's positions: 128).
MICRO = {
    "vocab_size": 8000,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "ffn_size": 64,
    "seq_len": 128,
}


def demo(out, capsys, *extra) -> tuple[int, str, str]:
    model = out.parent / "micro.json"
    if not model.exists():
        model.write_text(json.dumps(MICRO))
    code = main(["demo", "--out", str(out), *SMALL, "--model", str(model), *extra])
    captured = capsys.readouterr()
    return code, captured.out.replace(str(out), "OUT"), captured.err


@pytest.mark.heavy
def test_an_interrupted_demo_resumes_and_a_finished_one_is_not_redone(
    tmp_path, capsys, caplog, monkeypatch
):
    import aisyn.demo
    from aisyn.train.regime import Regime

    # a few cloze items: the demo's flow is under test, not the evaluation
    evaluate_run = functools.partial(aisyn.demo.evaluate_run, max_items=8)
    monkeypatch.setattr(aisyn.demo, "evaluate_run", evaluate_run)
    # at once: 6 steps are fewer than CKPT_EVERY, a checkpoint at the end only
    code, whole, _ = demo(tmp_path / "whole", capsys)
    assert code == 0 and "greedy completion of" in whole

    monkeypatch.setattr(aisyn.demo, "CKPT_EVERY", 2)
    save = Regime.save

    def interrupted_after_step_4(self, step, state):
        save(self, step, state)
        if step == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(Regime, "save", interrupted_after_step_4)
    out = tmp_path / "demo"
    code, printed, err = demo(out, capsys)
    assert code == 130 and "interrupted" in err and printed == ""

    monkeypatch.setattr(Regime, "save", save)
    with caplog.at_level("INFO"):
        code, printed, _ = demo(out, capsys)
    messages = [r.getMessage() for r in caplog.records]
    assert code == 0
    assert any("prepared already" in m for m in messages), messages
    assert any("resumed from" in m and "(step 4)" in m for m in messages), messages
    assert printed == whole  # the same model, figures and completion

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished demo ran again")

    for step in ("prepare", "train", "evaluate_run", "load_generator"):
        monkeypatch.setattr(aisyn.demo, step, must_not_run)
    code, printed, _ = demo(out, capsys)
    assert code == 0 and printed == whole


def test_a_folder_of_another_demo_or_of_something_else_is_refused(tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "demo.json").write_text(
        json.dumps({"settings": {"steps": 6, "max_docs": 150, "model": "tiny"}})
    )
    code, _, err = demo(out, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"aisyn: error: {out}: holds a demo of --steps 6 --max-docs 150 --model "
        "tiny; give those to resume it, or pass --overwrite or another --out"
    ]
    (out / "demo.json").unlink()
    (out / "notes.txt").write_text("mine")
    code, _, err = demo(out, capsys)
    assert code == 2 and "holds something else than a demo" in err
    assert (out / "notes.txt").read_text() == "mine"
