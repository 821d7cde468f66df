"""What a sampler pool sends rows to: a target (``SamplerTarget``: a call,
its capacity, whether it is down, how long its answers take), the error a
call raises (``SamplerCallError``), and a remote server's sampler model as a
call (``RemoteSampler``), with the probe a failed remote endpoint must answer
(one row sampled) before it takes rows again. The pool itself: ``sampler_pool``."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import ml_dtypes
import numpy as np

from ..schema import HOT_SET_REFUSAL, ROW_SCALARS, ROW_SCALARS_RECORD

if TYPE_CHECKING:  # imported where a remote target is called: the in-process
    # benches (bench serve-gpu) run on hosts without tritonclient
    from .sampler_client import SamplerClient

log = logging.getLogger(__name__)

#: How long a target that failed is left out before it is tried again.
PROBE_AFTER_S = 2.0
#: A remote request's limit: past it the endpoint counts as failed.
REMOTE_TIMEOUT_S = 10.0
#: How long a failed remote endpoint's readiness probe waits for an answer.
PROBE_TIMEOUT_S = 1.0
#: A remote call is late past its kind's answers' smoothed time plus
#: LATE_SPREADS of their mean deviation (RFC 6298's estimator: K = 4, gains
#: 1/8 and 1/4, fed only by answers not given up on, Karn's rule), never
#: before LATE_FLOOR_S, LATE_FIRST_S until that kind was answered once, and
#: doubled by each late until an answer comes in time (RFC 6298's backoff:
#: a host grown slower for good is learnt, not given up on at every call). A
#: late call's shard is sent again elsewhere, the late call left running, its
#: answer unread (a hedge); LATE_STRIKES late episodes in a row, or the late
#: call's failure with no answer in time since it was sent, mark the target
#: down.
LATE_SPREADS, LATE_FLOOR_S, LATE_FIRST_S, LATE_STRIKES = 4.0, 0.2, PROBE_TIMEOUT_S, 2
_ANSWER_GAIN, _SPREAD_GAIN = 1 / 8, 1 / 4


class SamplerCallError(RuntimeError):
    """A request to a sampler failed. ``retryable`` unless the sampler
    refused the rows themselves (INVALID_ARG): a dead or reloading instance,
    a transport error or a timeout are worth sending again."""

    def __init__(self, message: str, retryable: bool = True, late: bool = False,
                 struck: bool = False, down: bool = True):
        super().__init__(message)
        self.retryable = retryable
        #: no answer within the target's ``late_after``: the call left running;
        #: `struck`, it began a late episode; `down`, the target is marked down
        #: (always, for a failure)
        self.late, self.struck, self.down = late, struck, down


class AnswerTimes:
    """How long one kind of request to a target takes to be answered (full
    rows, or compact ones, thousands of times smaller), and how large its
    requests are: ``limit``."""

    def __init__(self):
        self.answer_s = self.spread_s = self.request_bytes = 0.0  # 0: none yet
        self.backoff = 1.0  # doubled by each late, 1 again once answered in time
        self._lock = threading.Lock()  # answers come from several threads

    def back_off(self) -> None:
        with self._lock:
            self.backoff = min(2 * self.backoff, 2.0 ** 10)

    def observe(self, took: float, size: int) -> None:
        with self._lock:
            self.backoff = 1.0
            if not self.answer_s:
                self.answer_s, self.spread_s, self.request_bytes = took, took / 2, size
                return
            self.spread_s += _SPREAD_GAIN * (abs(took - self.answer_s) - self.spread_s)
            self.answer_s += _ANSWER_GAIN * (took - self.answer_s)
            self.request_bytes += _ANSWER_GAIN * (size - self.request_bytes)

    def limit(self, size: int) -> float:
        """When a request of `size` bytes is late: a larger one than usual
        (a step of more rows) is given time in proportion."""
        if not self.answer_s:
            return min(REMOTE_TIMEOUT_S, LATE_FIRST_S * self.backoff)
        larger = size / self.request_bytes if self.request_bytes else 1.0
        usual = max(LATE_FLOOR_S, (self.answer_s + LATE_SPREADS * self.spread_s) * max(1.0, larger))
        return min(REMOTE_TIMEOUT_S, usual * self.backoff)


#: call(inputs) -> outputs: one synchronous request for some rows (inputs by
#: tensor name, ``logits`` among them); raises SamplerCallError.
SamplerCall = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class SamplerTarget:
    """One place rows can go; `capacity` is its instance count.

    A target that failed is left out until ``down_until``. With a `probe`
    (whether a remote endpoint samples a row, ``RemoteSampler.ready``) it
    then takes rows again only once the probe, asked in a thread of its
    own, has answered: a host that hangs would otherwise hold a step's
    shard for the request's whole timeout at every try."""

    name: str
    call: SamplerCall
    capacity: int = 1
    #: on this host: takes rows of the pool's arena by reference (logits_ref)
    shares_memory: bool = False
    down_until: float = 0.0
    failures: int = 0
    #: failures ever counted (``failures`` is reset when it serves): a
    #: probe's answer stands only if none came after the probe was asked
    failed_times: int = 0
    probe: Callable[[], bool] | None = None
    #: its probe answered, or it served, since its last failure (or it has
    #: no probe to ask)
    answered: bool = True
    probing: bool = False
    #: how long a failed probe leaves it out (its pool's ``probe_after_s``)
    probe_after_s: float = PROBE_AFTER_S
    _probe_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                        compare=False)
    _probe_failure: str = field(default="", init=False, repr=False, compare=False)
    #: its answers' times, by kind (full rows or not): ``late_after``
    times: dict = field(default_factory=lambda: {True: AnswerTimes(), False: AnswerTimes()},
                        repr=False, compare=False)
    #: late episodes in a row (``abandon``), when the last began, when it last
    #: answered in time, and its late calls still running
    lates: int = 0
    struck_at: float = 0.0
    answered_at: float = 0.0
    abandoned: int = 0
    _late_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                       compare=False)

    def timed_call(self, inputs: dict[str, np.ndarray],
                   abandoned: threading.Event | None = None) -> dict[str, np.ndarray]:
        """``call(inputs)``, its answer's time counted into ``late_after``
        unless the call was `abandoned` as late meanwhile (Karn's rule: the
        time of an answer nobody waited for says nothing of the next)."""
        started = time.monotonic()
        outputs = self.call(inputs)
        if abandoned is None or not abandoned.is_set():
            now = time.monotonic()
            self.times["logits" in inputs].observe(now - started, request_size(inputs))
            with self._late_lock:
                self.lates, self.answered_at = 0, now
        return outputs

    def late_after(self, inputs: dict[str, np.ndarray]) -> float | None:
        """How long a call of `inputs` may go unanswered before its shard is
        sent again to another target that is up (``SamplerPool``): a host
        that hangs some requests costs each of them this, not the request's
        whole timeout (REMOTE_TIMEOUT_S). None for a target without a probe
        or that shares the arena (this server's own instances, whose calls
        may be reading the step's slot: never abandoned)."""
        if self.probe is None or self.shares_memory:
            return None
        return self.times["logits" in inputs].limit(request_size(inputs))

    def abandon(self, inputs: dict[str, np.ndarray], sent_at: float) -> tuple[bool, bool]:
        """A call of `inputs` sent at `sent_at` is given up on as late: it
        takes no new shard while a late call of its runs (``is_up``), and a
        new late episode backs its kind's limit off. Returns (whether this
        begins a late episode: a call given up on while another late call
        of its runs, or sent before the last episode began, as a step's
        several shards are, is of that one; whether that makes LATE_STRIKES
        in a row, when it is marked down as a failed target is)."""
        with self._late_lock:
            # of the episode under way: a late call of its still runs, or it
            # was sent before the last began (a step's other shards, a lane's)
            ongoing = self.abandoned > 0 or sent_at <= self.struck_at
            self.abandoned += 1
            if ongoing:
                return False, False
            self.lates, self.struck_at = self.lates + 1, time.monotonic()
            down = self.lates >= LATE_STRIKES
        self.times["logits" in inputs].back_off()  # once an episode, as RFC 6298 backs off
        return True, down

    def abandoned_end(self, sent_at: float, failed: bool) -> bool:
        """A late call sent at `sent_at` ended (`failed`: with a retryable
        error); whether that marks the target down: only if nothing was
        answered in time since it was sent (a host back since is not)."""
        with self._late_lock:
            self.abandoned -= 1
            return failed and self.answered_at < sent_at

    def is_up(self, now: float) -> bool:
        if self.down_until > now or self.abandoned:
            return False
        if self.answered or self.probe is None:
            return True
        with self._probe_lock:  # asked from the event loop and send_now's threads
            if self.probing:
                return False
            self.probing = True
            asked_after = self.failed_times
        threading.Thread(target=self._probe, args=(asked_after,), name=f"probe {self.name}",
                         daemon=True).start()
        return False  # still left out until the probe answers

    def failed(self, probe_after_s: float) -> None:
        """A call to it failed: left out for `probe_after_s`, then probed."""
        self.failures += 1
        self.failed_times += 1
        self.answered = False
        with self._late_lock:  # the probe decides now; its lates start again
            self.lates = 0
        self.probe_after_s = probe_after_s
        self.down_until = time.monotonic() + probe_after_s

    def _probe(self, asked_after: int) -> None:
        try:
            answered, reason = bool(self.probe()), "it answered false"
        except Exception as error:  # noqa: BLE001 - any failure to answer: still down
            answered, reason = False, f"{type(error).__name__}: {error}"
        if answered and self.failed_times == asked_after:
            self.answered = True
            self._probe_failure = ""
        elif not answered:
            if reason != self._probe_failure:  # once per reason, not every probe_after_s
                log.warning("sampler %s: its probe failed (%s); it stays out", self.name, reason)
                self._probe_failure = reason
            self.down_until = time.monotonic() + self.probe_after_s
        # else a call that was in flight failed while it was asked: the
        # answer is older than that failure, and the next probe decides
        self.probing = False


