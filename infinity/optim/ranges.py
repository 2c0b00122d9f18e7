"""Which elements an update changes: the optimizer's ranges of each sub-group, and per-parameter step counts.

[Note: parameters without a gradient]
As in ``torch.optim``, a parameter whose gradient did not arrive since the last
``zero_grad`` (on any rank: the flags travel with the non-finite check's all-reduce) is
left alone: no weight decay, its moments and step count unchanged. Frozen parameters
(``requires_grad`` False) are such parameters: the optimizer holds them as torch's does,
and steps them again from the first gradient after they are unfrozen. Each parameter keeps
its own step count for Adam's bias correction as torch's ``state["step"]`` does; they
are stored as a lag behind the optimizer's ``step_count`` (parameters with lag 0 not
listed), saved in ``state_dict`` and checkpoints as ``param_steps`` by name. When every
trainable parameter of the changed groups has a gradient and no lag, the job is the
usual one (whole groups, padding included, one step); otherwise it carries its ranges
(``StepJob.runs``), one per parameter shard, merged where their steps agree.

This module computes ranges over the flat layout (``infinity.optim.flat_state``) and
the parameter groups; it moves no bytes.
"""
from __future__ import annotations

from infinity.errors import EngineError


def merge(ranges) -> list[tuple[int, int]]:
    """(offset, numel) ranges in increasing order, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for offset, numel in ranges:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + numel)
        else:
            out.append((offset, numel))
    return out


def shard_span(group, slot) -> tuple[int, int]:
    """The part of ``slot``'s parameter inside this rank's shard of ``group``, as shard offsets [a, b)."""
    start = group.rank * group.shard_numel
    return (max(slot.offset, start) - start,
            min(slot.offset + slot.numel, start + group.shard_numel) - start)


class UpdateRanges:
    """The groups with parameters in the optimizer, and per sub-group the ranges of their elements.

    A group whose parameters are all in the optimizer is one range, padding included
    (padding stays exactly zero under Adam), so the kernel sees long runs. Parameters
    frozen (``requires_grad`` False) are in the optimizer as in ``torch.optim``: without a
    gradient they are left alone, and once trainable again they are stepped.

    Parameters
    ----------
    groups:
        The parameter groups, in index order.
    layout:
        The flat layout (``infinity.optim.flat_state.FlatLayout``).
    params:
        The parameters the optimizer updates.
    """

    def __init__(self, groups, layout, params) -> None:
        chosen = {id(p) for p in params}
        self.layout = layout
        self.trainable: set[int] = set()
        # Those of them with a parameter that requires grad now (the rest are frozen, for now).
        self.training: set[int] = set()
        self._ranges: list[list[tuple[int, int, int]]] = [[] for _ in range(layout.num_subs)]
        for g in groups:
            mine = [s for s in g.slots if id(s.param) in chosen]
            if not mine:
                continue
            self.trainable.add(g.index)
            if any(s.param.requires_grad for s in mine):
                self.training.add(g.index)
            if len(mine) == len(g.slots):
                spans = [(0, g.shard_numel)]
            else:
                spans = [(a, b - a) for a, b in (shard_span(g, s) for s in mine)]
            for piece in layout.pieces_of_group[g.index]:
                for offset, numel in spans:
                    a = max(offset, piece.group_offset)
                    b = min(offset + numel, piece.group_offset + piece.numel)
                    if a < b:
                        self._ranges[piece.sub_index].append(
                            (g.index, piece.sub_offset + a - piece.group_offset, b - a))

    def changed(self, sub: int, updated: frozenset[int]) -> list[tuple[int, int]]:
        """The (offset, numel) ranges of ``sub`` whose elements Adam changes for ``updated`` groups."""
        return merge((offset, numel) for gi, offset, numel in self._ranges[sub] if gi in updated)

    def spans(self, sub: int, updated: frozenset[int]) -> list[tuple[int, int]]:
        """The ranges of ``sub`` holding ``updated`` groups' shards: their compute copies are rewritten whole."""
        return merge((p.sub_offset, p.numel) for p in self.layout.pieces_of_sub[sub] if p.group_index in updated)

    def runs(self, updated: frozenset[int], step: int) -> list[list[tuple[int, int, int, int]]]:
        """Per sub-group, ``(offset, numel, step, 0)`` of every changed range, all at ``step`` under the
        hyper-parameters of the first (here: the only) set."""
        return [[(o, n, step, 0) for o, n in self.changed(sub, updated)] for sub in range(self.layout.num_subs)]


