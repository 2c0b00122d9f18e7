"""Every field of a checkpoint's manifests checked before anything uses it.

[Note: manifests are checked whole]
A manifest is JSON anyone can edit (its CRC-32 in ``COMMIT`` has no key, [Note: checksums]), and the code
that reads it used to trust its shape: a removed key surfaced as a ``KeyError`` deep in a load, a negative
shard size made ``SavedLayout.locate`` loop forever, a shape of ``[2e9]`` over 16 bytes had consolidate write
an 8 GB file, RNG states were applied unchecked. So the global manifest and each rank's are checked here,
whole, as they are read (``SavedCheckpoint``): every type, every range, and the fields against each other
(group starts against shard sizes, parameter offsets inside their group, a shape's elements against its
count, a buffer's bytes against its shape and dtype, a tiled join's sizes against its shape). A failure is a
``CheckpointCorruptError`` naming the file and the field, raised before anything is allocated, read or
changed. What a field means stays with its reader; this module only says what a save could have written.
"""
from __future__ import annotations

import math
import re

import torch

from infinity.checkpoint.errors import CheckpointCorruptError
from infinity.checkpoint.manifest import CHUNK_NBYTES, MIN_CHUNK_NBYTES, _DTYPES, itemsize

_MAX_NUMEL = 1 << 50       # elements of one group or tensor: past any real model
_MAX_ITEMS = 1 << 24       # groups, parameters, buffers, keys
_MAX_DIMS = 64
_MAX_NAME = 4096
_HYPER_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
_MAX_HYPER_ITEMS = 256


class _Field:
    """One field's place in a manifest, for the error: ``manifest.json: groups[3].params[0].shape``."""

    def __init__(self, where: str, path: str = "") -> None:
        self.where, self.path = where, path

    def at(self, key) -> "_Field":
        if isinstance(key, int):
            return _Field(self.where, f"{self.path}[{key}]")
        return _Field(self.where, f"{self.path}.{key}" if self.path else str(key))

    def fail(self, problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.where}: field {self.path or '(the manifest)'} {problem}; the checkpoint "
                                      "was edited or damaged, nothing was loaded from it")

    def get(self, data: dict, key: str):
        if key not in data:
            raise self.at(key).fail("is missing")
        return data[key]


def _int(value, field: _Field, lo: int = 0, hi: int = _MAX_NUMEL) -> int:
    if type(value) is not int:
        raise field.fail(f"is {type(value).__name__}, not an integer")
    if not lo <= value <= hi:
        raise field.fail(f"is {value}, outside {lo}..{hi}")
    return value


def _number(value, field: _Field) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise field.fail(f"is {str(value)[:40]!r}, not a finite number")
    return value


def _str(value, field: _Field, limit: int = _MAX_NAME) -> str:
    if type(value) is not str or len(value) > limit:
        raise field.fail(f"is {type(value).__name__}, not a string of at most {limit} characters")
    return value


def _exactly(kind: type, words: str):
    """A check that a value is of JSON type ``kind`` (no subclass: a bool is no int), said as ``words``."""
    def check(value, field: _Field):
        if type(value) is not kind:
            raise field.fail(f"is {type(value).__name__}, not {words}")
        return value

    return check


_bool = _exactly(bool, "true or false")
_dict = _exactly(dict, "an object")


def _list(value, field: _Field, limit: int = _MAX_ITEMS) -> list:
    if type(value) is not list or len(value) > limit:
        raise field.fail(f"is {type(value).__name__}, not a list of at most {limit} items")
    return value


def _dtype(value, field: _Field) -> str:
    if value not in _DTYPES:
        raise field.fail(f"is {str(value)[:40]!r}, not one of {', '.join(_DTYPES)}")
    return value


def _shape(value, field: _Field) -> int:
    """A tensor shape; returns its element count."""
    numel = 1
    for i, d in enumerate(_list(value, field, _MAX_DIMS)):
        numel *= _int(d, field.at(i))
        if numel > _MAX_NUMEL:
            raise field.fail(f"has {numel} or more elements, past {_MAX_NUMEL}")
    return numel


def _names(value, field: _Field) -> list:
    names = _list(value, field)
    for i, name in enumerate(names):
        _str(name, field.at(i))
    return names


