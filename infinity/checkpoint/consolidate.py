"""One ordinary state dict from a sharded checkpoint, streamed, without the model.

[Note: streaming into torch.save's format]
``torch.save`` needs every tensor in memory at once. Instead we let torch write the
file's skeleton: under ``torch.serialization.skip_data`` it pickles a dict of
*fake* tensors (``FakeTensorMode``: shapes and dtypes, no memory) and reserves each
storage's bytes in the zip archive without writing them. We then find each
storage record's data offset in the archive (standard zip headers; storage ``k``
is the ``k``-th distinct tensor in dict order, which is how ``torch.save`` numbers
them) and stream the values there, window by window, straight from the checkpoint's
fp32 master shards, converting to the requested dtype on the way. Tied parameters
are one tensor under several keys, so they share one storage as in ``torch.save``
of the plain model. A tiled layer (infinity/tiling/layers.py) is written as the plain
layer's tensor under its untiled key, each tile's values placed at their rows (or
columns) of the joined tensor. Last, the CRC-32 fields of the zip records are filled in, so
the archive passes ``zipfile.testzip()``; the result is read by ``torch.load``
(``weights_only=True``, ``mmap=True`` too) like any file ``torch.save`` writes.
Host memory is one window of the checkpoint (``checkpoint.buffer_size``) plus one
converted window, whatever the model size.

Safetensors files are written directly (an 8-byte header length, a JSON header,
the tensors back to back), with the same streaming; the format forbids shared
storage, so a tied parameter is written once per name.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
import time
import zipfile
import zlib

import torch

from infinity.checkpoint import safetensors_file
from infinity.checkpoint.directory import SavedCheckpoint
from infinity.checkpoint.disk import free_bytes, human
from infinity.checkpoint.errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError
from infinity.checkpoint.manifest import LATEST, dtype_of, fsync_dir, itemsize, read_small_file
from infinity.checkpoint.reshard import SavedLayout
from infinity.checkpoint.stream import Run, StreamIO, _Done, _pwrite_all, read_runs
from tiers import newfile

_STATES = ("master", "exp_avg", "exp_avg_sq")


class _Entry:
    """One tensor of the output: a saved parameter, the join of a tiled layer's tiles, or a buffer.

    ``parts`` lists ``(saved parameter, segment, stride, shift)``: the parameter's elements go to
    the output in runs of ``segment`` elements placed ``stride`` apart from element ``shift``
    (a plain parameter: one run; a tile of a layer split along dimension d > 0: one run per
    index of the dimensions before d). ``buffer`` is the manifest entry of a buffer.
    """

    def __init__(self, key: str, shape, src_dtype: torch.dtype, out_dtype: torch.dtype, parts=(), buffer=None):
        self.key, self.shape, self.src_dtype, self.out_dtype = key, tuple(shape), src_dtype, out_dtype
        self.parts, self.buffer = list(parts), buffer
        self.numel = 1
        for d in self.shape:
            self.numel *= d

    @property
    def out_nbytes(self) -> int:
        return self.numel * itemsize(self.out_dtype)

    @property
    def identity(self):
        """Entries with one identity are one tensor (a tied parameter under several names)."""
        if self.buffer is not None:
            return ("buffer", self.key)
        return tuple((p.group, p.offset, seg, stride, shift) for p, seg, stride, shift in self.parts)


def _join_parts(join: dict, layout: SavedLayout) -> list:
    """The tiles of a tiled layer as ``(saved parameter, segment, stride, shift)`` (see ``_Entry``)."""
    shape, dim = join["shape"], join["dim"]
    inner = 1
    for d in shape[dim + 1:]:
        inner *= d
    parts, start = [], 0
    for name, size in zip(join["parts"], join["sizes"]):
        if name not in layout.by_name:
            raise CheckpointError(f"consolidate: tile {name!r} of {join['key']!r} is not in the checkpoint")
        parts.append((layout.by_name[name], size * inner, shape[dim] * inner, start * inner))
        start += size
    return parts


def _entries(manifest: dict, layout: SavedLayout, dtype: torch.dtype, with_buffers: bool = True) -> list[_Entry]:
    buffers = {e["name"]: e for e in manifest["buffers"]} if with_buffers else {}
    if with_buffers:    # parameters added after Init, saved whole ([Note: unmanaged parameters in checkpoints])
        buffers.update({e["name"]: dict(e, file="unmanaged") for e in manifest.get("unmanaged", [])
                        if e["state"] == "param"})
    joins = {j["key"]: j for j in manifest.get("joins", [])}
    tiles = {name for j in joins.values() for name in j["parts"]}
    keys = list(manifest["state_dict_keys"])
    listed = set(keys)
    keys += [n for p in layout.params for n in p.names if n not in listed and n not in tiles]
    entries = []
    for key in keys:
        if key in joins:
            entries.append(_Entry(key, joins[key]["shape"], torch.float32, dtype, _join_parts(joins[key], layout)))
        elif key in layout.by_name:
            p = layout.by_name[key]
            entries.append(_Entry(key, p.shape, torch.float32, dtype, [(p, p.numel, p.numel, 0)]))
        elif key in buffers:
            b = buffers[key]
            src = dtype_of(b["dtype"])
            entries.append(_Entry(key, b["shape"], src, dtype if src.is_floating_point else src, buffer=b))
    return entries


class _FileDest:
    """Values of ``src`` dtype into the output file at ``base``, converted to ``out`` dtype.

    Element ``e`` of the source goes to element ``(e // segment) * stride + shift + e % segment``
    of the output tensor (the identity for a plain parameter: ``segment == stride``, ``shift == 0``).
    """

    def __init__(self, fd: int, base: int, src: torch.dtype, out: torch.dtype, segment: int = 0, stride: int = 0,
                 shift: int = 0) -> None:
        self.fd, self.base, self.src, self.out = fd, base, src, out
        self.src_item, self.out_item = itemsize(src), itemsize(out)
        self.segment, self.stride, self.shift = segment, stride, shift

    def write(self, dest_offset: int, data: torch.Tensor):
        if self.src != self.out:
            data = data.view(self.src).to(self.out).view(torch.uint8)
        first = dest_offset // self.src_item
        if not self.segment or (self.segment == self.stride and not self.shift):
            _pwrite_all(self.fd, data, self.base + first * self.out_item)
            return _Done()
        done, numel = 0, data.numel() // self.out_item
        while done < numel:
            row, within = divmod(first + done, self.segment)
            take = min(self.segment - within, numel - done)
            at = (row * self.stride + self.shift + within) * self.out_item
            _pwrite_all(self.fd, data[done * self.out_item:(done + take) * self.out_item], self.base + at)
            done += take
        return _Done()


def _refuse_unwritable_output(out: str) -> None:
    """An output that cannot be written is refused before the state dict is streamed (minutes at scale)."""
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise CheckpointError(f"consolidate: the output {out} is a directory; give a file name")
    if os.path.exists(out) and not os.path.islink(out) and not stat.S_ISREG(os.stat(out).st_mode):
        # The output replaces what is there (a temporary file renamed over it): a device or a FIFO would go.
        raise CheckpointError(f"consolidate: the output {out} exists and is not a regular file; give a file name")
    if not os.path.isdir(parent):
        raise CheckpointError(f"consolidate: the output's directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
        raise CheckpointError(f"consolidate: the output {out} is not writable (no write permission on "
                              f"{out if os.path.exists(out) else parent})")


def _refuse_output_inside(out: str, directories: list[str]) -> None:
    """An output inside the checkpoint it is made from could replace one of its files (``CK/latest``) or
    be retired with an old version by the next save: refuse it, before anything is written."""
    target = os.path.realpath(out)
    for directory in directories:
        root = os.path.realpath(directory)
        if target == root or target.startswith(root + os.sep):
            raise CheckpointError(f"consolidate: the output {out} is inside the checkpoint {directory} it reads; "
                                  "write it outside the checkpoint directory")


def check_buffer_size(nbytes) -> int:
    """``nbytes`` as ``checkpoint.buffer_size`` takes it (an int, or a size such as "64MiB"), in bytes;
    ``ValueError`` saying why it is refused."""
    from infinity.config.sections import CheckpointConfig
    from infinity.config.values import ConfigError

    try:
        return CheckpointConfig(buffer_size=nbytes).buffer_size
    except ConfigError as exc:
        raise ValueError(exc.reason) from None


def consolidate(ckpt: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype = torch.float32, *,
                safetensors: bool = False, buffer_size: int | str | None = None, state: str = "master") -> dict:
    """Write the checkpoint's model as one ordinary state dict, streaming (see the module note).

    Parameters
    ----------
    ckpt:
        A checkpoint directory (its ``latest`` version) or a version directory.
    out:
        The file to write (replaced atomically when complete).
    dtype:
        dtype of the parameters (and floating-point buffers); values come from the fp32 masters.
    safetensors:
        Write the safetensors format instead of ``torch.save``'s.
    buffer_size:
        Bytes read from the checkpoint at a time, or a size such as ``"16MiB"``, as
        ``checkpoint.buffer_size`` takes it (default: the ``[checkpoint]`` default, 64 MiB).
    state:
        Which saved state each parameter's tensor holds: ``"master"`` (the parameters), or Adam's
        ``"exp_avg"`` / ``"exp_avg_sq"`` under the parameters' names (no buffers): fp32 values
        whatever ``[optimizer] state_dtype`` the run stored them in (see [Note: moments in
        checkpoints] in infinity/checkpoint/moments.py).

    Returns
    -------
    dict
        ``tensors``, ``nbytes`` written, ``seconds``, ``format`` and the source ``directory``.

    Examples
    --------
    >>> consolidate("ckpt", "model.pt")                            # doctest: +SKIP
    >>> GPT().load_state_dict(torch.load("model.pt"))              # doctest: +SKIP
    """
    from infinity.config import load_config

    t0 = time.perf_counter()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"consolidate: dtype must be float32, bfloat16 or float16, got {dtype}")
    if state not in _STATES:
        raise ValueError(f"consolidate: state must be one of {', '.join(_STATES)}, got {state!r}")
    if buffer_size is not None:     # checked before anything is read
        try:
            buffer_size = check_buffer_size(buffer_size)
        except ValueError as exc:
            raise ValueError(f"consolidate: buffer_size: {exc}") from None
    saved = SavedCheckpoint(ckpt)
    saved.refuse_in_place("infinity-consolidate")
    out = os.fspath(out)
    parent = os.path.dirname(os.path.abspath(saved.directory))    # the directory its save commits into
    _refuse_output_inside(out, [os.fspath(ckpt), saved.directory]
                          + ([parent] if os.path.isfile(os.path.join(parent, LATEST)) else []))
    _refuse_unwritable_output(out)
    manifest = saved.manifest
    layout = SavedLayout(manifest)
    entries = _entries(manifest, layout, dtype, with_buffers=state == "master")
    # A random name, created anew and written through its descriptor: [Note: temporary names on a shared disk].
    fd, tmp = newfile.create(os.path.dirname(os.path.abspath(out)), prefix=f".{os.path.basename(out)}.tmp-")
    config = load_config(None)
    try:
        with os.fdopen(fd, "r+b", closefd=False) as f:
            if safetensors:
                offsets = _safetensors_skeleton(f, entries, manifest)
            else:
                offsets = _torch_skeleton(f, tmp, entries)
        _fill(saved, layout, entries, offsets, fd, config, buffer_size or config.checkpoint.buffer_size, state)
        if not safetensors:
            with os.fdopen(fd, "r+b", closefd=False) as f:
                _fix_zip_crcs(f)
        os.fsync(fd)
        os.replace(tmp, out)
        fsync_dir(os.path.dirname(os.path.abspath(out)))
    except BaseException as exc:
        need = os.fstat(fd).st_size
        os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            free = free_bytes(os.path.dirname(os.path.abspath(out)))
            raise CheckpointWriteError(
                f"writing {out}: {exc.strerror or os.strerror(exc.errno)} ({errno.errorcode.get(exc.errno, exc.errno)})"
                + (f"; the output needs {human(need)}" if need else "")
                + (f", its filesystem has {human(free)} free" if free is not None else "")
                + "; the partial file was removed, the checkpoint is untouched", exc.errno) from exc
        raise
    finally:
        os.close(fd)
    return {"directory": saved.directory, "tensors": len(entries), "nbytes": os.path.getsize(out),
            "seconds": time.perf_counter() - t0, "format": "safetensors" if safetensors else "torch"}


def _fill(saved, layout, entries, offsets, fd, config, buffer_size, state: str = "master") -> None:
    files, runs, done = {}, [], set()
    for entry in entries:
        if not entry.parts or not _shares_storage(entry, offsets, done):
            continue
        for p, segment, stride, shift in entry.parts:
            dest = _FileDest(fd, offsets[entry.key], torch.float32, entry.out_dtype, segment, stride, shift)
            for rank, flat, rel, n in layout.locate(p.group, p.offset, p.numel):
                key = f"rank{rank}/{state}"
                if key not in files:
                    record = saved.file(rank, state, needed=True)
                    files[key] = (saved.path_of(record), record)
                runs.append(Run(key, flat * 4, n * 4, dest, rel * 4))
    with StreamIO(config.aio, buffer_size) as io:
        read_runs(io, files, runs)
    for file in ("buffers", "unmanaged"):
        buffers = [e for e in entries if e.buffer is not None and e.buffer.get("file", "buffers") == file]
        if not buffers:
            continue
        record = saved.file(0, file, needed=True)
        raw = read_small_file(saved.directory, record)
        for entry in buffers:
            b = entry.buffer
            chunk = bytearray(raw[b["offset"]:b["offset"] + b["nbytes"]])
            if len(chunk) != b["nbytes"]:
                raise CheckpointCorruptError(f"{saved.path_of(record)}: buffer {b['name']!r} reaches past the end "
                                             f"of the file ({len(raw)} bytes)")
            if chunk:
                _FileDest(fd, offsets[entry.key], entry.src_dtype, entry.out_dtype).write(
                    0, torch.frombuffer(chunk, dtype=torch.uint8))


def _shares_storage(entry: _Entry, offsets: dict, done: set) -> bool:
    """Whether this entry's bytes still need writing (aliases sharing one storage are written once)."""
    where = offsets[entry.key]
    if where in done:
        return False
    done.add(where)
    return True


def _torch_skeleton(f, path: str, entries: list[_Entry]) -> dict[str, int]:
    """``torch.save`` of fake tensors with data skipped into the empty file ``f`` (named ``path`` in errors);
    returns each key's data offset in the file."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tensors, order = {}, []
    with FakeTensorMode():
        for e in entries:
            if e.identity not in tensors:
                tensors[e.identity] = torch.empty(e.shape, dtype=e.out_dtype)
                order.append(e.identity)
    state = {e.key: tensors[e.identity] for e in entries}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, f)
    f.flush()
    nbytes = {e.identity: e.out_nbytes for e in entries}
    records = _zip_data_records(f)
    offsets_of = {}
    for index, identity in enumerate(order):
        record = records.get(str(index))
        if record is None or record[1] != nbytes[identity]:
            raise CheckpointError(f"consolidate: torch.save laid out {path} differently than expected (storage {index}"
                                  f" is {record}, expected {nbytes[identity]} bytes); this torch version is not "
                                  "supported by infinity-consolidate, use --safetensors")
        offsets_of[identity] = record[0]
    return {e.key: offsets_of[e.identity] for e in entries}


def _zip_data_records(f) -> dict[str, tuple[int, int]]:
    """``{storage key: (data offset, size)}`` of the ``<archive>/data/<key>`` records of the zip file ``f``."""
    out = {}
    f.seek(0)
    with zipfile.ZipFile(f) as z:
        for info in z.infolist():
            head, _, key = info.filename.rpartition("/")
            if head.rpartition("/")[2] != "data":
                continue
            f.seek(info.header_offset)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            out[key] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return out


def _fix_zip_crcs(f) -> None:
    """Fill the CRC-32 of the data records (skipped by ``skip_data``) in descriptors and central directory."""
    f.seek(0)
    with zipfile.ZipFile(f) as z:
        infos = z.infolist()
        start_dir = z.start_dir
    crcs = {}
    for info in infos:
        if info.CRC != 0 or info.file_size == 0:
            continue
        f.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
        data = info.header_offset + 30 + name_len + extra_len
        f.seek(data)
        crc, left = 0, info.file_size
        while left:
            block = f.read(min(left, 16 << 20))
            crc = zlib.crc32(block, crc)
            left -= len(block)
        crcs[info.filename] = crc
        if info.flag_bits & 0x08:
            f.seek(data + info.compress_size)
            at = data + info.compress_size + (4 if f.read(4) == b"PK\x07\x08" else 0)
            f.seek(at)
            f.write(struct.pack("<I", crc))
    f.seek(start_dir)
    position = start_dir
    while True:
        f.seek(position)
        header = f.read(46)
        if len(header) < 46 or header[:4] != b"PK\x01\x02":
            break
        name_len, extra_len, comment_len = struct.unpack("<HHH", header[28:34])
        name = f.read(name_len).decode("utf-8")
        if name in crcs:
            f.seek(position + 16)
            f.write(struct.pack("<I", crcs[name]))
        position += 46 + name_len + extra_len + comment_len


def _safetensors_skeleton(f, entries: list[_Entry], manifest: dict) -> dict[str, int]:
    """Write the safetensors header into the empty file ``f`` (tensors back to back, aliases as copies);
    returns each one's file offset."""
    head, offsets = safetensors_file.header(
        [(e.key, e.out_dtype, e.shape, e.out_nbytes) for e in entries],
        {"format": "pt", "source": "infinity-consolidate", "step": str(manifest.get("step", 0))})
    f.write(head)
    f.truncate(len(head) + sum(e.out_nbytes for e in entries))
    return offsets
