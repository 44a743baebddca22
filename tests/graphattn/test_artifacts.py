import numpy as np
import pytest
import torch

from graphattn import CompileConfig, GraphRunner, RunnerConfig, SchedulerOutput
from graphattn.artifacts import ArtifactStore, aot_compile_available
from graphattn.buckets import BucketPolicy
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState
from graphattn.sync import no_host_sync

needs_aot = pytest.mark.skipif(not aot_compile_available(),
                               reason="this torch does not save compiled functions")


def _runner(device, artifact_dir, dynamic=True, regions="step"):
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=2)).to(device)
    st = RequestState(4, 32, 8, device)
    model.allocate_caches(16, 8)
    runner = GraphRunner(model, st, RunnerConfig(
        policy=BucketPolicy(capture_sizes=(1, 2, 4), length_boundaries=(32,),
                            mixed_token_sizes=(8,)),
        compile=CompileConfig(enabled=True, dynamic=dynamic, artifact_dir=artifact_dir,
                              regions=regions)))
    runner.capture(progress=False)
    return runner, model


def _serve(runner, model):
    """Two requests prefilled (the mixed key), then decoded (the decode key), both replayed
    with no host read; the logits of both steps against the model's dense reference."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 64, n).tolist() for n in (5, 3)]
    slots = [runner.add_request(str(i), p) for i, p in enumerate(prompts)]
    logits = []
    for sched in ([len(p) for p in prompts], [1, 1]):
        with no_host_sync():
            out = runner.step(SchedulerOutput(np.array(slots), np.array(sched)))
        assert out.replayed
        logits.append(out.logits.clone())  # graph memory: valid until the next step
    dev = runner.token_ids.device
    tol = 1e-4 if dev.type == "cpu" else 2e-3
    for i, (s, p) in enumerate(zip(slots, prompts, strict=True)):
        ids = torch.tensor(p + [int(runner.token_ids[s, len(p)])], device=dev)
        ref = model.reference_logits(ids)
        for step_logits, row in zip(logits, (-2, -1), strict=True):
            torch.testing.assert_close(step_logits[i].double(), ref[row].double(),
                                       rtol=tol, atol=tol)
    return torch.cat(logits)


@pytest.mark.slow
@needs_aot
@pytest.mark.parametrize("regions", ["step", "blocks"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_second_runner_loads_the_saved_step_instead_of_compiling(tmp_path, monkeypatch,
                                                                   device, regions):
    """CompileConfig(artifact_dir=...): the first runner compiles and saves the step (one
    function for the decodes and the mixed key) and prepare's device half; a second one with
    the same settings compiles nothing, loads them and replays the same logits (the float64
    reference's); when the traced code's source reads differently, the saved functions are
    dropped and compiled again. With regions "blocks" what is saved is the layers' shared
    function, loaded once and run by both layers with their own weights."""
    torch._dynamo.reset()
    first, model = _runner(device, tmp_path, regions=regions)
    compiles = first.compiler.num_compiles
    assert compiles == 1 and first.compiler.num_loaded == 0  # decodes and the mixed key
    want = _serve(first, model)
    assert len(list(tmp_path.glob(f"{regions}-*/*.pt2"))) == compiles

    torch._dynamo.reset()
    second, model = _runner(device, tmp_path, regions=regions)
    assert second.compiler.num_compiles == 0 and second.compiler.num_loaded == compiles
    assert second.device_step.assembler.num_compiles == 0
    torch.testing.assert_close(_serve(second, model), want, rtol=0, atol=0)

    torch._dynamo.reset()
    monkeypatch.setattr("graphattn.artifacts.inspect.getsource", lambda m: "changed")
    third, _ = _runner(device, tmp_path, regions=regions)
    assert third.compiler.num_loaded == 0 and third.compiler.num_compiles == compiles


@pytest.mark.slow
@needs_aot
def test_other_settings_keep_their_own_folder(tmp_path):
    """A static-shape runner does not see a dynamic one's saved functions."""
    torch._dynamo.reset()
    _runner("cpu", tmp_path, dynamic=True)
    torch._dynamo.reset()
    static, _ = _runner("cpu", tmp_path, dynamic=False)
    assert static.compiler.num_loaded == 0 and static.compiler.num_compiles == 4
    assert len(list(tmp_path.glob("step-*"))) == 2


def test_store_folder_depends_on_the_fingerprint(tmp_path):
    a, b = (ArtifactStore(tmp_path, "step", f) for f in ("x", "y"))
    assert a.folder != b.folder and a.folder.parent == tmp_path
    assert a.folder == ArtifactStore(tmp_path, "step", "x").folder
    assert list(a.load()) == []
    a.folder.mkdir()
    (a.folder / "notes.pt2").write_text("not a saved function")
    (a.folder / "shared-0.pt2").write_bytes(b"truncated")
    assert list(a.load()) == []  # the stray file ignored, the unreadable one skipped


@pytest.mark.parametrize("kw, match", [
    (dict(backend="eager"), "needs backend 'inductor'"),
    (dict(fullgraph=False), "fullgraph=True"),
])
def test_artifact_dir_refused_where_it_cannot_work(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        CompileConfig(enabled=True, artifact_dir=tmp_path, **kw)
    with pytest.raises(ValueError, match="artifact_dir must be a folder path"):
        CompileConfig(enabled=True, artifact_dir=3)
