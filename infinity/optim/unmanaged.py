"""Parameters of an engine model that the engine does not manage, stepped by torch's own Adam(W).

[Note: unmanaged parameters]
``peft.get_peft_model`` on a model built earlier inside ``infinity.Init`` (as TRL's
``SFTTrainer(peft_config=...)`` does) adds adapters after the block: ordinary parameters, whole on
the compute device, that no engine group holds. They are small (a LoRA's few million elements beside
a base of billions), so they are trained as plain torch trains them: ``infinity.AdamW`` keeps them in
its ``param_groups`` (schedulers and the Trainer see every group as in ``torch.optim``), steps the
engine's parameters over their shards, and these with a ``torch.optim.AdamW`` (``Adam`` for
``infinity.Adam``) beside it, one torch group per param group that holds any, whose hyper-parameters
are copied from that group at every step. So their update is torch's, bit for bit. Their gradients are
autograd's ``.grad``; clipping counts them in the global norm and scales them by the same factor, a
non-finite one skips the whole step, and ``zero_grad`` clears them. Checkpoints hold their values and
Adam states whole (written by rank 0, see infinity/checkpoint/unmanaged.py).

On several ranks each rank holds its own copy, so their gradients are averaged over the ranks as torch
DDP averages them: at the end of every backward in which one of them got a gradient (a post-accumulate
hook notes the first, and queues a callback for the end of that backward), all of them are summed in one
all-reduce in the optimizer's parameter order, the same on every rank, and divided by the world size. A
parameter without a gradient on a rank adds zeros there (DDP's ``find_unused_parameters``), and one that has
none on any rank keeps ``None`` (a flag per parameter rides in the same all-reduce). So ``.grad`` after
``backward()`` is the average, as under DDP, for ``clip_grad_norm_`` (torch's or infinity's), for a user's
``p.grad.norm()`` and for the step. The same caveat as the engine's own hand-over holds: every rank must run
the backward (a backward in which a rank's adapters got no gradient at all, ``torch.autograd.grad`` on one
rank, issues no all-reduce there).
"""
from __future__ import annotations

import warnings

import torch

from infinity.optim.param_groups import HYPER_KEYS

STATES = ("exp_avg", "exp_avg_sq", "step")
# Past this many elements added after Init, say so: they stay whole on the compute device with their Adam
# states (16 bytes each in fp32), which is what offloading was for (an embedding resized after the block).
WARN_NUMEL = 1 << 24


class UnmanagedAdam:
    """torch's Adam(W) over the parameters of an engine model that its engine does not manage.

    Parameters
    ----------
    what:
        The optimizer's name, for messages (``infinity.AdamW``).
    decoupled:
        AdamW (True) or Adam with L2 weight decay (False).
    param_groups:
        The infinity optimizer's torch-style groups; the parameters not in ``managed`` are taken.
    managed:
        What the engine manages (its coordinator's ``group_of``).
    ranks:
        The engine's ranks: on several, the gradients are averaged over them (see [Note: unmanaged parameters]).
    """

    def __init__(self, what: str, decoupled: bool, param_groups: list, managed, ranks) -> None:
        self.what, self.managed, self.ranks = what, managed, ranks
        self.cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        self.optimizer: torch.optim.Optimizer | None = None
        self.outer: list[int] = []      # per torch group, the index of its infinity param group
        self.hooks: list = []
        self.queued = False             # this backward's average is queued for its end
        for index, group in enumerate(param_groups):
            self.add(index, group)

    def add(self, index: int, group: dict) -> None:
        """Take the unmanaged parameters of param group ``index`` (the constructor, ``add_param_group``)."""
        params = [p for p in group["params"] if p not in self.managed]
        if not params:
            return
        numel = sum(p.numel() for p in self.params) + sum(p.numel() for p in params)
        if numel > WARN_NUMEL >= numel - sum(p.numel() for p in params):
            biggest = max(params, key=lambda p: p.numel())
            warnings.warn(f"{self.what}: {numel:,} elements of parameters added after infinity.Init exited (the "
                          f"largest of shape {tuple(biggest.shape)}) are trained whole on the compute device with "
                          "their Adam states, not offloaded; a layer replaced after the block (an embedding "
                          "resized by resize_token_embeddings, say) belongs inside it", RuntimeWarning, stacklevel=5)
        torch_group = {"params": params, **{k: group[k] for k in HYPER_KEYS}}
        if self.optimizer is None:
            self.optimizer = self.cls([torch_group])
        else:
            self.optimizer.add_param_group(torch_group)
        self.outer.append(index)
        if self.ranks.world_size > 1:
            self.hooks += [p.register_post_accumulate_grad_hook(self._arrived) for p in params]

    def _arrived(self, param) -> None:
        """A gradient of one of them is in: average them all at the end of this backward (once)."""
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average)

    def _average(self) -> None:
        """Every one's ``.grad`` becomes the mean over the ranks (zeros where a rank has none; ``None`` where no
        rank has one): one all-reduce, in the optimizer's order ([Note: unmanaged parameters])."""
        self.queued = False
        params = self.params
        device = params[0].device
        flat = torch.cat([(p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params] + [torch.tensor([float(p.grad is not None) for p in params], device=device)])
        self.ranks.all_reduce_sum(flat)
        flat[:-len(params)] /= self.ranks.world_size
        position = 0
        for p, had in zip(params, flat[-len(params):].tolist()):
            mean = flat[position:position + p.numel()].view_as(p)
            position += p.numel()
            if had == 0:
                continue
            if p.grad is None:
                p.grad = mean.to(p.dtype).clone()
            else:
                p.grad.copy_(mean)

    def remove(self) -> None:
        """Take the hooks off (the optimizer is dropped)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [] if self.optimizer is None else [p for g in self.optimizer.param_groups for p in g["params"]]

    def has_grad(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def norm_sq(self) -> float:
        """The sum of their gradients' squares (fp32), for the global norm."""
        return sum(float(p.grad.detach().float().pow(2).sum()) for p in self.params if p.grad is not None)

    def nonfinite(self) -> bool:
        return any(not bool(torch.isfinite(p.grad).all()) for p in self.params if p.grad is not None)

    def step(self, param_groups: list, factor: float | None) -> None:
        """One torch step with the hyper-parameters ``param_groups`` hold now, the gradients first multiplied
        by ``factor`` (clipping's, and ``1 / loss scale`` in fp16)."""
        if self.optimizer is None:
            return
        for torch_group, index in zip(self.optimizer.param_groups, self.outer):
            torch_group.update({k: param_groups[index][k] for k in HYPER_KEYS})
        if factor is not None:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict | None:
        return None if self.optimizer is None else self.optimizer.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.optimizer is not None and state is not None:
            self.optimizer.load_state_dict(state)

    def states_of(self, param) -> dict[str, torch.Tensor]:
        """Adam's ``exp_avg``, ``exp_avg_sq`` and ``step`` of ``param`` (empty before its first step)."""
        if self.optimizer is None:
            return {}
        state = self.optimizer.state.get(param, {})
        return {k: state[k] for k in STATES if k in state}

    def load_states(self, param, states: dict[str, torch.Tensor]) -> None:
        """Set ``param``'s Adam states (a checkpoint's, checked by the caller); empty: none, as before a step."""
        if self.optimizer is None:
            return
        if not states:
            self.optimizer.state.pop(param, None)
            return
        self.optimizer.state[param] = {k: states[k].to(param.device if k != "step" else "cpu", copy=True)
                                       for k in STATES}

