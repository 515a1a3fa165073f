"""The tiled loss and MLPs under ZeRO-2 and ZeRO-3 on 2 CPU ranks with unequal token counts (one launch)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.launch import launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiling_zero")
    launch(["tests/helpers/tiling_zero.py", str(out)], launcher="torchrun", timeout=600)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("stage", [2, 3])
def test_tiles_match_the_untiled_model(results, stage):
    """ZeRO-2: each gradient is reduced once, after the last tile. ZeRO-3: the launch finishing at
    all shows the ranks made the same gathers, and the agreed (shorter, empty, padded) tiles
    compute the same loss and gradients."""
    for rank in results:
        runs = rank[f"zero{stage}"]
        (loss, grads), (want_loss, want_grads) = runs["tiled"], runs["untiled"]
        assert loss == pytest.approx(want_loss, rel=1e-6)
        assert grads.keys() == want_grads.keys()
        for name, want in want_grads.items():
            want = torch.tensor(want)
            scale = float(want.abs().max()) or 1.0
            torch.testing.assert_close(torch.tensor(grads[name]), want, rtol=0.0, atol=1e-5 * scale, msg=name)
