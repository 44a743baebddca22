import pytest
import torch

from graphattn.capture.graphs import CUDAGraphManager, GraphNotCapturedError
from graphattn.keys import GraphKey
from graphattn.sync import no_host_sync


def toy_forward(inputs, key):
    # rows: tokens; a padded slot (-1) must contribute nothing
    x, slot = inputs["x"], inputs["slot"]
    w = (slot >= 0).to(x.dtype).unsqueeze(-1)
    return (x * w * 2 + key.max_len_bucket) * w, x.sum(-1)


def make_inputs(device):
    def f(key):
        t = key.num_tokens_padded
        return {"x": torch.zeros(t, 3, device=device),
                "slot": torch.full((t,), -1, dtype=torch.int64, device=device),
                "qsl": torch.zeros(key.num_reqs_padded + 1, dtype=torch.int32, device=device)}
    return f


def keys():
    return [GraphKey(2, 2, 16, True), GraphKey(4, 4, 16, True), GraphKey(8, 8, 32, False)]


def run_manager(device):
    m = CUDAGraphManager(toy_forward, device, pad_values={"slot": -1, "qsl": "edge"})
    report = m.capture(keys(), make_inputs(device))
    assert report.num_graphs == 3 and report.keys[0] == GraphKey(8, 8, 32, False)
    # time and pool size per key, in capture order; the pool only grows
    assert len(report.key_seconds) == len(report.key_pool_bytes) == 3
    assert all(t > 0 for t in report.key_seconds)
    assert report.key_pool_bytes == sorted(report.key_pool_bytes)
    assert report.key_pool_bytes[-1] <= report.pool_bytes or device != "cuda"
    x = torch.randn(3, 3, device=device) + 0.5
    live = {"x": x, "slot": torch.tensor([4, 7, 1], device=device),
            "qsl": torch.tensor([0, 1, 3], dtype=torch.int32, device=device)}
    with no_host_sync():
        out, s = m.replay(GraphKey(4, 4, 16, True), live, 3)
    torch.testing.assert_close(out, x * 2 + 16)
    torch.testing.assert_close(s, x.sum(-1))
    static = m._captured[GraphKey(4, 4, 16, True)].inputs
    assert static["slot"].tolist() == [4, 7, 1, -1]  # padded with the sentinel
    assert static["qsl"].tolist() == [0, 1, 3, 3, 3]  # "edge" padding
    assert static["x"][3].abs().sum().item() == 0.0
    return m


def test_cpu_fallback_semantics():
    m = run_manager("cpu")
    assert m.num_replays == 1 and not m.use_graphs


def test_missing_key_error_or_eager():
    m = CUDAGraphManager(toy_forward, "cpu", pad_values={"slot": -1})
    m.capture(keys()[:1], make_inputs("cpu"))
    live = {"x": torch.ones(1, 3), "slot": torch.tensor([0]), "qsl": torch.tensor([0, 1],
                                                                                  dtype=torch.int32)}
    with pytest.raises(GraphNotCapturedError, match="no graph captured for reqs=3"):
        m.replay(GraphKey(3, 3, 16, True), live, 1)
    eager = CUDAGraphManager(toy_forward, "cpu", on_missing="eager")
    out, _ = eager.replay(GraphKey(1, 1, 16, True), live, 1)
    assert out.tolist() == [[18.0, 18.0, 18.0]] and eager.num_eager == 1


