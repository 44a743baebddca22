import torch

from graphattn.transfer import StagingRing


class FakeEvent:
    done = False
    waited = 0

    def record(self):
        pass

    def query(self):
        return FakeEvent.done

    def synchronize(self):
        FakeEvent.waited += 1
        FakeEvent.done = True


def test_staging_ring_reuses_a_buffer_only_after_its_copy_finished():
    ring = StagingRing("cpu", depth=2)
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
    ring.release(b)
    ring.release(c)
    FakeEvent.done = False  # both copies in flight and the ring is full: wait on the oldest
    d = ring.take(4, torch.int32)
    assert d is b and FakeEvent.waited == 1 and ring.num_allocated == 2
