"""One bf16 training run on CUDA with deterministic kernels; prints its losses as JSON (for test_cuda_path).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m tests.gpu.repro_losses PRESET NVME_DIR
"""
from __future__ import annotations

import json
import sys

import torch

import infinity
from infinity.config import load_config
from infinity.examples.gpt import GPT, GPTConfig


def main(preset: str, nvme_dir: str) -> None:
    torch.use_deterministic_algorithms(True)
    shape = GPTConfig(n_layer=6, d_model=512, n_head=8, vocab_size=8192, seq_len=256)
    torch.manual_seed(0)
    with infinity.Init(load_config(preset, overrides={"tiers": {"device": "cuda", "nvme_path": nvme_dir},
                                                      "precision": {"dtype": "bfloat16"}})):
        model = GPT(shape)
    opt = infinity.AdamW(model, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        idx = torch.randint(0, shape.vocab_size, (8, shape.seq_len), generator=gen).cuda()
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.synchronize()
    print(json.dumps({"losses": losses, "lending": infinity.stats(model)["gather_memory"]["lending"]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
