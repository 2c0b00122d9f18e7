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
DDP averages them: a post-accumulate hook notes that one of them got a gradient in this backward (and makes
sure the engine's end-of-backward runs, as an engine module's backward hook would), and the engine's end of
that backward (``Engine._end_backward``, one per backward, reentrant checkpoints' nested ones included, run
once also when a later stage fails: [Note: a resumable end of backward] in infinity/runtime/backward_end.py)
sums all of them in one all-reduce, in the optimizer's parameter order, after its own hand-over: the same
place in every rank's sequence of collectives. A parameter without a gradient on a rank adds zeros there
(DDP's ``find_unused_parameters``), and one that has none on any rank keeps ``None`` (a flag per parameter
rides in the same all-reduce). So ``.grad`` after ``backward()`` is the mean, as under DDP, for
``clip_grad_norm_`` (torch's or infinity's, which counts them once, not once per rank), for a user's
``p.grad.norm()`` and for the step. Every rank reduces at every end of backward, whether its own adapters
got a gradient or not (which did is rank-local: a branch on it would leave a rank out of a collective the
others issue). The same caveat as the engine's own hand-over holds: every rank must run the backward (one in
which nothing reaches the engine, neither an engine module's backward nor an adapter's gradient,
``torch.autograd.grad`` on one rank, ends no backward there). In fp16 with loss scaling, a gradient hook divides each incoming gradient by
the loss scale before it accumulates, so ``.grad`` reads unscaled, as the engine's gradients do through
``.grad`` ([Note: the grad face] in infinity/optim/grad_face.py), and torch's ``clip_grad_norm_`` over
``model.parameters()`` sees one scale.
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
    engine:
        The model's engine: what it manages, its ranks (on several, the gradients are averaged over them) and
        its loss scaler (see [Note: unmanaged parameters]).
    """

    def __init__(self, what: str, decoupled: bool, param_groups: list, engine) -> None:
        self.what, self.engine = what, engine
        self.managed, self.ranks = engine.coordinator.group_of, engine.ranks
        self.cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        self.optimizer: torch.optim.Optimizer | None = None
        self.outer: list[int] = []      # per torch group, the index of its infinity param group
        self.hooks: list = []
        self.frozen: list = []          # taken while frozen (torch hooks only a tensor that requires grad)
        self.arrived = False            # one of them got a gradient in the backward now running
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
        self.frozen += [p for p in params if not p.requires_grad]    # hooked once a forward finds them trained
        self._hook([p for p in params if p.requires_grad])

    def hook_unfrozen(self) -> None:
        """A forward starts: parameters taken while frozen (an adapter ``set_adapter`` left inactive) and trained
        now get their hooks, before this forward's graph reaches them."""
        if any(p.requires_grad for p in self.frozen):
            self._hook([p for p in self.frozen if p.requires_grad])
            self.frozen = [p for p in self.frozen if not p.requires_grad]

    def _hook(self, params: list) -> None:
        self.hooks += [p.register_post_accumulate_grad_hook(self._arrived) for p in params]
        if self.engine.loss_scaler is not None:
            self.hooks += [p.register_hook(self._unscale) for p in params]

    def _unscale(self, grad: torch.Tensor) -> torch.Tensor:
        """fp16: a gradient of the scaled loss, divided by the scale before it accumulates into ``.grad``."""
        return grad * (1.0 / self.engine.loss_scaler.scale)

    def _arrived(self, param) -> None:
        """A gradient of one of them is in: the engine's end of this backward averages them all."""
        self.arrived = True
        self.engine.pre_backward(None)      # that end runs even when no engine module's backward hook fires

    def end_backward(self) -> None:
        """The engine's backward is over (``Engine._end_backward``, on every rank): on several ranks every
        one's ``.grad`` becomes the mean over the ranks (zeros where a rank has none; ``None``
        where no rank has one): one all-reduce, in the optimizer's order ([Note: unmanaged parameters])."""
        # Every rank reduces at every backward's end, whether its own adapters got a gradient or not: which
        # rank got one is rank-local, and a branch on it around the all-reduce left a rank whose adapters sat
        # out this backward out of a collective the others issued.
        self.arrived = False
        if self.ranks.world_size == 1 or not self.params:
            return
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
        """The sum of their gradients' squares (fp32), for the global norm (one host sync)."""
        grads = [p.grad.detach().float() for p in self.params if p.grad is not None]
        return float(torch.stack(torch._foreach_norm(grads)).pow(2).sum()) if grads else 0.0

    def nonfinite(self) -> bool:
        """Whether a gradient holds inf or NaN (one host sync; the same on every rank once averaged)."""
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any()) if grads else False

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
        self.arrived = False
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

