"""The update pass: the host Adam kernel over the changed ranges, then the changed groups' new compute copies.

[Note: host Adam kernel]
The update runs torch's fused CPU Adam/AdamW kernel (``torch._fused_adamw_``) on
the flat fp32 sub-groups, one tensor per run of trainable groups (usually one per
sub-group). On these machines it streams the 28 bytes a parameter needs (read
master, grad, m, v; write master, m, v) at memory speed: 100M parameters, 2 threads,
1.74 G params/s, as fast as DeepSpeed's CPUAdam (1.57) and above a STREAM-triad bound
(1.22); the foreach path is 12x slower (benchmarks/adam.py). It gets there only if the
sub-group's arrays do not start at the same address modulo the huge page (half the
rate when they do: the store staggers them, [Note: staggered starts] in
tiers/host_alloc.py). The engine's step also writes each compute copy (4 bytes, plus
the line's write-allocate read): 0.90 G params/s for the whole step, synchronous, in the
run where torch's kernel alone did 1.47; with DPU it is off the critical path. The
kernel's math is ``torch.optim.AdamW``'s, so results match plain PyTorch to rounding.
Gradient clipping is folded into the kernel's ``grad_scale`` (it divides by
``1 / clip_coef``), which saves a pass over the gradients and differs from a separate
multiplication by at most one rounding. The kernel releases the GIL, so a background
step (DPU) runs beside compute.

With bf16 compute (how a GPU trains) torch's kernel, which takes one dtype, made the
update three passes: the bf16 gradient widened into an fp32 buffer, the step, the
master narrowed into the compute copy's staging. The C pass of optim_csrc/qadam.c
([Note: the fused fp32 step] there) does all three in one, with torch's arithmetic bit
for bit: each part's last ``numel % 16`` elements, which torch's kernel steps with its
scalar code, still go through torch (``UpdatePass._fused_step``), so an engine
stepping with it trains exactly as one stepping with torch's kernel
(tests/unit/test_fused_fp32_step.py). When the parameter tier is host memory
(``offload-host``) the pass writes each copy straight into the shard's key
(``ParamShards.update_place``) instead of a staging slice copied there afterwards; with fp32 compute
and the parameters in host memory it writes them there in fp32, where a copy of the masters after the
kernel read and wrote 8 more bytes a parameter. Compressed
moments get the same from their own kernel ([Note: the compressed step] in
infinity/optim/moments.py): bf16 gradient read, copies written in the pass. Where the pass
writes no copies (fp32 copies on the compute device, fp16 ones) it still steps fp32 moments in
host memory, and the copies are written after: the same bits as torch's kernel, and no
unscaled gradient written back when clipping (torch's kernel stores it: 4 more bytes a
parameter). The engine step at 50M parameters, fp32 copies on the CPU device, side by side on
2 cores shared with other work: 0.94-1.28x over ten runs, median 1.03x (1.28x in the one run on
a quiet machine); with clipping 0.97-1.26x, median 1.00x (benchmarks/adam.py, rows "ours (engine
step)" and "..., torch kernel"). A third of that step is the copies' memcpy into the CPU device's
tier (on a GPU the host->device copy). Without the built extension torch's kernel (or the
compressed one) and the conversion run as before.

[Note: the update pass]
Every update, synchronous, overlapped or delayed, is one :class:`StepJob` run by
:class:`UpdatePass`: one pass over the sub-groups (the state store's pipeline, see
[Note: pipelined sub-groups] in infinity/optim/flat_state.py) that reads master,
gradient and moments, runs the kernel, writes them back and writes each changed
group's new compute copy into the parameter tier. The job carries every key it
touches (the gradient keys and the compute-copy keys may be the second buffers of
DPU), so the pass never reads state the main thread may be changing. See
[Note: update modes] in infinity/optim/scheduler.py for when jobs run.

What the room may touch: the optimizer state store, and the parameter tier only
through ``ParamShards.write_updated``.
"""
from __future__ import annotations

import collections

import torch

