"""The settings of a federated run, and how they travel.

One flat dataclass. The launcher writes it into the generated Flower App's
``[tool.flwr.app.config]`` (hyphenated keys, TOML values, so no ``None``), the
ServerApp reads it from ``context.run_config``, and the server sends the part
clients need in every round's ``ConfigRecord``. Ready configurations (the
reference's scenarios 3 and 4) are TOML files of the same keys under
``aisyn/configs``.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

from aisyn.train.loop import TrainConfig
from aisyn.train.lora import Method
from aisyn.validate import check_number

STRATEGIES = ("fedavg", "fedprox", "fedadam", "fedavgm")
# How the server combines the accepted updates (Flower's own strategies): "mean"
# is FedAvg's weighted mean; the others are robust to a few bad clients.
AGGREGATIONS = ("mean", "trimmed-mean", "median", "krum", "multikrum", "bulyan")
SCHEDULES = ("continue", "restart")

#: bounds of numeric settings (``validate.number_problem`` keywords); a field
#: not listed need only be finite
NUMBER_RANGES: dict[str, dict] = {
    "rounds": {"low": 1},
    "local_steps": {"low": 1},
    "batch_size": {"low": 1},
    "micro_batch_size": {"low": 0},
    "lr": {"low": 0, "low_open": True},
    "warmup": {"low": 0},
    "weight_decay": {"low": 0},
    "grad_clip": {"low": 0},
    "seed": {"low": 0},
    "lora_rank": {"low": 1},
    "lora_alpha": {"low": 0, "low_open": True},
    "proximal_mu": {"low": 0},
    "server_lr": {"low": 0, "low_open": True},
    "server_momentum": {"low": 0, "high": 1, "high_open": True},
    "eta": {"low": 0, "low_open": True},
    "beta_1": {"low": 0, "high": 1, "high_open": True},
    "beta_2": {"low": 0, "high": 1, "high_open": True},
    "tau": {"low": 0, "low_open": True},
    "min_clients": {"low": 1},
    "round_timeout": {"low": 0, "low_open": True},
    "eval_items": {"low": 0},
    "trim_fraction": {"low": 0, "high": 0.5, "high_open": True},
    "assumed_attackers": {"low": 0},
    "max_examples": {"low": 0},
    "max_norm_ratio": {"low": 0},  # and 0 (off) or >= 1: __post_init__
}


@dataclass
class FLSettings:
    # rounds and local work
    rounds: int = 5
    local_steps: int = 50  # E: optimizer steps per client per round
    batch_size: int = 16
    micro_batch_size: int = 0  # 0: no gradient accumulation
    lr: float = 3e-4
    min_lr: float = -1.0  # < 0: lr / 10
    warmup: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 1234
    # "continue": one cosine schedule over all rounds' steps; "restart": per round
    schedule: str = "continue"
    # what is trained (and so what travels)
    method: str = "full"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    # aggregation
    strategy: str = "fedavg"
    proximal_mu: float = 0.01  # FedProx
    server_lr: float = 1.0  # FedAvgM
    server_momentum: float = 0.7  # FedAvgM
    eta: float = 3e-3  # FedAdam server learning rate
    beta_1: float = 0.9  # FedAdam
    beta_2: float = 0.99  # FedAdam
    tau: float = 1e-6  # FedAdam
    aggregation: str = "mean"  # one of AGGREGATIONS (with fedavg / fedprox)
    trim_fraction: float = 0.2  # trimmed-mean: share cut from each tail
    assumed_attackers: int = 1  # krum / multikrum / bulyan: f, clients to tolerate
    # participation and robustness
    min_clients: int = 2
    round_timeout: float = 3600.0
    # a reply's num-examples counts at most this (0: rounds x local-steps x
    # batch-size, the most items a client can train on in the run)
    max_examples: int = 0
    # an update (reply - global model) whose L2 norm exceeds this many times the
    # round's median update norm is rejected (0: no bound)
    max_norm_ratio: float = 3.0
    eval_items: int = 256  # client validation items per evaluation (0: all)
    device: str = "auto"
    tensorboard: bool = False  # server and clients also write TensorBoard files

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.local_steps < 1:
            raise ValueError("rounds and local-steps must be >= 1")
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.strategy!r}; expected one of {STRATEGIES}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; expected one of {SCHEDULES}"
            )
        if self.min_clients < 1:
            raise ValueError(f"min-clients must be >= 1, got {self.min_clients}")
        if self.round_timeout <= 0:
            raise ValueError("round-timeout must be positive")
        if self.max_examples < 0:
            raise ValueError(f"max-examples must be >= 0, got {self.max_examples}")
        if self.max_norm_ratio != 0 and not self.max_norm_ratio >= 1:
            raise ValueError(
                f"max-norm-ratio must be 0 (off) or >= 1, got {self.max_norm_ratio}"
            )
        self._check_aggregation()
        # Every number is finite (TOML has nan and inf) and in its range; named
        # as in the TOML file and the flags.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                check_number(
                    f.name.replace("_", "-"), value, **NUMBER_RANGES.get(f.name, {})
                )
        self.method_spec()  # validates method / rank
        self.train_config()  # validates batch sizes and lr

    def _check_aggregation(self) -> None:
        a, f, n = self.aggregation, self.assumed_attackers, self.min_clients
        if a not in AGGREGATIONS:
            raise ValueError(
                f"unknown aggregation {a!r}; expected one of {AGGREGATIONS}"
            )
        if a != "mean" and self.strategy not in ("fedavg", "fedprox"):
            raise ValueError(
                f"aggregation {a!r} replaces FedAvg's mean: use it with strategy "
                f"fedavg or fedprox, not {self.strategy}"
            )
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(
                f"trim-fraction must be in [0, 0.5), got {self.trim_fraction}"
            )
        if a == "trimmed-mean" and int(self.trim_fraction * n) < 1:
            raise ValueError(
                f"trim-fraction {self.trim_fraction} of {n} clients trims nothing "
                "(the plain mean); raise it or min-clients"
            )
        if f < 0:
            raise ValueError(f"assumed-attackers must be >= 0, got {f}")
        if n < min_updates(a, f):
            raise ValueError(
                f"aggregation {a!r} with assumed-attackers {f} needs min-clients "
                f">= {min_updates(a, f)}, got {n}"
            )

    @property
    def total_local_steps(self) -> int:
        return self.rounds * self.local_steps

    def method_spec(self) -> Method:
        return Method(self.method, rank=self.lora_rank, alpha=self.lora_alpha)

    def train_config(self) -> TrainConfig:
        """The optimizer/schedule settings of one client over the whole run."""
        return TrainConfig(
            steps=self.total_local_steps,
            batch_size=self.batch_size,
            micro_batch_size=self.micro_batch_size or None,
            lr=self.lr,
            min_lr=None if self.min_lr < 0 else self.min_lr,
            warmup_steps=self.warmup,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
            seed=self.seed,
            device=self.device,
        )

    def lr_at(self, server_round: int, step: int) -> float:
        """Learning rate of global local-step index ``step`` in ``server_round``."""
        if self.schedule == "continue":
            return self.train_config().lr_at(step)
        per_round = TrainConfig(
            **{**self.train_config().to_dict(), "steps": self.local_steps}
        )
        return per_round.lr_at(step - (server_round - 1) * self.local_steps)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_run_config(self) -> dict:
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict, source: str = "settings") -> FLSettings:
        known = {f.name for f in fields(cls)}
        norm = {str(k).replace("-", "_"): v for k, v in d.items()}
        unknown = sorted(set(norm) - set(known))
        if unknown:
            raise ValueError(f"{source}: unknown federated settings {unknown}")
        kw = {}
        for f in fields(cls):
            if f.name in norm:
                kw[f.name] = _coerce(f.name, norm[f.name], f.default, source)
        try:
            return cls(**kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_run_config(cls, run_config: dict) -> FLSettings:
        known = {f.name.replace("_", "-") for f in fields(cls)}
        return cls.from_dict(
            {k: v for k, v in run_config.items() if k in known}, "run config"
        )


def min_updates(aggregation: str, attackers: int) -> int:
    """Accepted updates an aggregation needs to tolerate ``attackers`` bad ones:
    Krum's guarantee needs n >= 2f + 3, Bulyan's n >= 4f + 3 (their papers)."""
    if aggregation in ("krum", "multikrum"):
        return 2 * attackers + 3
    if aggregation == "bulyan":
        return 4 * attackers + 3
    return 1


def _coerce(name: str, value, default, source: str):
    """TOML/Flower values to the field's type (ints may stand for floats)."""
    typ = type(default)
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if typ is float and is_number:
        return float(value)
    if isinstance(value, typ) and (typ is bool) == isinstance(value, bool):
        return value
    raise ValueError(
        f"{source}: {name.replace('_', '-')} must be a {typ.__name__}, got {value!r}"
    )


def load_settings(path: str | Path | None, **overrides) -> FLSettings:
    """Settings from a TOML file (a path or a shipped config name), then overrides."""
    base: dict = {}
    if path is not None:
        base = read_settings_file(path)
    return FLSettings.from_dict(
        {**base, **{k: v for k, v in overrides.items() if v is not None}},
        str(path or "settings"),
    )


def shipped_configs() -> list[str]:
    root = resources.files("aisyn") / "configs"
    return sorted(
        p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml")
    )


def read_settings_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file() and "/" not in str(path) and not str(path).endswith(".toml"):
        asset = resources.files("aisyn") / "configs" / f"{path}.toml"
        if not asset.is_file():
            raise ValueError(
                f"no file or shipped configuration {str(path)!r} "
                f"(shipped: {', '.join(shipped_configs())})"
            )
        p = Path(str(asset))
    if not p.is_file():
        raise FileNotFoundError(f"{p}: federated configuration not found")
    try:
        d = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not valid TOML ({e})") from None
    # Keys may sit at the top level or under [federated]; other tables (e.g. a
    # scenario's description of its parties) are for the launcher and docs.
    settings = d.get("federated", {})
    settings.update({k: v for k, v in d.items() if not isinstance(v, dict)})
    return settings
