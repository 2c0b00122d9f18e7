"""A Hugging Face model built in ``infinity.Init``, beside the plain one on the same weights:
``save_pretrained`` outside ``infinity.gathered`` raises naming a parameter and ``infinity.gathered``;
inside, it writes the plain model's weights; ``num_parameters`` counts as on the plain model; in bf16 the
fp32 masters hold exactly what the model's own init (``post_init``) gave, not its bf16 rounding."""
import os

import pytest
import torch

import infinity
from infinity.checkpoint.consolidate import consolidate
from infinity.errors import EngineError

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
    with pytest.raises(EngineError, match=r"'transformer\.wte\.weight'.*infinity\.gathered"):
        model.save_pretrained(tmp_path / "outside")
    assert not (tmp_path / "outside" / "model.safetensors").exists()

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


def test_resize_token_embeddings_inside_init_is_refused_naming_the_way(tmp_path):
    """Adding tokens inside ``infinity.Init`` changed a partitioned parameter's shape; the exit failed with
    "The size of tensor a (16384) must match the size of tensor b (20480)"."""
    cfg = {"tiers": {"params": "host", "optimizer": "host", "device": "cpu"}}
    with pytest.raises(EngineError, match=r"changed shape after it was partitioned .*\(64, 32\) -> \(80, 32\)"
                                          r".*new vocab_size"):
        with infinity.Init(cfg):
            model = transformers.GPT2LMHeadModel(_config())
            model.resize_token_embeddings(80)
    with infinity.Init(cfg):        # nothing was left behind
        model = transformers.GPT2LMHeadModel(_config())
    infinity.release(model)