from infinity.optim import moments
from infinity.optim.job import StepJob
from infinity.optim.moments import AdamHyper, MomentStep, step_seed
from infinity.optim.ranges import UpdateRanges
from tiers.arena import Arena
from tiers.base import wait_quietly

# See [Note: chunks and parallel regions]. A multiple of ALIGN_NUMEL, so every compute-copy
# write starts on a 4096-byte block: the NVMe tier writes a partial block by read-modify-write,
# and two such writes in flight to one block would race.
CHUNK_NUMEL = 4 << 20
# The last (numel % 16) elements of a tensor torch's fused CPU kernel steps with its scalar code,
# whose roundings differ from its vector code's (16: a vector of AVX-512, two of AVX2).
_TORCH_TAIL = 16
# A compute copy the C pass writes straight into the parameter tier's host memory (UpdatePass._stage_copies).
_IN_PLACE = object()
_WHOLE = 1 << 62


def lane_of(tier) -> str:
    """Where a tier's states are stepped: "device" (the device tier), or "host" (host memory, NVMe)."""
    return "device" if tier.kind == "device" else "host"


def update_lanes(store, coordinator, ranges: UpdateRanges, device, allocator) -> tuple["UpdatePass", "UpdatePass | None"]:
    """The pass over the states in host memory or on NVMe (or over all of them, in one tier), and the pass over
    a split store's device share, or None ([Note: optimizer states over tiers] in infinity/optim/tier_split.py)."""
    if len(store.tiers) == 1:
        return UpdatePass(store, coordinator, ranges, device, allocator), None
    lanes = {lane_of(t) for t in store.tiers}
    device_lane = UpdatePass(store, coordinator, ranges, device, allocator, "device") if "device" in lanes else None
    return UpdatePass(store, coordinator, ranges, device, allocator, "host"), device_lane


def chunk_numel() -> int:
    """Elements per chunk of the update pass on the calling thread.

    [Note: chunks and parallel regions]
    Writing a chunk's compute copy right after the kernel stepped it, while the chunk
    (4Mi elements: 16 MiB of fp32, 8 MiB as bf16) is still in the 32 MiB L3, halves the
    cost of the bf16/fp16 conversion on one thread (64Mi parameters: 51 vs 109 ms; fp32
    copies gain nothing, 46 vs 46 ms). But every torch kernel call on several threads is
    an OpenMP parallel region ending in a barrier, and when the cores are oversubscribed
    (compute beside the DPU worker, or other processes) each barrier waits for a
    descheduled thread: on 2 threads at load 5-7, 4Mi chunks took 254 ms where whole
    sub-groups took 54 ms (fp32; bf16 384 vs 124 ms). So chunks are used only when the
    calling thread's team is one thread, as the DPU worker's is with ``dpu.threads = 1``.
    """
    return CHUNK_NUMEL if torch.get_num_threads() == 1 else _WHOLE


def _hyper_set(hyper: dict, job: StepJob, index: int) -> dict:
    """The kernel's keyword arguments for the job's ``index``-th set of hyper-parameters."""
    if not job.hypers:
        return hyper
    lr, beta1, beta2, eps, weight_decay = job.hypers[index]
    return dict(hyper, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)


