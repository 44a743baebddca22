"""`bench.warm_start`: a cold and a warm start in fresh processes sharing one compile cache."""

import json
import sys

import pytest

from bench import warm_start


@pytest.mark.slow
def test_cold_and_warm_start_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [
        "warm_start", "--model", "tiny", "--max-reqs", "2", "--max-len", "64", "--mixed", "",
        "--dynamic", "--warm-compile-threads", "1", "--cache-dir", str(tmp_path / "cache"),
        "--out", str(tmp_path)])
    warm_start.main()
    result = json.loads((tmp_path / "warm_start_cpu_tiny_2_dynamic_warm1.json").read_text())
    cold, warm = result["rows"]
    assert (cold["start"], warm["start"]) == ("cold", "warm")
    assert (cold["compile_threads"], warm["compile_threads"]) == (None, 1)
    for row in (cold, warm):
        # keys of 1 and 2 rows: the step compiles twice (dynamo specializes size 1)
        assert row["keys"] == 2 and row["compiles"] == 2
        assert row["seconds"] == pytest.approx(row["first_key_s"] + row["other_keys_s"])
    assert "--dynamic" in result["meta"]["command"]
    assert any((tmp_path / "cache").iterdir())  # the compile cache the warm start read
