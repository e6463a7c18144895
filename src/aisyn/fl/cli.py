"""``aisyn fl simulate | server | client | partition``: federated fine-tuning."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aisyn import validate
from aisyn.fl.settings import (
    AGGREGATIONS,
    DP_MODES,
    LOCAL_OPTIMIZERS,
    NUMBER_RANGES,
    SCHEDULES,
    STRATEGIES,
    FLSettings,
    load_settings,
    setting_types,
)
from aisyn.flagtable import DEVICE, REQUIRED, add_command, add_flags, add_group
from aisyn.tls_flags import add_allow_insecure_remote, add_tls_files
from aisyn.train.lora import METHODS

#: the server's TLS flags as spelled before they matched ``aisyn split``'s
OLD_SERVER_TLS_FLAGS = {
    "--tls-cert": "--ssl-certfile",
    "--tls-key": "--ssl-keyfile",
    "--tls-ca": "--ssl-ca-certfile",
}

_HELP = {
    "rounds": "federated rounds R",
    "local_steps": "optimizer steps per client per round (E)",
    "local_epochs": "> 0: each client's steps per round are this x its training "
    "items / batch-size instead of --local-steps (FedAvg's local epochs)",
    "batch_size": "samples per local optimizer step",
    "micro_batch_size": "samples per forward/backward (0: whole batch)",
    "lr": "peak local learning rate",
    "min_lr": "final learning rate of the cosine decay (default lr/10)",
    "warmup": "linear warm-up steps",
    "schedule": "continue: one schedule across all rounds; restart: per round",
    "local_optimizer": "fresh: each round's local steps start a new AdamW; kept: "
    "each client goes on with its own AdamW moments (kept in its run folder)",
    "method": "full: train (and send) all weights; lora: only LoRA adapters",
    "strategy": "server aggregation",
    "proximal_mu": "FedProx proximal-term weight mu",
    "server_lr": "server learning rate (FedAvgM; SCAFFOLD's global step)",
    "server_momentum": "FedAvgM server momentum",
    "eta": "FedAdam server learning rate",
    "tau": "FedAdam adaptivity (epsilon)",
    "aggregation": "how accepted updates combine: FedAvg's mean or a robust one",
    "trim_fraction": "trimmed-mean: share of values cut from each tail",
    "assumed_attackers": "krum / multikrum / bulyan: attackers f to tolerate",
    "min_clients": "clients needed to start / aggregate a round",
    "max_examples": "a reply's num-examples counts at most this (0: no fixed "
    "cap; under SecAgg+ rounds x local-steps x batch-size)",
    "max_examples_ratio": "a reply's num-examples counts at most this x the "
    "round's median report (0: off)",
    "max_norm_ratio": "reject updates whose norm exceeds this x the round's "
    "median (0: off)",
    "round_timeout": "seconds to wait for replies per round (dropouts)",
    "eval_items": "client validation items per evaluation (0: all)",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "clip the global gradient L2 norm (0: off)",
    "device": DEVICE.help,
    "tensorboard": "also write TensorBoard event files (server and clients)",
    "secure_aggregation": "Flower's SecAgg+: the server sees only the sum of the "
    "updates (no robust aggregation or max-norm-ratio with it)",
    "secagg_threshold": "SecAgg+: clients that must complete a round (0: a "
    "majority of those sampled, at least 2); more dropouts halt the round",
    "secagg_clipping_range": "SecAgg+: each update coordinate is clipped to "
    "+-this before quantisation (2**22 levels)",
    "dp": "client-level DP: off, or updates clipped on the clients (client) or "
    "on the server (server), Gaussian noise added to their mean",
    "dp_noise_multiplier": "DP: noise std / (clipping norm / sampled clients)",
    "dp_clipping_norm": "DP: L2 bound of each client's update",
    "dp_sampled_clients": "DP: clients sampled per round out of min-clients (0: all)",
    "dp_delta": "DP: delta at which epsilon is reported",
    "max_message_mb": "largest message of a model, MiB (0: no limit); a larger "
    "model's global weights and updates travel in chunks under it",
}


#: a client's data-parallel ranks (its node's setting, not the federation's)
CLIENT_RANKS = (
    "--client-ranks",
    validate.positive_int,
    1,
    "train each round's local steps on N DDP ranks (torchrun; gloo on CPU, NCCL on "
    "GPU); --batch-size must split into them",
)


RESUME = (
    "--resume",
    "store_true",
    None,
    "continue the run in --out from its last finished round (the same settings "
    "and base; the server's optimiser state and random draws are restored)",
)


_CHOICES = {
    "strategy": STRATEGIES,
    "schedule": SCHEDULES,
    "local_optimizer": LOCAL_OPTIMIZERS,
    "method": METHODS,
    "aggregation": AGGREGATIONS,
    "dp": DP_MODES,
}


def add_settings_args(p: argparse.ArgumentParser) -> None:
    """One flag per setting (``FLSettings.to_dict``'s keys), unset by default
    so that a --config file's value stands unless a flag overrides it."""
    g = p.add_argument_group("federated settings (override --config)")
    g.add_argument(
        "--config",
        default=None,
        help="TOML of settings: a file or a shipped name (scenario3, scenario4)",
    )
    for name, typ in setting_types().items():
        kw: dict = {"default": None, "help": _HELP.get(name, name.replace("_", " "))}
        if name in _CHOICES:
            kw["choices"] = _CHOICES[name]
        elif name == "device":
            kw["type"] = DEVICE.kind
        elif typ is bool:
            kw.update(action="store_const", const=True)
        elif typ in (int, float):
            # the ranges FLSettings checks TOML values against, so that a bad
            # flag fails while parsing, with the flag named
            kw["type"] = validate.number_type(typ, **NUMBER_RANGES.get(name, {}))
        g.add_argument("--" + name.replace("_", "-"), **kw)


def settings_from_args(args) -> FLSettings:
    keys = FLSettings().to_dict()
    return load_settings(args.config, **{k: getattr(args, k) for k in keys})


def parse_clients(specs: list[str]) -> dict[str, str]:
    clients: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--client {spec!r}: expected NAME=SFT_DIR")
        if name in clients:
            raise ValueError(f"--client {name}: given twice")
        clients[name] = path
    return clients


def _print_result(result: dict) -> None:
    for h in result["history"]:
        loss = h.get("global_valid_loss")
        shown = "-" if loss is None else f"{loss:.4f}"
        print(
            f"round {h['round']}: global valid loss before training {shown}, "
            f"accepted {h.get('accepted')}/{h.get('clients')}, "
            f"round {h.get('round_s') or 0:.1f} s"
        )
    if result.get("final_global_valid_loss") is not None:
        print(f"final global valid loss {result['final_global_valid_loss']:.4f}")
    privacy = result.get("privacy") or {}
    if privacy.get("secure_aggregation"):
        print(
            "secure aggregation (SecAgg+): the server saw only the sum of the "
            f"updates (threshold {privacy['secagg_threshold']})"
        )
    if privacy.get("dp", "off") != "off":
        eps = privacy["epsilon"]
        shown = "inf (no noise: no privacy)" if eps is None else f"{eps:.4g}"
        print(
            f"client DP ({privacy['dp']} clipping to {privacy['clipping_norm']:g}, "
            f"noise multiplier {privacy['noise_multiplier']:g}, "
            f"{privacy['sampled_clients']} clients per round): "
            f"epsilon {shown} at delta {privacy['delta']:g}"
        )
    print(f"global model: {result['run']}")


def cmd_simulate(args) -> None:
    """Start a SuperLink and one SuperNode per --client on loopback, run the
    federation, stop them. Writes OUT/server (global model, per-round metrics),
    OUT/clients/NAME (local models) and OUT/runtime (Flower logs)."""
    from aisyn.fl.launch import simulate

    clients = parse_clients(args.client)
    if args.min_clients is None and "min_clients" not in _config_keys(args.config):
        # before the settings are validated: robust aggregations check it
        args.min_clients = len(clients)
    settings = settings_from_args(args)
    result = simulate(
        args.base,
        clients,
        args.out,
        settings,
        echo=args.echo,
        client_ranks=args.client_ranks,
        resume=args.resume,
    )
    _print_result(result)
    for name, path in result["clients"].items():
        print(f"client {name}: {path}")


def _config_keys(config: str | None) -> set[str]:
    if config is None:
        return set()
    from aisyn.fl.settings import read_settings_file

    return {k.replace("-", "_") for k in read_settings_file(config)}


def cmd_server(args) -> None:
    """Start a SuperLink on --host:--port and run the federation once
    --min-clients clients joined. TLS is required unless --host is loopback."""
    from aisyn.fl.launch import serve
    from aisyn.fl.runtime import ServerTls

    tls_files = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls_files) and not all(tls_files):
        raise ValueError("give all of --tls-cert, --tls-key, --tls-ca")
    tls = ServerTls(*map(Path, tls_files)) if all(tls_files) else None
    result = serve(
        args.base,
        args.out,
        settings_from_args(args),
        host=args.host,
        port=args.port,
        tls=tls,
        allow_insecure=args.allow_insecure_remote,
        client_keys=args.client_key or (),
        resume=args.resume,
    )
    _print_result(result)


