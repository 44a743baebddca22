"""`bench.graph_replay`'s CPU parts: the transformers modes' runner, and the merged table of
the models of a run."""

import json

import numpy as np
import pytest

from bench.graph_replay import merge, mode_runner, replay_policy
from bench.setup import fill_requests, make_setup
from graphattn.models.tiny import TinyConfig
from graphattn.state import SchedulerOutput


def test_hf_llama_of_a_bench_shape_serves_graph_replay_steps():
    """The transformers modes: the Llama of the setup's shape, on the setup's state."""
    pytest.importorskip("transformers")
    cfg = TinyConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=128)
    policy, max_len = replay_policy((1, 4), (32,), 2)
    setup = make_setup("cpu", 4, max_len, policy, cfg)
    fill_requests(setup, 4, np.full(4, 16, np.int32), np.random.default_rng(0))
    runner = mode_runner("hf_graphs", setup, policy)
    assert type(runner.forward).__name__ == "HFCausalLM" and not setup.model.caches
    runner.capture(progress=False)
    out = runner.step(SchedulerOutput(np.arange(4, dtype=np.int32), np.ones(4, np.int32)))
    assert out.replayed and out.key.num_reqs_padded == 4


def test_merge_takes_the_files_of_the_runs_models_only(tmp_path):
    pytest.importorskip("matplotlib")
    row = {"mode": "graphattn_graphs", "batch": 1, "length": 512, "us_step": 2.0,
           "floor_us": 1.0, "x_floor": 2.0, "model": "tiny"}
    meta = {"date": "2026-12-06", "torch": "t", "device": "d", "command": "c"}
    for name in ("tiny", "1b_other_card"):
        (tmp_path / f"graph_replay_{name}.json").write_text(json.dumps(
            {"meta": meta, "rows": [{**row, "model": name}]}))
    merge(tmp_path, ["tiny", "1b"])  # no file for 1b: nothing of it
    rows = json.loads((tmp_path / "graph_replay.json").read_text())
    assert [r["model"] for r in rows] == ["tiny"] and rows[0]["device"] == "d"
    assert "| tiny | 512 | 1 |" in (tmp_path / "graph_replay.md").read_text()
