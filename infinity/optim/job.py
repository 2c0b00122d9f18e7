"""One optimizer update as data: what ``opt.step()`` hands over, and where the update's time went.

A ``StepJob`` is fixed when ``opt.step()`` returns (hyper-parameters, gradient and
compute-copy keys, which groups and ranges change), so an update can run later on a
worker thread without reading anything the main thread goes on changing. This module
holds data only; it imports no other room.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepJob:
    """Everything one optimizer update needs, fixed when ``opt.step()`` hands it over.

    Attributes
    ----------
    step:
        The Adam step number (bias correction) of this update.
    call:
        Which ``opt.step()`` call produced it (1-based; skipped steps count).
    lr, beta1, beta2, eps, weight_decay:
        Hyper-parameters read from ``param_groups[0]`` (all groups, when they agree) at hand-off, so a learning-rate
        scheduler stepped after ``opt.step()`` affects the next update, as in PyTorch.
    decoupled:
        AdamW (True) or Adam with L2 weight decay (False).
    clip_coef:
        Factor by which the gradients of this step are scaled (``clip_grad_norm_``), or None.
    grad_keys:
        The optimizer-tier keys of this step's gradient sub-groups.
    updated:
        The groups this update changes: those with parameters in the optimizer that received
        a gradient since the last ``zero_grad`` (like ``torch.optim``, which skips parameters
        whose ``.grad`` is None). Other groups' ranges of ``grad_keys`` are stale, never read.
    param_keys:
        Per group, the parameter-tier key that receives the new compute copy; None for the
        groups this update does not change.
    delayed:
        True when the job runs on the background worker one step behind (DPU).
    runs:
        Per sub-group, the ``(offset, numel, step, hyper)`` ranges Adam updates, the step count of
        each and the index of its set in ``hypers``, when some trainable parameter had no gradient
        or lags in steps (see [Note: parameters without a gradient] in infinity/optim/ranges.py) or
        the param groups' hyper-parameters differ; None when every trainable parameter of
        ``updated`` has a gradient and ``step`` and one set of hyper-parameters applies (the common
        case: whole groups, one step, one kernel call per sub-group).
    hypers:
        Per torch param group, ``(lr, beta1, beta2, eps, weight_decay)``, when they differ
        between groups (``runs`` then says which applies where); empty when all share the
        scalars above.
    subs:
        The sub-groups this job steps (None: all); the update during backward steps one at a time
        (see [Note: update during backward] in infinity/optim/in_backward.py).
    grads:
        ``{sub-group: gradient}`` held in host memory instead of read from ``grad_keys`` (the update
        during backward with states on NVMe); the pass takes each one as it steps it. None: read the keys.
    overlapped:
        True when the job runs on the background worker at exact semantics: it writes the
        published compute copies in place and reports each finished sub-group
        (``BackgroundUpdate.sub_done``, with the futures of its compute-copy writes) so the
        next forward can fetch those groups once the writes have landed.
    offer_fresh:
        True when the new compute copies are also kept in host memory for the next forward's
        fetches (the overlapped step and the update during backward: see [Note: fresh shards] in
        infinity/prefetch/fresh_shards.py).
    """

    step: int
    call: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    clip_coef: float | None
    grad_keys: tuple[int, ...]
    updated: frozenset[int]
    param_keys: tuple[int | None, ...]
    delayed: bool = False
    overlapped: bool = False
    runs: tuple | None = None
    hypers: tuple = ()
    subs: frozenset | None = None
    grads: dict | None = None
    offer_fresh: bool = False


@dataclass
class UpdateStats:
    """Where the optimizer's time went (seconds, summed over steps)."""

    sync_steps: int = 0
    delayed_steps: int = 0
    overlapped_steps: int = 0
    skipped_steps: int = 0
    optimizer_seconds: float = 0.0
    exposed_seconds: float = 0.0
    last_job_seconds: float = 0.0
    device_share_seconds: float = 0.0
    worker_thread_ids: set = field(default_factory=set)

    def add_sync(self, seconds: float) -> None:
        """Book an update that ran on the calling thread: all of it exposed to compute."""
        self.sync_steps += 1
        self.optimizer_seconds += seconds
        self.exposed_seconds += seconds
        self.last_job_seconds = seconds

    def add_device_share(self, seconds: float) -> None:
        """Book the device share's update of a split store, run on the calling thread before the rest of the
        step's update ([Note: optimizer states over tiers] in infinity/optim/tier_split.py): exposed."""
        self.optimizer_seconds += seconds
        self.exposed_seconds += seconds
        self.device_share_seconds += seconds

    def as_dict(self) -> dict:
        hidden = 1.0 - self.exposed_seconds / self.optimizer_seconds if self.optimizer_seconds else 0.0
        return {"sync_steps": self.sync_steps, "delayed_steps": self.delayed_steps,
                "overlapped_steps": self.overlapped_steps, "skipped_steps": self.skipped_steps,
                "optimizer_seconds": self.optimizer_seconds,
                "exposed_seconds": self.exposed_seconds, "hidden_fraction": hidden,
                "last_job_seconds": self.last_job_seconds, "device_share_seconds": self.device_share_seconds}