class RemoteSampler:
    """The `simple_sampler` model on another Triton server, over gRPC (the
    logits travel inline: no shared memory between hosts). One client per
    thread, since calls come from several threads at once. hot_set: the
    fingerprint of the hot set every sampler of the decode loop must hold
    (``shvs.hot_vocab.fingerprint``), sent with each request and checked
    there (``sampler_serve.check_hot_set``); None: not sent. vocab_size:
    the decode loop's V (0: unknown), which it must sample."""

    def __init__(self, url: str, model: str = "simple_sampler",
                 timeout_s: float = REMOTE_TIMEOUT_S, hot_set: int | None = None,
                 vocab_size: int = 0):
        self.url, self.model, self.timeout_s, self.hot_set = url, model, timeout_s, hot_set
        self.vocab_size = vocab_size
        self._local = threading.local()
        #: every thread's client, closed by ``close``
        self._clients: list[SamplerClient] = []
        self._clients_lock = threading.Lock()
        self._probe_client = None
        #: the one row of zero logits ``ready`` has sampled (``probe_row``);
        #: None until the endpoint's configuration was read
        self._probe_row: np.ndarray | None = None

    def _client(self) -> SamplerClient:
        client = getattr(self._local, "client", None)
        if client is None:
            from .sampler_client import SamplerClient

            client = self._local.client = SamplerClient(self.url, "grpc", self.model)
            with self._clients_lock:
                self._clients.append(client)
        return client

    def close(self) -> None:
        """Close its clients: a call still running (one left late) ends now."""
        with self._clients_lock:
            clients, self._clients = self._clients + [self._probe_client], []
            self._probe_client = None
        for client in filter(None, clients):
            client.close()

    def configuration(self) -> dict | None:
        """The model's configuration there (Triton's JSON), None when it
        cannot be asked now (logged: an endpoint down at start is probed by
        the requests)."""
        try:
            return self._client().client.get_model_config(
                self.model, as_json=True, client_timeout=self.timeout_s)["config"]
        except Exception as error:  # noqa: BLE001 - any failure to ask: not now
            log.warning("sampler endpoint %s: cannot read its configuration (%s)", self.url, error)
            return None

    def check(self, config: dict) -> None:
        """At start (`config`: ``configuration()``'s), raise ValueError
        naming what differs rather than serve requests every one of which
        would be refused: its ``row_scalars`` record (another version's
        layout), the endpoint's vocabulary, when it declares one,
        must be the decode loop's ``vocab_size``, and its hot set
        ``hot_set`` (asked with one row of zero logits in the dtype it
        declares: the row is sampled, or refused naming both hot sets)."""
        record = declared_record_bytes(config)
        if record and record != ROW_SCALARS_RECORD.itemsize:
            raise ValueError(f"sampler endpoint {self.url} reads row_scalars records of {record} "
                             f"bytes, this server sends {ROW_SCALARS_RECORD.itemsize}: it runs "
                             f"another version of simple-sampler (run one on every host)")
        declared = declared_vocab_size(config)
        if declared and self.vocab_size and declared != self.vocab_size:
            raise ValueError(f"sampler endpoint {self.url} samples rows of V={declared}, this "
                             f"decode loop's have V={self.vocab_size}")
        self._probe_row = probe_row(config, self.vocab_size)
        if self.hot_set is None or self._probe_row is None:
            return
        try:
            self({"logits": self._probe_row})
        except SamplerCallError as error:
            if HOT_SET_REFUSAL in str(error):
                raise ValueError(f"sampler endpoint {error}") from None
            log.warning("sampler endpoint %s: its hot set is checked by the requests: the "
                        "probe failed (%s)", self.url, error)

    def ready(self) -> bool:
        """Whether it samples one row of zero logits (``probe_row``) within
        PROBE_TIMEOUT_S; raises when it does not. Triton's model readiness
        alone answers true for a host whose sampler hangs on every request
        (its stub stopped), which would then hold each shard sent to it for
        the request's whole timeout. Where the row's V is not known (neither
        its configuration nor ``vocab_size`` gives one), whether the model
        answers ready. ``SamplerTarget``'s probe: one at a time, on a
        client of its own."""
        if self._probe_client is None:
            from .sampler_client import SamplerClient

            self._probe_client = SamplerClient(self.url, "grpc", self.model)
        client = self._probe_client.client
        if self._probe_row is None:
            self._probe_row = probe_row(client.get_model_config(
                self.model, as_json=True, client_timeout=PROBE_TIMEOUT_S)["config"],
                self.vocab_size)
        if self._probe_row is None:
            return client.is_model_ready(self.model, client_timeout=PROBE_TIMEOUT_S)
        logits, arrays = self._arrays({"logits": self._probe_row})
        self._probe_client.sample(logits, timeout_s=PROBE_TIMEOUT_S, **arrays)
        return True

    def _arrays(self, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray | None, dict]:
        """(logits or None for compact rows, the other inputs with the hot
        set's fingerprint)."""
        arrays = dict(inputs)
        logits = arrays.pop("logits", None)        # None: compact rows (hot_logits, ...)
        if self.hot_set is not None:
            rows = len(logits) if logits is not None else len(arrays["row_scalars"])
            arrays["hot_vocab_fingerprint"] = np.full((rows, 1), self.hot_set, np.int64)
        return logits, arrays

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from tritonclient.utils import InferenceServerException

        logits, arrays = self._arrays(inputs)
        try:
            return self._client().sample(logits, timeout_s=self.timeout_s, **arrays)
        except InferenceServerException as error:
            refused = "INVALID_ARGUMENT" in str(error.status())
            raise SamplerCallError(f"{self.url}: {error.message()}", retryable=not refused) \
                from error
        except Exception as error:  # noqa: BLE001 - any transport failure: another target
            raise SamplerCallError(f"{self.url}: {error}") from error


