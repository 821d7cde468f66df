"""stacks: every thread's stack sampled at an interval, written as collapsed
stacks, summarized per thread."""
import threading
import time

from simple_sampler.stacks import StackSampler, summary


def spin_until(event: threading.Event) -> None:
    while not event.is_set():
        sum(range(1000))


def blocked_until(event: threading.Event) -> None:
    event.wait()


def test_samples_say_where_each_thread_is_running_or_blocked(tmp_path):
    done = threading.Event()
    threads = [threading.Thread(target=spin_until, args=(done,), name="spinner"),
               threading.Thread(target=blocked_until, args=(done,), name="waiter")]
    for thread in threads:
        thread.start()
    sampler = StackSampler(tmp_path / "x.stacks", interval_s=0.002).start()
    # a count of samples, not a time: under load the spinner holds the GIL
    # and the sampler gets fewer turns (15 in 0.3 s on a busy CI host)
    deadline = time.monotonic() + 30
    while sampler.samples < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    path = sampler.stop()
    done.set()
    for thread in threads:
        thread.join()
    assert sampler.samples >= 20
    lines = path.read_text().splitlines()
    by_thread = {}
    for line in lines:
        stack, count = line.rsplit(" ", 1)
        name, *frames = stack.split(";")
        by_thread.setdefault(name, []).append((frames, int(count)))
    # every sample of each thread, once each: the sampler's own thread never
    for name in ("spinner", "waiter", "MainThread"):
        assert sum(count for _, count in by_thread[name]) == sampler.samples, name
    assert "stack-sampler" not in by_thread
    # outermost first: the thread's target is in every one of its stacks
    assert all(any(f.startswith("spin_until (") for f in frames)
               for frames, _ in by_thread["spinner"])
    assert all(frames[-1].startswith("wait (threading.py:")
               and any(f.startswith("blocked_until (") for f in frames)
               for frames, _ in by_thread["waiter"])
    text = "\n".join(summary(path))
    assert f"waiter: {sampler.samples} samples" in text
    assert "100.0%  wait (threading.py:" in text


def test_from_env_is_off_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv("SIMPLE_SAMPLER_STACKS_DIR", raising=False)
    assert StackSampler.from_env("llm-1") is None
    monkeypatch.setenv("SIMPLE_SAMPLER_STACKS_DIR", str(tmp_path / "d"))
    sampler = StackSampler.from_env("llm-1")
    deadline = time.monotonic() + 30
    while sampler.samples == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sampler.stop() == tmp_path / "d" / "llm-1.stacks" and sampler.samples > 0
