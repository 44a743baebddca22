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

    def make():
        return torch.zeros(4, dtype=torch.int32)

    assert not ring.cuda and ring.take("k", make).tolist() == [0, 0, 0, 0]
    ring.cuda = True  # the CUDA bookkeeping, with host buffers and a fake event
    ring._event = FakeEvent
    a = ring.take("k", make)
    a.fill_(7)
    ring.release("k", a)
    FakeEvent.done = False
    b = ring.take("k", make)  # a's copy is still in flight: a new buffer
    assert b is not a and ring.num_allocated == 2
    FakeEvent.done = True
    c = ring.take("k", make)  # now a is free again, as it was left
    assert c is a and c.tolist() == [7, 7, 7, 7]
    ring.release("k", b)
    ring.release("k", c)
    FakeEvent.done = False  # both copies in flight and the ring is full: wait on the oldest
    d = ring.take("k", make)
    assert d is b and FakeEvent.waited == 1 and ring.num_allocated == 2
    assert ring.take("other", make) is not d  # keys do not share objects
