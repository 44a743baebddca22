"""graphattn: sync-free attention metadata from CPU upper bounds, CUDA-graph replay and
torch.compile per bucket for LLM inference.

Stages, one module each: `state` -> `batch` -> `metadata` -> `backends` -> `ubatch` /
`spec_decode`; graph keys and buckets in `keys` / `buckets`; the capture layer
(dispatch, graphs, runner, profiling) in `graphattn.capture`.
"""

__version__ = "0.2.0"
