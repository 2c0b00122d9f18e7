"""Parameters added after ``infinity.Init`` in a checkpoint: values and Adam states whole, written by rank 0.

[Note: unmanaged parameters in checkpoints]
An engine model may hold parameters no engine group does (peft's adapters added after the block, [Note:
unmanaged parameters] in infinity/optim/unmanaged.py). A save used to refuse them, as it could not leave
them out; now rank 0 writes each one's value and, once the optimizer has stepped it, torch's
``exp_avg``, ``exp_avg_sq`` and ``step``, as raw bytes in ``rank0/unmanaged.bin``, each listed in the
global manifest's ``unmanaged`` entries (name, state, dtype, shape, offset, bytes) the way module
buffers are, CRC-checked per chunk. A checkpoint is data: the entries are checked whole with the rest
of the manifest (infinity/checkpoint/schema.py), a load then checks them against the model (the same
names, shapes and dtypes, every state of a parameter or none) and reads them before anything is
written, and ``apply`` copies them in.
"""
from __future__ import annotations

import torch
from torch import nn

from infinity.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from infinity.checkpoint.manifest import dtype_name, dtype_of, read_small_file
from infinity.optim.unmanaged import STATES

FILE = "unmanaged"
KINDS = ("param",) + STATES


def params(engine, model: nn.Module) -> dict[str, nn.Parameter]:
    """``model``'s parameters that ``engine`` does not manage, by their first name, in model order."""
    managed = engine.coordinator.group_of
    return {name: p for name, p in model.named_parameters() if p not in managed}


def tensors(engine, model: nn.Module, opt) -> list[tuple[dict, torch.Tensor]]:
    """``(entry, tensor)`` for each value and Adam state to save, the entries' offsets in file order."""
    out, offset = [], 0
    for name, p in params(engine, model).items():
        states = opt.unmanaged.states_of(p) if opt is not None else {}
        for kind, t in [("param", p.detach())] + [(k, states[k]) for k in STATES if k in states]:
            nbytes = t.numel() * t.element_size()
            out.append(({"name": name, "state": kind, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                         "offset": offset, "nbytes": nbytes}, t))
            offset += nbytes
    return out


def read(saved, manifest: dict, engine, model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's values and states of ``model``'s unmanaged parameters, checked against the model and
    read (CRC-checked): ``{name: {state: tensor}}``. Nothing is changed."""
    wanted = params(engine, model)
    entries = manifest.get("unmanaged", [])
    saved_names = list(dict.fromkeys(e["name"] for e in entries))
    if saved_names != list(wanted):
        missing = [n for n in wanted if n not in saved_names]
        unexpected = [n for n in saved_names if n not in wanted]
        raise CheckpointMismatchError(
            f"parameters added after infinity.Init (not managed by infinity: peft's adapters) differ: in the model "
            f"only: {missing[:3]}{' ...' if len(missing) > 3 else ''}; in the checkpoint only: {unexpected[:3]}"
            f"{' ...' if len(unexpected) > 3 else ''}" + ("; or in another order" if not (missing or unexpected)
                                                          else ""))
    if not entries:
        return {}
    record = saved.file(0, FILE, needed=True)
    raw = read_small_file(saved.directory, record)
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in wanted}
    for entry in entries:
        name, kind = entry["name"], entry["state"]
        p = wanted[name]
        dtype = dtype_of(entry["dtype"])
        want_shape, want_dtype = ((tuple(p.shape), p.dtype) if kind in ("param", "exp_avg", "exp_avg_sq")
                                  else (None, None))
        if kind in out[name]:
            raise CheckpointCorruptError(f"{saved.path_of(record)}: {name!r} has its {kind} twice")
        if want_shape is not None and (tuple(entry["shape"]) != want_shape or dtype != want_dtype):
            raise CheckpointMismatchError(f"parameter {name!r} (added after infinity.Init) is {want_dtype} "
                                          f"{want_shape} in the model but its {kind} is {dtype} "
                                          f"{tuple(entry['shape'])} in the checkpoint")
        if kind == "step" and (tuple(entry["shape"]) != () or not dtype.is_floating_point):
            raise CheckpointCorruptError(f"{saved.path_of(record)}: the Adam step of {name!r} is not one number")
        chunk = bytearray(raw[entry["offset"]:entry["offset"] + entry["nbytes"]])
        if len(chunk) != entry["nbytes"]:
            raise CheckpointCorruptError(f"{saved.path_of(record)}: the {kind} of {name!r} reaches past the end of "
                                         f"the file ({len(raw)} bytes)")
        value = torch.frombuffer(chunk, dtype=dtype) if chunk else torch.empty(0, dtype=dtype)
        out[name][kind] = value.reshape(entry["shape"])
    for name, states in out.items():
        if "param" not in states or 1 < len(states) < len(KINDS):
            raise CheckpointCorruptError(f"{saved.path_of(record)}: {name!r} has {sorted(states)}, not its value "
                                         f"with every Adam state ({list(STATES)}) or none")
    return out


def apply(values: dict[str, dict[str, torch.Tensor]], engine, model: nn.Module, opt) -> None:
    """Copy what ``read`` returned into the parameters and, with ``opt``, their Adam states."""
    wanted = params(engine, model)
    with torch.no_grad():
        for name, states in values.items():
            p = wanted[name]
            p.copy_(states["param"])
            if opt is not None:
                opt.unmanaged.load_states(p, {k: v for k, v in states.items() if k != "param"})
