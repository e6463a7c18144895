"""``aisyn split train --defence recommended``: the recommended cut defence
(``split.defence.cut_dp.RECOMMENDED``), its clipping bounds calibrated at the data party
before the run starts, as ``aisyn privacy calibrate`` calibrates them; and a
trained bottleneck's (``split.defence.bottleneck``) centre and bound, calibrated on the
same public text through A's own front as the run starts.

Where the calibration's text and model come from, and why:

* the text is the built-in public corpus (``split.defence.calibration``), encoded
  with the run's own tokenizer: never A's rows, so nothing of A's data sets
  the bounds (the accounting takes them for constants), and the user needs
  no file of public text;
* the model is the run's start: the base of ``--init-from`` (read whole,
  once, and freed: calibration needs B's blocks too, which the public base
  holds) or the seeded init both parties start from (A knows the seed);
* it all happens at A. B is told nothing new: it sees the defended tensors,
  exactly as under the equivalent ``--dp-*`` flags.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from aisyn.data.tokenizer import open_tokenizer
from aisyn.model.families import ModelConfig, build_model
from aisyn.split.defence import cut_dp as dp
from aisyn.split.defence.bottleneck import Bottleneck
from aisyn.split.defence.calibration import CALIBRATION_ROWS, calibrate, public_rows
from aisyn.split.party import PartyState
from aisyn.train.config import TrainConfig
from aisyn.train.memory import check_fits, whole_model_bytes
from aisyn.train.models import load_model_checkpoint
from aisyn.train.run import RunDir

log = logging.getLogger("aisyn.split")


def recorded_defence(request: dp.Recommended, out: str | Path) -> dp.CutDefence:
    """On ``--resume``: the run's own calibrated defence (its budget spans the
    run), if it was started with ``--defence recommended``; with no defence
    flag given (``request.implied``), whatever defence the run started with."""
    recorded = dp.CutDefence.from_dict(RunDir(out).read_config().get("cut_defence"))
    if request.implied:  # no defence flag given: the run keeps what it had
        return recorded
    if not request.matches(recorded):
        raise ValueError(
            f"{out}: trained with cut defence {recorded.describe()}, not "
            "--defence recommended; resume it with the same defence flags (its "
            "privacy budget is accounted over the whole run)"
        )
    return recorded


def calibrated_defence(
    request: dp.Recommended,
    mcfg: ModelConfig,
    cut: str,
    tokenizer_info: dict,
    tokenizer_file: Path,
    seq_len: int,
    cfg: TrainConfig,
    init_from: str | Path | None,
    device: torch.device,
) -> dp.CutDefence:
    """``RECOMMENDED`` noise at bounds measured on public text at ``cut``,
    with the model the run starts from, in steps of the run's batch size, on
    rows of the run's ``seq_len``."""
    rows_at_once = _rows_at_once(mcfg, cfg, seq_len, device)
    tokenizer = open_tokenizer(tokenizer_file, tokenizer_info)
    rows = public_rows(tokenizer, seq_len, max(CALIBRATION_ROWS, cfg.batch_size))
    if len(rows) < cfg.batch_size:
        raise ValueError(
            f"--defence recommended: the built-in public text makes {len(rows)} "
            f"rows of {seq_len + 1} tokens, less than one batch of "
            f"{cfg.batch_size}; calibrate on your own public text (aisyn privacy "
            "calibrate --public) and give the --dp-* flags"
        )
    if init_from is None:
        model = build_model(mcfg, seed=cfg.seed)
    else:
        model = build_model(mcfg, device="meta")
        try:
            load_model_checkpoint(model, init_from)
        except ValueError as e:  # e.g. a base that holds A's tensors only
            raise ValueError(
                f"--defence recommended calibrates on the whole base model: {e}"
            ) from None
    model = model.to(device).eval().requires_grad_(False)
    clips = calibrate(model, rows.to(device), cut, cfg.batch_size, rows_at_once)
    del model
    backward = clips.backward if request.gradient else None
    defence = dp.recommended_defence(
        clips.forward, backward, request.delta, request.bottleneck
    )
    log.info(
        "cut defence: recommended, calibrated on %d rows of public text "
        "(the same run as --dp-forward-clip %r --dp-forward-noise %g%s)",
        len(rows) - len(rows) % cfg.batch_size,
        clips.forward,
        dp.RECOMMENDED.forward,
        f" --dp-backward-clip {clips.backward!r} --dp-backward-noise "
        f"{dp.RECOMMENDED.backward:g}"
        if request.gradient
        else "; no gradient crosses",
    )
    return defence


def _rows_at_once(
    mcfg: ModelConfig, cfg: TrainConfig, seq_len: int, device: torch.device
) -> int:
    """A whole batch per pass where the whole (frozen) model and its
    activations fit (fewer, larger passes are faster), else a micro-batch;
    ValueError if not even that fits."""
    what = "calibrating --defence recommended (the whole model, as the run starts)"

    def need(rows: int) -> float:
        return whole_model_bytes(mcfg, rows, seq_len, "fp32", trains_all_weights=False)

    try:
        check_fits(need(cfg.batch_size), device, what)
        return cfg.batch_size
    except ValueError:
        check_fits(need(cfg.micro), device, what)
        return cfg.micro


def attach_bottleneck(state: PartyState, defence: dp.CutDefence) -> Bottleneck | None:
    """A defence's trained bottleneck, attached to the data party's state (its
    parameters trained and saved with A's), or None without one."""
    if defence.bottleneck is None:
        return None
    bottleneck = Bottleneck(
        defence.bottleneck, state.cfg.seq_len, state.cfg.hidden_size
    )
    state.attach("bottleneck", bottleneck)
    return bottleneck


@torch.no_grad()
def calibrate_bottleneck(
    bottleneck: Bottleneck,
    state: PartyState,
    tokenizer_info: dict,
    tokenizer_file: Path,
    seq_len: int,
) -> None:
    """The bottleneck's centre and bound from the built-in public text through
    A's front as the run starts (its weights in place: the base's, the seeded
    init's or a private warm-up's), a micro-batch at a time."""
    tokenizer = open_tokenizer(tokenizer_file, tokenizer_info)
    rows = public_rows(tokenizer, seq_len, CALIBRATION_ROWS)
    front = state.segments[0]
    was = front.training
    front.eval()
    micro = state.train_cfg.micro
    outputs = torch.cat(
        [
            front(chunk[:, :-1].to(state.device), None, None).float()
            for chunk in rows.split(micro)
        ]
    )
    front.train(was)
    bottleneck.calibrate(outputs)
    log.info(
        "trained bottleneck at the cut: centred and clipped per token to R = %.4g "
        "(median on %d rows of public text), noise at least %g x R/sqrt(H) per "
        "coordinate, capacity term weight %g",
        float(bottleneck.radius),
        len(rows),
        bottleneck.spec.floor,
        bottleneck.spec.beta,
    )
