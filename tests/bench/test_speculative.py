"""bench.speculative on CPU: the exact truncated drafter agrees with its target on every
token; the rows carry what the results page reads."""

import argparse
import copy

import torch

from bench.speculative import exact_truncated_draft, run_row
from graphattn.models.tiny import TinyConfig, TinyDecoder


def test_exact_truncated_draft_accepts_everything_and_rows_are_complete():
    torch.manual_seed(0)
    target = TinyDecoder(TinyConfig(vocab_size=256, hidden_size=64, num_layers=4))
    exact = copy.deepcopy(target)
    draft = exact_truncated_draft(exact)
    assert len(draft.layers) == 2 and draft.lm_head is exact.lm_head
    ids = torch.randint(0, 256, (12,))
    torch.testing.assert_close(draft.reference_logits(ids), exact.reference_logits(ids))
    args = argparse.Namespace(prompt=16, new=12, device="cpu")
    with torch.inference_mode():
        row = run_row(exact, "draft-exact", 3, 2, args, (1, 2))
        random = run_row(target, "draft-random", 3, 2, args, (1, 2))
    assert row["acceptance"] == 1.0 and row["steps"] <= 4
    assert random["acceptance"] < 0.5
    assert {"tokens_per_s", "step_us", "batch", "k"} <= row.keys()
    assert row["host_syncs_per_step"] == random["host_syncs_per_step"] == 0
