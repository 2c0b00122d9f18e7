"""``torch.compile`` (default backend) of an engine model over two ranks trains as a plain model on the
whole batch: the hooks that gather and reduce over the ranks stay out of the compiled graphs."""
import os

import torch

import infinity
from tests.support.ranks import run_ranks, step_beside
from tests.unit.test_compile import _Net

LOCAL = 2


def _train(rank, world, workdir):
    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    torch.manual_seed(0)
    ref = _Net()
    with infinity.Init({"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme}}):
        model = _Net()
    with infinity.gathered(model):
        model.load_state_dict(ref.state_dict())
    opt = infinity.AdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    compiled = torch.compile(model)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(4):
        x, y = torch.randn(LOCAL * world, 8, generator=gen), torch.randn(LOCAL * world, 4, generator=gen)
        loss, ref_loss, _, _ = step_beside(compiled, opt, ref, ref_opt, x, y, rank, world, LOCAL)
        worst = max(worst, abs(loss - ref_loss))
    with infinity.gathered(compiled):
        param_diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    infinity.release(compiled)
    return worst, param_diff


def test_compiled_model_on_two_ranks(tmp_path):
    for loss_diff, param_diff in run_ranks(_train, 2, tmp_path):
        assert loss_diff < 1e-5 and param_diff < 1e-5, (loss_diff, param_diff)