class UpdatePass:
    """Runs one :class:`StepJob` (see [Note: the update pass]).

    Parameters
    ----------
    store:
        The optimizer state store (``infinity.optim.flat_state.OptimizerStateStore``).
    coordinator:
        Owner of the parameter groups; its ``shards`` (``infinity.runtime.shards.ParamShards``)
        receive the new compute copies.
    ranges:
        Which elements of each sub-group the optimizer's parameters occupy.
    device:
        The compute device (``infinity.runtime.device.ComputeDevice``).
    allocator:
        Host memory for compute copies converted from host master weights (``tiers.HostAllocator``).
    lane:
        With the states split over tiers ([Note: optimizer states over tiers] in infinity/optim/tier_split.py),
        the sub-groups this pass steps: "device" (the device tier's), or "host" (those in host memory and on
        NVMe); None: every sub-group, in the store's one tier.
    """

    def __init__(self, store, coordinator, ranges: UpdateRanges, device, allocator, lane: str | None = None) -> None:
        self.store, self.ranges, self.device = store, ranges, device
        self.groups, self.shards = coordinator.groups, coordinator.shards
        self.lane = lane
        # Where the states (and so the new compute copies) are: the optimizer tier's memory.
        self.states_on = lane or lane_of(store.tier)
        # The kernel reads the step and the scale where the states are (a device optimizer tier).
        self.kernel_device = next(getattr(t, "device", torch.device("cpu")) for t in store.tiers
                                  if lane_of(t) == self.states_on)
        # A compute copy in another dtype than the fp32 master is converted into this staging
        # (two sub-groups' worth, reused; infinity-plan's "compute_copy_staging" row), never into
        # memory allocated per write: on a GPU that would be a pageable host->device copy.
        self.staging = None
        converts = self.states_on == "host" and self.shards.dtype != torch.float32
        # Compressed moments are stepped by their own kernel (see [Note: the compressed step] in
        # infinity/optim/moments.py); fp32 ones by torch's fused kernel.
        self.moment_step = MomentStep(store.moment_format) if store.moment_format.compressed else None
        # bf16 compute copies of states in host memory: one C pass steps and narrows (fp32 states: see
        # [Note: the fused fp32 step] in optim_csrc/qadam.c; compressed ones: the compressed kernel
        # writes them, [Note: the compressed step] in infinity/optim/moments.py); else torch's kernel
        # (or the compressed one), then a conversion.
        if self.moment_step is None:
            native = moments.fused_native()
        else:
            native = self.moment_step.native and moments.copies_native()
        # fp32 compute with the parameters in host memory: the C pass writes the new weights into their
        # shards too, while in cache, instead of a copy of the masters afterwards (fp32 states, or compressed
        # ones whose kernel writes fp32 copies).
        fp32_copies = moments.fused_fp32_copies_native() if self.moment_step is None else moments.copies_fp32_native()
        fp32_in_place = (self.states_on == "host" and self.shards.kind == "host" and self.shards.dtype == torch.float32
                         and native and fp32_copies)
        self.fused = (converts and native and self.shards.dtype == torch.bfloat16) or fp32_in_place
        # fp32 moments in host memory whose copies the pass does not write: still stepped by the C pass,
        # the copies written after ([Note: host Adam kernel]).
        self.c_kernel = self.states_on == "host" and self.moment_step is None and moments.fused_native()
        # The C pass writes copies of parameters in host memory in place (``ParamShards.update_place``).
        # States on the device, copies on NVMe: the NVMe tier writes from host memory only, so the new copies
        # go down into the staging first (a blocking copy: the pass is synchronous anyway).
        self.through_host = self.states_on == "device" and self.shards.kind == "nvme"
        if (converts and not (self.fused and self.shards.kind == "host")) or self.through_host:
            nbytes = 2 * store.layout.sub_group_size * torch.empty((), dtype=self.shards.dtype).element_size()
            self.staging = Arena(allocator.empty, nbytes, name="compute-copy-staging")
        self._staged: collections.deque = collections.deque()    # (write future, loan) not yet given back
        self._lent: list = []       # every staging loan out, issued or not (a failed pass gives them all back)
        self._itemsize = torch.empty((), dtype=self.shards.dtype).element_size()
        # Told ``sub_done(sub, futures)`` after each sub-group of an overlapped job (the
        # ``BackgroundUpdate`` running it), so the next forward may fetch its groups.
        self.progress = None

    def run(self, job: StepJob) -> None:
        """Adam over the changed ranges, and the changed groups' new compute copies.

        On a single-threaded run the work goes in chunks (see [Note: chunks and parallel
        regions]): the kernel on a chunk, then that chunk's compute copies while it is in cache.
        """
        kernel = torch._fused_adamw_ if job.decoupled else torch._fused_adam_
        device = self.kernel_device
        step_ts: dict[int, torch.Tensor] = {}

        def step_t(step: int) -> torch.Tensor:
            if step not in step_ts:
                step_ts[step] = torch.full((), float(step), device=device)   # a fill: no host->device copy
            return step_ts[step]

        grad_scale = None if job.clip_coef is None else torch.full((), 1.0 / job.clip_coef, device=device)
        hyper = dict(amsgrad=False, lr=job.lr, beta1=job.beta1, beta2=job.beta2, weight_decay=job.weight_decay,
                     eps=job.eps, maximize=False, grad_scale=grad_scale, found_inf=None)
        num_subs = self.store.layout.num_subs
        runs = job.runs or self.ranges.runs(job.updated, job.step)
        spans = [self.ranges.spans(sub, job.updated) if (job.subs is None or sub in job.subs) and (
                 self.lane is None or lane_of(self.store.sub_tiers[sub]) == self.lane) else [] for sub in range(num_subs)]
        passes = self.store.sub_groups(job.grad_keys, [bool(r) for r in spans], job.grads, compact=self.fused,
                                       streamed=self.lane != "device")
        chunk = chunk_numel()
        copies: list = []
        by_group: dict[int, list] | None = {} if job.overlapped else None     # what a fetch waits for
        try:
            for sub, st, writes in passes:
                states = (st["master"], st["grad"], st["exp_avg"], st["exp_avg_sq"])
                for start, numel in spans[sub]:
                    for c0 in range(start, start + numel, chunk):
                        c1 = min(c0 + chunk, start + numel)
                        parts = [(max(o, c0), min(o + n, c1), k, h) for o, n, k, h in runs[sub]
                                 if o < c1 and o + n > c0]
                        if self.fused:
                            staged = self._stage_copies(job, sub, c0, c1)
                            if self.moment_step is None:
                                filled = self._fused_step(st, parts, staged, job, hyper, step_t)
                            else:
                                filled = [[] for _ in staged]
                                for h in sorted({h for *_, h in parts}):
                                    self._step_compressed(st, sub, [part for part in parts if part[3] == h], job,
                                                          _hyper_set(hyper, job, h), staged, filled)
                            self._fill_unstepped(staged, filled, st["master"])
                            self._issue_copies(job, staged, copies, by_group)
                            continue
                        if self.c_kernel:
                            self._fused_step(st, parts, [], job, hyper, step_t)
                        else:
                            for h in sorted({h for *_, h in parts}):   # one call per set of hyper-parameters
                                mine = [part for part in parts if part[3] == h]
                                if self.moment_step is not None:
                                    self._step_compressed(st, sub, mine, job, _hyper_set(hyper, job, h))
                                    continue
                                kernel(*[[t[a:b] for a, b, _, _ in mine] for t in states], [],
                                       [step_t(k) for _, _, k, _ in mine], **_hyper_set(hyper, job, h))
                        self._write_compute_copies(job, sub, st["master"], c0, c1, copies, by_group)
                if job.overlapped:
                    # The next forward may fetch this sub-group's groups: it waits for the host or NVMe
                    # writes, and orders its stream after the device copies (see [Note: device copies
                    # of an overlapped update] in infinity/optim/background.py).
                    self.progress.sub_done(sub, by_group)
                    by_group = {}
                writes.extend(copies)
                copies = []
                self._give_back_staging()
        except BaseException:
            # Wait for what this sub-group issued, then let the pass wait for the rest, before
            # the error travels on: no transfer outlives a failed update. Every staging slice goes back,
            # written, failed or never issued: the next update (after a load) finds the staging whole.
            wait_quietly(fut for fut, _ in copies)
            passes.close()
            wait_quietly(fut for fut, _ in self._staged)
            self._staged.clear()
            lent, self._lent = self._lent, []
            for loan in lent:
                loan.release()      # a second release of one already given back does nothing
            raise
        self._give_back_staging()
        self._lent = [loan for _, loan in self._staged]     # still out: their writes are still running

    def _step_compressed(self, st: dict, sub: int, parts: list, job: StepJob, hyper: dict,
                         staged: list = (), filled: list | None = None) -> None:
        """Adam over ``parts`` (``(start, end, step, hyper index)`` in ``sub``) with compressed moments;
        the kernel also writes the new weights of the ``staged`` compute copies it steps (see
        ``_stage_copies``), appending each ``[x, y)`` it wrote to ``filled[i]``."""
        grad_mul = 1.0 if job.clip_coef is None else job.clip_coef
        for a, b, step, _ in parts:
            h = AdamHyper(step=step, lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"], eps=hyper["eps"],
                          weight_decay=hyper["weight_decay"], decoupled=job.decoupled, grad_mul=grad_mul)
            outs = []
            for i, (_, sa, sb, _, values, _) in enumerate(staged):
                x, y = max(a, sa), min(b, sb)
                if x < y:
                    outs.append((x, y, values[x - sa:y - sa]))
                    filled[i].append((x, y))
            self.moment_step(st["master"], st["grad"], st["exp_avg"], st["exp_avg_sq"], a, b, h, step_seed(step, sub),
                             outs)

    def _write_compute_copies(self, job: StepJob, sub: int, master: torch.Tensor, c0: int, c1: int,
                              writes: list, by_group: dict | None) -> None:
        """Write elements [c0, c1) of ``sub``'s master weights into the job's compute-copy keys;
        the writes not done yet go to ``writes`` as ``(future, values)``, and by group index to
        ``by_group`` when an overlapped job's fetches wait for them (else None)."""
        staged = self._stage_copies(job, sub, c0, c1, master)
        for _, a, b, _, values, loan in staged:
            if loan is not None:
                values.copy_(master[a:b])
        self._issue_copies(job, staged, writes, by_group)

    def _stage_copies(self, job: StepJob, sub: int, c0: int, c1: int, master: torch.Tensor | None = None) -> list:
        """The compute copies of elements [c0, c1) of ``sub`` the job writes, in sub-group order:
        ``(piece, a, b, key, values, loan)`` with ``values`` to hold elements [a, b) in the compute
        dtype: a staging slice (``loan``), or with ``master`` given and no conversion to make, its
        own elements (``loan`` None), or without ``master`` (the C pass fills them), the key's own host
        memory when the shards live there (``loan`` is ``_IN_PLACE``: nothing to write afterwards)."""
        dtype = self.shards.dtype
        staged = []
        for piece in self.store.layout.pieces_of_sub[sub]:
            key = job.param_keys[piece.group_index]
            a, b = max(piece.sub_offset, c0), min(piece.sub_offset + piece.numel, c1)
            if key is None or a >= b:
                continue
            loan = None
            place = None if master is not None else self.shards.update_place(
                key, piece.group_offset + a - piece.sub_offset, b - a)
            if place is not None:
                values, loan = place, _IN_PLACE
            elif master is not None and not self.through_host and (master.dtype == dtype or self.staging is None):
                values = master[a:b].to(dtype)     # the master itself (fp32), or on the device
            else:
                loan = self._stage((b - a) * self._itemsize)
                values = loan.tensor.view(dtype)[:b - a]
            staged.append((piece, a, b, key, values, loan))
        staged.sort(key=lambda entry: entry[1])
        return staged

    def _issue_copies(self, job: StepJob, staged: list, writes: list, by_group: dict | None) -> None:
        """Start writing the filled ``staged`` compute copies into their keys (see ``_write_compute_copies``)."""
        for piece, a, _, key, values, loan in staged:
            in_staging = loan is not None and loan is not _IN_PLACE    # host memory, wherever the states are
            fut = self.shards.write_updated(self.groups[piece.group_index], key, values,
                                            piece.group_offset + a - piece.sub_offset,
                                            source="host" if in_staging else self.states_on,
                                            offer_fresh=job.offer_fresh, in_place=loan is _IN_PLACE)
            if in_staging:
                self._staged.append((fut, loan))
            if not fut.done():
                writes.append((fut, values))
                if by_group is not None:
                    by_group.setdefault(piece.group_index, []).append(fut)

    def _fused_step(self, st: dict, parts: list, staged: list, job: StepJob, hyper: dict, step_t) -> list:
        """Adam over ``parts`` of a sub-group by the C pass that also fills the ``staged`` compute
        copies; returns, per staged copy, the ``[x, y)`` it wrote (not a part's last < 16 elements,
        which torch's kernel steps as its own scalar tail does).

        Bit for bit what ``torch._fused_adam(w)_`` on each part and a conversion give: the C pass
        does torch's vector arithmetic, and a part's tail goes through torch itself."""
        master, grad, m, v = st["master"], st["grad"], st["exp_avg"], st["exp_avg_sq"]
        g_bf16 = grad.dtype == torch.bfloat16
        kernel = torch._fused_adamw_ if job.decoupled else torch._fused_adam_
        threads = torch.get_num_threads()
        filled = [[] for _ in staged]       # per staged copy, the [x, y) the C pass wrote
        scale = 0.0 if job.clip_coef is None else 1.0 / job.clip_coef    # the C pass rounds it as torch.full
        for a, b, step, h in parts:
            hp = _hyper_set(hyper, job, h)
            body = a + (b - a) // _TORCH_TAIL * _TORCH_TAIL
            x = a
            for i, (_, sa, sb, _, values, _) in enumerate(staged):
                if sb <= x or sa >= body:
                    continue
                if sa > x:
                    self._step_c(x, sa, master, grad, g_bf16, m, v, 0, step, hp, scale, job, threads)
                    x = sa
                y = min(sb, body)
                out = values.data_ptr() + (x - sa) * values.element_size()
                self._step_c(x, y, master, grad, g_bf16, m, v, out, step, hp, scale, job, threads,
                             values.dtype == torch.float32)
                filled[i].append((x, y))
                x = y
            if x < body:
                self._step_c(x, body, master, grad, g_bf16, m, v, 0, step, hp, scale, job, threads)
            if body < b:
                g = grad[body:b].float() if g_bf16 else grad[body:b]
                kernel([master[body:b]], [g], [m[body:b]], [v[body:b]], [], [step_t(step)], **hp)
        return filled

    @staticmethod
    def _fill_unstepped(staged: list, filled: list, master: torch.Tensor) -> None:
        """The elements of the ``staged`` compute copies the kernel did not write (``filled[i]``: the
        ``[x, y)`` it did), converted from the master weights."""
        for (_, sa, sb, _, values, _), done in zip(staged, filled):
            x = sa
            for y0, y1 in sorted(done) + [(sb, sb)]:
                if x < y0:
                    values[x - sa:y0 - sa].copy_(master[x:y0])
                x = y1

    @staticmethod
    def _step_c(x: int, y: int, master, grad, g_bf16: bool, m, v, out: int, step: int, hp: dict, scale: float,
                job: StepJob, threads: int, out_fp32: bool = False) -> None:
        """The C pass over elements [x, y) of a sub-group's states; ``out`` the address of element x's
        compute copy (0: none; bf16, or fp32 with ``out_fp32``)."""
        if x >= y:
            return
        moments.fused_fp32_step(
            y - x, master.data_ptr() + 4 * x, grad.data_ptr() + grad.element_size() * x, g_bf16,
            m.data_ptr() + 4 * x, v.data_ptr() + 4 * x, out, step, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"],
            hp["weight_decay"], scale, job.decoupled, threads, out_fp32)

    def _stage(self, nbytes: int):
        """A slice of the staging, giving back the oldest staged copies once written if it is full."""
        while True:
            loan = self.staging.take(nbytes, "compute copy")
            if loan is not None:
                self._lent.append(loan)
                return loan
            if not self._staged:
                raise RuntimeError(f"compute-copy staging of {self.staging.capacity} bytes cannot hold "
                                   f"{nbytes} bytes (internal error: it holds two sub-groups)")
            fut, old = self._staged.popleft()
            fut.wait()
            old.release()

    def _give_back_staging(self) -> None:
        """Every staged compute copy is written (the pass waited for them): give their slices back."""
        while self._staged:
            fut, loan = self._staged.popleft()
            if fut.done():
                loan.release()
            else:
                self._staged.appendleft((fut, loan))
                return
