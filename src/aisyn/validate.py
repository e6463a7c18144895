"""Checks of the numbers, addresses, devices and files a user hands to ``aisyn``.

One place for every command. Two layers:

* ``check_number`` (and ``require_*`` helpers) raise ``ValueError`` naming the
  setting; config dataclasses (``TrainConfig``, ``FLSettings``) call them
  because their values also arrive from files and from peers, not only flags;
* the argparse types below (``positive_int``, ``port``, ``host_port``, ...)
  wrap the same checks so that a bad flag fails while parsing, with the flag
  named by argparse, before anything is loaded or written.

argparse shows the message of an ``ArgumentTypeError`` verbatim but replaces
that of a ``ValueError`` with a generic "invalid ... value", so the flag types
raise the former.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path

# --- numbers --------------------------------------------------------------------------


def number_problem(
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> str | None:
    """Why ``value`` is out of range ("must be >= 1, got 0"), or None if it is fine.

    NaN and infinities are always refused: no setting of this project means
    anything at NaN, and an infinite one is a typo rather than a request.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number, got {value!r}"
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if low is not None and (value <= low if low_open else value < low):
        if low == 0 and low_open:
            return f"must be positive, got {_show(value)}"
        return f"must be {'>' if low_open else '>='} {_show(low)}, got {_show(value)}"
    if high is not None and (value >= high if high_open else value > high):
        return f"must be {'<' if high_open else '<='} {_show(high)}, got {_show(value)}"
    return None


def _show(value: float) -> str:
    """Integers in full (a seed of 2**64 is not "1.84467e+19"), floats short."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def check_number(name: str, value: float, **bounds) -> None:
    """Raise ``ValueError("NAME must be ...")`` unless ``value`` is in range
    (keywords as :func:`number_problem`)."""
    problem = number_problem(value, **bounds)
    if problem:
        raise ValueError(f"{name} {problem}")


#: The largest seed any command takes. Seeds reach torch generators, which
#: take at most 2**64 - 1 ("Overflow when unpacking long long" beyond), after
#: small offsets (the epoch, +1); a split run's secret seed is 63-bit.
MAX_SEED = 2**63 - 1
#: ``validate.number_problem`` keywords of a seed
SEED_RANGE = {"low": 0, "high": MAX_SEED}


# --- argparse types -------------------------------------------------------------------


def _flag_type(name: str, parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type=`` from ``parse``; its ValueError becomes the message."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = name  # argparse names the type in some messages
    return convert


def _to_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _to_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {text!r}")
    return value


def number_type(kind: type, name: str | None = None, **bounds) -> Callable:
    """An argparse type for an ``int`` or (finite) ``float`` within ``bounds``
    (keywords as :func:`number_problem`)."""
    to = _to_int if kind is int else _to_float

    def parse(text: str):
        value = to(text)
        problem = number_problem(value, **bounds)
        if problem:
            raise ValueError(problem)
        return value

    return _flag_type(name or kind.__name__, parse)


positive_int = number_type(int, "positive_int", low=1)
nonneg_int = number_type(int, "nonneg_int", low=0)
positive_float = number_type(float, "positive_float", low=0, low_open=True)
nonneg_float = number_type(float, "nonneg_float", low=0)
probability = number_type(float, "probability", low=0, high=1)
# Strictly between 0 and 1 (a DP delta: 0 is unreachable, 1 promises nothing).
open_probability = number_type(
    float, "open_probability", low=0, high=1, low_open=True, high_open=True
)
# A probability mass to keep (top-p): 0 would keep nothing.
positive_probability = number_type(
    float, "positive_probability", low=0, low_open=True, high=1
)
#: every command's ``--seed``
seed = number_type(int, "seed", **SEED_RANGE)


# --- addresses ------------------------------------------------------------------------

MAX_PORT = 65535


def parse_port(text: str, *, allow_zero: bool = False) -> int:
    """A TCP port number; 0 ("any free port") only where a server may pick one.

    Checked here because gRPC takes a port modulo 65536 without a word, so
    ``:99999`` would listen on 34463.
    """
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"port {text!r} is not a number") from None
    low = 0 if allow_zero else 1
    if not low <= value <= MAX_PORT:
        raise ValueError(f"port {value} is out of range ({low}..{MAX_PORT})")
    return value


def parse_host_port(text: str, *, allow_zero_port: bool = False) -> str:
    """``HOST:PORT`` or ``[IPv6]:PORT`` with a valid port; returned unchanged."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise ValueError(f"{text!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"{text!r}: unbalanced brackets around the IPv6 host")
    if ":" in host and not host.startswith("["):
        raise ValueError(f"{text!r}: write an IPv6 host in brackets, [::1]:PORT")
    try:
        parse_port(port_text, allow_zero=allow_zero_port)
    except ValueError as e:
        raise ValueError(f"{text!r}: {e}") from None
    return text


