"""Keep a running Triton server's Python models alive: a dead stub comes back.

Triton 2.51's Python backend neither restarts a dead stub nor marks its model
unready. :class:`Supervisor` watches the stubs of its server (run with
``--model-control-mode=explicit``) and, when one is gone:

* for an ordinary model: unloads it alone (``/v2/models/<m>/ready`` answers
  400 meanwhile) and loads it again (fresh stubs), and after
  ``orphan_grace_s`` kills what is left of the old stubs and unlinks their
  shared-memory regions and the dead stub's. Not its dependents: loading the
  ensemble again would load every model it composes again, llm included (a
  second data plane beside the serving one); the ensemble stays loaded and
  its requests fail until the model is back;
* for a model that holds requests after its execute returned (``llm``,
  which answers through response senders, decoupled or not), whose requests
  Triton would never end: SIGKILLs the server (every client sees its connection close, an error,
  not a hang) and starts it again on the same ports.

Requests routed to the dead stub fail; the decode loop re-sends sampler rows
and a seeded row gives the same token on any instance, so a sampler fault costs
no request. Why the model and not the instance is reloaded, how a death is told
from an unload, and how each case is tested: docs/RELIABILITY.md.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

from .. import row_arena
from ..pids import alive
from ..settings import LlmSettings
from .processes import SHM_DIRECTORY, Stub, list_stubs, unlink_shm
from .startup import StartInterrupted

log = logging.getLogger(__name__)


def arena_prefix() -> str:
    """The name prefix of this pid namespace's row arenas, before the owner's
    pid (row_arena.py)."""
    return f"{row_arena.PREFIX}{row_arena.pid_namespace()}-"


def arena_regions(pids) -> list[str]:
    """The row-arena regions (row_arena.py) the processes `pids` own: a stub
    that Triton gave up on at its exit timeout, or that was SIGKILLed, never
    ran its model's finalize, which removes them."""
    prefixes = tuple(f"{arena_prefix()}{pid}-" for pid in pids)
    if not prefixes:
        return []
    return sorted(name for name in os.listdir(SHM_DIRECTORY) if name.startswith(prefixes))


