"""bench.deepseek_step on CPU: both attention paths of a tiny DeepSeek stack run through the
runner with no host read, and the rows carry what the results page reads."""

import argparse

import pytest
import torch

from bench.deepseek_step import cache_bytes, run_path

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V3.2", allow_module_level=True)


@pytest.mark.parametrize("path,backend", [("sparse", "sparse_indexer"), ("dense", "mla")])
def test_rows_of_each_path(path, backend):
    args = argparse.Namespace(shape="tiny", layers=2, steps=2, device="cpu")
    with torch.inference_mode():
        rows = run_path(path, args, (1, 2), (40,))
    assert [(r["batch"], r["backend"]) for r in rows] == [(1, backend), (2, backend)]
    assert all(r["host_syncs_per_step"] == 0 and r["us_step"] > 0 for r in rows)


def test_the_sparse_path_reads_fewer_cache_bytes_past_its_top_k():
    from bench.deepseek_step import V32

    dense = cache_bytes("dense", V32, 4, 16384, 2)
    sparse = cache_bytes("sparse", V32, 4, 16384, 2)
    assert sparse < 0.4 * dense
    assert cache_bytes("sparse", V32, 4, 1024, 2) > cache_bytes("dense", V32, 4, 1024, 2)
