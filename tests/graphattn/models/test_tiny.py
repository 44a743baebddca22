"""TinyDecoder's caches: the model's dtype or fp8 (an fp8 cache decodes through the same
graphs with the logits close to the model-dtype cache's), refused kinds named."""

import numpy as np
import pytest
import torch

from graphattn import BucketPolicy, GraphRunner, RequestState, RunnerConfig, SchedulerOutput
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.sync import no_host_sync


def first_logits(kv_cache_dtype, device="cpu"):
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=128, hidden_size=64)).to(device)
    st = RequestState(2, 64, 8, device)
    model.allocate_caches(st.num_kv_blocks, 8, kv_cache_dtype)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(1, 2))))
    runner.capture(progress=False)
    a = runner.add_request("a", list(range(1, 20)))
    runner.step(SchedulerOutput(np.array([a]), np.array([19])))
    logits = []
    for _ in range(4):
        with no_host_sync():
            out = runner.step(SchedulerOutput(np.array([a]), np.array([1])))
        logits.append(out.logits[0].float().cpu())
        assert out.replayed
    return torch.stack(logits), model.caches[0][0].dtype


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp8_cache_decodes_through_the_graphs_close_to_the_model_dtype(device):
    want, dtype = first_logits(None, device)
    got, fp8 = first_logits("fp8_e4m3", device)
    assert fp8 == torch.float8_e4m3fn and dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)


def test_kv_cache_dtype_is_validated():
    model = TinyDecoder(TinyConfig(vocab_size=128, hidden_size=64))
    with pytest.raises(ValueError, match="kv_cache_dtype = 'int8', expected None, 'fp8_e4m3'"):
        model.allocate_caches(4, 8, "int8")