def cmd_client(args) -> None:
    """Connect to the server's SuperLink and train on this organisation's SFT
    data when asked; runs until stopped (Ctrl-C)."""
    from aisyn.fl.launch import join

    rc = join(
        args.superlink,
        args.name,
        args.data,
        args.base,
        args.out,
        root_certificates=Path(args.tls_ca) if args.tls_ca else None,
        allow_insecure=args.allow_insecure_remote,
        auth_key=args.auth_key,
        client_ranks=args.client_ranks,
    )
    if rc:
        raise OSError(f"flower-supernode exited with status {rc}")


def cmd_keygen(args) -> None:
    """Write NAME.key (private: stays with the client, --auth-key) and NAME.pub
    (for the server: --client-key) into --out."""
    from aisyn.fl.node_keys import make_node_keys

    keys = make_node_keys(args.out, args.name)
    print(json.dumps({"private": str(keys.private), "public": str(keys.public)}))


def cmd_partition(args) -> None:
    """Pool the given SFT folders and deal their items at random into --parts
    folders of the same distribution; with --alpha, give each part its share
    of every domain (a --data folder), the shares drawn from a Dirichlet of
    that concentration (0.1: most parts hold one domain; 1.0: a mix of uneven
    sizes), seeded."""
    from aisyn.fl.partition import partition_dirichlet, partition_iid

    if args.alpha is None:
        dirs = partition_iid(args.data, args.out, args.parts, seed=args.seed)
    else:
        dirs = partition_dirichlet(
            args.data, args.out, args.parts, args.alpha, seed=args.seed
        )
    print(json.dumps({"parts": [str(d) for d in dirs]}, indent=2))


