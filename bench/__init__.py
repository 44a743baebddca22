"""graphattn benchmark suite: `python -m bench` (GPU scenarios + CPU host overhead)."""
