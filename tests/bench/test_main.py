"""python -m bench: the scenario suite parses its options and writes its result files."""

import json
import subprocess
import sys


def test_one_quick_scenario_writes_results_with_their_meta(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--only", "ubatch_split",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["command"] == "python -m bench --quick --only ubatch_split"
    assert {r["scenario"] for r in result["rows"]} == {"ubatch_split"}
    assert (tmp_path / "results.md").exists()
