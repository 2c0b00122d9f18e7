"""Every upload into gathered memory waits for the compute stream's last use of that memory, checked on the CPU.

On a GPU a group's shard is uploaded on the host->device copy stream into memory the compute
stream used before: a slice another group gave back, a new arena slab, or (with a torch that
cannot lend memory to storages) a storage resized for the gather, which the caching allocator
may take from a tensor the compute stream freed with kernels still queued. Unless the copy
stream first waits for an event recorded on the compute stream after that use, the upload can
overwrite values a queued kernel is about to read. On the lent H100 (torch 2.11, no lending)
the resized storages' uploads waited for nothing, and ``offload-host`` lost that race now and
then (bf16 losses 0.01-0.1% off, different from run to run).

A CPU has no streams, so the test keeps time instead: a clock ticks at every mark the data path
records on the compute stream (``DataPath.mark``) and whenever the engine enqueues compute (a
module's forward or backward, a group's gradients). Memory becomes unsafe for a copy stream when
it is given back or allocated; an upload into it must wait for a mark made no earlier.
"""
from __future__ import annotations

import pytest
import torch

import infinity
import infinity.runtime.datapath as datapath
import infinity.runtime.engine as engine_module
import infinity.runtime.gather_memory as gather_memory
from tests.support import gpt_runs
from tiers.arena import Arena


class Mark:
    """A compute-stream event of the CPU's clock."""

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.fixture
def clock(monkeypatch):
    state = {"now": 0, "freed": [], "slabs": [], "flats": {}, "checked": 0, "late": []}

    def tick() -> int:
        state["now"] += 1
        return state["now"]

    monkeypatch.setattr(datapath.DataPath, "mark", lambda self: Mark(tick()))
    for name in ("pre_forward", "post_forward", "pre_backward", "on_group_grads"):
        original = getattr(engine_module.Engine, name)

        def ticking(self, *args, _original=original, **kwargs):
            tick()      # compute enqueued: marks made before it do not cover it
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(engine_module.Engine, name, ticking)

    def ranges_of(memory: torch.Tensor) -> tuple[int, int]:
        return memory.data_ptr(), memory.data_ptr() + memory.numel() * memory.element_size()

    return_slice = Arena._return

    def returned(self, index, offset, nbytes):
        if self.name.startswith("gather"):
            lo = self._slabs[index].memory.data_ptr() + offset
            state["freed"].append((lo, lo + nbytes, state["now"]))
        return return_slice(self, index, offset, nbytes)
    monkeypatch.setattr(Arena, "_return", returned)

    allocate = gather_memory.GatherMemory._allocate

    def allocating(self, nbytes):
        before = state["now"]
        memory = allocate(self, nbytes)
        state["slabs"].append((*ranges_of(memory), before))    # fresh from the allocator: unsafe from here
        return memory
    monkeypatch.setattr(gather_memory.GatherMemory, "_allocate", allocating)

    attach = gather_memory.GatherMemory.attach

    def attaching(self, flat, numel, dtype, owner, source=None, kept=False):
        before = state["now"]
        out = attach(self, flat, numel, dtype, owner, source, kept)
        lo, hi = ranges_of(out)
        if self.lending:
            # the memory's last release, or its slab's allocation
            since = max(t for a, b, t in state["freed"] + state["slabs"] if a < hi and lo < b)
        else:
            since = before     # a resized storage: any tensor the compute stream freed so far
        state["flats"][lo] = (hi, since, owner)
        return out
    monkeypatch.setattr(gather_memory.GatherMemory, "attach", attaching)

    upload = datapath.DataPath.upload

    def checked_upload(self, dst, src, after=None):
        lo = dst.data_ptr()
        for start, (hi, since, owner) in state["flats"].items():
            if start <= lo < hi:
                marks = [e.seq for e in (after if isinstance(after, tuple) else (after,)) if isinstance(e, Mark)]
                state["checked"] += 1
                if not marks or max(marks) < since:
                    state["late"].append((owner, since, marks))
                break
        return upload(self, dst, src, after)
    monkeypatch.setattr(datapath.DataPath, "upload", checked_upload)
    return state


def _train(tmp_path, name: str) -> list[float]:
    return gpt_runs.losses(*gpt_runs.build(tmp_path, name, n_layer=2), steps=3, batch=2, weight_decay=0.0)


@pytest.mark.parametrize("lending", [True, False], ids=["lent-slices", "resized-storages"])
@pytest.mark.parametrize("name", ["offload-host", "nvme"])
def test_an_upload_into_gathered_memory_waits_for_its_last_use(tmp_path, monkeypatch, clock, name, lending):
    if lending and not gather_memory._CAN_LEND:
        pytest.skip("this torch cannot lend memory to storages")
    monkeypatch.setattr(gather_memory, "_CAN_LEND", lending)
    _train(tmp_path, name)
    assert clock["checked"] > 30, "the preset's gathers were expected to upload into gathered memory"
    assert not clock["late"], clock["late"][:5]


class Copy:
    """The event of a device copy an overlapped update made of a group's new compute copy."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("name", ["offload-host", "device"])
def test_a_fetch_reads_a_shard_after_the_updates_device_copies_of_it(tmp_path, monkeypatch, name):
    # With the optimizer's states on a GPU and the parameters in host RAM, the update's new compute
    # copies go device->host on a copy stream, and only an event says when they landed: the upload
    # of the shard must wait for it (the compute stream waiting is not enough: the upload is on
    # another stream). With the shards in device memory the compute stream copies them: it waits.
    import infinity.runtime.shards as shards_module
    copies: dict = {}
    monkeypatch.setattr(shards_module.ParamShards, "update_events",
                        lambda self, group: (copies.setdefault(group.index, Copy()),))
    waited: list = []
    upload, use = datapath.DataPath.upload, datapath.DataPath.use

    def upload_after(self, dst, src, after=None):
        waited.extend(e for e in (after if isinstance(after, tuple) else (after,)) if isinstance(e, Copy))
        return upload(self, dst, src, after)

    def use_of(self, event):
        if isinstance(event, Copy):
            waited.append(event)
        return use(self, event)
    monkeypatch.setattr(datapath.DataPath, "upload", upload_after)
    monkeypatch.setattr(datapath.DataPath, "use", use_of)
    _train(tmp_path, name)
    assert copies and set(map(id, copies.values())) <= set(map(id, waited)), "a shard was read before its copies"


def _losses(tmp_path, name: str) -> tuple[list[float], dict]:
    model, shape = gpt_runs.build(tmp_path, name, n_layer=2)
    return gpt_runs.losses(model, shape, steps=3, batch=2, weight_decay=0.0), infinity.stats(model)


@pytest.mark.parametrize("name", ["device", "offload-host"])
def test_without_storage_lending_every_preset_trains_alike(tmp_path, monkeypatch, name):
    # A torch without UntypedStorage._swap_data_ptr_ (2.11 on the lent H100) resizes storages instead of
    # lending them memory; the device preset's groups are then their stored shards through set_().
    if not gather_memory._CAN_LEND:
        pytest.skip("this torch cannot lend memory to storages: there is nothing to compare with")
    lent, lent_stats = _losses(tmp_path / "lent", name)
    monkeypatch.setattr(gather_memory, "_CAN_LEND", False)
    resized, stats = _losses(tmp_path / "resized", name)
    assert stats["gather_memory"]["lending"] is False
    assert resized == lent
    if name == "device":    # in place: nothing copied into gathered memory, before or after
        assert stats["fetch"]["bytes_gathered"] == lent_stats["fetch"]["bytes_gathered"]
