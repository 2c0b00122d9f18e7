"""transformers' ``generate`` on two ranks at stage 3, whose sequences end at different lengths: each rank gets the
plain model's tokens, and the rank done first runs forwards until the other is done, so neither waits in the
other's all-gathers ([Note: generating on several ranks] in infinity/runtime/synced_generate.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")


class _Wrapper(nn.Module):
    """A model of the user's around a transformers one, with a ``generate`` of its own that knows no
    ``synced_gpus`` (left alone)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.lm = transformers.GPT2LMHeadModel(cfg)

    def generate(self, ids, steps: int):
        return self.lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, pad_token_id=0,
                                do_sample=False)


def _generate(rank, world, workdir, stage):
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    plain = _Wrapper(cfg).eval()
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host" if stage == 3 else "device", "optimizer": "host", "device": "cpu"},
                        "partition": {"stage": stage}, "precision": {"dtype": "float32"}}):
        model = _Wrapper(cfg)
    model.eval()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(2 + rank))
    out = []
    for new in (2 + 4 * rank, 6 - 4 * rank):       # rank 0 done first, then rank 1
        common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": new, "pad_token_id": 0}
        out.append((model.lm.generate(ids, do_sample=False, **common),
                    plain.lm.generate(ids, do_sample=False, **common)))
    # synced_gpus=False, as Seq2SeqTrainer passes it, and the wrapper's own generate
    common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 2 + 4 * rank, "pad_token_id": 0}
    out.append((model.lm.generate(ids, do_sample=False, synced_gpus=False, **common),
                plain.lm.generate(ids, do_sample=False, **common)))
    out.append((model.generate(ids, 6 - 4 * rank), plain.generate(ids, 6 - 4 * rank)))
    synced = ("generate" in vars(model.lm), "generate" in vars(model))
    infinity.release(model)
    return out, synced, "generate" in vars(model.lm)


@pytest.mark.parametrize("stage", [3, 2])
def test_generate_with_other_lengths_on_each_rank_gives_the_plain_models_tokens(tmp_path, stage):
    for rank, (out, synced, after) in enumerate(run_ranks(_generate, 2, tmp_path, stage, collective_timeout=60)):
        for got, want in out:
            assert torch.equal(got, want), (rank, got, want)
        assert [got.shape[1] for got, _ in out] == ([10, 14, 10, 14] if rank == 0 else [14, 10, 14, 10])
        assert synced == (stage == 3, False) and not after, (synced, after)   # release gives the model's own back
