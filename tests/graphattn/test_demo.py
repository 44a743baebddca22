import pytest

from graphattn import demo


def test_demo_serving_loop_runs_with_no_host_sync(capsys):
    assert demo.main(["--steps", "25"]) == 0
    out = capsys.readouterr().out
    assert "host syncs in step(): 0" in out and "finished" in out


def test_demo_answers_chat_prompts_with_the_real_model(capsys):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from graphattn.demo import main

    assert main(["--model", "smollm2", "--steps", "10", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "host syncs in step(): 0" in out