class Supervisor:
    """Watches `server`'s stubs from a thread (module docstring).

    `server` is a started :class:`~simple_sampler.launch.server.TritonServer`
    running with explicit model control. ``recoveries`` counts reloads per
    model; ``regions`` holds every shared-memory region a stub of this server
    was seen with, so that :meth:`cleanup` can remove what a killed server
    leaves behind.
    """

    def __init__(self, server, poll_s: float = 0.25, confirm_s: float = 0.5,
                 orphan_grace_s: float = 10.0, load_timeout_s: float = 600.0,
                 holding_confirm_s: float = 0.1):
        self.server = server
        self.poll_s, self.confirm_s = poll_s, confirm_s
        # A holding model's death is seen at once (a pidfd wakes the watch)
        # and confirmed sooner: until the restart, the server still answers
        # ready and routes requests to the dead stub. Nothing unloads such a
        # model while it is supervised, so the short look is only against
        # the instant between a stub's exit and Triton removing its region.
        self.holding_confirm_s = holding_confirm_s
        self._pidfds: dict[int, int] = {}  # holding models' stubs' pid -> pidfd
        self.orphan_grace_s, self.load_timeout_s = orphan_grace_s, load_timeout_s
        self.recoveries: dict[str, int] = {}
        self.restarts = 0
        self.restarting = threading.Event()  # the server is being replaced
        #: a stop is draining: a holding model's death restarts nothing
        #: (ordinary models are still reloaded, so the drain's requests finish)
        self.draining = False
        self._restart_lock = threading.Lock()  # draining vs a restart's start
        self.pids_seen: set[int] = set()  # every stub's, for their row arenas
        self.holding: set[str] = set()
        self.regions: set[str] = set()
        self.tracked: dict[int, Stub] = {}  # pid -> the stub it was started as
        self._gone_since: dict[int, float] = {}
        self._orphans: list[tuple[float, list[Stub]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Supervisor":
        self._learn_models()
        self._track(list_stubs(self.server.process.pid))
        self._thread = threading.Thread(target=self._run, name="stub-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait_s: float | None = None) -> None:
        """Stop watching; wait for the watch to end, at most `wait_s` (a
        reload under way may take long: its load fails once Triton exits)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def hold_restarts(self) -> bool:
        """From now on (a stop's drain) a holding model's death restarts
        nothing; a dead sampler instance is still reloaded. False when a
        restart is under way: stop the supervisor instead, which
        interrupts it."""
        with self._restart_lock:
            self.draining = True
            return not self.restarting.is_set()

    def cleanup(self) -> list[str]:
        """After the server is gone: remove the regions its stubs left, and
        the row arenas of stubs that never ran their finalize (a dead one)."""
        # alive: a pid of days ago may be another process's now
        return unlink_shm([*sorted(self.regions),
                           *arena_regions(pid for pid in self.pids_seen if not alive(pid))])

    def _learn_models(self) -> None:
        import tritonclient.http as httpclient

        # the models that hold requests after their execute returned: the
        # decoupled ones, and llm, which answers through response senders
        # either way (decoupled_mode false too)
        client = httpclient.InferenceServerClient(self.server.http_url)
        self.holding = {
            entry["name"] for entry in client.get_model_repository_index()
            if entry["name"] == LlmSettings.triton_model
            or client.get_model_config(entry["name"]).get("model_transaction_policy", {})
            .get("decoupled")}

    def _track(self, stubs: list[Stub]) -> None:
        for stub in stubs:
            self.tracked.setdefault(stub.pid, stub)
            self.pids_seen.add(stub.pid)
            self.regions.add(stub.shm_region)
            if stub.model in self.holding and stub.pid not in self._pidfds:
                try:
                    self._pidfds[stub.pid] = os.pidfd_open(stub.pid)
                except (OSError, AttributeError):  # gone already, or no pidfd: polled
                    pass

    def _forget_pidfds(self) -> None:
        for pid in [pid for pid in self._pidfds if pid not in self.tracked]:
            os.close(self._pidfds.pop(pid))

    def _wait(self) -> bool:
        """Sleep `poll_s`, or less when a holding model's stub exits; True once stopped."""
        if self._pidfds:
            select.select(list(self._pidfds.values()), [], [], self.poll_s)
        else:
            self._stop.wait(self.poll_s)
        return self._stop.is_set()

    def _run(self) -> None:
        try:
            while not self._wait():
                if self.server.process.poll() is not None:
                    return  # the server exited: the launcher decides what follows
                try:
                    self.check()
                except StartInterrupted:
                    return  # stopped during a restart: the launcher stops the server
                except Exception:  # noqa: BLE001 - the watch must outlive one failed attempt
                    log.exception("stub supervisor: check failed; retrying")
        finally:
            for fd in self._pidfds.values():
                os.close(fd)
            self._pidfds.clear()

    def check(self) -> list[str]:
        """One look at the stubs; reloads the models that lost one and
        returns their names.

        A stub that Triton stopped (an unload, a reload) exits after its
        model was finalized and Triton then removes its shared-memory region;
        a stub that died keeps its region, because the Python backend never
        finalizes that instance. So a stub counts as dead when its process
        is gone and its region is still there `confirm_s` later."""
        self._kill_orphans()
        live = list_stubs(self.server.process.pid)
        # an unloaded generation's stubs waiting to be killed are not watched
        orphans = {stub.pid for _, group in self._orphans for stub in group}
        self._track([stub for stub in live if stub.pid not in orphans])
        live_pids = {stub.pid for stub in live}
        now, dead = time.monotonic(), []
        for pid, stub in list(self.tracked.items()):
            if pid in live_pids:
                continue
            region = SHM_DIRECTORY / stub.shm_region
            if stub.model in self.holding and region.exists() and pid not in self._gone_since:
                self._gone_since[pid] = now
                time.sleep(self.holding_confirm_s)
            if not region.exists():
                del self.tracked[pid]  # stopped by Triton
                self._gone_since.pop(pid, None)
            elif stub.model in self.holding or (
                    now - self._gone_since.setdefault(pid, now) >= self.confirm_s):
                dead.append(stub)
        self._forget_pidfds()
        models = sorted({stub.model for stub in dead})
        if self.holding & set(models):
            with self._restart_lock:
                restart = not self.draining
                if restart:
                    self.restarting.set()
            if restart:
                self._restart(sorted(self.holding & set(models)), dead)
            else:  # a stop is draining: its requests would hang until its SIGKILL
                log.error("model(s) %s, holding requests, lost stub(s) %s while the server "
                          "stops: ending the server now, as those cannot end otherwise",
                          ", ".join(sorted(self.holding & set(models))),
                          ", ".join(f"{s.instance} (pid {s.pid})" for s in dead))
                try:  # the group only: the stop's own thread reaps it and cleans up
                    os.killpg(self.server.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._stop.set()
            return models
        for model in models:
            lost = [s for s in dead if s.model == model]
            log.error("model %s lost its stub process(es) %s: reloading it", model,
                      ", ".join(f"{s.instance} (pid {s.pid})" for s in lost))
            old = [s for s in live if s.model == model]
            for stub in lost + old:
                self.tracked.pop(stub.pid, None)
                self._gone_since.pop(stub.pid, None)
            # Before the reload: a stop that starts meanwhile must not wait
            # for this generation either (TritonServer.abandon says why it
            # never finishes unloading).
            self.server.abandon(lost + old)
            self._reload(model)
            self.recoveries[model] = self.recoveries.get(model, 0) + 1
            unlink_shm([*(s.shm_region for s in lost), *arena_regions(s.pid for s in lost)])
            self._orphans.append((time.monotonic() + self.orphan_grace_s, old))
        if models:
            orphans |= {stub.pid for _, group in self._orphans for stub in group}
            self._track([s for s in list_stubs(self.server.process.pid) if s.pid not in orphans])
        return models

    def _reload(self, model: str) -> None:
        import tritonclient.http as httpclient

        started = time.monotonic()
        client = httpclient.InferenceServerClient(self.server.http_url,
                                                  network_timeout=self.load_timeout_s)

        def ready() -> set[str]:
            return {entry["name"] for entry in client.get_model_repository_index()
                    if entry.get("state") == "READY"}

        client.unload_model(model)
        deadline = time.monotonic() + 10.0  # the unload itself is asynchronous
        while model in ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        client.load_model(model)
        log.warning("model %s reloaded in %.1f s (ready: %s)", model,
                    time.monotonic() - started, ", ".join(sorted(ready())))

    def _restart(self, models: list[str], dead: list[Stub]) -> None:
        log.error("model(s) %s, holding requests, lost stub(s) %s: those cannot end otherwise, "
                  "restarting the server", ", ".join(models),
                  ", ".join(f"{s.instance} (pid {s.pid})" for s in dead))
        started = time.monotonic()
        try:  # self.restarting: set by check
            self.server.kill()
            self.cleanup()
            self.pids_seen.clear()
            self.tracked.clear()
            self._gone_since.clear()
            self._orphans.clear()
            self._forget_pidfds()
            self.server.start_again(stop_requested=self._stop.is_set)
            self._track(list_stubs(self.server.process.pid))
        finally:
            self.restarting.clear()
        self.restarts += 1
        log.warning("server restarted in %.1f s", time.monotonic() - started)

    def _kill_orphans(self) -> None:
        now, waiting = time.monotonic(), []
        for deadline, stubs in self._orphans:
            if now < deadline:
                waiting.append((deadline, stubs))
                continue
            for stub in stubs:
                if alive(stub.pid):
                    log.warning("killing stub %s (pid %d) of %s's unloaded generation",
                                stub.instance, stub.pid, stub.model)
                    try:
                        os.kill(stub.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            unlink_shm([*(stub.shm_region for stub in stubs),
                        *arena_regions(stub.pid for stub in stubs)])
        self._orphans = waiting
