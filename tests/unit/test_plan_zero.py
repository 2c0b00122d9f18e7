"""The ZeRO model-state arithmetic against the paper's published figures.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020): Section 1's example (7.5B parameters, K = 12, N_d = 64) and Table 1 (per-device
model-state memory in GB for 7.5B, 128B and 1T parameters at N_d = 1 ... 1024).

[Note: the paper's printed precision]
Table 1 rounds its decimal cells (41.25 is printed 41.3, 21.5625 is 21.6) but truncates the
large integer cells (4187.5 is printed 4187, 2054.69 is 2054, 513.5 is 513). A cell matches
when our value, rounded half-up OR truncated to the digits printed, equals the printed text;
either way the test pins the value to within one unit of the last printed digit.
"""
from __future__ import annotations

from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

import pytest

from infinity.plan import PlanError, model_states_per_rank, render_zero_table, zero_table

# Table 1 as printed: {params: {N_d: (P_os, P_os+g, P_os+g+p)}} in GB; baseline = N_d 1 cell.
TABLE_1 = {
    7.5e9: {
        1: ("120", "120", "120"),
        4: ("52.5", "41.3", "30"),
        16: ("35.6", "21.6", "7.5"),
        64: ("31.4", "16.6", "1.88"),
        256: ("30.4", "15.4", "0.47"),
        1024: ("30.1", "15.1", "0.12"),
    },
    128e9: {
        1: ("2048", "2048", "2048"),
        4: ("896", "704", "512"),
        16: ("608", "368", "128"),
        64: ("536", "284", "32"),
        256: ("518", "263", "8"),
        1024: ("513", "257", "2"),
    },
    1e12: {
        1: ("16000", "16000", "16000"),
        4: ("7000", "5500", "4000"),
        16: ("4750", "2875", "1000"),
        64: ("4187", "2218", "250"),
        256: ("4046", "2054", "62.5"),
        1024: ("4011", "2013", "15.6"),
    },
}


def _matches_printed(nbytes: int, printed: str) -> bool:
    """See [Note: the paper's printed precision]."""
    value = Decimal(nbytes) / Decimal(10**9)
    places = Decimal(1).scaleb(-len(printed.partition(".")[2]))
    target = Decimal(printed)
    return target in (
        value.quantize(places, rounding=ROUND_HALF_UP),
        value.quantize(places, rounding=ROUND_DOWN),
    )


def test_paper_example_7_5b_on_64_ranks():
    psi, nd = 7.5e9, 64
    baseline = model_states_per_rank(psi, nd, stage=0)["total"]
    assert baseline == 120 * 10**9  # (2 + 2 + 12) x 7.5e9 bytes = 120 GB
    expected = {1: "31.4", 2: "16.6", 3: "1.88"}
    for stage, printed in expected.items():
        assert _matches_printed(model_states_per_rank(psi, nd, stage=stage)["total"], printed)
    # The exact values behind the printed ones.
    assert model_states_per_rank(psi, nd, stage=1)["total"] == 31_406_250_000
    assert model_states_per_rank(psi, nd, stage=2)["total"] == 16_640_625_000
    assert model_states_per_rank(psi, nd, stage=3)["total"] == 1_875_000_000


@pytest.mark.parametrize("psi", sorted(TABLE_1))
def test_table_1(psi):
    for nd, cells in TABLE_1[psi].items():
        for stage, printed in zip((1, 2, 3), cells):
            total = model_states_per_rank(psi, nd, stage=stage, k=12)["total"]
            assert _matches_printed(total, printed), (psi, nd, stage, total, printed)
        # Baseline data parallelism does not shrink with the rank count.
        assert model_states_per_rank(psi, nd, stage=0)["total"] == 16 * int(psi)


def test_printed_precision_check_is_tight():
    # One unit of the last printed digit off must fail, so the table test cannot pass loosely.
    assert _matches_printed(31_406_250_000, "31.4")
    assert not _matches_printed(31_406_250_000, "31.5")
    assert not _matches_printed(31_406_250_000, "31.3")
    assert not _matches_printed(4_187_500_000_000, "4186")
    assert not _matches_printed(4_187_500_000_000, "4189")


def test_components_sum_and_partitioning():
    states = model_states_per_rank(1000, 3, stage=2, k=12, param_bytes=2, grad_bytes=2)
    # Shards are whole elements: ceil(1000 / 3) = 334.
    assert states == {
        "params": 2 * 1000,
        "grads": 2 * 334,
        "optimizer_states": 12 * 334,
        "total": 2000 + 668 + 4008,
    }
    assert model_states_per_rank(1000, 3, stage=3)["params"] == 2 * 334
    assert model_states_per_rank(1000, 3, stage=1)["grads"] == 2 * 1000
    assert model_states_per_rank("7.5B", 64) == model_states_per_rank(7_500_000_000, 64)


def test_zero_table_rows_and_text():
    rows = zero_table([7.5e9, "1e12"], [1, 64])
    assert [(r["num_params"], r["world_size"]) for r in rows] == [
        (7_500_000_000, 1), (7_500_000_000, 64), (10**12, 1), (10**12, 64)]
    assert rows[1]["P_os+g+p"] == 1_875_000_000
    text = render_zero_table(rows)
    assert "GB = 1e9 bytes" in text
    assert "7.5B parameters" in text and "1T parameters" in text
    assert "1.88" in text and "4187.5" in text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_params": 0, "world_size": 4}, "num_params must be positive"),
        ({"num_params": -7.5e9, "world_size": 4}, "num_params must be positive"),
        ({"num_params": "-5", "world_size": 4}, "num_params must be positive"),
        ({"num_params": 1.5, "world_size": 4}, "num_params must be a whole number"),
        ({"num_params": "lots", "world_size": 4}, "num_params must be a positive whole number"),
        ({"num_params": 1e9, "world_size": 0}, "world_size must be a positive integer"),
        ({"num_params": 1e9, "world_size": 2.5}, "world_size must be a positive integer"),
        ({"num_params": 1e9, "world_size": 4, "stage": 4}, "stage must be one of"),
        ({"num_params": 1e9, "world_size": 4, "k": 0}, "k .* must be a positive integer"),
        ({"num_params": 1e9, "world_size": 4, "param_bytes": -2}, "param_bytes must be"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(PlanError, match=match):
        model_states_per_rank(**kwargs)
