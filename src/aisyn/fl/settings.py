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
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from aisyn.accountant import DEFAULT_DELTA
from aisyn.flagfile import config_path
from aisyn.train.config import SETTINGS, TrainConfig
from aisyn.train.lora import Method
from aisyn.validate import check_number, number_problem

STRATEGIES = ("fedavg", "fedprox", "fedadam", "fedavgm", "scaffold")
#: the strategies whose server step is FedAvg's mean of the updates, the one a
#: robust aggregation replaces and client DP noises
MEAN_STRATEGIES = ("fedavg", "fedprox")
# How the server combines the accepted updates (Flower's own strategies): "mean"
# is FedAvg's weighted mean; the others are robust to a few bad clients.
AGGREGATIONS = ("mean", "trimmed-mean", "median", "krum", "multikrum", "bulyan")
SCHEDULES = ("continue", "restart")
# A client's AdamW at the start of each round: "fresh" (new moments, as Flower's
# clients and Reddi et al.'s FedOpt do) or "kept" (its own moments of its last
# round, from its run folder: they never leave it; DiLoCo keeps its workers'
# inner AdamW so, Douillard et al. 2023).
LOCAL_OPTIMIZERS = ("fresh", "kept")
# Client-level differential privacy (Flower's fixed-clipping wrappers): off, or
# each update clipped on its client (``fixedclipping_mod``) or on the server.
DP_MODES = ("off", "client", "server")
#: the aggregations that need to see each client's update (not only the sum)
ROBUST_AGGREGATIONS = ("trimmed-mean", "median", "krum", "multikrum", "bulyan")


def _shown(key: str) -> str:
    """A setting as TOML files and flags spell it (``local-steps``)."""
    return key.replace("_", "-")


#: the settings that are each client's ``TrainConfig`` (its local optimizer
#: and schedule), by their flag / TOML name, with their federated defaults
#: (the TrainConfig's own suit pre-training): (value, type); a key whose value
#: is None is absent from a TOML file
LOCAL_TRAIN_DEFAULTS: dict[str, tuple[object, type]] = {
    "batch_size": (16, int),
    "micro_batch_size": (None, int),  # None: no gradient accumulation
    "lr": (3e-4, float),
    "min_lr": (None, float),  # None: lr / 10
    "warmup": (10, int),
    "weight_decay": (0.0, float),
    "grad_clip": (1.0, float),
    "seed": (1234, int),
    "device": ("auto", str),
}
#: the TrainConfig field of each of those: of the same name, or the one whose
#: flag it is (``warmup``: ``warmup_steps``); FLSettings holds them as ``train``
LOCAL_TRAIN_KEYS = {
    key: name
    for key in LOCAL_TRAIN_DEFAULTS
    for name, f in SETTINGS.items()
    if name == key or f.metadata["flag"] == "--" + _shown(key)
}

#: bounds of numeric settings (``validate.number_problem`` keywords); a field
#: not listed need only be finite. The local-training keys' are TrainConfig's.
NUMBER_RANGES: dict[str, dict] = {
    "rounds": {"low": 1},
    "local_steps": {"low": 1},
    "local_epochs": {"low": 0},
    **{
        k: SETTINGS[f].metadata["bounds"]
        for k, f in LOCAL_TRAIN_KEYS.items()
        if SETTINGS[f].metadata["bounds"]
    },
    "micro_batch_size": {"low": 0},  # 0 here: no gradient accumulation
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
    "max_examples_ratio": {"low": 0},  # and 0 (off) or >= 1: __post_init__
    "max_norm_ratio": {"low": 0},  # and 0 (off) or >= 1: __post_init__
    "secagg_threshold": {"low": 0},  # and 0 (auto) or >= 2: __post_init__
    "secagg_clipping_range": {"low": 0, "low_open": True},
    "dp_noise_multiplier": {"low": 0},
    "dp_clipping_norm": {"low": 0, "low_open": True},
    "dp_sampled_clients": {"low": 0},
    "dp_delta": {"low": 0, "high": 1, "low_open": True, "high_open": True},
    "max_message_mb": {"low": 0},  # and 0 (off) or >= MIN_MESSAGE_MB: __post_init__
}
#: the smallest message limit (4 KiB; fractions of a MiB are fine: 0.0625 is 64 KiB)
MIN_MESSAGE_MB = 4096 / 2**20


