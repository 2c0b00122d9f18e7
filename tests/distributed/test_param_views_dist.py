"""Views of engine parameters on two ranks, against plain torch on the same weights (the one-rank case and
what it checks: tests/unit/test_param_views.py): reads of a released parameter refused, writes through
``state_dict()`` tensors under ``infinity.gathered`` reaching every rank's shards (a tiled layer's too),
bf16 masters holding the fp32 values the model was built with."""
import pytest

from tests.support.ranks import run_ranks
from tests.unit.test_param_views import views_case


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_param_views_on_two_ranks(tmp_path, dtype):
    run_ranks(views_case, 2, tmp_path, dtype)


@pytest.mark.hf
def test_resize_token_embeddings_inside_init_on_two_ranks(tmp_path):
    pytest.importorskip("transformers")
    from tests.integration.test_hf_views import resize_case

    for diffs in run_ranks(resize_case, 2, tmp_path):
        assert max(diffs) < 1e-5, diffs
