from graphattn import demo


def test_demo_serving_loop_runs_with_no_host_sync(capsys):
    assert demo.main(["--steps", "25"]) == 0
    out = capsys.readouterr().out
    assert "host syncs in step(): 0" in out and "finished" in out
