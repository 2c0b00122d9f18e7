"""Shared test set-up: the tests folder is importable (tests.support.*) in spawned ranks too.

Tests feed CPU tensors, so the engines they build compute on the CPU on every machine, a GPU
machine included: ``INFINITY_DEVICE=cpu`` resolves ``tiers.device = "auto"`` (inherited by
spawned ranks and subprocesses). Tests of the GPU path (tests/gpu) set ``tiers.device = "cuda"``.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

os.environ["INFINITY_DEVICE"] = "cpu"
