"""What a split run's options may be, each refused in one line before anything
is built: the base it starts from, the pipeline, a frozen backbone, the
private warm-up, and -- for ``--resume`` -- one compatibility check per
component of the recorded run (kind, objective, defence, backbone, methods).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from aisyn.model.families import ModelConfig, hf_folder
from aisyn.split.client.data_ranks import DataRanks
from aisyn.split.defence import cut_dp as dp
from aisyn.split.party import run_methods
from aisyn.split.session import SplitOptions
from aisyn.train.config import TrainConfig
from aisyn.train.lora import Method
from aisyn.train.objective import LMObjective, SFTObjective
from aisyn.train.run import RunDir

#: the options of a frozen backbone a resumed run must keep (key -> flag)
FROZEN_FLAGS = {
    "backbone": "--backbone",
    "front_via": "--front-via",
    "emulator_blocks": "--emulator-blocks",
}


def base_of(
    model_config: ModelConfig | str | Path,
    init_from: str | Path | None,
    out: str | Path,
    opts: SplitOptions,
    methods: tuple[Method, Method],
    *,
    sft: bool,
    resume: bool,
) -> str | Path | None:
    """The base model the run starts from (None: a seeded init): ``init_from``,
    a pretrained ``--model`` folder, or what a resumed run recorded when it
    needs one (LoRA's base, a frozen backbone's, the warm-up's emulator's).
    Refuses a base that does not exist, and LoRA or ``--sft`` without one."""
    if init_from is None and isinstance(model_config, str | Path):
        if hf_folder(model_config) is not None:
            init_from = model_config  # a pretrained folder brings its weights
    if init_from is not None and not (hf_folder(init_from) or Path(init_from)).exists():
        raise ValueError(
            f"--init-from {init_from}: no such base model (a run folder, "
            "checkpoint folder or .safetensors file)"
        )
    lora = any(m.name == "lora" for m in methods)
    recorded = resume and (Path(out) / "config.json").is_file()
    needs_base = lora or opts.frozen or opts.private_warmup
    if needs_base and recorded and init_from is None:
        init_from = RunDir(out).read_config().get("init_from")
    if lora and init_from is None:
        raise ValueError(
            "LoRA trains adapters on a base model: give --init-from BASE (or "
            "--model hf:DIR); the compute party needs the same base"
        )
    if sft and init_from is None and not resume:
        raise ValueError(
            "--sft: split fine-tuning starts from a pre-trained base; give "
            "--init-from BASE (the compute party starts from the same base)"
        )
    return init_from


def check_options(
    opts: SplitOptions,
    cfg: TrainConfig,
    init_from: str | Path | None,
    methods: tuple[Method, Method],
    defence: object,
    ranks: DataRanks | None,
    resume: bool,
) -> object:
    """Refuse options that cannot go together; returns ``defence`` as it
    applies (the recommended one noises no gradient where none crosses)."""
    check_pipeline(opts.window, cfg)
    method, compute_method = methods
    if ranks is not None and (why := ranks.problem_with(cfg.micro, method)):
        raise ValueError(why)
    if opts.frozen and isinstance(defence, dp.Recommended):
        defence = replace(defence, gradient=False)  # no gradient to noise
    if opts.frozen:
        check_frozen_backbone(init_from, compute_method, defence, ranks, resume)
    if opts.private_warmup:
        check_warmup(init_from, method, ranks, resume)
    return defence


def check_frozen_backbone(
    init_from: str | Path | None,
    compute_method: Method,
    defence: object,
    ranks: DataRanks | None,
    resume: bool,
) -> None:
    """Refuse, in one line, what cannot go with ``--backbone frozen``."""
    if init_from is None and not resume:
        raise ValueError(
            "--backbone frozen runs the compute party's blocks as a base model has "
            "them: give --init-from BASE (or --model hf:DIR); both parties start "
            "from it"
        )
    if compute_method.name == "lora":
        raise ValueError(
            "--backbone frozen: the compute party trains nothing, so "
            "--compute-method lora has nothing to adapt; leave it out"
        )
    if isinstance(defence, dp.CutDefence) and defence.backward is not None:
        raise ValueError(
            "--backbone frozen: no gradient crosses the cut, so there is none to "
            "clip or noise; leave out --dp-backward-* (--dp-forward-* and "
            "--defence recommended, its noise on the activations alone, apply)"
        )
    if ranks is not None:
        raise ValueError(
            "--backbone frozen runs with a data party of one process (this one "
            "runs over ranks)"
        )


def check_warmup(
    init_from: str | Path | None,
    method: Method,
    ranks: DataRanks | None,
    resume: bool,
) -> None:
    """Refuse, in one line, what cannot go with ``--private-warmup``."""
    if init_from is None and not resume:
        raise ValueError(
            "--private-warmup trains through an emulator of B's blocks built from "
            "the public base: give --init-from BASE (or --model hf:DIR)"
        )
    if method.name == "lora":
        raise ValueError(
            "--private-warmup trains this party's blocks themselves; with "
            "--method lora leave it out"
        )
    if ranks is not None:
        raise ValueError(
            "--private-warmup runs on a data party of one process (this one runs "
            "over ranks)"
        )


def check_pipeline(window: int, cfg: TrainConfig) -> None:
    """Refuse ``--pipeline`` where a step has one micro-batch: there would be
    nothing to overlap, and the run would silently be lockstep."""
    if not window or cfg.grad_accum >= 2:
        return
    b = cfg.batch_size
    fix = (
        f"set --micro-batch-size to a divisor of {b} below it, e.g. "
        f"{max(d for d in range(1, b) if b % d == 0)}"
        if b >= 2
        else "set --batch-size to 2 or more and --micro-batch-size below it"
    )
    raise ValueError(
        f"--pipeline {window} overlaps the micro-batches of a step, and a step of "
        f"--batch-size {b} with --micro-batch-size {cfg.micro} has only one: "
        f"{fix} (or leave out --pipeline)"
    )


# --- resuming: one check per component of the recorded run ----------------------


def check_kind(path: Path, old: dict, config: dict) -> None:
    if old.get("kind") != "split":
        raise ValueError(f"{path}: not a split run; cannot --resume it here")


def check_objective(path: Path, old: dict, config: dict) -> None:
    was = old.get("objective", LMObjective.name)
    if was != config["objective"]:
        flag = "--sft" if was == SFTObjective.name else "--data"
        raise ValueError(
            f"{path}: a split run of objective {was!r}; resume it with {flag}"
        )


def check_defence(path: Path, old: dict, config: dict) -> None:
    was = dp.CutDefence.from_dict(old.get("cut_defence"))
    if was != dp.CutDefence.from_dict(config["cut_defence"]):
        raise ValueError(
            f"{path}: trained with cut defence {was.describe()}; resume it with "
            "the same defence flags (its privacy budget is accounted over the "
            "whole run)"
        )


def check_backbone(path: Path, old: dict, config: dict) -> None:
    was_split = old.get("split", {})
    for key, flag in FROZEN_FLAGS.items():
        was = was_split.get(key, SplitOptions.__dataclass_fields__[key].default)
        if was != config["split"][key]:
            raise ValueError(f"{path}: trained with {flag} {was}; resume it with that")


def check_methods(path: Path, old: dict, config: dict) -> None:
    was = run_methods(old)
    if was != run_methods(config):
        raise ValueError(
            f"{path}: trained with method {was[0].name} / compute method "
            f"{was[1].name}; resume it with those"
        )


#: what a resumed split run must keep, component by component
RESUME_CHECKS = (
    check_kind,
    check_objective,
    check_defence,
    check_backbone,
    check_methods,
)


def check_resume(run: RunDir, old: dict, config: dict) -> None:
    """Refuse to resume the split run ``old`` (its recorded config) with
    ``config`` where a component differs, naming the flag to keep."""
    for check in RESUME_CHECKS:
        check(run.path, old, config)