def test_bad_inputs_rejected():
    m = CUDAGraphManager(toy_forward, "cpu")
    m.capture(keys()[:1], make_inputs("cpu"))
    k = keys()[0]
    good = {"x": torch.ones(2, 3), "slot": torch.zeros(2, dtype=torch.int64),
            "qsl": torch.zeros(3, dtype=torch.int32)}
    with pytest.raises(ValueError, match="got names"):
        m.replay(k, {"x": good["x"]}, 2)
    with pytest.raises(ValueError, match=r"does not fit the static buffer \(2, 3\)"):
        m.replay(k, {**good, "x": torch.ones(3, 3)}, 2)
    with pytest.raises(ValueError, match="expected torch.float32"):
        m.replay(k, {**good, "x": torch.ones(2, 3, dtype=torch.float64)}, 2)
    again = m.capture(keys()[:1], make_inputs("cpu"))
    assert (again.num_graphs, again.num_skipped) == (0, 1)
    with pytest.raises(ValueError, match="on_missing"):
        CUDAGraphManager(toy_forward, "cpu", on_missing="maybe")


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    m = run_manager("cuda")
    assert m.use_graphs
    # re-replaying with new data changes the output: the graph reads the static buffers
    x = torch.randn(2, 3, device="cuda")
    live = {"x": x, "slot": torch.tensor([0, 1], device="cuda"),
            "qsl": torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")}
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = m.replay(GraphKey(2, 2, 16, True), live, 2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(out, x * 2 + 16)


def test_replay_path_on_meta_device():
    m = CUDAGraphManager(toy_forward, "meta", pad_values={"slot": -1, "qsl": "edge"})
    m.capture(keys(), make_inputs("meta"))
    live = {"x": torch.empty(3, 3, device="meta"),
            "slot": torch.empty(3, dtype=torch.int64, device="meta"),
            "qsl": torch.empty(3, dtype=torch.int32, device="meta")}
    with no_host_sync():
        out, _ = m.replay(GraphKey(4, 4, 16, True), live, 3)
    assert out.shape == (3, 3) and out.device.type == "meta"


@pytest.mark.cuda
def test_pinned_host_inputs_copy_into_static_buffers():
    m = CUDAGraphManager(toy_forward, "cuda", pad_values={"slot": -1, "qsl": "edge"})
    m.capture(keys()[:2], make_inputs("cuda"))
    x = torch.randn(3, 3) + 0.5
    live = {"x": x.pin_memory(), "slot": torch.tensor([4, 7, 1]).pin_memory(),
            "qsl": torch.tensor([0, 1, 3], dtype=torch.int32).pin_memory()}
    with no_host_sync():
        out, _ = m.replay(GraphKey(4, 4, 16, True), live, 3)
    torch.testing.assert_close(out.cpu(), x * 2 + 16)
    with pytest.raises(ValueError, match=r"on cpu, expected torch.float32 \(4, 3\) on cuda:0 "
                                         r"\(or pinned host memory\)"):
        m.replay(GraphKey(4, 4, 16, True), {**live, "x": x}, 3)


def test_interrupted_capture_resumes_and_reports():
    ks = keys()
    calls = {"n": 0}

    def flaky(inputs, key):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("fault in the forward")
        return toy_forward(inputs, key)

    m = CUDAGraphManager(flaky, "cpu")
    with pytest.raises(RuntimeError, match="fault"):
        m.capture(ks, make_inputs("cpu"))
    report = m.capture(ks, make_inputs("cpu"), progress=True)
    assert report.num_skipped == 1 and report.num_graphs == len(ks) - 1
    assert set(m.keys) == set(ks)
    assert str(report).startswith(f"ran {len(ks) - 1} keys eagerly: no CUDA graphs on cpu")


WIDE = 1 << 20  # 4 MiB a row: every wide output over 2 MiB, most in segments of their own


def big_forward(inputs, key):
    """A large first output (e.g. logits) and a small one, both from the live rows."""
    x = inputs["x"]
    wide = (x.sum(-1, keepdim=True) + key.max_len_bucket).expand(-1, WIDE) * 1.0
    return wide, x.sum(-1) * 3


@pytest.mark.cuda
def test_scratch_outputs_share_the_pool_across_keys():
    ks = [GraphKey(8, 8, 16, True), GraphKey(6, 6, 16, True), GraphKey(4, 4, 16, True),
          GraphKey(2, 2, 16, True)]
    pools = {}
    for scratch in ((), (0,)):
        m = CUDAGraphManager(big_forward, "cuda", pad_values={"slot": -1, "qsl": "edge"},
                             scratch_outputs=scratch)
        alone = m.capture_alone(ks, make_inputs("cuda"))
        assert not m.keys and m.pool_bytes() == 0  # dry runs leave nothing captured
        for k, (pool, kept) in zip(ks, alone, strict=True):
            wide = k.num_reqs_padded * WIDE * 4
            assert pool >= wide and kept == k.num_reqs_padded * 4 + (wide if not scratch else 0)
        pools[scratch] = m.capture(ks, make_inputs("cuda")).pool_bytes
        for k in (ks[2], ks[0], ks[3], ks[0]):  # alternate keys: each replay's own values
            n = k.num_reqs_padded
            x = torch.randn(n, 3, device="cuda")
            live = {"x": x, "slot": torch.arange(n, device="cuda"),
                    "qsl": torch.arange(n + 1, dtype=torch.int32, device="cuda")}
            with no_host_sync():
                wide, small = m.replay(k, live, n)
            torch.testing.assert_close(wide[:, -1], x.sum(-1) + 16)
            torch.testing.assert_close(wide[:, 0], x.sum(-1) + 16)
            torch.testing.assert_close(small, x.sum(-1) * 3)
        del m
    # four keys' wide outputs (8 + 6 + 4 + 2 rows of 4 MiB) against the largest one's
    assert pools[(0,)] <= pools[()] - 40 * 2**20, pools


def test_capture_starts_no_garbage_collection_and_restores_the_collector():
    """Python starts no collection while keys are captured (one would walk everything made
    since the heap was frozen: compiled code loaded at a key's first call); the collector's
    state is as before afterwards, also when a capture raises."""
    import gc

    seen = []

    def forward(inputs, key):
        seen.append(gc.isenabled())
        if key.num_tokens_padded == 8:
            raise RuntimeError("boom")
        return toy_forward(inputs, key)

    m = CUDAGraphManager(forward, "cpu", pad_values={"slot": -1, "qsl": "edge"})
    m.capture(keys()[:2], make_inputs("cpu"))
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        m.capture(keys(), make_inputs("cpu"))
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        m.capture(keys()[:2], make_inputs("cpu"))
    finally:
        assert not gc.isenabled()
        gc.enable()