def request_size(inputs: dict[str, np.ndarray]) -> int:
    """The bytes of a request's arrays (rows by reference: their references')."""
    return sum(array.nbytes for array in inputs.values())


def declared_vocab_size(config: dict) -> int:
    """The V a sampler model's configuration (Triton's JSON) declares in its
    ``vocab_size`` parameter, 0 where it declares none."""
    parameter = config.get("parameters", {}).get("vocab_size", {})
    return int(parameter.get("string_value") or 0)


def declared_input(config: dict, name: str) -> dict:
    """Input `name` as a model's configuration (Triton's JSON) declares it,
    {} where it declares no such input."""
    return next((tensor for tensor in config.get("input", []) if tensor.get("name") == name), {})


def declared_record_bytes(config: dict) -> int:
    """The bytes of a ``row_scalars`` record a sampler model's configuration
    declares, 0 where it declares no such input."""
    dims = declared_input(config, ROW_SCALARS.name).get("dims")
    return max(int(dims[-1]), 0) if dims else 0  # -1: an older version's, undeclared


def probe_row(config: dict, vocab_size: int) -> np.ndarray | None:
    """One row of zero logits [1, V] in the dtype a sampler model's
    configuration declares for ``logits``: V its declared one, else
    `vocab_size` (None where neither is known)."""
    width = declared_vocab_size(config) or vocab_size
    if not width:
        return None
    logits_type = declared_input(config, "logits").get("data_type", "TYPE_FP32")
    dtype = {"TYPE_BF16": ml_dtypes.bfloat16, "TYPE_FP16": np.float16}.get(logits_type,
                                                                          np.float32)
    return np.zeros((1, width), dtype)