def local_train_config(**local) -> TrainConfig:
    """A client's TrainConfig from ``LOCAL_TRAIN_KEYS`` values, the federated
    defaults filling the rest (``steps`` is FLSettings' to set)."""
    values = {k: default for k, (default, _) in LOCAL_TRAIN_DEFAULTS.items()}
    values.update(local)
    return TrainConfig(**{LOCAL_TRAIN_KEYS[k]: v for k, v in values.items()})


@dataclass
class FLSettings:
    # rounds and local work
    rounds: int = 5
    local_steps: int = 50  # E: optimizer steps per client per round
    # > 0: each client's local steps per round are local-epochs x its training
    # items / batch-size instead (at least 1): FedAvg's own measure of local
    # work (McMahan et al. 2017), under which a client with more data takes
    # more steps, as it does in data fusion; local-steps then only numbers the
    # server's checkpoints
    local_epochs: float = 0.0
    # each client's optimizer and schedule; its ``steps`` is always the run's
    # rounds x local-steps (set here)
    train: TrainConfig = field(default_factory=local_train_config)
    # "continue": one cosine schedule over all rounds' steps; "restart": per round
    schedule: str = "continue"
    # "fresh" or "kept" (LOCAL_OPTIMIZERS): a fresh AdamW's first steps are
    # sign-like at whatever rate the schedule has reached, once per round
    local_optimizer: str = "fresh"
    # what is trained (and so what travels)
    method: str = Method.name
    lora_rank: int = Method.rank
    lora_alpha: float = Method.alpha
    # aggregation
    strategy: str = "fedavg"
    proximal_mu: float = 0.01  # FedProx
    server_lr: float = 1.0  # FedAvgM, SCAFFOLD's global step
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
    # a reply's num-examples (its FedAvg weight) counts at most this (0: no
    # fixed cap; under SecAgg+, where each client scales its own update,
    # rounds x local-steps x batch-size)
    max_examples: int = 0
    # ... and at most this many times the round's median report (0: no bound)
    max_examples_ratio: float = 4.0
    # an update (reply - global model) whose L2 norm exceeds this many times the
    # round's median update norm is rejected (0: no bound)
    max_norm_ratio: float = 3.0
    eval_items: int = 256  # client validation items per evaluation (0: all)
    tensorboard: bool = False  # server and clients also write TensorBoard files
    # Flower's SecAgg+: the server sees only the sum of the clients' updates
    # (aisyn.fl.secure). A round needs secagg-threshold live clients (0: a
    # majority of the sampled ones, at least 2); each update coordinate is
    # clipped to +-secagg-clipping-range before it is quantised.
    secure_aggregation: bool = False
    secagg_threshold: int = 0
    secagg_clipping_range: float = 1.0
    # client-level DP (aisyn.fl.dp): every update clipped to L2 norm
    # dp-clipping-norm, Gaussian noise of std noise x clip / sampled clients
    # added to their mean; dp-sampled-clients of min-clients train each round
    # (0: all); epsilon is reported at dp-delta
    dp: str = "off"
    dp_noise_multiplier: float = 1.0
    dp_clipping_norm: float = 1.0
    dp_sampled_clients: int = 0
    dp_delta: float = DEFAULT_DELTA
    # the largest Flower message of a model (MiB; 0: no limit, one message per
    # model): a larger model travels in chunks (aisyn.fl.chunks)
    max_message_mb: float = 0.0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.strategy!r}; expected one of {STRATEGIES}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; expected one of {SCHEDULES}"
            )
        if self.local_optimizer not in LOCAL_OPTIMIZERS:
            raise ValueError(
                f"unknown local-optimizer {self.local_optimizer!r}; expected one "
                f"of {LOCAL_OPTIMIZERS}"
            )
        if self.max_examples_ratio != 0 and not self.max_examples_ratio >= 1:
            raise ValueError(
                "max-examples-ratio must be 0 (off) or >= 1, got "
                f"{self.max_examples_ratio}"
            )
        if self.max_norm_ratio != 0 and not self.max_norm_ratio >= 1:
            raise ValueError(
                f"max-norm-ratio must be 0 (off) or >= 1, got {self.max_norm_ratio}"
            )
        if self.max_message_mb != 0 and not self.max_message_mb >= MIN_MESSAGE_MB:
            raise ValueError(
                f"max-message-mb must be 0 (no limit) or at least {MIN_MESSAGE_MB} "
                f"(4 KiB), got {self.max_message_mb}"
            )
        trim = NUMBER_RANGES["trim_fraction"]
        if number_problem(self.trim_fraction, **trim):
            raise ValueError(
                f"trim-fraction must be in [{trim['low']}, {trim['high']}), got "
                f"{self.trim_fraction}"
            )
        # the local-training keys are their TrainConfig's to check
        _check_numbers(
            {k: v for k, v in self.to_dict().items() if k not in LOCAL_TRAIN_KEYS}
        )
        self.train = replace(self.train, steps=self.total_local_steps)
        self._check_aggregation()
        self._check_privacy()
        self._check_scaffold()
        self.method_spec()  # validates method / rank

    def _check_aggregation(self) -> None:
        a, f, n = self.aggregation, self.assumed_attackers, self.min_clients
        if a not in AGGREGATIONS:
            raise ValueError(
                f"unknown aggregation {a!r}; expected one of {AGGREGATIONS}"
            )
        if a != "mean" and self.strategy not in MEAN_STRATEGIES:
            raise ValueError(
                f"aggregation {a!r} replaces FedAvg's mean: use it with strategy "
                f"fedavg or fedprox, not {self.strategy}"
            )
        if a == "trimmed-mean" and int(self.trim_fraction * n) < 1:
            raise ValueError(
                f"trim-fraction {self.trim_fraction} of {n} clients trims nothing "
                "(the plain mean); raise it or min-clients"
            )
        if n < min_updates(a, f):
            raise ValueError(
                f"aggregation {a!r} with assumed-attackers {f} needs min-clients "
                f">= {min_updates(a, f)}, got {n}"
            )

    def _check_privacy(self) -> None:
        """Secure aggregation and client DP: what they cannot be combined with."""
        if self.dp not in DP_MODES:
            raise ValueError(f"unknown dp {self.dp!r}; expected one of {DP_MODES}")
        if self.secagg_threshold == 1:
            raise ValueError("secagg-threshold must be 0 (a majority) or >= 2, got 1")
        k = self.sampled_clients
        if self.dp != "off":
            if self.dp_sampled_clients > self.min_clients:
                raise ValueError(
                    f"dp-sampled-clients {self.dp_sampled_clients} exceeds "
                    f"min-clients {self.min_clients}"
                )
            if self.strategy not in MEAN_STRATEGIES or self.aggregation != "mean":
                name = self.strategy if self.aggregation == "mean" else self.aggregation
                raise ValueError(
                    f"client DP noises the plain mean of the clipped updates: use "
                    f"strategy fedavg or fedprox with aggregation mean, not {name}"
                )
            if self.max_norm_ratio:
                raise ValueError(
                    "client DP clips every update to dp-clipping-norm instead of "
                    "max-norm-ratio (a rejected update would break the noise's "
                    "calibration): set max-norm-ratio 0"
                )
        if not self.secure_aggregation:
            return
        if self.local_epochs:
            raise ValueError(
                "local-epochs gives each client steps of its own, but secure "
                "aggregation bounds every client's example count by local-steps: "
                "set local-epochs 0"
            )
        if self.aggregation in ROBUST_AGGREGATIONS:
            raise ValueError(
                f"aggregation {self.aggregation!r} needs every client's update, but "
                "under secure aggregation the server sees only their sum"
            )
        if self.max_norm_ratio:
            raise ValueError(
                "max-norm-ratio needs every client's update norm, but under secure "
                "aggregation the server sees only their sum: set max-norm-ratio 0 "
                "(SecAgg+ clips each update coordinate to secagg-clipping-range on "
                "the client; add --dp client to bound each update's L2 norm there)"
            )
        if self.dp == "server":
            raise ValueError(
                "dp server clips each client's update on the server, but under "
                "secure aggregation it sees only their sum: use dp client"
            )
        if k < 2:
            raise ValueError(
                f"secure aggregation needs at least 2 clients per round, got {k}"
            )
        if self.secagg_quorum > k:
            raise ValueError(
                f"secure aggregation with secagg-threshold {self.secagg_quorum} "
                f"needs at least that many clients per round, got {k}"
            )

    def for_items(self, items: int) -> FLSettings:
        """The settings a client with ``items`` training items trains by: with
        ``local_epochs``, its own steps per round (and so its own schedule's
        length); these settings otherwise."""
        if not self.local_epochs:
            return self
        steps = max(1, round(self.local_epochs * items / self.train.batch_size))
        return replace(self, local_steps=steps, local_epochs=0.0)

    def update_weight(self, examples: int) -> float:
        """What an update of a client with ``examples`` (counted) weighs in
        the mean: its examples, or under ``local_epochs`` its examples per
        local step (``for_items``' steps, as the client took them). Each step
        of each client then weighs alike, as each batch does in data fusion;
        weighed by examples alone a client's data would count twice, in its
        steps and its weight (FedNova's objective inconsistency, Wang et al.
        2020: its normalisation, without its step-size factor, so the mean
        stays within the clients' range)."""
        if not self.local_epochs:
            return examples
        return examples / self.for_items(examples).local_steps

    def _check_scaffold(self) -> None:
        """SCAFFOLD's control variates travel beside each model, one per client
        (``fl.scaffold``): what they cannot ride along with."""
        if self.strategy != "scaffold":
            return
        if self.secure_aggregation:
            raise ValueError(
                "strategy scaffold sends each client's control variate beside its "
                "update; secure aggregation masks only the update: drop one of them"
            )
        if self.max_message_mb:
            raise ValueError(
                "strategy scaffold's control variates do not travel in chunks: set "
                "max-message-mb 0 or use another strategy"
            )

    @property
    def sampled_clients(self) -> int:
        """Clients asked to train each round (at least; all connected unless DP
        samples)."""
        if self.dp != "off" and self.dp_sampled_clients:
            return self.dp_sampled_clients
        return self.min_clients

    @property
    def secagg_quorum(self) -> int:
        """SecAgg+'s reconstruction threshold: live clients a round needs."""
        return self.secagg_threshold or max(2, self.sampled_clients // 2 + 1)

    @property
    def masked_examples_bound(self) -> int:
        """Under SecAgg+, the most a client's num-examples counts: each client
        scales its own update by count / this before masking, so it must be
        known before any count is (max-examples; 0: rounds x local-steps x
        batch-size, the most items a client can train on)."""
        return self.max_examples or self.total_local_steps * self.train.batch_size

    @property
    def total_local_steps(self) -> int:
        return self.rounds * self.local_steps

    def method_spec(self) -> Method:
        return Method(self.method, rank=self.lora_rank, alpha=self.lora_alpha)

    def lr_at(self, server_round: int, step: int) -> float:
        """Learning rate of global local-step index ``step`` in ``server_round``."""
        if self.schedule == "continue":
            return self.train.lr_at(step)
        per_round = replace(self.train, steps=self.local_steps)
        return per_round.lr_at(step - (server_round - 1) * self.local_steps)

    def to_dict(self) -> dict:
        """Flat, by flag name with underscores (the client's training settings
        among the others; None: the default rule, e.g. min-lr = lr / 10)."""
        flat = {}
        for f in fields(self):
            if f.name == "train":  # in its place, in the flags' order
                flat.update(
                    {k: getattr(self.train, a) for k, a in LOCAL_TRAIN_KEYS.items()}
                )
            else:
                flat[f.name] = getattr(self, f.name)
        return flat

    def to_run_config(self) -> dict:
        """As a TOML / Flower run config: hyphenated keys, no None values."""
        return {
            k.replace("_", "-"): v for k, v in self.to_dict().items() if v is not None
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "settings") -> FLSettings:
        """From flat keys (``to_dict``'s, hyphens or underscores), defaults for
        the rest and for None; ValueError naming ``source`` for an unknown key
        or a bad value."""
        types = setting_types()
        norm = {str(k).replace("-", "_"): v for k, v in d.items() if v is not None}
        unknown = sorted(set(norm) - set(types))
        if unknown:
            raise ValueError(f"{source}: unknown federated settings {unknown}")
        kw = {k: _coerce(k, v, types[k], source) for k, v in norm.items()}
        if kw.get("micro_batch_size") == 0:  # as the flag says: no accumulation
            kw["micro_batch_size"] = None
        private = kw.get("secure_aggregation") or kw.get("dp", "off") != "off"
        if private and "max_norm_ratio" not in kw:
            # its default bound needs each client's update (refused when given)
            kw["max_norm_ratio"] = 0.0
        local = {k: kw.pop(k) for k in LOCAL_TRAIN_KEYS if k in kw}
        try:
            _check_numbers(local)  # by their names here, before TrainConfig's
            return cls(train=local_train_config(**local), **kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_run_config(cls, run_config: dict) -> FLSettings:
        known = {k.replace("_", "-") for k in cls().to_dict()}
        return cls.from_dict(
            {k: v for k, v in run_config.items() if k in known}, "run config"
        )


def _check_numbers(flat: dict) -> None:
    """Every number is finite (TOML has nan and inf) and in its range; named as
    in the TOML file and the flags."""
    for name, value in flat.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            check_number(_shown(name), value, **NUMBER_RANGES.get(name, {}))


def setting_types() -> dict[str, type]:
    """Each flat setting's type, in ``FLSettings.to_dict``'s order."""
    local = {k: t for k, (_, t) in LOCAL_TRAIN_DEFAULTS.items()}
    return {
        k: local[k] if k in local else type(getattr(FLSettings, k))
        for k in FLSettings().to_dict()
    }


def min_updates(aggregation: str, attackers: int) -> int:
    """Accepted updates an aggregation needs to tolerate ``attackers`` bad ones:
    Krum's guarantee needs n >= 2f + 3, Bulyan's n >= 4f + 3 (their papers)."""
    if aggregation in ("krum", "multikrum"):
        return 2 * attackers + 3
    if aggregation == "bulyan":
        return 4 * attackers + 3
    return 1


def _coerce(name: str, value, typ: type, source: str):
    """TOML/Flower values to the setting's type (ints may stand for floats)."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if typ is float and is_number:
        return float(value)
    if isinstance(value, typ) and (typ is bool) == isinstance(value, bool):
        return value
    raise ValueError(
        f"{source}: {name.replace('_', '-')} must be a {typ.__name__}, got {value!r}"
    )


#: the settings only some strategies or aggregations take, and which
OWN_SETTINGS = {
    "proximal_mu": ("strategy", ("fedprox",)),
    "server_lr": ("strategy", ("fedavgm", "scaffold")),
    "server_momentum": ("strategy", ("fedavgm",)),
    "eta": ("strategy", ("fedadam",)),
    "beta_1": ("strategy", ("fedadam",)),
    "beta_2": ("strategy", ("fedadam",)),
    "tau": ("strategy", ("fedadam",)),
    "trim_fraction": ("aggregation", ("trimmed-mean",)),
    "assumed_attackers": ("aggregation", ("krum", "multikrum", "bulyan")),
}


def check_given(settings: FLSettings, given: Iterable[str]) -> None:
    """Refuse, in one line, a setting ``given`` for a strategy or aggregation
    the run does not use (``--proximal-mu`` with FedAvg would do nothing)."""
    for key in given:
        if key not in OWN_SETTINGS:
            continue
        field_name, takers = OWN_SETTINGS[key]
        if getattr(settings, field_name) not in takers:
            raise ValueError(
                f"--{_shown(key)} is {' and '.join(takers)}'s; {field_name} "
                f"{getattr(settings, field_name)} does not take it (set "
                f"--{field_name} {takers[0]}, or drop it)"
            )


def load_settings(path: str | Path | None, **overrides) -> FLSettings:
    """Settings from a TOML file (a path or a shipped config name), then
    overrides; an override the strategy or aggregation does not take is
    refused (``check_given``)."""
    base: dict = {}
    if path is not None:
        base = read_settings_file(path)
    given = {k: v for k, v in overrides.items() if v is not None}
    settings = FLSettings.from_dict({**base, **given}, str(path or "settings"))
    check_given(settings, given)
    return settings


def read_settings_file(path: str | Path) -> dict:
    p = config_path(str(path))  # a file, or a shipped configuration's name
    try:
        d = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not valid TOML ({e})") from None
    # Keys may sit at the top level or under [federated]; other tables (e.g. a
    # scenario's description of its parties) are for the launcher and docs.
    settings = d.get("federated", {})
    settings.update({k: v for k, v in d.items() if not isinstance(v, dict)})
    return settings
