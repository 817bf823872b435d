"""The shared timing helpers, with the CUDA-event timer replaced (no GPU here)."""
from megamoe_plugin import timing


def test_median_call_seconds_drops_the_warm_up_and_runs_before_each_call(monkeypatch):
    calls = []
    # The warm-up call is the slowest (kernel load); the median must not see it.
    times = iter([9.0, 3.0, 1.0, 2.0])

    def fake_timed_seconds(fn, iters):
        assert iters == 1
        fn()
        return next(times)

    monkeypatch.setattr(timing, "timed_seconds", fake_timed_seconds)
    median = timing.median_call_seconds(lambda: calls.append("call"), 3, lambda: calls.append("before"))
    assert median == 2.0
    assert calls == ["before", "call"] * 4
