"""`bench.startup --lazy`: the first step of each new key beside an eager step and the
capture."""

import torch

from bench.startup import measure_lazy
from graphattn.models.tiny import TinyConfig, TinyDecoder


def test_lazy_rows_time_each_new_decode_key():
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=128, hidden_size=32))
    model.allocate_caches(4 * 4, 16)
    rows = measure_lazy(model, "cpu", 4, 64, (1, 4))
    assert [r["key"].split()[0] for r in rows] == ["reqs=1", "reqs=4"]
    for r in rows:
        assert r["first_step_s"] > 0 and r["eager_step_s"] > 0 and r["capture_s"] > 0
        assert r["first_over_eager_plus_capture"] == r["first_step_s"] / (
            r["eager_step_s"] + r["capture_s"])
