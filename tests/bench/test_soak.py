from bench.soak import run


def test_short_soak_holds_every_invariant():
    result = run(400, seed=3)
    assert result["violations"] == 0, result["first_violations"]
    assert result["preemptions"] > 0 and result["dummy_runs"] > 0 and result["requests"] > 20
    assert result["runner_steps"] > 300 and result["drafts"] > 500
    assert result["graphs"] == result["plans_cached"] == 21  # 3 buckets x 7 sizes; no growth
