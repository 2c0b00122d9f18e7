"""transformers' ``generate`` on a model built inside ``infinity.Init``, between training steps: greedy,
sampled and beam-searched tokens equal the plain model's with the same weights, and training goes on
exactly as the plain model's after it; the forwards without gradients follow a prefetch trace of their
own, and the training steps theirs."""
import pytest
import torch

import infinity

pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
transformers = pytest.importorskip("transformers")


def _pair(tier: str, nvme: str):
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": tier, "optimizer": tier, "device": "cpu", "nvme_path": nvme},
                        "precision": {"dtype": "float32"}}):
        model = transformers.GPT2LMHeadModel(cfg)
    return (model, infinity.AdamW(model, lr=1e-2)), (plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


def _steps(model, opt, ids, n: int) -> list[float]:
    model.train()
    losses = []
    for _ in range(n):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _generated(model, ids) -> list[torch.Tensor]:
    model.eval()
    common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 6, "pad_token_id": 0}
    out = [model.generate(ids, do_sample=False, **common)]
    torch.manual_seed(1)
    out.append(model.generate(ids, do_sample=True, top_k=20, **common))
    out.append(model.generate(ids, num_beams=3, **common))
    return out


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_generate_between_training_steps_matches_the_plain_model(tmp_path, tier):
    (model, opt), (plain, plain_opt) = _pair(tier, str(tmp_path))
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    got, want = [], []
    for net, o, into in ((model, opt, got), (plain, plain_opt, want)):
        into.append(_steps(net, o, ids, 3))
        into.extend(_generated(net, ids))
        into.append(_steps(net, o, ids, 2))
    assert got[0] == pytest.approx(want[0], rel=1e-6) and got[-1] == pytest.approx(want[-1], rel=1e-6)
    for name, a, b in zip(("greedy", "sampled", "beam search"), got[1:-1], want[1:-1]):
        assert a.shape == (2, 14) and torch.equal(a, b), name
    # Every token's forward (the prompt's, then one token at a time) asks in the same order: the passes
    # follow their own trace, and the training steps theirs ([Note: inference passes]).
    prefetch = infinity.stats(model)["prefetch"]
    passes = prefetch["inference_trace"]
    assert passes["mode"] == "following" and passes["recordings"] == 1 and passes["divergences"] == 0, passes
    assert prefetch["trace"]["divergences"] == 0 and prefetch["divergences"] == []
    infinity.release(model)
