"""Each backend captured per key, replayed on decode steps whose lengths change
between replays (re-planned every step), compared with eager on a cache copy."""

import numpy as np
import pytest
import torch

from graphattn.backends import get_backend
from graphattn.backends.cross import CrossAttentionBuilder
from graphattn.backends.flex import FlexAttentionBuilder, FlexAttentionImpl
from graphattn.backends.mla import MLABuilder
from graphattn.backends.paged import PagedAttentionBuilder
from graphattn.backends.reference import allocate_kv_cache
from graphattn.backends.sparse_indexer import SparseIndexerBuilder
from graphattn.batch import prepare_inputs
from graphattn.buckets import LengthBuckets
from graphattn.capture.dispatcher import GraphDispatcher
from graphattn.capture.graphs import CUDAGraphManager
from graphattn.metadata import build_common_metadata
from graphattn.spec_decode import RejectionFeedback, apply_rejections, verify_schedule
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import no_host_sync
from graphattn.transfer import to_device

H, HKV, D, BS, MAXLEN = 4, 2, 16, 8, 96
LORA, ROPE, HI, DI = 16, 8, 2, 8


class Case:
    """Backend-specific inputs, builders and caches."""

    def __init__(self, name, device, num_slots, spec):
        flex_compile = None
        if name == "flex_uncompiled":
            name, flex_compile = "flex", False
        self.name, self.device = name, device
        spec_ = get_backend(name)
        self.support = spec_.capture_support
        nb = num_slots * (MAXLEN // BS)
        dt = torch.float32
        if name == "paged":
            self.builder, self.impl = PagedAttentionBuilder(BS, spec + 1), spec_.impl_cls(H, D, HKV)
            self.caches = [allocate_kv_cache(nb, BS, HKV, D, dt, device) for _ in range(2)]
            self.shapes = {"q": (H, D), "k": (HKV, D), "v": (HKV, D)}
        elif name == "flex":
            # compiled on CUDA (128-wide mask blocks), reference implementation on CPU
            self.builder = FlexAttentionBuilder(BS, LengthBuckets(MAXLEN, (32, 64)),
                                             mask_block_size=32 if device == "cpu" else 128)
            self.impl = spec_.impl_cls(H, D, HKV, compile=flex_compile)
            self.caches = [allocate_kv_cache(nb, BS, HKV, D, dt, device) for _ in range(2)]
            self.shapes = {"q": (H, D), "k": (HKV, D), "v": (HKV, D)}
        elif name == "mla":
            self.builder, self.impl = MLABuilder(BS, 64, spec + 1), spec_.impl_cls(
                H, LORA, ROPE, 0.2)
            self.caches = [allocate_kv_cache(nb, BS, 1, LORA + ROPE, dt, device)]
            self.shapes = {"q": (H, LORA + ROPE), "kv_c": (LORA,), "k_pe": (ROPE,)}
        elif name == "cross":
            self.builder, self.impl = CrossAttentionBuilder(BS, MAXLEN), spec_.impl_cls(H, D, HKV)
            self.caches = [allocate_kv_cache(nb, BS, HKV, D, dt, device) for _ in range(2)]
            self.shapes = {"q": (H, D)}
            eb = MAXLEN // BS
            self.cross_bt = np.arange(num_slots * eb, dtype=np.int32).reshape(num_slots, eb)
            self.enc_len = np.random.default_rng(1).integers(5, MAXLEN, num_slots).astype(np.int32)
            self.encoder = None
        elif name == "sparse_indexer":
            self.builder = SparseIndexerBuilder(BS, 4096, spec + 1)
            self.impl = spec_.impl_cls(H, D, HKV, topk=12)
            self.caches = [allocate_kv_cache(nb, BS, HKV, D, dt, device) for _ in range(2)]
            self.caches.append(allocate_kv_cache(nb, BS, 1, DI, dt, device))
            self.shapes = {"q": (H, D), "k": (HKV, D), "v": (HKV, D), "q_idx": (HI, DI),
                           "k_idx": (DI,), "w": (HI,)}

    def build(self, batch, common, key=None):
        if self.name != "cross":
            return self.builder.build(common, key)
        slots = batch.req_slots_np
        enc = np.where(np.arange(batch.num_reqs_padded) < batch.num_reqs, self.enc_len[slots], 0)
        bt = self.cross_bt[slots]
        return self.builder.build(common, enc, bt, to_device(bt, self.device), key)

    def run(self, x, caches, meta):
        if self.name in ("paged", "flex"):
            return self.impl.forward(x["q"], x["k"], x["v"], caches, meta)
        if self.name == "cross":
            enc = self.encoder if meta.num_encoder_tokens else None
            return self.impl.forward(x["q"], *(enc or (None, None)), caches, meta)
        if self.name == "mla":
            return self.impl.forward(x["q"], x["kv_c"], x["k_pe"], caches[0], meta)
        # positive indexer inputs: no relu-zero ties, so top-k is unique
        pos = [x[n].abs() + 0.01 for n in ("q_idx", "k_idx", "w")]
        return self.impl.forward(x["q"], x["k"], x["v"], *pos, caches, meta)

    def rand_inputs(self, t, gen):
        return {k: torch.randn(t, *s, generator=gen).to(self.device)
                for k, s in self.shapes.items()}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    return request.param



CASES = [(b, spec) for b in ("paged", "flex",
                              "mla", "sparse_indexer")
         for spec in (0, 2)] + [("cross", 0), ("flex_uncompiled", 0)]


def _prefilled(case: Case, num_slots: int, rng: np.random.Generator,
               gen: torch.Generator) -> RequestState:
    """A state whose requests' prompts the case's eager step has written."""
    st = RequestState(num_slots, MAXLEN, BS, case.device)
    prompts = rng.integers(3, 30, num_slots)
    for i, p in enumerate(prompts):
        st.add_request(f"r{i}", int(p), np.arange(i * (MAXLEN // BS), (i + 1) * (MAXLEN // BS)))
    pre = SchedulerOutput(np.arange(num_slots), prompts)
    batch = prepare_inputs(st, pre)
    if case.name == "cross":
        tot = int(case.enc_len.sum())
        case.encoder = tuple(torch.randn(tot, HKV, D, generator=gen).to(case.device)
                             for _ in range(2))
    case.run(case.rand_inputs(batch.num_tokens_padded, gen), case.caches,
             case.build(batch, build_common_metadata(batch)))
    st.postprocess(pre)
    return st


def _graph_manager(case: Case, st: RequestState, gen: torch.Generator):
    """A manager whose forward runs the case with the metadata of each key's dummy plan, and
    the inputs of a key's capture."""
    templates = {}

    def make_inputs(key):
        empty = SchedulerOutput(np.array([], np.int32), np.array([], np.int32))
        dummy = prepare_inputs(st, empty, key.num_reqs_padded, key.num_tokens_padded)
        templates[key] = case.build(dummy, build_common_metadata(dummy), key)
        x = case.rand_inputs(key.num_tokens_padded, gen)
        return {**x, **templates[key].tensors()}

    def forward(inputs, key):
        meta = templates[key].with_tensors(inputs)
        return case.run(inputs, case.caches, meta)

    pads = get_backend(case.name).metadata_cls.pad_values
    return CUDAGraphManager(forward, case.device, pad_values=pads), make_inputs


@pytest.mark.parametrize("name, spec", CASES, ids=lambda c: getattr(c, "value", str(c)))
def test_capture_replay_matches_eager(name, spec, device):
    num_slots = 6
    case = Case(name, device, num_slots, spec)
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    st = _prefilled(case, num_slots, rng, gen)
    disp = GraphDispatcher([2, 4, 8], LengthBuckets(MAXLEN, (32, 64)), spec + 1,
                           capture_support=case.support)
    mgr, make_inputs = _graph_manager(case, st, gen)
    if device == "cuda" and isinstance(case.impl, FlexAttentionImpl) and case.impl.compile is False:
        with pytest.raises(ValueError, match="uncompiled flex_attention cannot be captured"):
            mgr.capture(disp.all_keys()[:1], make_inputs)
        return
    report = mgr.capture(disp.all_keys(), make_inputs)
    assert report.num_graphs == len(disp.all_keys()) == 9
    seen_keys, over = set(), 0
    for step in range(12):
        n = int(rng.integers(1, num_slots + 1))
        slots = np.sort(rng.choice(num_slots, n, replace=False)).astype(np.int32)
        sched = verify_schedule(st, slots, np.full(n, spec)) if spec else SchedulerOutput(
            slots, np.ones(n, np.int32))
        key = disp.dispatch(n, sched.total_num_scheduled_tokens,
                            int((st.num_computed_tokens_np[slots] + sched.num_scheduled_tokens)
                                .max()), True)
        assert key is not None
        seen_keys.add(key)
        x = case.rand_inputs(key.num_tokens_padded, gen)
        eager_caches = [c.clone() for c in case.caches]
        with no_host_sync():  # on CUDA: set_sync_debug_mode("error") too
            batch = prepare_inputs(st, sched, key.num_reqs_padded, key.num_tokens_padded)
            common = build_common_metadata(batch)
            meta = case.build(batch, common, key)
            out = mgr.replay(key, {**x, **meta.tensors()}, batch.num_tokens)
        over += int((batch.seq_lens_cpu_upper_bound_np > batch.seq_lens.cpu().numpy()).sum())
        ref = case.run(x, eager_caches, case.build(batch, common))
        got, want = (out[0], ref[0]) if isinstance(out, tuple) else (out, ref)
        if isinstance(ref, tuple):
            torch.testing.assert_close(out[1], ref[1][: batch.num_tokens])
        torch.testing.assert_close(got, want[: batch.num_tokens], rtol=2e-4, atol=2e-4)
        for c, e in zip(case.caches, eager_caches, strict=True):
            torch.testing.assert_close(c[:-1], e[:-1])  # the sink block may differ
        rejected = rng.integers(0, spec + 1, n).astype(np.int32)
        st.postprocess(sched, num_rejected=torch.from_numpy(rejected).to(device) if spec else None)
        if spec and step % 2:  # feedback arrives late on odd steps only
            pend = st.num_pending_drafts_np[slots]
            apply_rejections(st, RejectionFeedback(slots, pend, np.minimum(rejected, pend)))
    assert len(seen_keys) >= 3
    if spec:
        assert over > 0
