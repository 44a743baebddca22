"""The README's supported-families table, from running the family checks of
tests/graphattn/models/test_hf_families.py and test_hf_encoder_decoder.py (tiny random
configs, greedy tokens against each model's own generation, or the refusal at wrap time).

    python -m scripts.hf_families
"""

import transformers

from tests.graphattn.models.test_hf_encoder_decoder import (
    test_unsupported_encoder_decoders_refused_when_wrapping,
    test_whisper_matches_own_generation_with_encoder_run_once,
)
from tests.graphattn.models.test_hf_families import (
    FAMILIES,
    REFUSED,
    SMALL,
    test_family_matches_own_generate,
)


def main() -> None:
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
