"""DiLoCo's settings (``--sync diloco``): what a run's centres must agree on."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aisyn.validate import number_problem

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
    inner_steps: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    precision: str = "fp32"
    data: str = "split"
    max_skipped: int = 3
    #: torchrun's ranks per centre: DDP inside a centre, the outer step
    #: across centres (each of a centre's ranks exchanging its own share)
    ranks_per_centre: int = 1
    #: Streaming DiLoCo: the model in ``fragments`` of about equal size, each
    #: exchanged every H steps, H / fragments steps after the one before it
    fragments: int = 1
    #: inner steps an exchange overlaps (< H / fragments): started that many
    #: steps before the fragment's outer step, it crosses while the centre
    #: trains on; the fragment is then ``mixing`` x local + the rest global
    overlap_steps: int = 0
    mixing: float = 0.5
    #: a centre's delta whose norm is above this many times the other
    #: centres' median (or its own last accepted one) is left out (delta_guard)
    delta_bound: float = 4.0
    #: ... and one whose cosine to the run's recent direction is below this
    delta_min_cosine: float = -0.5

    def __post_init__(self) -> None:
        checks = {
            "inner_steps": dict(low=1),
            "ranks_per_centre": dict(low=1),
            "fragments": dict(low=1),
            "overlap_steps": dict(low=0),
            "mixing": dict(low=0, high=1, high_open=True),
            "outer_lr": dict(low=0, low_open=True),
            "outer_momentum": dict(low=0, high=1, high_open=True),
            "max_skipped": dict(low=1),
            "delta_bound": dict(low=1, low_open=True),
            "delta_min_cosine": dict(low=-1, high=1),
        }
        for name, bounds in checks.items():
            value = getattr(self, name)
            integer = name not in (
                "outer_lr",
                "outer_momentum",
                "mixing",
                "delta_bound",
                "delta_min_cosine",
            )
            if integer and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"--{_flag(name)} must be an integer, got {value!r}")
            if problem := number_problem(value, **bounds):
                raise ValueError(f"--{_flag(name)} {problem}")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"--delta-precision {self.precision!r}: one of {', '.join(PRECISIONS)}"
            )
        if self.data not in DATA_MODES:
            raise ValueError(f"--centre-data {self.data!r}: one of {DATA_MODES}")
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


def _flag(name: str) -> str:
    special = {"precision": "delta-precision", "mixing": "overlap-mixing"}
    return special.get(name, name.replace("_", "-"))
