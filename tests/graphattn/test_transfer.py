import pytest
import torch

from graphattn.sync import no_host_sync
from graphattn.transfer import StagingRing, Uploader


class FakeEvent:
    done = False
    waited = 0

    def record(self, stream=None):
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


def test_uploader_off_cuda_is_a_plain_copy():
    for device in ("cpu", "meta"):
        up = Uploader(device)
        dst = torch.zeros(5, dtype=torch.int32, device=device)
        up.copy_(dst, torch.arange(5, dtype=torch.int32))
        assert up.stream is None
        if device == "cpu":
            assert dst.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.cuda
def test_uploader_keeps_every_upload_in_order_behind_a_busy_stream():
    up = Uploader("cuda", depth=2)
    dst = torch.zeros(4096, dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32, generator=gen)
            .pin_memory() for _ in range(7)]
    got = []
    with no_host_sync():
        for src in srcs:
            torch.cuda._sleep(200_000)  # the side stream runs ahead of the current one
            up.copy_(dst, src)
            got.append(dst * 1)
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), s) for g, s in zip(got, srcs, strict=True))


@pytest.mark.cuda
def test_current_stream_follows_the_user_stream_and_reuses_its_objects():
    from graphattn.transfer import CurrentStream

    current = CurrentStream("cuda")
    default = current()
    assert default == torch.cuda.current_stream() and current() is default
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert current() == s and current() is current()
    assert current() is default
