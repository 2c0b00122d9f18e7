"""The optimizer step during backward (``[optimizer] update_in_backward``): sub-groups stepped as gradients come.

[Note: update during backward]
The update pass steps sub-groups of the flat space (see [Note: pipelined sub-groups] in
infinity/optim/flat_state.py). With ``update_in_backward`` a sub-group is stepped on a
worker thread as soon as every trainable group with a piece in it has its gradient shard
on this rank, all of its parameters having received one (a group may straddle two
sub-groups: it completes both only together with their other groups). Backward produces
gradients roughly in reverse flat order, so the sub-groups complete from the last one
down, while the rest of backward computes. Stepping a sub-group writes its groups' new
compute copies through the ordinary path (``ParamShards.write_updated``); autograd is
done with those groups, so nothing of this backward reads them again, and ``opt.step()``
drops stale gathered copies as after any update. ``opt.step()`` waits for the worker,
then runs the remaining sub-groups (groups without a gradient on some parameter, or
whose gradient only comes with the end of backward, tied weights) as one ordinary
update, and does the bookkeeping (step count, skipped steps).

With the states on NVMe the gradient never goes to the disk: each sub-group's shards
are held in host memory in the dtype the gradient key would store them in (the same
rounding), from their arrival until the sub-group is stepped, and the pass widens them
as it would after reading them. Held sub-groups are those with a gradient but not yet
stepped: with backward in reverse flat order, about one or two at a time, plus those
of groups whose gradient comes last (a tied embedding keeps its sub-group open). Where
backward outruns the update (a disk-bound one beside a fast GPU backward), sub-groups
queued for the worker keep theirs too: before a new buffer is taken, backward waits for
the worker while held and queued gradients would pass two sub-groups and the largest
group's, the ``held_grads`` row of infinity-plan (``stats()["in_backward_wait_seconds"]``
says how long it waited, in backward and in ``opt.step()``'s last hand-offs). Sub-groups of
a group with a parameter that got no gradient stay held until ``opt.step()`` and are not in
that row; where they pass it, each new buffer waits until the queue is empty, never longer.

With the optimizer states split over tiers ([Note: optimizer states over tiers] in
infinity/optim/tier_split.py) the host and NVMe shares' sub-groups are stepped here as they
complete, the NVMe share's gradients held as above, the host share's in their accumulators;
the device share's wait for ``opt.step()``, which steps them on the compute device before
the rest (the device's update is short, and the next forward needs those groups first):
their gradients are added on the device and never land here.

The hyper-parameters are read from ``param_groups`` when the first sub-group is
stepped, during backward of step t. A torch learning-rate scheduler changes ``lr``
after ``opt.step()``, so these are the values ``opt.step()`` of step t would read;
changing ``param_groups`` between ``backward()`` and ``opt.step()`` is too late (it
applies from the next step, and ``opt.step()`` raises, naming the key, when it sees
that the values differ).

A backward cut short (an error in the model, a failed read, Ctrl-C) after sub-groups were
stepped leaves the step half applied: redone, those sub-groups would be stepped twice; finished
by ``opt.step()``, the rest would be stepped with part of its gradients. Neither trains as the
run would have, so the states are marked damaged, naming the key, when the engine closes that
backward (the next forward, ``opt.step()`` or ``zero_grad()``, [Note: aborted backward] in
infinity/runtime/engine.py); ``zero_grad()`` then drops the gradients, and a checkpoint load is
the way on. So too when ``opt.step()`` finds a non-finite gradient or an edited ``.grad`` after
sub-groups were stepped, or the worker failed. Cut short before any sub-group was stepped, the
step is redone after ``zero_grad()`` as with the ordinary update.

Exact (losses equal to the ordinary update's) or refused, naming the key:
``dpu.enabled``, float16 loss scaling and ``tiers.optimizer = "device"`` at config time;
``clip_grad_norm_`` (the global norm needs every gradient before any step), a second
backward before ``opt.step()`` (accumulation), ``zero_grad`` after a backward whose
sub-groups were stepped, an edit of ``.grad`` or of the gradient shards before
``opt.step()``, and a non-finite gradient once a sub-group was stepped (the ordinary
update would skip the whole step), at the call.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref

import torch

from infinity.errors import EngineError
from infinity.optim import param_groups
from infinity.optim.background import bound_this_thread, close_at_exit, damage
from infinity.optim.job import StepJob

KEY = "optimizer.update_in_backward"


class HeldGrads:
    """Gradient shards of streamed sub-groups not stepped yet, in host memory (states on NVMe; a split store's
    sub-groups in memory take theirs into their accumulators).

    Parameters
    ----------
    store:
        The optimizer state store (its layout and gradient dtype).
    """

    def __init__(self, store) -> None:
        self.store = store
        self.subs: dict[int, torch.Tensor] = {}
        # ``room(nbytes)``: called before a new buffer is taken, with what would then be held; it may wait.
        self.room = None

    def accumulate(self, group_index: int, shard: torch.Tensor) -> None:
        layout = self.store.layout
        for piece in layout.pieces_of_group[group_index]:
            buf = self.subs.get(piece.sub_index)
            if buf is None:
                numel = layout.sub_ranges[piece.sub_index][1]
                if self.room is not None:
                    self.room(self.bytes_held() + numel * self.store.grad_dtype.itemsize)
                buf = self.subs[piece.sub_index] = torch.zeros(numel, dtype=self.store.grad_dtype)
            buf[piece.sub_offset:piece.sub_offset + piece.numel].copy_(
                shard[piece.group_offset:piece.group_offset + piece.numel])

    def read(self, piece, dst: torch.Tensor) -> None:
        """A piece of a held gradient into ``dst`` (a ``.grad`` read before ``opt.step()``)."""
        buf = self.subs.get(piece.sub_index)
        if buf is None:
            raise EngineError(f"the gradient of group {piece.group_index} was consumed by the update during "
                              f"backward ({KEY} = true): read .grad with that key off")
        dst.copy_(buf[piece.sub_offset:piece.sub_offset + piece.numel])

    def take(self, subs) -> dict[int, torch.Tensor]:
        """The held gradients of ``subs``, no longer held here (the job that steps them owns them)."""
        return {s: self.subs.pop(s) for s in list(subs) if s in self.subs}

    def bytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.subs.values())


class _Pending:
    """A count of queued jobs and of the gradient bytes they hold, which the main thread can wait on, kept apart
    from the optimizer so that the worker can count a job done after it has let go of the optimizer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0
        self.nbytes = 0

    def add(self, nbytes: int = 0) -> None:
        with self._cond:
            self._count += 1
            self.nbytes += nbytes

    def done(self, nbytes: int = 0) -> None:
        with self._cond:
            self._count -= 1
            self.nbytes -= nbytes
            self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self._count:
                self._cond.wait()

    def wait_room(self, held: int, budget: int) -> bool:
        """Until the queued jobs' gradient bytes and ``held`` fit ``budget``, or none is queued; whether it waited."""
        waited = False
        with self._cond:
            while self._count and self.nbytes + held > budget:
                waited = True
                self._cond.wait()
        return waited


