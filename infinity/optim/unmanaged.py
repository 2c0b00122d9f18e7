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

On several ranks each rank would hold its own copy, updated with its own gradients: DDP would
all-reduce them, the engine does not yet, so an optimizer over such parameters is refused when the
world size is above 1 (add the adapters inside the ``Init`` block there: then they are managed).
"""
from __future__ import annotations

import warnings

import torch

from infinity.errors import EngineError
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
    world_size:
        The engine's; above 1 the parameters are refused (see [Note: unmanaged parameters]).
    """

    def __init__(self, what: str, decoupled: bool, param_groups: list, managed, world_size: int) -> None:
        self.what, self.managed, self.world_size = what, managed, world_size
        self.cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        self.optimizer: torch.optim.Optimizer | None = None
        self.outer: list[int] = []      # per torch group, the index of its infinity param group
        for index, group in enumerate(param_groups):
            self.add(index, group)

    def add(self, index: int, group: dict) -> None:
        """Take the unmanaged parameters of param group ``index`` (the constructor, ``add_param_group``)."""
        params = [p for p in group["params"] if p not in self.managed]
        if not params:
            return
        if self.world_size > 1:
            raise EngineError(
                f"{self.what}: {len(params)} parameters of param group {index} (shape {tuple(params[0].shape)} the "
                f"first) were added after infinity.Init exited, and on {self.world_size} ranks their gradients would "
                "need averaging over the ranks, which infinity does not do for them yet. Add them inside the block "
                "(`with infinity.Init(config): model = ...; model = peft.get_peft_model(model, lora_config)`), where "
                "they are sharded and reduced as the rest of the model")
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