def check_commit(commit: dict, where: str) -> None:
    """``COMMIT`` past its format, version and world size (checked first, by the caller): the step and the
    table of the manifests' CRC-32s."""
    top = _Field(where)
    _int(commit.get("step", 0), top.at("step"))
    _str(commit.get("id", ""), top.at("id"))
    for rel, crc in _dict(top.get(commit, "manifests"), top.at("manifests")).items():
        _int(crc, top.at("manifests").at(str(rel)[:80]), 0, (1 << 32) - 1)


def check_global(manifest: dict, where: str, world_size: int) -> None:
    """The global manifest (``manifest.json``) of a checkpoint saved on ``world_size`` ranks (its COMMIT's)."""
    top = _Field(where)
    for key in ("format", "id"):
        _str(top.get(manifest, key), top.at(key))
    _int(top.get(manifest, "step"), top.at("step"))
    if _int(top.get(manifest, "world_size"), top.at("world_size"), 1) != world_size:
        raise top.at("world_size").fail(f"is {manifest['world_size']}, COMMIT says {world_size}")
    chunk = _int(top.get(manifest, "chunk_nbytes"), top.at("chunk_nbytes"), MIN_CHUNK_NBYTES, CHUNK_NBYTES)
    if chunk % MIN_CHUNK_NBYTES:
        raise top.at("chunk_nbytes").fail(f"is {chunk}, not a multiple of {MIN_CHUNK_NBYTES}")
    _dtype(top.get(manifest, "param_dtype"), top.at("param_dtype"))
    for key in ("in_place", "moments_initialized"):
        _bool(manifest.get(key, False), top.at(key))
    _number(manifest.get("created", 0), top.at("created"))
    _check_groups(manifest, top, world_size)
    _check_buffers(_list(top.get(manifest, "buffers"), top.at("buffers")), top.at("buffers"))
    _check_unmanaged(_list(manifest.get("unmanaged", []), top.at("unmanaged")), top.at("unmanaged"))
    _names(top.get(manifest, "state_dict_keys"), top.at("state_dict_keys"))
    _names(manifest.get("skipped_keys", []), top.at("skipped_keys"))
    _check_joins(_list(manifest.get("joins", []), top.at("joins")), top.at("joins"))
    if manifest.get("optimizer") is not None:
        _check_optimizer(_dict(manifest["optimizer"], top.at("optimizer")), top.at("optimizer"))
    _dict(manifest.get("config", {}), top.at("config"))


def _check_groups(manifest: dict, top: _Field, world_size: int) -> None:
    layout = _dict(top.get(manifest, "layout"), top.at("layout"))
    field = top.at("layout")
    _int(field.get(layout, "sub_group_size"), field.at("sub_group_size"))
    total = _int(field.get(layout, "total_numel"), field.at("total_numel"))
    starts = _list(field.get(layout, "group_starts"), field.at("group_starts"))
    groups = _list(top.get(manifest, "groups"), top.at("groups"))
    if len(starts) != len(groups):
        raise field.at("group_starts").fail(f"has {len(starts)} entries for {len(groups)} groups")
    end, named = 0, {}
    for gi, (start, group) in enumerate(zip(starts, groups)):
        gfield = top.at("groups").at(gi)
        _dict(group, gfield)
        if _int(gfield.get(group, "index"), gfield.at("index")) != gi:
            raise gfield.at("index").fail(f"is {group['index']}, its place is {gi}")
        _str(gfield.get(group, "module"), gfield.at("module"))
        _bool(gfield.get(group, "trainable"), gfield.at("trainable"))
        numel = _int(gfield.get(group, "numel"), gfield.at("numel"))
        shard = _int(gfield.get(group, "shard_numel"), gfield.at("shard_numel"), 1)
        if shard * world_size < numel:
            raise gfield.at("shard_numel").fail(f"is {shard}: {world_size} shards cannot hold the group's {numel} "
                                                "elements")
        if _int(start, field.at("group_starts").at(gi)) != end:
            raise field.at("group_starts").at(gi).fail(f"is {start}; the groups before end at element {end}")
        end += shard
        params = _list(gfield.get(group, "params"), gfield.at("params"))
        for pi, param in enumerate(params):
            pfield = gfield.at("params").at(pi)
            _dict(param, pfield)
            names = _names(pfield.get(param, "names"), pfield.at("names"))
            if not names:
                raise pfield.at("names").fail("is empty")
            for name in names:      # one name for two parameters: one of them would be read as the other
                if named.setdefault(name, (gi, pi)) != (gi, pi):
                    raise pfield.at("names").fail(f"names {name!r}, which groups[{named[name][0]}].params"
                                                  f"[{named[name][1]}] names too")
            count = _shape(pfield.get(param, "shape"), pfield.at("shape"))
            if _int(pfield.get(param, "numel"), pfield.at("numel")) != count:
                raise pfield.at("numel").fail(f"is {param['numel']}, its shape holds {count}")
            offset = _int(pfield.get(param, "offset"), pfield.at("offset"))
            if offset + count > numel:
                raise pfield.at("offset").fail(f"is {offset}: {count} elements from there leave the group's {numel}")
    if total != end:
        raise field.at("total_numel").fail(f"is {total}; the groups' shards add up to {end}")


