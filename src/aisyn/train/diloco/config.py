"""DiLoCo's settings (``--sync diloco``): what a run's centres must agree on."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aisyn.setting import check_fields, setting

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
#: elements per int8 scale of the flat delta (a scale per tensor would let
#: one large tensor's range crush a small one's)
INT8_BLOCK = 4096
#: the outer optimizer's state in a checkpoint
OUTER_FILE = "outer.safetensors"
#: the data each centre reads: ``split``: every centre the same data, each
#: its own share of every global batch (DDP's rows); ``own``: centre i reads
#: the i-th data folder alone (a domain each)
DATA_MODES = ("split", "own")


class OuterStepError(FloatingPointError):
    """Outer steps were skipped for non-finite deltas too many times in a row."""


@dataclass(frozen=True)
class DiLoCoConfig:
    """DiLoCo's settings, each declared once (``aisyn.setting``): the flags of
    ``--sync diloco`` and the checks of a config a centre reads back."""

    inner_steps: int = setting(
        100, "--inner-steps", "diloco: each centre's own steps between outer steps (H)",
        low=1,
    )  # fmt: skip
    outer_lr: float = setting(
        0.7, "--outer-lr", "diloco: the outer SGD's learning rate",
        low=0, low_open=True,
    )  # fmt: skip
    outer_momentum: float = setting(
        0.9, "--outer-momentum", "diloco: the outer SGD's Nesterov momentum (0: none)",
        low=0, high=1, high_open=True,
    )  # fmt: skip
    precision: str = setting(
        "fp32",
        "--delta-precision",
        "diloco: what the centres' deltas cross as (int8: a scale per 4096 values)",
        choices=PRECISIONS,
    )
    data: str = setting(
        "split",
        "--centre-data",
        "diloco: split: every centre reads its share of every batch of the "
        "same --data (as DDP's ranks); own: centre i reads the i-th --data alone",
        choices=DATA_MODES,
    )
    #: outer steps skipped (a non-finite mean, or a centre out of bound) in a
    #: row before the run stops
    max_skipped: int = setting(3, low=1)
    #: torchrun's ranks per centre: DDP inside a centre, the outer step
    #: across centres (each of a centre's ranks exchanging its own share)
    ranks_per_centre: int = setting(
        1,
        "--ranks-per-centre",
        "diloco: torchrun's ranks per centre (a node's, say), contiguous: DDP "
        "inside a centre, the outer step across centres",
        low=1,
    )
    #: Streaming DiLoCo: the model in ``fragments`` of about equal size, each
    #: exchanged every H steps, H / fragments steps after the one before it
    fragments: int = setting(
        1,
        "--fragments",
        "diloco: Streaming DiLoCo: the model in this many fragments, each "
        "exchanged every H steps, H/fragments steps apart (a fragment's bytes "
        "at a time)",
        low=1,
    )
    #: inner steps an exchange overlaps (< H / fragments): started that many
    #: steps before the fragment's outer step, it crosses while the centre
    #: trains on; the fragment is then ``mixing`` x local + the rest global
    overlap_steps: int = setting(
        0,
        "--overlap-steps",
        "diloco: inner steps a fragment's exchange overlaps (< H/fragments): it "
        "crosses while the centre trains on",
        low=0,
    )
    mixing: float = setting(
        0.5,
        "--overlap-mixing",
        "diloco, with --overlap-steps: the local model's share of a fragment "
        "after its exchange (the rest: the new global model)",
        low=0, high=1, high_open=True,
    )  # fmt: skip
    #: a centre's delta whose norm is above this many times the other
    #: centres' median (or its own last accepted one) is left out (delta_guard)
    delta_bound: float = setting(
        4.0,
        "--delta-bound",
        "diloco: a centre's delta is left out when its norm is above this many "
        "times the other centres' median (or, with no fair other, its own last "
        "accepted norm) (> 1)",
        low=1, low_open=True,
    )  # fmt: skip
    #: ... and one whose cosine to the run's recent direction is below this
    delta_min_cosine: float = setting(
        -0.5,
        "--delta-min-cosine",
        "diloco: a centre's delta is left out when its cosine to the run's "
        "recent direction (the outer momentum) is below this (-1 to 1)",
        low=-1, high=1,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_fields(self, lambda f: f.metadata["flag"] or "--max-skipped")
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"--inner-steps {self.inner_steps} does not split into --fragments "
                f"{self.fragments}: a fragment's exchange every H / fragments steps"
            )
        if self.overlap_steps >= self.inner_steps // self.fragments:
            raise ValueError(
                f"--overlap-steps {self.overlap_steps} must be below --inner-steps / "
                f"--fragments ({self.inner_steps // self.fragments}): an exchange "
                "ends before the next fragment's begins"
            )

    @property
    def slot(self) -> int:
        """Steps between one fragment's outer step and the next one's."""
        return self.inner_steps // self.fragments

    def due(self, done: int, fragment: int, lead: int = 0) -> bool:
        """Whether, after ``done`` steps, ``fragment``'s outer step is due
        (``lead`` steps early: its exchange starts). The last fragment's is
        due after every H steps, where the checkpoints are: nothing is under
        way there."""
        h = self.inner_steps
        return done % h == ((fragment + 1) * self.slot - lead) % h

    @property
    def merge(self) -> float:
        """The local share of a fragment after an overlapped exchange."""
        return self.mixing if self.overlap_steps else 0.0

    def to_dict(self) -> dict:
        return asdict(self)
