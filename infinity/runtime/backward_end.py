"""The end of a backward as stages, each run once per backward, resumed where one failed."""
from __future__ import annotations

from collections.abc import Callable, Sequence


class BackwardEnd:
    """Which stages of the running backward's end are done, and whether the last attempt at it failed.

    [Note: a resumable end of backward]
    The end of a backward (``Engine._end_backward``) first issues collectives, in the same place on every
    rank (the hand-over of groups short of a gradient; the unmanaged parameters' all-reduce, [Note:
    unmanaged parameters] in infinity/optim/unmanaged.py), then does rank-local work that may fail
    (releasing the groups held for backward: tier I/O). A failure there raises on that rank alone and
    leaves its backward open for the next ``step()``, ``zero_grad()`` or forward to close. Run again from
    the top, the end would issue its collectives a second time on that rank alone: collectives no other
    rank joins (a hang, or the next step's paired with the wrong ones). So each stage runs once per
    backward: the count of stages done, reset when a backward starts, makes a later call retry the stage
    that failed and skip those done. The gradients are then reduced and kept as on the other ranks, and
    the step goes on as theirs does (``cut_short`` reaches the reducer only if its stage is still to run:
    after it, nothing was cut short).

    A new backward (``retain_graph``, a second loss) that starts before anything closed such an end
    finishes it first, so that its own end runs whole. The retry may fail again on that rank alone: in
    ``step()`` and in the forward it runs inside their agreement ([Note: failing together] in
    infinity/runtime/ranks.py), so every rank raises; an ``opt.zero_grad()`` that fails there has left
    this rank's gradients uncleared where the others' are cleared, and owes the clear
    (``Engine.clear_owed``): the next forward, which every rank's ``zero_grad()`` made agree first, runs
    it inside the agreement (what every rank asked for), and a ``step()`` before refuses, so no rank
    trains on gradients the others dropped. Where the retry that starts a new backward fails again, that
    backward raises on this rank alone and the others wait in its collectives, as for any error raised
    inside one rank's backward (an out-of-memory in the model's own backward: NCCL's timeout ends it).
    """

    def __init__(self) -> None:
        self.done = 0           # stages of the running backward's end that ran
        self.failed = False     # the last attempt raised: the end is still to finish

    def begin(self) -> None:
        """A backward starts: its end has run no stage."""
        self.done, self.failed = 0, False

    def run(self, stages: Sequence[Callable[[], None] | None]) -> None:
        """Run the stages not done yet, in order (None: a stage this engine lacks); a failure raises with
        ``failed`` set and the failed stage counted as not done."""
        self.failed = False
        try:
            while self.done < len(stages):
                stage = stages[self.done]
                if stage is not None:
                    stage()
                self.done += 1
        except BaseException:
            self.failed = True
            raise