def _check_buffers(buffers: list, field: _Field) -> None:
    for i, entry in enumerate(buffers):
        bfield = field.at(i)
        _dict(entry, bfield)
        _str(bfield.get(entry, "name"), bfield.at("name"))
        dtype = _dtype(bfield.get(entry, "dtype"), bfield.at("dtype"))
        count = _shape(bfield.get(entry, "shape"), bfield.at("shape"))
        _int(bfield.get(entry, "offset"), bfield.at("offset"))
        nbytes = count * itemsize(getattr(torch, dtype))
        if _int(bfield.get(entry, "nbytes"), bfield.at("nbytes")) != nbytes:
            raise bfield.at("nbytes").fail(f"is {entry['nbytes']}; a {dtype} tensor of that shape has {nbytes}")


def _check_unmanaged(entries: list, field: _Field) -> None:
    """Parameters added after Init ([Note: unmanaged parameters in checkpoints]): buffers with a state."""
    _check_buffers(entries, field)
    for i, entry in enumerate(entries):
        if entry.get("state") not in _UNMANAGED_STATES:
            raise field.at(i).at("state").fail(f"is {str(entry.get('state'))[:40]!r}, not one of {_UNMANAGED_STATES}")


_UNMANAGED_STATES = ("param", "exp_avg", "exp_avg_sq", "step")


def _check_joins(joins: list, field: _Field) -> None:
    for i, join in enumerate(joins):
        jfield = field.at(i)
        _dict(join, jfield)
        _str(jfield.get(join, "key"), jfield.at("key"))
        shape = jfield.get(join, "shape")
        _shape(shape, jfield.at("shape"))
        dim = _int(jfield.get(join, "dim"), jfield.at("dim"), 0, max(len(shape) - 1, 0))
        sizes = _list(jfield.get(join, "sizes"), jfield.at("sizes"))
        for k, n in enumerate(sizes):
            _int(n, jfield.at("sizes").at(k), 1)
        if not shape or sum(sizes) != shape[dim]:
            raise jfield.at("sizes").fail(f"add up to {sum(sizes)}, not the shape's {shape[dim] if shape else '?'}")
        if len(_names(jfield.get(join, "parts"), jfield.at("parts"))) != len(sizes):
            raise jfield.at("parts").fail(f"names {len(join['parts'])} tiles for {len(sizes)} sizes")


def _check_optimizer(saved: dict, field: _Field) -> None:
    _str(field.get(saved, "class"), field.at("class"))
    _int(field.get(saved, "step"), field.at("step"))
    _int(saved.get("skipped_steps", 0), field.at("skipped_steps"))
    _hyper(_dict(field.get(saved, "hyper"), field.at("hyper")), field.at("hyper"))
    for gi, group in enumerate(_list(saved.get("groups", []), field.at("groups"))):
        _hyper(_dict(group, field.at("groups").at(gi)), field.at("groups").at(gi))
    steps = _dict(saved.get("param_steps", {}), field.at("param_steps"))
    for name, step in steps.items():
        _int(step, field.at("param_steps").at(str(name)[:80]))
    if saved.get("loss_scale") is not None:
        _dict(saved["loss_scale"], field.at("loss_scale"))


