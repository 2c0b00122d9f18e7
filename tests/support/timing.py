"""What a test may assume about the data path's timing (see [Note: a GPU's timing in every test] in
tests/conftest.py)."""
from __future__ import annotations

import os

KEEPING_UP = 3
"""Most polls a held copy answers "not done" while its copy stream still keeps up with compute."""


def copies_keep_up() -> bool:
    """Whether this test's held copies finish within a few polls, as a GPU's copy streams do beside compute.

    The host-wait rules of a steady step (no host wait in forward or backward) hold then. With copies held
    until they are used (``INFINITY_LATE_COPIES=1000``: a copy stream far behind), the gradient staging
    buffers run out and the step rightly waits for them; what is checked then is that it trains the same."""
    from infinity.runtime.datapath import LATE_COPIES_ENV

    polls = os.environ.get(LATE_COPIES_ENV)
    return polls is None or int(polls) <= KEEPING_UP
