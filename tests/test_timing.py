"""The shared timing helpers, with the CUDA-event timer and NVML replaced (no GPU here)."""
import statistics
import sys
import time
import types

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


def _fake_nvml(monkeypatch, readings, uuids, fail_after=None):
    """A stand-in pynvml whose device answers `readings` (SM MHz, clock-event reasons) in turn,
    repeating the last, knows only the GPUs named in `uuids`, and stops answering after
    `fail_after` readings where given."""
    readings = list(readings)
    state = dict(i=0)

    def reading():
        if fail_after is not None and state["i"] >= fail_after:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return readings[min(state["i"], len(readings) - 1)]

    def clock(handle, kind):
        assert handle == "handle" and kind == nvml.NVML_CLOCK_SM
        return reading()[0]

    def reasons(handle):
        r = reading()[1]
        state["i"] += 1  # the second of the two reads of one sample
        return r

    def by_uuid(uuid):
        if uuid not in uuids:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "handle"

    nvml = types.SimpleNamespace(NVML_CLOCK_SM=1, nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=by_uuid,
                                 nvmlDeviceGetClockInfo=clock, nvmlDeviceGetCurrentClocksEventReasons=reasons)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(timing.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(timing.torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(uuid="1234-abcd"))


def _sample_until(sampler, count, linger_s=0.0):
    """Runs `sampler` until it holds `count` readings (5 s at most), then `linger_s` longer."""
    with sampler:
        deadline = time.monotonic() + 5
        while len(sampler.samples) < count and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(linger_s)


def test_clock_sampler_reports_the_readings_taken_while_the_calls_ran(monkeypatch):
    _fake_nvml(monkeypatch, [(1980, 0), (1500, 0x4), (1700, 0x20)] * 3 + [(1755, 0)], {"GPU-1234-abcd"})
    sampler = timing.GpuClockSampler(period_s=0.001)
    assert sampler.available
    _sample_until(sampler, 12)
    taken = list(sampler.samples)
    assert len(taken) >= 12
    s = sampler.summary()
    assert s["sm_mhz_min"] == 1500
    assert s["limits"] == "PT"  # a power cap and a thermal slowdown, each seen once at least
    assert s["sm_mhz"] == statistics.median(m for m, _ in taken)
    # A second use starts afresh: only its own readings count.
    with sampler:
        pass
    assert len(sampler.samples) >= 1 and sampler.summary()["limits"] == "-"


def test_clock_sampler_keeps_its_readings_when_nvml_stops_answering(monkeypatch):
    _fake_nvml(monkeypatch, [(1980, 0), (1600, 0x4)], {"GPU-1234-abcd"}, fail_after=3)
    sampler = timing.GpuClockSampler(period_s=0.001)
    _sample_until(sampler, 3, linger_s=0.02)  # periods on: the fourth reading fails, the thread ends quietly
    assert sampler.samples == [(1980, 0), (1600, 0x4), (1600, 0x4)]
    assert sampler.summary() == dict(sm_mhz=1600, sm_mhz_min=1600, limits="P")


def test_clock_sampler_without_nvml_reports_nothing(monkeypatch):
    _fake_nvml(monkeypatch, [(1980, 0)], uuids=set())  # NVML does not list this GPU
    sampler = timing.GpuClockSampler()
    assert not sampler.available
    with sampler:
        pass
    assert sampler.summary() == dict(sm_mhz=None, sm_mhz_min=None, limits=None)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed: import fails
    assert not timing.GpuClockSampler().available
