"""The README's families table is the one bench.hf_families generates from the sweep's
results and the accepted lists (so it cannot drift from what HFCausalLM accepts)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from bench.hf_families import MARK_BEGIN, MARK_END, SWEEP_JSON, readme_table  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_families_table_is_generated():
    text = README.read_text()
    block = text.split(MARK_BEGIN)[1].split(MARK_END)[0].strip()
    assert block == readme_table(json.loads(SWEEP_JSON.read_text())["rows"])


def test_every_sweep_verdict_agrees_with_what_wrapping_does():
    from graphattn.models.hf import type_refusal

    for row in json.loads(SWEEP_JSON.read_text())["rows"]:
        accepted = type_refusal(row["type"]) is None
        assert accepted == (row["verdict"] == "match" and row["type"] != "llama4_text"), row
