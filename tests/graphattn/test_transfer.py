import torch

from graphattn.transfer import StagingRing


class FakeEvent:
    done = False

    def record(self):
        pass

    def query(self):
        return FakeEvent.done


def test_staging_ring_reuses_a_buffer_only_after_its_copy_finished():
    ring = StagingRing("cpu", max_per_size=2)
    assert not ring.cuda and ring.take(4, torch.int32).tolist() == [0, 0, 0, 0]
    ring.cuda = True  # the CUDA bookkeeping, with host buffers and a fake event
    ring._alloc = lambda size, dtype: torch.zeros(size, dtype=dtype)
    ring._event = FakeEvent
    a = ring.take(4, torch.int32)
    a.fill_(7)
    ring.release(a)
    FakeEvent.done = False
    b = ring.take(4, torch.int32)  # a's copy is still in flight: a new buffer
    assert b is not a and ring.num_allocated == 2
    FakeEvent.done = True
    c = ring.take(4, torch.int32)  # now a is free again, zeroed
    assert c is a and c.tolist() == [0, 0, 0, 0]
    for buf in (b, c, ring.take(4, torch.int32)):
        ring.release(buf)
    assert len(ring._free[(4, torch.int32)]) == 2  # capped per size
