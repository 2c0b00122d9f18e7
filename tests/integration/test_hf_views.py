"""A Hugging Face model built in ``infinity.Init``, beside the plain one on the same weights:
``save_pretrained`` outside ``infinity.gathered`` raises naming a parameter and ``infinity.gathered``;
inside, it writes the plain model's weights; ``num_parameters`` counts as on the plain model; in bf16 the
fp32 masters hold exactly what the model's own init (``post_init``) gave, not its bf16 rounding;
``resize_token_embeddings`` inside ``infinity.Init`` trains as on the plain model, and after it says so."""
import os

import pytest
import torch

import infinity
from infinity.checkpoint.consolidate import consolidate
from infinity.errors import EngineError

pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
transformers = pytest.importorskip("transformers")


def _config():
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_pretrained_and_masters_against_the_plain_model(tmp_path, dtype):
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(_config())
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host"}, "precision": {"dtype": dtype}}):
        model = transformers.GPT2LMHeadModel(_config())
    assert model.num_parameters() == ref.num_parameters()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.json").write_text("{}")       # the user's: kept ([Note: save_pretrained
    # refused before it writes] in infinity/runtime/save_guard.py)
    with pytest.raises(EngineError, match=r"GPT2LMHeadModel.save_pretrained\(\).*Nothing was written.*"
                                          r"infinity\.save_pretrained\(model, d\)"):
        model.save_pretrained(tmp_path / "outside")
    assert sorted(os.listdir(tmp_path / "outside")) == ["config.json"]
    assert (tmp_path / "outside" / "config.json").read_text() == "{}"
    with pytest.raises(EngineError, match=r"save_pretrained\(\).*Nothing was written"):
        model.transformer.save_pretrained(tmp_path / "inner")     # a transformers module inside, too
    assert not (tmp_path / "inner").exists()

    with infinity.gathered(model):
        model.save_pretrained(tmp_path / "inside")
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "inside", torch_dtype=torch.float32)
    compute = getattr(torch, dtype)
    for (name, p), q in zip(ref.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(q, p.to(compute).float()), name

    infinity.save_checkpoint(tmp_path / "ckpt", model)
    consolidate(tmp_path / "ckpt", tmp_path / "masters.pt")
    masters = torch.load(tmp_path / "masters.pt")
    plain = ref.state_dict()
    assert {k: torch.equal(masters[k], plain[k]) for k in masters} == {k: True for k in masters}
    infinity.release(model)


def _quiet_config(tie: bool = True):
    """No dropout: the engine's and the plain model's forwards draw nothing, so their losses can be compared."""
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("load", [False, True], ids=["built", "from_pretrained"])
def test_resize_token_embeddings_inside_init_trains_as_the_plain_resized_model(tmp_path, load, tie):
    """Adding tokens to a model about to be fine-tuned: inside ``infinity.Init`` the embeddings (and an untied
    head) are partitioned again with their new rows; it was refused ("changed shape after it was
    partitioned"), and before that the exit failed ("The size of tensor a (16384) must match ...")."""
    if load:
        torch.manual_seed(1)
        transformers.GPT2LMHeadModel(_quiet_config(tie)).save_pretrained(tmp_path / "base")

    def build():
        if load:
            return transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
        return transformers.GPT2LMHeadModel(_quiet_config(tie))

    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"},
                        "precision": {"dtype": "float32"}}):
        model = build()
        model.resize_token_embeddings(80)       # the new rows drawn from the old ones' mean and covariance
    torch.manual_seed(0)
    plain = build()
    plain.resize_token_embeddings(80)
    assert model.num_parameters() == plain.num_parameters()
    assert model.lm_head.weight.shape == (80, 32) and (model.lm_head.weight is model.transformer.wte.weight) == tie
    opt, plain_opt = infinity.AdamW(model, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for loss, plain_loss in _losses_beside((model, opt), (plain, plain_opt), steps=3):
        assert loss == pytest.approx(plain_loss, rel=1e-5)
    with infinity.gathered(model):
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)
    infinity.release(model)


def test_resize_token_embeddings_after_init_says_where_it_can_run():
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}}):
        model = transformers.GPT2LMHeadModel(_config())
    with pytest.raises(EngineError, match=r"'transformer\.wte\.weight': resize_token_embeddings gives parameters "
                                          r"new shapes.*call it inside that block"):
        model.resize_token_embeddings(80)
    assert model.transformer.wte.weight.shape == (64, 32)
    infinity.release(model)


def resize_case(rank: int, world: int, workdir) -> list[float]:
    """Each rank resizes inside ``infinity.Init`` from a generator of its own: rank 0's new rows win, as rank 0's
    values win at partitioning; the model trains (every rank the same batch) as the plain model does with
    rank 0's draw. Returns the per-step |loss - plain loss|."""
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host", "device": "cpu"},
                        "precision": {"dtype": "float32"}}):
        model = transformers.GPT2LMHeadModel(_quiet_config(tie=False))
        torch.manual_seed(100 + rank)
        model.resize_token_embeddings(80, mean_resizing=False)     # new rows from the model's init: N(0, 0.02)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(_quiet_config(tie=False))
    torch.manual_seed(100)
    plain.resize_token_embeddings(80, mean_resizing=False)
    opt, plain_opt = infinity.AdamW(model, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    diffs = [abs(loss - plain_loss) for loss, plain_loss in _losses_beside((model, opt), (plain, plain_opt), steps=2)]
    infinity.release(model)
    return diffs


def _losses_beside(*runs, steps: int) -> list[tuple]:
    """Per step, each (model, optimizer)'s loss on the same batch of the 80-token vocabulary."""
    ids = torch.randint(0, 80, (2, 16), generator=torch.Generator().manual_seed(0))
    out = []
    for _ in range(steps):
        losses = []
        for net, opt in runs:
            loss = net(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.append(tuple(losses))
    return out