class ParamSteps:
    """Each trainable parameter's own Adam step count, kept as a lag behind the optimizer's.

    See [Note: parameters without a gradient].

    Parameters
    ----------
    slots:
        ``(group, slot)`` of every parameter in the optimizer, in group order.
    layout:
        The flat layout.
    names:
        ``id(param) -> name``, for ``as_dict`` and ``load``.
    what:
        The optimizer's name, for messages.
    """

    def __init__(self, slots, layout, names: dict[int, str], what: str) -> None:
        self.slots = slots
        self.layout = layout
        self.names = names
        self.what = what
        self._lag: dict[int, int] = {}

    @property
    def lagging(self) -> bool:
        """Whether any parameter's count differs from the optimizer's (jobs then carry their runs)."""
        return bool(self._lag)

    def count_missing(self, with_grad: set[int]) -> None:
        """An update is taken: every parameter without a gradient falls one step further behind."""
        for _, slot in self.slots:
            pid = id(slot.param)
            if pid not in with_grad:
                self._lag[pid] = self._lag.get(pid, 0) + 1

    def runs(self, updated: frozenset[int], with_grad: set[int], step_count: int,
             hyper_of: dict[int, int] | None = None) -> tuple:
        """Per sub-group, ``(offset, numel, step, hyper)`` of each updated parameter's shard on this rank.

        ``hyper_of``: ``id(param) ->`` the index of its set of hyper-parameters (its torch param
        group, see [Note: parameter groups of the optimizer] in infinity/optim/adam.py); None: all 0.
        """
        layout = self.layout
        runs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(layout.num_subs)]
        for g, slot in self.slots:
            pid = id(slot.param)
            if g.index not in updated or pid not in with_grad:
                continue
            step = step_count - self._lag.get(pid, 0)
            hyper = hyper_of[pid] if hyper_of is not None else 0
            a, b = shard_span(g, slot)
            for piece in layout.pieces_of_group[g.index]:
                lo, hi = max(a, piece.group_offset), min(b, piece.group_offset + piece.numel)
                if lo < hi:
                    runs[piece.sub_index].append((piece.sub_offset + lo - piece.group_offset, hi - lo, step, hyper))
        merged = []
        for sub_runs in runs:
            out: list[tuple[int, int, int, int]] = []
            for offset, numel, step, hyper in sorted(sub_runs):
                if out and out[-1][0] + out[-1][1] == offset and out[-1][2:] == (step, hyper):
                    out[-1] = (out[-1][0], out[-1][1] + numel, step, hyper)
                else:
                    out.append((offset, numel, step, hyper))
            merged.append(out)
        return tuple(merged)

    def as_dict(self, step_count: int) -> dict[str, int]:
        """Adam step counts of the parameters that lag behind ``step_count`` (missed updates), by name."""
        return {self.names.get(pid, str(pid)): step_count - lag for pid, lag in self._lag.items()}

    def load(self, steps: dict[str, int], step_count: int, where: str) -> None:
        """Restore :meth:`as_dict` (after ``step_count``); unknown names are an error."""
        by_name = {name: pid for pid, name in self.names.items()}
        unknown = sorted(set(steps) - set(by_name))
        if unknown:
            raise EngineError(f"{self.what}: the {where} has step counts for parameters this model does not "
                              f"have: {unknown[:5]}")
        self._lag = {by_name[name]: step_count - int(step) for name, step in steps.items()
                     if step_count != int(step)}
