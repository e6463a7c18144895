"""Atomic checkpoints: safetensors for tensors, JSON for everything else.

A checkpoint is a folder ``checkpoints/step_00000100/`` holding
``model.safetensors`` (weights; the tied ``lm_head.weight`` is stored once, as
``transformer.wte.weight``), ``optimizer.safetensors`` (AdamW moments keyed by
parameter *name*, so a checkpoint can be split or merged by party, plus RNG
states) and ``state.json`` (step, data position, configs). It is written into
a temporary folder and renamed into place, then ``checkpoints/latest`` is
replaced atomically: a crash mid-write never leaves a half checkpoint that
``--resume`` would pick up, and never touches the previous one.
Nothing here unpickles anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from aisyn.data.cache import cache_dir
from aisyn.data.folder import publish_dir
from aisyn.model.families import hf_folder
from aisyn.model.hf import read_hf_tensors
from aisyn.validate import name_differences, read_json

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
#: a party's own modules beside the model (a split data party's bottleneck):
#: never sent, never merged into the model
PRIVATE_FILE = "private.safetensors"
STATE_FILE = "state.json"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or belongs to another model."""


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` with each shared tensor once (first name wins)."""
    seen: set[int] = set()
    out = {}
    # keep_vars: a tied parameter is then one object under both names, which
    # is how a meta model (no storage to compare) shows its ties.
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict(keep_vars=True).items():
        # a meta tensor has no storage, an FSDP2 shard's tells nothing of ties
        by_object = t.device.type == "meta" or isinstance(t, DTensor)
        key = id(t) if by_object else t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


def load_weights(
    model: nn.Module, tensors: dict[str, torch.Tensor], source: str
) -> None:
    """Copy ``tensors`` into ``model``, strictly; tied duplicates may be absent.

    Also accepts checkpoints of the public PanGu-α port, which store the tied
    ``lm_head.weight`` separately. A model built on the meta device takes the
    tensors themselves (in its dtype), on their device: no second copy of
    the weights, half the peak memory of copying into allocated ones.
    """
    expected = check_weights(model, tensors, source)
    if all(t.is_meta for t in expected.values()):
        state = {n: tensors[n].to(t.dtype) for n, t in expected.items()}
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()  # assign replaced the embedding a tied head shares
        return
    with torch.no_grad():
        for name, t in expected.items():
            t.copy_(tensors[name])


@torch.no_grad()
def load_exactly(
    expected: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    source: str,
    what: str,
) -> None:
    """Copy ``tensors`` into ``expected`` once every name and shape matches;
    CheckpointError (``source`` is not ``what``) naming the first difference
    otherwise."""
    if diff := name_differences(expected, tensors):
        raise CheckpointError(f"{source}: not {what} ({diff})")
    for name, t in expected.items():
        if tensors[name].shape != t.shape:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(tensors[name].shape)}, expected "
                f"{tuple(t.shape)}"
            )
    for name, t in expected.items():
        t.copy_(tensors[name])


def check_weights(
    model: nn.Module, tensors: dict[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """``load_weights``' checks alone (a model on the meta device will do):
    every name and shape; returns the model's tensors by name."""
    expected = unique_state_dict(model)
    aliases = set(model.state_dict()) - set(expected)  # tied weights, saved or not
    if diff := name_differences(expected, set(tensors) - aliases, more=True):
        raise CheckpointError(
            f"{source}: does not match this model ({diff}); a checkpoint of "
            "another config?"
        )
    for name, t in expected.items():
        if tensors[name].shape != t.shape:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(tensors[name].shape)}, this model "
                f"expects {tuple(t.shape)}; a checkpoint of another config?"
            )
    return expected


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str]
) -> dict[str, torch.Tensor]:
    out = {}
    for p, st in optimizer.state.items():
        for key, value in st.items():
            out[f"{names[p]}::{key}"] = torch.as_tensor(value).detach().contiguous()
    return out


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer,
    named_params: dict[str, nn.Parameter],
    tensors: dict[str, torch.Tensor],
    source: str,
) -> None:
    state: dict[nn.Parameter, dict] = {}
    for key, value in tensors.items():
        if key.startswith("rng."):
            continue
        name, _, field = key.rpartition("::")
        if name not in named_params:
            raise CheckpointError(
                f"{source}: optimizer state for unknown parameter {name}"
            )
        p = named_params[name]
        # a file from elsewhere: one line here, not a shape error (or NaN
        # weights) at the first step
        if value.dim() and value.shape != p.shape:
            raise CheckpointError(
                f"{source}: optimizer state {key} has shape "
                f"{tuple(value.shape)}, its parameter {tuple(p.shape)}"
            )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{source}: optimizer state {key} is not finite")
        state.setdefault(p, {})[field] = value.to(p.device)
    optimizer.state.clear()
    optimizer.state.update(state)


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    if "rng.cpu" in tensors:
        torch.set_rng_state(tensors["rng.cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def save(
    root: Path,
    step: int,
    files: dict[str, dict[str, torch.Tensor]],
    state: dict,
    keep: int = 2,
) -> Path:
    """Write ``files`` (name -> tensors) and ``state`` as step ``step``; atomic.

    Refuses (before writing anything) a tensor holding NaN or inf: a poisoned
    checkpoint would replace a good one and make every resume start from it.
    """
    for file, tensors in files.items():
        bad = first_nonfinite(tensors)
        if bad is not None:
            raise CheckpointError(
                f"not writing the checkpoint of step {step}: {bad} in {file} holds "
                "non-finite values; the earlier checkpoints are kept"
            )
    root.mkdir(parents=True, exist_ok=True)
    final = step_folder(root, step)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, tensors in files.items():
        save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp / name))
    (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
    _fsync_dir(tmp)
    # re-saving the same step (e.g. after resume) swaps safely
    publish_dir(tmp, final, old=root / f".{final.name}.old")
    _write_atomic(root / LATEST, final.name)
    if keep > 0:
        for old in sorted(root.glob("step_*"))[:-keep]:
            shutil.rmtree(old)
    return final


def step_folder(root: Path, step: int) -> Path:
    """The folder of step ``step``'s checkpoint under ``root`` (``step_00000100``;
    zero-padded, so that names sort by step)."""
    return root / f"step_{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root`` (oldest first); a folder
    without its state file is one a crash interrupted."""
    if not root.is_dir():
        return []
    out = []
    for d in root.glob("step_*"):
        try:
            step = int(d.name.removeprefix("step_"))
        except ValueError:
            continue
        if (d / STATE_FILE).is_file():
            out.append(step)
    return sorted(out)


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """Name of the first floating-point tensor holding NaN or inf, if any."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest(root: Path) -> Path | None:
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{pointer}: points at {path.name}, which is incomplete")
    return path


def read_state(ckpt: Path) -> dict:
    """A checkpoint's ``state.json``, read bounded (a base model's checkpoint
    may come from another organisation): CheckpointError in one line for a
    missing, oversized, too deeply nested or non-object file."""
    path = Path(ckpt) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: not a checkpoint (no {STATE_FILE})")
    return read_json(path, error=CheckpointError)


def model_file(path: str | Path) -> Path:
    """The weights file of a run folder (its latest checkpoint), a checkpoint
    folder, or a ``.safetensors`` file itself; ``hf:DIR`` (a Hugging Face
    model folder) stays as it is, for ``read_some_tensors``."""
    if hf_folder(path) is not None:
        return Path(str(path))
    path = Path(path)
    if path.is_dir() and (path / "checkpoints").is_dir():
        last = latest(path / "checkpoints")
        if last is None:
            raise CheckpointError(f"{path}: run has no checkpoint yet")
        path = last
    if path.is_dir():
        path = path / MODEL_FILE
    return path


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from None


def tensors_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """The one fingerprint of model weights: sha256 over the names, dtypes,
    shapes and bytes of ``tensors``, in name order.

    Over tensors rather than file bytes, so it names the weights whatever file
    holds them (a header differs between two saves of the same weights), and
    over any subset: a split run's parties compare the base model by the data
    party's tensors, which both hold; a federated run by all of them.
    """
    return _hash_tensors((name, tensors[name]) for name in sorted(tensors))


def _hash_tensors(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in items:
        t = t.contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


@contextlib.contextmanager
def opened(path: Path) -> Iterator:
    """A safetensors file opened by its header (``safe_open``): its tensors
    read one at a time, by name or slice; a file that is not one, or is cut
    short, raises CheckpointError in one line (every read of a safetensors
    file outside a whole-file ``read_tensors`` goes through here)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from None


def file_fingerprint(path: Path) -> str:
    """``tensors_fingerprint`` of every tensor in a safetensors file, memoised
    by (path, size, mtime) so a large base is hashed once."""
    st = path.stat()
    key = hashlib.sha1(
        f"tensors/1\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    )
    memo = cache_dir("fingerprints") / f"{key.hexdigest()}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    with opened(path) as f:  # one tensor at a time
        digest = _hash_tensors((n, f.get_tensor(n)) for n in sorted(f.keys()))
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def read_some_tensors(
    path: Path, shapes: dict[str, tuple[int, ...]], whose: str, *, read: bool = True
) -> dict[str, torch.Tensor]:
    """Read only the tensors named in ``shapes`` (name -> expected shape).

    A safetensors file is indexed by its header, so a party that owns a few
    tensors of a large model reads just those. Missing names or a wrong shape
    raise CheckpointError in one line; ``read=False`` only checks. ``path``
    may also be ``hf:DIR``, a Hugging Face model folder (see ``model_file``).
    """
    folder = hf_folder(path)
    if folder is not None:
        try:
            return read_hf_tensors(folder, shapes, whose, read=read)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    with opened(path) as f:
        missing = sorted(set(shapes) - set(f.keys()))
        if missing:
            raise CheckpointError(
                f"{path}: lacks {len(missing)} of the {len(shapes)} tensors "
                f"{whose} ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''})"
            )
        for name, shape in shapes.items():
            got = tuple(f.get_slice(name).get_shape())
            if got != tuple(shape):
                raise CheckpointError(
                    f"{path}: {name} has shape {got}, expected {tuple(shape)}; a "
                    "checkpoint of another config?"
                )
        return {name: f.get_tensor(name) for name in shapes} if read else {}
