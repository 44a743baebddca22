"""The README's supported-families table, from running the family checks of
tests/graphattn/models/test_hf_families.py and test_hf_encoder_decoder.py (tiny random
configs, greedy tokens against each model's own generation, or the refusal at wrap time).

    python -m bench.hf_families            # the table
    python -m bench.hf_families --sweep    # every causal-LM family, refusal bypassed
    python -m bench.hf_families --readme README.md   # the README's families table, from
                                                     # results/hf_families_sweep.json

`--sweep` runs every causal-LM family of the installed transformers in a tiny random config
through HFCausalLM(model, unchecked=True) and compares tokens and logits with its own
generate(): what decides which families are accepted.
"""

import argparse
import datetime
import json
import multiprocessing
import resource
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.graphattn.models.test_hf_encoder_decoder import (
    test_unsupported_encoder_decoders_refused_when_wrapping,
    test_whisper_matches_own_generation_with_encoder_run_once,
)
from tests.graphattn.models.test_hf_families import (
    FAMILIES,
    REFUSED,
    SMALL,
    build_generic,
    serve_and_compare,
    test_family_matches_own_generate,
)


def sweep_one(model_type: str) -> dict:
    """One family: matches, or how it failed."""
    try:
        model = build_generic(model_type)
        got, expected, diff = serve_and_compare(model, unchecked=True, new=8)
        verdict = "match" if got == expected and diff < 1e-4 else "differs"
        return {"type": model_type, "class": type(model).__name__, "verdict": verdict,
                "max_logit_diff": diff}
    except Exception as e:  # noqa: BLE001  (a family that cannot even be built or run)
        return {"type": model_type, "verdict": "error",
                "error": f"{type(e).__name__}: {str(e)[:160]}"}


def _isolated(model_type: str, conn: Any) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a family's huge default
    conn.send(sweep_one(model_type))


def sweep(only: list[str] | None, timeout: float = 120.0) -> list[dict]:
    """Each family in a forked process (memory-capped, timed out), one JSON line each."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    ctx, rows = multiprocessing.get_context("fork"), []
    for model_type in only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_isolated, args=(model_type, send))
        proc.start()
        send.close()
        try:
            row = recv.recv() if recv.poll(timeout) else {
                "type": model_type, "verdict": "error", "error": f"no result in {timeout:.0f} s"}
        except EOFError:  # the process died (out of its memory cap)
            row = {"type": model_type, "verdict": "error", "error": "the process died"}
        proc.kill()
        proc.join()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


SWEEP_JSON = Path(__file__).parent / "results" / "hf_families_sweep.json"
MARK_BEGIN = "<!-- families table: python -m bench.hf_families --readme README.md -->"
MARK_END = "<!-- end of families table -->"
# where each checked family's match is asserted (the CPU suite)
CHECKED_IN = {"deepseek_v2": "test_hf_mla.py", "deepseek_v3": "test_hf_mla.py",
              "deepseek_v32": "test_hf_dsa.py"}


def readme_table(sweep_rows: list[dict]) -> str:
    """The README's families table: the checked families, then the sweep's verdicts (its
    matches accepted; the rest refused, with the reason `HFCausalLM` gives)."""
    from graphattn.models.hf import CHECKED, type_refusal

    lines = ["| model type | accepted | evidence |", "|---|---|---|"]
    for t in sorted(CHECKED):
        test = CHECKED_IN.get(t, "test_hf_families.py")
        lines.append(f"| {t} | yes | tokens and logits of its own `generate()`, "
                     f"`tests/graphattn/models/{test}` |")
    for r in sorted(sweep_rows, key=lambda r: (r["verdict"] != "match", r["type"])):
        t, reason = r["type"], type_refusal(r["type"])
        if r["verdict"] == "match":
            seen = f"sweep: logits within {r['max_logit_diff']:.1e}"
        elif r["verdict"] == "differs":
            seen = f"sweep: logits {r['max_logit_diff']:.2g} off"
        else:
            seen = "sweep: fails to run (" + r["error"].split(":")[0] + ")"
        lines.append(f"| {t} | {'yes' if reason is None else 'no: ' + reason} | {seen} |")
    return "\n".join(lines)


def write_readme(path: Path, table: str) -> None:
    """Replace the text between the README's family-table markers with `table`."""
    text = path.read_text()
    head, rest = text.split(MARK_BEGIN)
    _, tail = rest.split(MARK_END)
    path.write_text(f"{head}{MARK_BEGIN}\n{table}\n{MARK_END}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="run every causal-LM family")
    ap.add_argument("--only", default=None, help="comma-separated model types to sweep")
    ap.add_argument("--out", default=None, help="folder for hf_families_sweep.json")
    ap.add_argument("--readme", default=None,
                    help="write the families table into this README (between its markers)")
    args = ap.parse_args()
    if args.readme:
        rows = json.loads(SWEEP_JSON.read_text())["rows"]
        write_readme(Path(args.readme), readme_table(rows))
        return
    if args.sweep:
        rows = sweep(args.only.split(",") if args.only else None)
        if args.out:
            write_sweep(Path(args.out) / "hf_families_sweep.json", rows, bool(args.only))
        return
    table()


def write_sweep(path: Path, rows: list[dict], partial: bool) -> None:
    """Write the sweep's rows; a partial sweep (--only) replaces its types' rows in an
    existing file and keeps the others, its command naming every type the file holds."""
    if partial and path.exists():
        swept = {r["type"] for r in rows}
        rows = [r for r in json.loads(path.read_text())["rows"] if r["type"] not in swept] + rows
    types = ",".join(sorted(r["type"] for r in rows))
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "command": "python -m bench.hf_families --sweep" + (f" --only {types}" if partial
                                                                 else "")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "rows": sorted(rows, key=lambda r: r["type"])},
                               indent=1))


def table() -> None:
    from graphattn.models.hf import HFCausalLM

    print(f"transformers {transformers.__version__}\n")
    print("| model | result |\n|---|---|")
    for family, (_, model_name, extra) in sorted(FAMILIES.items()):
        try:
            test_family_matches_own_generate(family)
            result = "matches generate() token for token (20 tokens, 4 requests, chunked)"
        except AssertionError:
            result = "MISMATCH"
        note = f" ({', '.join(f'{k}={v}' for k, v in extra.items())})" if extra else ""
        print(f"| {model_name}{note} | {result} |")
    for model_name, (cfg_name, extra, _) in sorted(REFUSED.items()):
        cfg = getattr(transformers, cfg_name)(**{**SMALL, **extra})
        try:
            HFCausalLM(getattr(transformers, model_name)(cfg))
            result = "ACCEPTED (should be refused)"
        except ValueError as e:
            result = "refused: " + str(e).split(": ", 1)[1].split("; supported")[0]
        print(f"| {model_name} | {result} |")
    try:
        test_whisper_matches_own_generation_with_encoder_run_once()
        result = ("matches its own generation token for token through HFEncoderDecoder (12 "
                  "tokens, 4 requests, chunked; encoder once per request, cross backend)")
    except AssertionError:
        result = "MISMATCH"
    print(f"| WhisperForConditionalGeneration | {result} |")
    try:
        test_unsupported_encoder_decoders_refused_when_wrapping()
        result = ("refused by HFEncoderDecoder: its decoder derives positions from the cache "
                  "length, not from position ids")
    except AssertionError:
        result = "ACCEPTED (should be refused)"
    print(f"| BartForConditionalGeneration | {result} |")


if __name__ == "__main__":
    main()
