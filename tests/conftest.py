"""Shared test set-up: the tests folder is importable (tests.support.*) in spawned ranks too."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
