"""The one error type of ``infinity.plan``."""
from __future__ import annotations


class PlanError(ValueError):
    """Bad input to the planner: a size, a world size, a model callable or a config.

    The message names the offending argument, the value given and what is allowed, so that
    ``infinity-plan`` can print it as its one line of output (exit code 2).
    """