def register(sub) -> None:
    fsub = add_group(
        sub,
        "fl",
        "federated fine-tuning on Flower",
        description="Federated supervised fine-tuning of a base model: clients train "
        "E local steps per round on their own SFT data; the server aggregates with "
        "FedAvg / FedProx / FedAdam / FedAvgM. Full weights or LoRA adapters.",
    )

    s = add_command(
        fsub, "simulate", cmd_simulate, "all parties on this machine (loopback)"
    )
    add_flags(
        s,
        ("--base", None, REQUIRED, "base model run folder"),
        ("--client", "append", REQUIRED, "NAME=SFT_DIR (repeat; one per organisation)"),
        ("--out", None, REQUIRED, "run folder"),
        ("--echo", "store_true", None, "stream the server log"),
        CLIENT_RANKS,
        RESUME,
    )
    add_settings_args(s)

    sv = add_command(
        fsub, "server", cmd_server, "the server side: a SuperLink, then the run"
    )
    add_flags(
        sv,
        ("--base", None, REQUIRED, "base model run folder"),
        ("--out", None, REQUIRED, "server run folder"),
        ("--host", None, "127.0.0.1", "address to listen on"),
        ("--port", validate.port, 9092, "port to listen on"),
        RESUME,
    )
    add_tls_files(
        sv,
        cert="server certificate (PEM)",
        key="server private key (PEM)",
        ca="CA certificate (PEM)",
        old=OLD_SERVER_TLS_FLAGS,
    )
    add_allow_insecure_remote(
        sv,
        "allow plaintext on a non-loopback address (not recommended)",
        old="--insecure-remote",
    )
    add_flags(
        sv,
        (
            "--client-key",
            "append",
            None,
            "a client's public key (repeat; with TLS only these clients can join)",
        ),
    )
    add_settings_args(sv)

    c = add_command(
        fsub, "client", cmd_client, "one organisation's client (a SuperNode)"
    )
    add_flags(
        c,
        ("--superlink", validate.host_port, REQUIRED, "server HOST:PORT"),
        ("--name", None, REQUIRED, "this client's name"),
        ("--data", None, REQUIRED, "SFT folder (aisyn prepare-sft)"),
        ("--base", None, REQUIRED, "base model run folder"),
        ("--out", None, REQUIRED, "this client's run folder"),
    )
    add_tls_files(
        c,
        cert=None,  # a client proves who it is with --auth-key
        key=None,
        ca="CA certificate (PEM) that signed the server's",
        old={"--tls-ca": "--root-certificates"},
    )
    add_allow_insecure_remote(
        c,
        "allow plaintext to a non-loopback server (not recommended)",
        old="--insecure-remote",
    )
    add_flags(
        c,
        (
            "--auth-key",
            None,
            None,
            "this client's private key (with TLS; the server registers its .pub)",
        ),
        CLIENT_RANKS,
    )

    k = add_command(
        fsub, "keygen", cmd_keygen, "a client's key pair for SuperNode authentication"
    )
    add_flags(
        k,
        ("--name", None, REQUIRED, "key file name (the client's)"),
        ("--out", None, REQUIRED, "folder for the two files"),
    )

    pt = add_command(
        fsub,
        "partition",
        cmd_partition,
        "split pooled SFT data into IID parts (scenario 4), or non-IID ones",
    )
    add_flags(
        pt,
        ("--data", "append", REQUIRED, "SFT folder (a domain)"),
        ("--parts", validate.positive_int, 2, "parts (clients) to deal"),
        (
            "--alpha",
            validate.positive_float,
            None,
            "non-IID: each domain's shares of the parts drawn from a Dirichlet "
            "of this concentration (0.1, 1.0: the usual benchmarks); default: IID",
        ),
        ("--out", None, REQUIRED, "folder for part0, part1, ..."),
        ("--seed", validate.seed, 0, "seed of the deal"),
    )