def hyper_problem(key, value) -> str | None:
    """What keeps an optimizer hyper-parameter out of a checkpoint, in words (None: it can be saved). The
    writer refuses at the save what the reader would call damage at the load."""
    if type(key) is not str or not _HYPER_KEY.fullmatch(key) or key == "params":
        return f"its name {str(key)[:40]!r} is not a hyper-parameter name a checkpoint holds"
    items = value if type(value) is list else [value]
    if len(items) > _MAX_HYPER_ITEMS:
        return f"a list of {len(items)} values (at most {_MAX_HYPER_ITEMS})"
    for item in items:
        if item is not None and type(item) not in (bool, int, float, str):
            return f"it holds {type(item).__name__} (numbers, strings, None, or a flat list of them)"
        if type(item) is str and len(item) > _MAX_NAME:
            return "a string longer than a checkpoint holds"
    return None


def _hyper(hyper: dict, field: _Field) -> None:
    """An optimizer group's hyper-parameters: what a save writes (``hyper_problem``), never ``params``."""
    for key, value in hyper.items():
        problem = hyper_problem(key, value)
        if problem is not None:
            raise field.at(str(key)[:40]).fail(problem)


def check_rank(manifest: dict, where: str, rank: int, world_size: int) -> None:
    """Rank ``rank``'s manifest: its rank and world size, a table of file records (each checked as it is
    used, ``FileRecord.from_json``) and its generator states (``rng.check``)."""
    from infinity.checkpoint import rng

    top = _Field(where)
    if _int(top.get(manifest, "rank"), top.at("rank")) != rank:
        raise top.at("rank").fail(f"is {manifest['rank']}, the manifest of rank {rank}")
    if _int(top.get(manifest, "world_size"), top.at("world_size"), 1) != world_size:
        raise top.at("world_size").fail(f"is {manifest['world_size']}, COMMIT says {world_size}")
    files = _dict(top.get(manifest, "files"), top.at("files"))
    for name, record in files.items():
        _dict(record, top.at("files").at(str(name)[:80]))
    if manifest.get("swap") is not None:
        _check_swap(_dict(manifest["swap"], top.at("swap")), top.at("swap"))
    if manifest.get("rng") is not None:
        try:
            rng.check(_dict(manifest["rng"], top.at("rng")))
        except ValueError as exc:
            raise top.at("rng").fail(f"is not a generator state a save writes ({exc})") from None


def _check_swap(swap: dict, field: _Field) -> None:
    """A checkpoint in place's record of its sealed swap files and where each state lies in them (the files'
    names are checked again where they are opened: ``in_place._open_sealed``)."""
    _str(field.get(swap, "label"), field.at("label"))
    directories = _names(field.get(swap, "directories"), field.at("directories"))
    files = _names(field.get(swap, "files"), field.at("files"))
    if len(files) > max(len(directories), 1) * 64:
        raise field.at("files").fail(f"names {len(files)} files for {len(directories)} directories")
    roles = _dict(field.get(swap, "roles"), field.at("roles"))
    for role, record in roles.items():
        rfield = field.at("roles").at(str(role)[:80])
        _dict(record, rfield)
        nbytes = _int(rfield.get(record, "nbytes"), rfield.at("nbytes"))
        _int(rfield.get(record, "crc32"), rfield.at("crc32"), 0, (1 << 32) - 1)
        place = _dict(rfield.get(record, "placement"), rfield.at("placement"))
        pfield = rfield.at("placement")
        if set(place) != {"files", "offsets", "sizes", "stripe_nbytes"}:
            raise pfield.fail("does not hold files, offsets, sizes and stripe_nbytes")
        indices = _list(place["files"], pfield.at("files"), len(files))
        offsets = _list(place["offsets"], pfield.at("offsets"), len(files))
        sizes = _list(place["sizes"], pfield.at("sizes"), len(files))
        if not indices or len(offsets) != len(indices) or len(sizes) != len(indices):
            raise pfield.fail("lists files, offsets and sizes of different lengths")
        for j, (index, offset, size) in enumerate(zip(indices, offsets, sizes)):
            _int(index, pfield.at("files").at(j), 0, len(files) - 1)
            _int(offset, pfield.at("offsets").at(j))
            _int(size, pfield.at("sizes").at(j))
        _int(place["stripe_nbytes"], pfield.at("stripe_nbytes"), 1)
        if sum(sizes) != nbytes:
            raise pfield.at("sizes").fail(f"add up to {sum(sizes)}, not the state's {nbytes} bytes")
