"""infinity.timeline: one training step as a Chrome / Perfetto trace (``infinity.trace``).

What the room holds: ``trace`` (the public context manager), ``record`` (the spans and the trace
file), ``probes`` (what times the engine while a trace runs), ``predicted`` (the plan's phases beside
the step) and ``draw`` (a trace file drawn as an SVG timeline). What it may touch: the engine's public
parts, for the trace's duration only; nothing stays on the model or the engine after it.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from infinity import registry
from infinity.timeline.predicted import predicted_phases
from infinity.timeline.probes import Probes
from infinity.timeline.record import Timeline


@contextlib.contextmanager
def trace(model: nn.Module, path: str | os.PathLike, *, nvme_bandwidth=None, machine=None, workload=None):
    """Record what the engine does inside the block and write it to ``path`` as a Chrome trace.

    Run one training step inside the block (forward, backward, ``opt.step()``), best a steady one
    (after the first step, which records the prefetch trace). On exit the running optimizer update
    is waited for (not published: with DPU it becomes current at the next ``opt.step()`` as untraced), so
    the file holds the whole step, and ``path`` is written
    under a temporary name, then renamed into place; a block that raises writes nothing. Open the
    file in https://ui.perfetto.dev or ``chrome://tracing``.

    Tracks, one per kind of work (see [Note: probes, not hooks] in infinity/timeline/probes.py):
    ``compute`` (each group's forward and backward), ``copies`` (gathers, releases, host<->device
    copies), ``nvme read`` and ``nvme write`` (each request from submission to completion),
    ``update`` (each optimizer sub-group, and ``opt.step()``), ``host waits``; and, in a process of
    its own, ``plan``: the NVMe traffic ``infinity.plan`` predicts for the step and, with a machine
    profile, the predicted forward, backward and update (see [Note: the plan beside the step] in
    infinity/timeline/predicted.py).

    Outside the block nothing is installed: no hook, no wrapper, no timestamp.

    Parameters
    ----------
    model:
        A model built in ``infinity.Init``.
    path:
        The trace file to write (JSON). ``{rank}`` in it stands for this process's rank in the job, so
        that every rank of a distributed run writes a file of its own.
    nvme_bandwidth:
        For the plan track's phase lengths: a ``(read_gbps, write_gbps)`` pair, an
        ``infinity-bench nvme --json`` file, an ``infinity.plan.Bandwidth``, or None (the plan's byte
        counts only). Without it, a machine profile's disk rates.
    machine:
        For the predicted forward, backward and update: an ``infinity.plan.MachineProfile`` or a profile
        file; None reads this machine's cached profile (``infinity-plan model --probe`` or
        ``infinity.Init("auto")`` caches one) and, where none is cached, leaves them out: a trace never
        probes.
    workload:
        The step's work for the compute term: an ``infinity.plan.Workload`` or the tokens of one step
        (batch x sequence); None: the token ids the block's first forward of ``model`` is given (its
        ``input_ids``, else its first integer tensor argument), or ``Workload()``'s 16384 tokens when it is
        given none.

    Examples
    --------
    >>> with infinity.trace(model, "step.json"):  # doctest: +SKIP
    ...     model(x, y).backward()
    ...     opt.step()
    ...     opt.zero_grad()
    """
    engine = registry.engine_of(model, "infinity.trace")
    timeline = Timeline()
    phases = predicted_phases(engine, nvme_bandwidth, machine, workload)    # before the step: no part of it
    probes = Probes(engine, timeline)
    seen: list[int | None] = []

    def take(_, args, kwargs) -> None:
        if not seen:
            seen.append(_tokens(args, kwargs))

    hook = model.register_forward_pre_hook(take, with_kwargs=True) if workload is None else None
    try:
        probes.install()        # inside: what a failed install put on comes off again
        start = timeline.now()
        yield timeline
        if engine.optimizer is not None:
            # The step's update, not published: with DPU ``synchronize()`` would make it current a step
            # early and change what the next forward computes (on the traced ranks only).
            engine.optimizer.updates.wait_running()
        probes.poll()
        end = timeline.now()
        in_flight = len(probes.inflight)
    finally:
        if engine.optimizer is not None:
            engine.optimizer.updates.wait_running(report=False)    # no worker inside a probe as it comes off
        probes.remove()
        if hook is not None:
            hook.remove()
    if seen and seen[0]:    # the step's own tokens (the plan above was made with the default's)
        phases = predicted_phases(engine, nvme_bandwidth, machine, seen[0])
    for phase in phases:
        timeline.plan(phase.name, start + phase.start_s * 1e6, phase.seconds * 1e6, phase.args)
    timeline.meta.update(step_us=end - start, rank=engine.ranks.rank, world_size=engine.ranks.world_size,
                         nvme_in_flight_at_end=in_flight)
    timeline.write(str(path).replace("{rank}", str(engine.ranks.global_rank)))


def _tokens(args, kwargs) -> int | None:
    """The tokens of a forward's input: its ``input_ids``, else its first integer tensor argument."""
    ids = kwargs.get("input_ids")
    candidates = [ids] if torch.is_tensor(ids) else [*args, *kwargs.values()]
    for value in candidates:
        if torch.is_tensor(value) and not value.is_floating_point() and not value.is_complex() \
                and value.dtype != torch.bool:
            return value.numel()
    return None


__all__ = ["Timeline", "trace"]
