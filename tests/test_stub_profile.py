"""SIMPLE_SAMPLER_PROFILE: the sampler stub's execute under cProfile, one
.prof per instance (docs/COPIES.md, "Profiling the sampler stub")."""
import pstats

from simple_sampler.triton.stub_profile import PROFILE_ENV, StubProfile


def busy_execute(requests):
    return [sum(i * i for i in range(20_000)) for _ in requests]


def test_off_by_default_just_calls(monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    profile = StubProfile("simple_sampler_0_0")
    assert profile.run(busy_execute, [1, 2]) == busy_execute([1, 2])
    assert profile.dump() is None


def test_on_writes_one_profile_per_instance_with_the_calls(monkeypatch, tmp_path):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "prof"))
    profile = StubProfile("simple_sampler 0/1")
    assert profile.run(busy_execute, [1]) == busy_execute([1])
    path = profile.dump()
    assert path == str(tmp_path / "prof" / "simple_sampler_0_1.prof")
    stats = pstats.Stats(path)
    calls = {name: row for (_, _, name), row in stats.stats.items()}
    assert calls["busy_execute"][0] == 1 and stats.total_tt > 0  # thread CPU seconds
