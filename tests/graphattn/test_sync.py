import pytest
import torch

from graphattn.sync import HostSyncError, count_host_syncs, no_host_sync, note_host_read


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.sum().item(),
        lambda t: int(t[0]),
        lambda t: bool(t[0] > 0),
        lambda t: t.nonzero(),
        lambda t: torch.equal(t, t),
        lambda t: t[t > 0],
    ],
    ids=["item", "int", "bool", "nonzero", "equal", "masked_select"],
)
def test_planted_read_raises(read):
    t = torch.randn(8)
    read(t)  # fine outside
    with pytest.raises(HostSyncError), no_host_sync():
        read(t)


def test_meta_device_to_cpu_copy_raises():
    t = torch.empty(4, device="meta")
    with pytest.raises(HostSyncError, match="device->cpu"), no_host_sync():
        t.cpu()


def test_device_ops_allowed():
    t = torch.randn(8)
    with no_host_sync():
        u = (t * 2).cumsum(0)
        torch.searchsorted(u.sort().values, t)
        torch.from_numpy(u.numpy().copy()).to("cpu")  # CPU->CPU is not a device read


def test_count_host_syncs_counts_each_read_once():
    t = torch.randn(4)
    with count_host_syncs() as c:
        t.sum().item()
        t.nonzero()
        (t + 1).exp()
    assert c.count == 2
    assert c.reasons == ["aten._local_scalar_dense", "aten.nonzero"]


def test_note_host_read():
    note_host_read("outside: nothing happens")
    with count_host_syncs() as c:
        note_host_read("x")
    assert c.count == 1
    with pytest.raises(HostSyncError, match="declared"), no_host_sync():
        note_host_read("declared")


def test_nesting_restores():
    t = torch.ones(2)
    with no_host_sync():
        pass
    assert t.sum().item() == 2.0


@pytest.mark.cuda
def test_cuda_sync_debug_mode_error():
    t = torch.ones(4, device="cuda")
    with pytest.raises((HostSyncError, RuntimeError)), no_host_sync():
        t.cpu()
    assert torch.cuda.get_sync_debug_mode() == 0
    with no_host_sync():
        assert torch.cuda.get_sync_debug_mode() == 2


@pytest.mark.parametrize(
    "read",
    [
        lambda t: torch.repeat_interleave(t.long().abs() + 1),
        lambda t: t.unique(),
        lambda t: t.index_put_((t > 0,), torch.tensor(0.0)),
    ],
    ids=["repeat_interleave", "unique", "bool_index_put"],
)
def test_data_dependent_shapes_raise(read):
    with pytest.raises(HostSyncError), no_host_sync():
        read(torch.randn(6))


def test_repeat_interleave_with_output_size_allowed():
    r = torch.tensor([1, 2])
    with no_host_sync():
        out = torch.repeat_interleave(r, output_size=3)
    assert out.tolist() == [0, 1, 1]


def test_opaque_region_pauses_dispatch_check_only_inside():
    from graphattn.sync import opaque_region

    t = torch.ones(3)
    with no_host_sync():
        with opaque_region():
            t.sum().item()  # a compiled region's internals are not seen here
        with pytest.raises(HostSyncError):
            t.sum().item()
    with opaque_region():
        pass
