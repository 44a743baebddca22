import pytest
import torch

from capture.compile import BucketCompiler, RecompileError
from capture.dispatcher import GraphKey


def fwd(inputs, key):
    return inputs["x"][:, : key.max_len_bucket].sum(-1) * key.num_reqs_padded


def test_compiles_once_per_key_and_fails_loudly_after_freeze():
    torch._dynamo.reset()
    c = BucketCompiler(fwd, backend="eager")
    keys = [GraphKey(r, r, b, True) for r in (1, 2, 4) for b in (4, 8)]
    for k in keys:
        for _ in range(2):
            c({"x": torch.randn(k.num_tokens_padded, 8)}, k)
    assert c.num_compiles == len(keys)
    c.freeze()
    for k in keys:  # steady state: same keys, new instances and data
        c({"x": torch.randn(k.num_tokens_padded, 8)}, GraphKey(*(getattr(k, f) for f in
                                                                  k.__slots__)))
    assert c.num_compiles == len(keys)
    with pytest.raises(RecompileError, match="steady-state recompile after 6 compiles"):
        c({"x": torch.randn(8, 8)}, GraphKey(8, 8, 8, True))


def test_more_keys_than_dynamo_default_limit():
    torch._dynamo.reset()
    c = BucketCompiler(fwd, backend="eager", max_compiles=64)
    for r in range(1, 21):
        c({"x": torch.randn(r, 4)}, GraphKey(r, r, 4, True))
    assert c.num_compiles == 20


def test_steady_state_block():
    torch._dynamo.reset()
    c = BucketCompiler(fwd, backend="eager")
    c({"x": torch.randn(2, 4)}, GraphKey(2, 2, 4, True))
    with c.steady_state(), pytest.raises(RecompileError):
        c({"x": torch.randn(3, 4)}, GraphKey(3, 3, 4, True))
    assert not c.frozen