class InBackwardUpdate:
    """Steps each complete sub-group during backward (see [Note: update during backward]).

    Parameters
    ----------
    opt:
        The optimizer (its ``param_groups``).
    engine:
        The engine (store, coordinator, reducer, config, device).
    run:
        The update pass's ``run``.
    job_for:
        ``job_for(sub, updated groups, held gradients, hypers)``: the ``StepJob`` stepping ``sub`` as
        the next ``opt.step()`` would (its step counts and hyper-parameters).
    trainable:
        Indices of the groups with parameters in the optimizer.
    """

    def __init__(self, opt, engine, run, job_for, trainable) -> None:
        self.opt = opt
        self.job_for = job_for
        self.store = engine.store
        self.coordinator = engine.coordinator
        self.datapath = engine.datapath
        self.device = engine.device
        self.run = run
        self.held = None if self.store.in_place else HeldGrads(self.store)
        if self.held is not None:
            self.held.room = self._room
        self.waited_s = 0.0     # backward's waits for room for held gradients
        self.store.held = self.held
        self.store.refuse_second_grad = self._refuse_second
        self.store.before_zero_grad = self._before_zero_grad
        engine.reducer.watcher = self
        threads = engine.config.dpu.threads or (0 if engine.device.is_cuda else 1)
        self.threads = threads
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.pending = _Pending()          # sub-groups queued and not done yet
        self._failure: BaseException | None = None
        self.damaged = damage(engine)      # a failed step marks the states damaged when it is reported
        self.is_damaged = lambda: bool(engine.damaged)
        self._stream = None
        self.stepped: set[int] = set()     # sub-groups stepped (or queued) since the last step
        self._partial: set[int] = set()    # groups some parameter of which had no gradient
        self._taken: set[int] = set()      # groups whose gradient backward produced since the last step
        self._landed: set[int] = set()     # groups whose gradient shard is in the store (its copy has run)
        self._hyper = None                 # (hypers, uniform) read at the first sub-group of a step
        self.subs_stepped = 0
        self.refresh(trainable)
        weakref.finalize(self, self._queue.put, None)

    def refresh(self, trainable) -> None:
        """The groups with parameters in the optimizer (``trainable``) changed (``add_param_group``)."""
        self._held = frozenset(trainable)
        self._training = None
        self._watch_training()

    def _watch_training(self) -> None:
        """Which groups each sub-group waits for: the optimizer's groups with a parameter that requires grad.

        Read again at the first gradient of each backward (``requires_grad`` may change between steps, as
        in torch): a frozen group would keep its sub-groups waiting for a gradient that never comes, and a
        group unfrozen since must be waited for, or its sub-groups would be stepped without it."""
        groups = self.coordinator.groups
        training = frozenset(gi for gi in self._held if groups[gi].has_trainable)
        if training == self._training:
            return
        self._training = training
        self.waits = [frozenset(p.group_index for p in pieces if p.group_index in training)
                      for pieces in self.store.layout.pieces_of_sub]

    # -- called by the gradient reducer (main thread) --------------------------------------------
    def taken(self, group_index: int, complete: bool) -> None:
        """A group's gradient is about to be reduced and sent; a second one before the step is refused.

        ``complete``: every trainable parameter of the group had a gradient (else its sub-groups wait for
        ``opt.step()``, whose flags say exactly which parameters to step); frozen ones are not stepped."""
        if not self._taken:     # the first gradient of this backward
            self._watch_training()
        if group_index in self._taken:
            self._refuse_second(group_index)
        self._taken.add(group_index)
        if not complete:
            self._partial.add(group_index)

    def landed(self, group_index: int) -> None:
        """A group's gradient shard is in the store: step the sub-groups it completes.

        Completes by the groups that *landed*, not by the store's ``grad_written``: a group counts as written
        there when its first shard's copy is issued, and on a GPU that copy may still be writing the
        sub-group's accumulator when another group's landing completes it."""
        self._landed.add(group_index)
        for piece in self.store.layout.pieces_of_group[group_index]:
            sub = piece.sub_index
            wait = self.waits[sub]
            if sub in self.stepped or not wait or not wait <= self._landed or wait & self._partial:
                continue
            self._submit(sub)

    def _room(self, held: int) -> None:
        """A held gradient buffer is about to be taken, ``held`` bytes with it: backward waits for the worker while
        they and the gradients of sub-groups queued for it would pass what infinity-plan counts (two sub-groups
        and the largest group's), so that a backward faster than the update does not end up holding the whole
        NVMe share's gradients in host memory (see [Note: update during backward])."""
        layout = self.store.layout
        sub = layout.sub_group_size
        budget = (2 * sub + -(-max(layout.shard_numels) // sub) * sub) * self.store.grad_dtype.itemsize
        t0 = time.perf_counter()
        if self.pending.wait_room(held, budget):
            self.waited_s += time.perf_counter() - t0

    def _refuse_second(self, group_index: int) -> None:
        raise EngineError(f"a second gradient for group {group_index} before opt.step(): {KEY} = true steps "
                          "each sub-group as soon as its gradients are in, so gradients cannot be accumulated "
                          "over micro-batches; set the key to false to accumulate")

    def _submit(self, sub: int) -> None:
        if self._hyper is None:     # the first sub-group of this step: the update begins
            self._hyper = param_groups.hyper_sets(self.opt.param_groups)
            # Its new compute copies are offered for the next forward (see [Note: fresh shards] in
            # infinity/prefetch/fresh_shards.py), kept past the end of this backward when it still
            # runs; the worker is idle, the last update over.
            self.coordinator.shards.reset_fresh(outlive_backward=self.datapath.phase == "backward")
        grads = self.held.take([sub]) if self.held is not None else None
        job = self.job_for(sub, self.waits[sub], grads, self._hyper)
        ready = None
        if self.device.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device.device))
        nbytes = sum(t.numel() * t.element_size() for t in grads.values()) if grads else 0
        self.pending.add(nbytes)
        try:
            if self._thread is None:
                thread = threading.Thread(target=self._loop, name="infinity-update-in-backward", daemon=True,
                                          args=(self._queue, weakref.ref(self)))
                thread.start()
                self._thread = thread
                close_at_exit(self)
            self._queue.put((job, ready, nbytes))
        except BaseException:   # not queued (no thread, Ctrl-C): counted out, its gradients held again
            self.pending.done(nbytes)
            if grads:
                self.held.subs.update(grads)
            raise
        self.stepped.add(sub)

    @staticmethod
    def _loop(jobs: queue.Queue, owner_ref) -> None:
        """The worker thread; it holds its owner weakly between jobs (a dropped optimizer is collected)."""
        owner = owner_ref()
        if owner is None:
            return
        bound_this_thread(owner.threads)
        del owner
        while True:
            item = jobs.get()
            owner = owner_ref()
            if item is None or owner is None:
                return
            pending = owner.pending
            job, ready, nbytes = item
            try:
                owner.work(job, ready)
            finally:
                # Counted done only once this thread holds neither the optimizer nor the job (nor its held
                # gradients): a model dropped right after ``opt.step()`` returns is collected at once, its
                # engine with it.
                del owner, item, job, ready
                pending.done(nbytes)

    def work(self, job: StepJob, ready) -> None:
        """One sub-group on the worker thread; a failure is kept for ``wait``."""
        try:
            with torch.no_grad():
                if self.device.is_cuda:
                    if self._stream is None:
                        self._stream = torch.cuda.Stream(self.device.device)
                    with torch.cuda.device(self.device.device), torch.cuda.stream(self._stream):
                        self._stream.wait_event(ready)
                        self.run(job)
                    self._stream.synchronize()
                else:
                    self.run(job)
        except BaseException as exc:    # reported by finish() on the main thread
            self._failure = self._failure or exc
        self.subs_stepped += 1      # read by the main thread only after the wait for this sub-group

    # -- called by the optimizer ------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every queued sub-group; raise a failed one's error."""
        self.pending.wait()
        if self._failure is not None:
            exc, self._failure = self._failure, None
            what = (f"the optimizer step during backward ({KEY}) failed: {exc!r}. Parameters, master weights and "
                    "Adam moments may be partly updated")
            self.damaged(what)
            raise EngineError(what + ": load a checkpoint (infinity.load_checkpoint) before training on") from exc

    def finish(self, what: str, clip_coef, nonfinite: bool) -> frozenset[int]:
        """``opt.step()``: wait for the stepped sub-groups and check that the step is exact; returns them."""
        self.wait()
        stepped = frozenset(self.stepped)
        if stepped and self._hyper is not None:
            now = param_groups.hyper_sets(self.opt.param_groups)
            if now != self._hyper:
                raise EngineError(f"{what}: param_groups' hyper-parameters changed between backward() and "
                                  f"opt.step(); with {KEY} = true the step reads them during backward (change "
                                  "them after opt.step(), as learning-rate schedulers do)")
        if stepped and clip_coef is not None:
            self.damaged(f"{what}: {len(stepped)} sub-groups were stepped during backward ({KEY} = true) with "
                         "gradients edited after it")
            raise EngineError(f"{what}: the gradients were scaled after backward (.grad edited or clipped); with "
                              f"{KEY} = true sub-groups are stepped during backward, so they cannot be; set the "
                              "key to false")
        if stepped and nonfinite:
            self.damaged(f"{what}: {len(stepped)} sub-groups were stepped during backward ({KEY} = true) with a "
                         "non-finite gradient")
            raise EngineError(f"{what}: a gradient is inf/NaN, but {len(stepped)} sub-groups were already stepped "
                              f"during backward ({KEY} = true), so the step cannot be skipped; reload a checkpoint, "
                              "and set the key to false to have such steps skipped")
        return stepped

    def remaining_grads(self, subs) -> dict | None:
        return None if self.held is None else self.held.take(subs)

    def reset(self, what: str) -> None:
        """After ``opt.step()``, or at ``zero_grad`` (refused when sub-groups were stepped since the step)."""
        damaged = self.is_damaged()     # the states are reloaded anyway: nothing to refuse, nothing to report
        if what and self.stepped and not damaged:
            raise EngineError(f"{what}: {len(self.stepped)} sub-groups were already stepped during backward "
                              f"({KEY} = true); call opt.step() before zero_grad() (or set the key to false to "
                              "throw gradients away)")
        if damaged:
            self.pending.wait()
            self._failure = None
        else:
            self.wait()
        self.stepped.clear()
        self._partial.clear()
        self._taken.clear()
        self._landed.clear()
        self._hyper = None
        if self.held is not None:
            self.held.subs.clear()

    def cut_short(self, what: str = "a backward was cut short") -> None:
        """The backward ended by an exception ([Note: aborted backward] in infinity/runtime/engine.py), or
        ``opt.step()`` failed before its update (``what`` says which): sub-groups already stepped leave the states
        damaged (a failure of the worker's is part of the same damage)."""
        if not self.stepped:
            return
        self.pending.wait()
        failed, self._failure = self._failure, None
        also = f"; the update itself failed too: {failed!r}" if failed is not None else ""
        self.damaged(f"{what} after {len(self.stepped)} sub-groups of this step had been stepped during backward "
                     f"({KEY} = true): parameters, master weights and Adam moments are partly updated, and neither "
                     f"redoing the step nor finishing it trains as intended{also}")

    def _before_zero_grad(self) -> None:
        """The store's gradients are dropped (``model.zero_grad()`` too): refused once sub-groups were stepped."""
        self.reset("zeroing the gradients (opt.zero_grad(), model.zero_grad() or .grad = None)")

    def refuse(self, call: str) -> None:
        raise EngineError(f"{call}: {KEY} = true steps each sub-group as soon as its gradients are in, so nothing "
                          "can scale all gradients by their global norm first; set the key to false to clip")

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
