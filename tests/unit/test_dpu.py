"""Delayed parameter update: exact semantics against a plain-PyTorch reference of the delayed schedule.

The reference (``DelayedReference``) is ordinary ``torch.optim.AdamW`` on an ordinary model:
after warm-up it keeps the (clipped) gradients of step t and applies them at step t+1,
with the learning rate read when they were kept. Every test compares the parameters the
engine's forward actually computes with (captured by forward pre-hooks while the model
runs) with the reference's parameters at the same iteration.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
import infinity.optim.update
from infinity.optim.background import UpdateWorkerError

VOCAB, D, SEQ = 48, 32, 8
TOL = 1e-6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Tiny(nn.Module):
    """Embedding, two MLP blocks, a frozen-or-not final norm and a head tied to the embedding."""

    def __init__(self, freeze_norm: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.ln_f = nn.LayerNorm(D)
        if freeze_norm:
            self.ln_f.requires_grad_(False)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g))
            for _ in range(n)]


class DelayedReference:
    """Plain PyTorch AdamW run on the DPU schedule (see the module docstring)."""

    def __init__(self, model: nn.Module, warmup: int, lr: float, wd: float) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=wd)
        self.warmup = warmup
        self.handed = 0
        self.pending = None

    def _apply(self, grads, lr) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt.param_groups[0]["lr"] = lr
        self.opt.step()
        for p in self.params:
            p.grad = None

    def step(self, lr: float, skip: bool = False) -> None:
        grads = [p.grad.clone() for p in self.params]
        for p in self.params:
            p.grad = None
        if skip:
            self.synchronize()
            return
        if self.handed < self.warmup:
            self._apply(grads, lr)
        else:
            self.synchronize()
            self.pending = (grads, lr)
        self.handed += 1

    def synchronize(self) -> None:
        if self.pending is not None:
            self._apply(*self.pending)
            self.pending = None


def capture_forward_params(model: nn.Module) -> dict:
    """Record the value of every parameter as the running forward sees it (first sight per iteration)."""
    seen: dict[str, torch.Tensor] = {}

    def hook(module, args, prefix):
        for name, p in module.named_parameters(prefix=prefix):
            if p.numel() and name not in seen:
                seen[name] = p.detach().clone()

    for qn, mod in model.named_modules():
        mod.register_forward_pre_hook(lambda m, a, qn=qn: hook(m, a, qn))
    return seen


def make(tmp_path, params="host", optimizer="host", warmup=2, enabled=True, threads=0, freeze_norm=False,
         dtype="float32", device="cpu"):
    cfg = {"tiers": {"params": params, "optimizer": optimizer, "nvme_path": str(tmp_path), "device": device},
           "precision": {"dtype": dtype},
           "partition": {"sub_group_size": 4096},
           "dpu": {"enabled": enabled, "warmup_steps": warmup, "threads": threads}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = Tiny(freeze_norm)
    torch.manual_seed(0)
    ref = Tiny(freeze_norm).to(device)
    return model, ref


def max_diff(captured: dict, ref: nn.Module) -> float:
    named = dict(ref.named_parameters(remove_duplicate=False))
    return max(float((v - named[k].detach()).abs().max()) for k, v in captured.items())


def run_schedule(model, ref, steps, warmup, *, clip=None, accumulate=1, skip_at=(), sync_at=(),
                 lr_at=lambda k: 1e-2, device="cpu"):
    """Train both; return per-iteration (max diff of forward params, |loss diff|, covered names)."""
    opt = infinity.AdamW(model, lr=lr_at(0), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_at(k) / lr_at(0))
    reference = DelayedReference(ref, warmup, lr_at(0), 0.1)
    seen = capture_forward_params(model)
    data = batches(steps * accumulate)
    out, covered = [], set()
    for it in range(steps):
        seen.clear()
        lr = opt.param_groups[0]["lr"]
        losses = []
        for micro in range(accumulate):
            idx, tgt = (t.to(device) for t in data[it * accumulate + micro])
            loss = model(idx, tgt)
            ref_loss = ref(idx, tgt)
            if it in skip_at:
                loss, ref_loss = loss * float("inf"), ref_loss * float("inf")
            loss.backward()
            ref_loss.backward()
            losses.append(abs(loss.item() - ref_loss.item()) if it not in skip_at else 0.0)
            if micro == 0:
                diff = max_diff(seen, ref)
                covered |= set(seen)
        if clip is not None:
            infinity.clip_grad_norm_(model, clip)
            torch.nn.utils.clip_grad_norm_(reference.params, clip)
        opt.step()
        reference.step(lr, skip=it in skip_at)
        opt.zero_grad()
        sched.step()
        if it in sync_at:
            opt.synchronize()
            reference.synchronize()
        out.append((diff, max(losses)))
    return opt, reference, out, covered


def gathered_diff(model, ref) -> float:
    named = dict(ref.named_parameters(remove_duplicate=False))
    with infinity.gathered(model):
        return max(float((p.detach() - named[n].detach()).abs().max())
                   for n, p in model.named_parameters(remove_duplicate=False))


def test_dpu_off_matches_torch_adamw(tmp_path):
    model, ref = make(tmp_path, params="device", enabled=False)
    opt, reference, out, covered = run_schedule(model, ref, 5, warmup=10 ** 6, clip=0.5)
    assert all(d <= TOL and l <= 1e-5 for d, l in out), out
    assert opt.stats()["sync_steps"] == 5 and not opt.stats()["dpu"]
    assert covered == set(n for n, _ in ref.named_parameters(remove_duplicate=False))
    assert gathered_diff(model, ref) <= TOL


@pytest.mark.parametrize("params,optimizer,chunk", [("host", "host", None), ("nvme", "nvme", None),
                                                   ("device", "nvme", 2048), ("nvme", "host", 6144)])
def test_delayed_schedule_matches_reference(tmp_path, monkeypatch, params, optimizer, chunk):
    if chunk is not None:  # chunks smaller than groups and sub-groups: the pass's boundary cases
        monkeypatch.setattr(infinity.optim.update, "chunk_numel", lambda: chunk)
    model, ref = make(tmp_path, params, optimizer, warmup=2)
    opt, reference, out, covered = run_schedule(model, ref, 7, warmup=2, clip=0.5,
                                                lr_at=lambda k: 1e-2 * 0.8 ** k)
    assert all(d <= TOL and l <= 1e-5 for d, l in out), out
    assert covered == set(n for n, _ in ref.named_parameters(remove_duplicate=False))
    stats = opt.stats()
    assert (stats["sync_steps"], stats["delayed_steps"], stats["pending"]) == (2, 5, 1), stats
    # The delay is real: the model's current parameters differ from the newest ones.
    assert reference.pending is not None
    reference.synchronize()
    assert gathered_diff(model, ref) <= TOL
    assert opt.stats()["pending"] == 0


def test_warmup_steps_are_synchronous_then_one_step_behind(tmp_path):
    model, ref = make(tmp_path, warmup=3)
    opt = infinity.AdamW(model, lr=1e-2)
    pending = []
    for idx, tgt in batches(5):
        model(idx, tgt).backward()
        opt.step()
        pending.append(opt.stats()["pending"])
        opt.zero_grad()
    assert pending == [0, 0, 0, 1, 1]
    assert opt.stats()["sync_steps"] == 3
    # Compared with plain (synchronous) AdamW the 5th forward differs: it runs one step behind.
    _, _, out, _ = run_schedule(*make(tmp_path, warmup=3), 6, warmup=3)
    assert all(d <= TOL for d, _ in out)
    _, _, plain, _ = run_schedule(*make(tmp_path, warmup=3), 6, warmup=10 ** 6)
    assert max(d for d, _ in plain[:4]) <= TOL < min(d for d, _ in plain[4:])


def test_synchronize_and_gathered_see_complete_state_and_restart_the_delay(tmp_path):
    model, ref = make(tmp_path, warmup=1)
    _, reference, out, _ = run_schedule(model, ref, 8, warmup=1, sync_at=(3, 5))
    assert all(d <= TOL for d, _ in out), out
    reference.synchronize()
    assert gathered_diff(model, ref) <= TOL


def test_state_dict_waits_for_the_worker(tmp_path):
    model, ref = make(tmp_path, optimizer="nvme", warmup=0)
    opt, reference, _, _ = run_schedule(model, ref, 4, warmup=0)
    sd = opt.state_dict()
    reference.synchronize()
    assert sd["step"] == 4 and opt.stats()["pending"] == 0
    with infinity.gathered(model):
        groups = model_groups(model)
        for g, shard in zip(groups, sd["shards"]["master"]):
            flat = g.flatten().float()
            assert torch.equal(g.shard_of(flat), shard[: g.shard_numel])


def model_groups(model):
    from infinity.registry import engine_of

    return engine_of(model, "test").coordinator.groups


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_gradient_accumulation_and_frozen_params(tmp_path, optimizer):
    model, ref = make(tmp_path, optimizer=optimizer, warmup=1, freeze_norm=True)
    _, reference, out, covered = run_schedule(model, ref, 5, warmup=1, accumulate=2)
    assert all(d <= TOL for d, _ in out), out
    assert "ln_f.weight" in covered
    reference.synchronize()
    assert gathered_diff(model, ref) <= TOL


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_nonfinite_gradient_skips_its_update_and_is_reported(tmp_path, optimizer):
    model, ref = make(tmp_path, optimizer=optimizer, warmup=1)
    with pytest.warns(RuntimeWarning, match=r"call 4 found a non-finite gradient .* \(1 skipped so far\)"):
        opt, reference, out, _ = run_schedule(model, ref, 7, warmup=1, skip_at=(3,))
    assert all(d <= TOL for d, _ in out), out
    stats = opt.stats()
    assert stats["skipped_steps"] == 1 and opt.step_count == 6 and stats["calls"] == 7
    reference.synchronize()
    assert gathered_diff(model, ref) <= TOL


def test_worker_runs_on_its_own_thread_with_bounded_threads(tmp_path):
    model, _ = make(tmp_path, warmup=0, threads=1)
    opt = infinity.AdamW(model)
    before = torch.get_num_threads()
    for idx, tgt in batches(2):
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    stats = opt.stats()
    assert stats["worker_threads"] == 1 and stats["delayed_steps"] == 2
    assert torch.get_num_threads() == before
    assert threading.get_ident() not in opt.updates.stats.worker_thread_ids


def test_worker_failure_is_raised_on_the_main_thread(tmp_path, monkeypatch):
    model, _ = make(tmp_path, warmup=0)
    opt = infinity.AdamW(model)
    idx, tgt = batches(1)[0]
    model(idx, tgt).backward()

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(torch, "_fused_adamw_", broken)
    monkeypatch.setattr(infinity.optim.moments, "fused_fp32_step", broken)     # the C pass, where it steps
    opt.step()  # handed over: returns at once
    with pytest.raises(UpdateWorkerError, match=r"background optimizer step 1 .*kernel exploded"):
        opt.synchronize()


@pytest.mark.parametrize("params", ["host", "nvme"])
def test_bf16_compute_copies_are_the_rounded_master_weights(tmp_path, monkeypatch, params):
    monkeypatch.setattr(infinity.optim.update, "chunk_numel", lambda: 6144)
    model, _ = make(tmp_path, params=params, warmup=1, dtype="bfloat16")
    opt = infinity.AdamW(model, lr=1e-2)
    for idx, tgt in batches(3):
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    masters = opt.state_dict()["shards"]["master"]
    checked = 0
    with infinity.gathered(model):
        for g, master in zip(model_groups(model), masters):
            shard = g.shard_of(g.flatten())
            assert shard.dtype == torch.bfloat16
            assert torch.equal(shard, master.to(torch.bfloat16)), g.name
            checked += 1
    assert checked == len(masters) > 3


@pytest.mark.gpu
@pytest.mark.parametrize("params,optimizer", [("device", "host"), ("host", "nvme"), ("device", "device")])
def test_delayed_schedule_on_cuda(tmp_path, params, optimizer):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the worker's copies to a device parameter tier run on its own stream")
    model, ref = make(tmp_path, params, optimizer, warmup=2, device="cuda")
    opt, reference, out, _ = run_schedule(model, ref, 6, warmup=2, clip=0.5, device="cuda")
    # The GPU's kernels differ from the CPU's by rounding only; both sides compute on the GPU.
    assert all(d <= 1e-5 for d, _ in out), out
    assert opt.stats()["pending"] == 1
    reference.synchronize()
    assert gathered_diff(model, ref) <= 1e-5


def test_update_pass_chunks_only_on_one_thread():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert infinity.optim.update.chunk_numel() == infinity.optim.update.CHUNK_NUMEL
        torch.set_num_threads(2)
        assert infinity.optim.update.chunk_numel() > 1 << 40
    finally:
        torch.set_num_threads(threads)
    assert infinity.optim.update.CHUNK_NUMEL % 2048 == 0  # compute-copy writes stay block-aligned



def test_worker_threads_are_stopped_and_joined_at_exit(tmp_path):
    # A daemon worker left alive is killed by finalization the next time it takes the GIL; inside a
    # torch call that released it (a CUDA copy, a stream synchronize) that aborts the process
    # ("terminate called without an active exception", exit status -6: every offload run on an H100).
    # So the exit handler finishes the running update and joins the thread, before finalization.
    from infinity.optim import background

    model, _ = make(tmp_path, warmup=0)
    opt = infinity.AdamW(model, lr=1e-3)
    for idx, tgt in batches(3):
        model(idx, tgt).backward()
        opt.step()          # the last update is still running or just done: nothing waited for it
        opt.zero_grad()
    workers = [t for t in threading.enumerate() if t.name == "infinity-dpu"]
    assert workers, "the updates were expected on the worker thread"
    background._drain_at_exit()
    assert not [t for t in workers if t.is_alive()]
    model(*batches(1)[0]).backward()    # a later step starts a new worker
    opt.step()
    opt.synchronize()
