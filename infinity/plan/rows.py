"""One row of a plan: the bytes one rank holds for one purpose in one tier.

A leaf of the plan room: ``layout`` produces rows, ``planner`` gathers them into a
``Plan``, ``render`` prints them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanRow:
    """Bytes one rank holds for one purpose in one tier.

    Attributes
    ----------
    key : str
        Stable identifier (``compute_copy``, ``master``, ``adam_moments``, ``grad_accumulator``,
        ``pool_buffers``, ``optimizer_subgroup_buffers``, ``nvme_staging``, ``prefetch_arena``, ``working_set``, ``gather_buffer``,
        ``working_set_grad``, ``device_prefetch``, ``persistent_params``).
    what : str
        Human description, including dtype and sizes.
    tier : str
        ``device``, ``host`` or ``nvme``.
    nbytes : int
        Bytes per rank.
    """

    key: str
    what: str
    tier: str
    nbytes: int
