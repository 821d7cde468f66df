"""SIMPLE_SAMPLER_PROFILE: the sampler stub's execute under cProfile, one
.prof per instance (docs/COPIES.md, "Profiling the sampler stub")."""
import math
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


def test_calls_per_request_from_the_profiles_of_two_instances(monkeypatch, tmp_path, capsys):
    """Requests are serve_request's calls over every instance; each listed
    function's calls per request and share of _execute, C methods by name."""
    from simple_sampler.triton import stub_profile

    class Metric:
        def increment(self, value):
            pass
    metric = Metric()

    def decode_request(inputs):
        return sum(i for i in range(2_000))

    def sample_request(decoded):
        return decoded

    def serve_request(inputs):
        return sample_request(decode_request(inputs))

    def _execute(requests):
        for request in requests:
            serve_request(request)
        metric.increment(len(requests))
        {}.get("x")
        math.sqrt(len(requests))

    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))
    paths = []
    for instance, requests in (("simple_sampler_0_0", [1, 2, 3]), ("simple_sampler_0_1", [4])):
        profile = StubProfile(instance)
        profile.run(_execute, requests)
        paths.append(profile.dump())
    monkeypatch.setattr(stub_profile, "PROFILED_FUNCTIONS",
                        (*stub_profile.PROFILED_FUNCTIONS, "get", "sqrt"))
    summary = stub_profile.calls_per_request(paths)
    assert summary["requests"] == 4
    assert summary["compact_requests"] == 0 and summary["calls_per_compact_request"] is None
    assert summary["functions"]["get"]["calls_per_request"] == 0.5  # a C method (dict.get)
    assert summary["functions"]["sqrt"]["calls_per_request"] == 0.5  # a C function, as pb_utils'
    functions = summary["functions"]
    assert functions["decode_request"]["calls_per_request"] == 1.0
    assert functions["serve_request"]["calls_per_request"] == 1.0
    assert functions["decide_plain_compact"] == {"calls_per_request": 0.0, "share": 0.0}
    assert functions["increment"]["calls_per_request"] == 0.5  # Python method, by name
    assert functions["sample_compact"] == {"calls_per_request": 0.0, "share": 0.0}
    assert 0 < functions["sample_request"]["share"] < functions["decode_request"]["share"] <= 1
    # _execute, its 4 decode_request + 4 sample_request (+ their genexprs), increment, get
    assert summary["calls_per_request"] > 2
    assert stub_profile.main(paths) == 0
    assert "4 requests" in capsys.readouterr().out
    assert stub_profile.main([str(tmp_path)]) == 0, "a directory stands for its profiles"
    assert "4 requests" in capsys.readouterr().out
