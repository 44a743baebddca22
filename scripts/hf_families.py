"""The README's supported-families table, from running the family checks of
tests/graphattn/models/test_hf_families.py (tiny random configs, greedy tokens against each
model's own generate(), or the refusal at wrap time).

    python -m scripts.hf_families
"""

import transformers

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


if __name__ == "__main__":
    main()
