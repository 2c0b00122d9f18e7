"""Training a model built in ``infinity.Init`` and its plain-PyTorch twin side by side."""
import torch

import infinity
from infinity import registry


def engine_twin(net, config: dict):
    """(plain model, engine model): ``net()`` twice (seed 0), the second inside ``infinity.Init(config)``
    and loaded with the first's values."""
    torch.manual_seed(0)
    ref = net()
    with infinity.Init(config):
        model = net()
    with infinity.gathered(model):
        model.load_state_dict(ref.state_dict())
    return ref, model


def train_side_by_side(model, opt, ref, ref_opt, data, after_step=None):
    """Per-step |loss - reference loss|, and per-parameter max |p - reference p| at the end."""
    loss_diffs = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diffs.append(abs(loss.item() - ref_loss.item()))
        if after_step is not None:
            after_step()
    with infinity.gathered(model):
        param_diffs = {name: float((p - q).detach().abs().max())
                       for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    return loss_diffs, param_diffs


def stored_grad(model, p):
    """The gradient of ``p`` as the engine's optimizer tier holds it (one rank): its slot of the group's shard."""
    engine = registry.engine_of(model)
    engine.reducer.settle()     # the shards still on their way land first (a GPU's downloads run late)
    engine.store.flush()
    group = engine.coordinator.group_of[p]
    slot = next(s for s in group.slots if s.param is p)
    return engine.store.read_state_shard("grad", group.index)[slot.offset:slot.offset + slot.numel].view(slot.shape)