port = _flag_type("port", parse_port)
#: an address to dial: the port must be a real one
host_port = _flag_type("host_port", parse_host_port)
#: an address to listen on: port 0 asks for any free port
listen_address = _flag_type(
    "listen_address", lambda text: parse_host_port(text, allow_zero_port=True)
)


# --- devices --------------------------------------------------------------------------


def check_device(name: str) -> str:
    """``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``, ... that exists here.

    Checked before anything runs because torch reports a bad name with a
    RuntimeError and a missing GPU with an AssertionError deep in ``.to()``.
    """
    if name in ("auto", "cpu"):
        return name  # no torch import for the common cases
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"device {name!r}: expected auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"device {name!r}: this machine has {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1})"
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {name!r}: MPS is not available on this machine")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r}: expected auto, cpu, cuda or cuda:N")
    return name


device = _flag_type("device", check_device)


# --- TLS files ------------------------------------------------------------------------


def _read_pem(path: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        return p.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None


def check_pem_certificates(path: str) -> str:
    """A PEM file of one or more X.509 certificates (a chain or CA bundle).

    Parsed here because gRPC reports a bad certificate only as "Failed to bind
    to address" (server) or a failed handshake (client), naming no file.
    """
    from cryptography import x509

    data = _read_pem(path)
    try:
        x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ValueError(f"{path}: not a PEM certificate") from None
    return path


def check_pem_private_key(path: str) -> str:
    """A PEM private key without a passphrase (gRPC cannot decrypt one)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    data = _read_pem(path)
    try:
        load_pem_private_key(data, password=None)
    except TypeError:  # cryptography's way of saying "needs a password"
        raise ValueError(
            f"{path}: the private key is encrypted; gRPC needs an unencrypted key"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ValueError(f"{path}: not a PEM private key") from None
    return path


pem_certificates = _flag_type("pem_certificates", check_pem_certificates)
pem_private_key = _flag_type("pem_private_key", check_pem_private_key)


# --- names ----------------------------------------------------------------------------


def name_differences(
    expected: Iterable[str], given: Iterable[str], *, more: bool = False
) -> str | None:
    """ "missing [...], unexpected [...]": the first three (sorted) of the names
    ``expected`` but not ``given`` and of those ``given`` but not expected,
    with ``more`` a "..." after a longer list; None when the names agree."""
    expected, given = set(expected), set(given)
    if expected == given:
        return None

    def first(names: set[str]) -> str:
        shown = sorted(names)
        return f"{shown[:3]}{'...' * (more and len(shown) > 3)}"

    return f"missing {first(expected - given)}, unexpected {first(given - expected)}"


# --- run folders ----------------------------------------------------------------------


def holds_run(out: str | Path) -> bool:
    """Whether run folder ``out`` holds a run (its config.json)."""
    return (Path(out) / "config.json").is_file()


def check_resumable(out: str | Path) -> None:
    """``--resume`` needs a run to continue: refuse an empty or missing folder
    instead of quietly starting a new run the user did not ask for."""
    if not holds_run(out):
        raise ValueError(
            f"--resume: nothing to resume in {out} (no config.json); "
            "drop --resume to start a new run there"
        )


# --- JSON files from elsewhere --------------------------------------------------------

#: Larger than any config, index or tokenizer settings file a model ships with
#: (a 1 000-shard index is ~100 KB) by far, and small enough that parsing the
#: worst (millions of empty objects) stays within a few hundred MB.
MAX_JSON_BYTES = 16 * 2**20
#: Deeper than any of those files nests (tokenizer_config.json: 4 levels);
#: a deeper one is an attack on the parser, not a config.
MAX_JSON_DEPTH = 32


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


# A JSON string: brackets inside one do not nest.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def json_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest, read off the
    text before it is parsed (so a hostile file builds nothing): strings
    dropped, then the running count of open brackets, vectorised. (UTF-8
    bytes of non-ASCII characters are >= 0x80, never a bracket.)"""
    import numpy as np

    raw = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8"), dtype=np.uint8)
    opens = (raw == ord("[")) | (raw == ord("{"))
    closes = (raw == ord("]")) | (raw == ord("}"))
    if not opens.any():
        return 0
    return int(np.cumsum(opens.astype(np.int64) - closes).max())


def parse_json(
    text: str | bytes,
    where: str,
    *,
    error: type[ValueError] = ValueError,
    max_depth: int = MAX_JSON_DEPTH,
) -> object:
    """The JSON value of ``text`` (a file's content, or one line of a .jsonl),
    or ``error("WHERE: why")`` in one line: not JSON, nested deeper than
    ``max_depth``, or a non-finite number (NaN, Infinity, 1e400), which no
    setting here means."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8-sig")
        if json_depth(text) > max_depth:
            raise error(f"{where}: nested deeper than {max_depth} levels")
        return json.loads(
            text, parse_constant=_refuse_constant, parse_float=_finite_float
        )
    except RecursionError:  # unreachable past the depth check; kept as a guard
        raise error(f"{where}: nested deeper than {max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ones
        if isinstance(e, error) and str(e).startswith(f"{where}: nested"):
            raise
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise error(f"{where}: not valid JSON ({first})") from None


def read_json(
    path: str | Path,
    *,
    error: type[ValueError] = ValueError,
    kind: type | None = dict,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> object:
    """The JSON value of a file that came from elsewhere (a model folder's
    ``config.json``, a shard index, ``tokenizer_config.json``, ``--model
    FILE``), bounded before it is read: at most ``max_bytes``, nested at most
    ``max_depth`` deep, of type ``kind`` (None: any); ``error`` with one line
    naming the file otherwise. The one reader of every such file, so that
    none of them can be made to exhaust the parser."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(
                f"{path}: {size} bytes; larger than any JSON file of this kind "
                f"({max_bytes // 2**20} MiB at most)"
            )
        data = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    value = parse_json(data, str(path), error=error, max_depth=max_depth)
    if kind is not None and not isinstance(value, kind):
        name = {dict: "a JSON object", list: "a JSON array"}.get(kind, kind.__name__)
        raise error(f"{path}: must be {name}, got {type(value).__name__}")
    return value


def json_field(
    obj: dict,
    key: str,
    kind: type | tuple[type, ...],
    default: object,
    where: str,
    *,
    error: type[ValueError] = ValueError,
) -> object:
    """``obj[key]`` (``default`` if absent or null) if it is of ``kind``;
    ``error("WHERE: KEY must be ...")`` otherwise. bool is not an int here:
    ``"num_heads": true`` is a mistake, not 1."""
    value = obj.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = {
            int: "an integer",
            float: "a number",
            str: "a string",
            dict: "a JSON object",
            list: "a JSON array",
            bool: "true or false",
        }
        want = " or ".join(names.get(k, k.__name__) for k in kinds)
        raise error(f"{where}: {key} must be {want}, got {value!r:.60}")
    return value
