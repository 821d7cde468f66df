"""Where each step's rows are sampled: the local `simple_sampler` instances
(BLS inside this server) and/or the same model on other Triton servers
(gRPC), with failover.

A step's rows are split over the targets that are up in proportion to their
capacity (a target's instance count), and each target's part into one shard
per instance, all sent at once. A shard whose request fails for a reason that
is not the rows' own (a dead instance, a server that went away, a timeout) is
sent again at once to another target that is up, and the target that failed
is marked down for ``probe_after_s``; after that it is tried again with the
next step's rows (and marked down again if it still fails). When no other
target is up the shard waits (backoff from RETRY_FIRST_S, doubling to
RETRY_MAX_S) and goes to the target that will be back soonest, until
``deadline_s`` has passed. A shard the sampler refused (INVALID_ARG: the rows
themselves are bad, which would be our bug) is never sent again.

Sampling is stateless and every draw is keyed by (seed, step), so a row gives
the same token on whichever target samples it, however often it is sent.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..params import SamplingBatch
from ..sampling import logits_array
from ..settings import LOCAL, parse_endpoints
from .sampler_client import SamplerClient
from .sampler_codec import batch_arrays

log = logging.getLogger(__name__)

#: Retries: the first wait, its doubling cap, and the time after which a
#: shard's rows fail (a reload of the sampler model takes ~2-5 s).
RETRY_FIRST_S, RETRY_MAX_S, RETRY_DEADLINE_S = 0.05, 1.0, 30.0
#: How long a target that failed is left out before it is tried again.
PROBE_AFTER_S = 2.0
#: A remote request's limit: past it the endpoint counts as failed.
REMOTE_TIMEOUT_S = 10.0


class SamplerCallError(RuntimeError):
    """A request to a sampler failed. ``retryable`` unless the sampler
    refused the rows themselves (INVALID_ARG): a dead or reloading instance,
    a transport error or a timeout are worth sending again."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


#: call(inputs) -> outputs: one synchronous request for some rows (inputs by
#: tensor name, ``logits`` among them); raises SamplerCallError.
SamplerCall = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class SamplerTarget:
    """One place rows can go; `capacity` is its instance count."""

    name: str
    call: SamplerCall
    capacity: int = 1
    down_until: float = 0.0
    failures: int = 0

    def is_up(self, now: float) -> bool:
        return self.down_until <= now


class RemoteSampler:
    """The `simple_sampler` model on another Triton server, over gRPC (the
    logits travel inline: no shared memory between hosts). One client per
    thread, since calls come from several threads at once."""

    def __init__(self, url: str, model: str = "simple_sampler",
                 timeout_s: float = REMOTE_TIMEOUT_S):
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self._local = threading.local()

    def _client(self) -> SamplerClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = SamplerClient(self.url, "grpc", self.model)
        return client

    def capacity(self) -> int:
        """The model's instance count there (1 if it cannot be asked now)."""
        try:
            config = self._client().client.get_model_config(self.model, as_json=True,
                                                             client_timeout=self.timeout_s)
            groups = config["config"].get("instance_group", [])
            return max(1, sum(int(group.get("count", 1)) for group in groups))
        except Exception as error:  # noqa: BLE001 - an endpoint down at start is probed later
            log.warning("sampler endpoint %s: cannot read its configuration (%s)", self.url, error)
            return 1

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from tritonclient.utils import InferenceServerException

        arrays = dict(inputs)
        logits = arrays.pop("logits", None)        # None: compact rows (hot_logits, ...)
        try:
            return self._client().sample(logits, timeout_s=self.timeout_s, **arrays)
        except InferenceServerException as error:
            refused = "INVALID_ARGUMENT" in str(error.status())
            raise SamplerCallError(f"{self.url}: {error.message()}", retryable=not refused) \
                from error
        except Exception as error:  # noqa: BLE001 - any transport failure: another target
            raise SamplerCallError(f"{self.url}: {error}") from error


@dataclass
class SamplerPool:
    """The decoder's sampler over `targets` (module docstring). Call it as
    ``await pool(logits, batch)``; `on_retry` is called for every shard
    sent again."""

    targets: list[SamplerTarget]
    on_retry: Callable[[], None] = lambda: None
    deadline_s: float = RETRY_DEADLINE_S
    probe_after_s: float = PROBE_AFTER_S
    rows_sent: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if not self.targets:
            raise ValueError("a sampler pool needs at least one target")

    async def __call__(self, logits: torch.Tensor, batch: SamplingBatch):
        # bfloat16 rows stay bfloat16 (ml_dtypes): no cast, no copy.
        outputs = await self.send({"logits": logits_array(logits)}, batch)
        return outputs["output_ids"].astype(np.int64), outputs["output_log_probs"]

    async def send(self, rows: dict[str, np.ndarray], batch: SamplingBatch) -> dict[str, np.ndarray]:
        """The rows (``logits``, or the compact inputs: arrays of len(batch)
        rows) with `batch`'s parameters, sharded over the targets; returns
        each output concatenated, [B] (output_log_probs NaN where not asked)."""
        arrays = {**rows, **batch_arrays(batch)}
        wanted = batch.want_logprobs
        arrays["return_log_probs"] = (np.ones(len(batch), bool) if wanted is None
                                      else np.asarray(wanted, bool))[:, None]
        shards = self.shards(len(batch))
        parts = await asyncio.gather(*(
            self._send({k: v[a:b] for k, v in arrays.items()}, target)
            for target, a, b in shards))
        nan = np.full((len(batch), 1), np.nan, np.float32)  # no row of a shard asked
        for part in parts:
            part.setdefault("output_log_probs", nan[:len(part["output_ids"])])
        return {name: np.concatenate([p[name][:, 0] for p in parts]) for name in parts[0]
                if parts[0][name].ndim == 2 and parts[0][name].shape[1] == 1}

    def shards(self, rows: int) -> list[tuple[SamplerTarget, int, int]]:
        """(target, first row, end row) for every shard of `rows` rows: the
        targets that are up share them in proportion to their capacity (all
        of them, if none is up), one shard per instance."""
        now = time.monotonic()
        targets = [t for t in self.targets if t.is_up(now)] or self.targets
        slots = [t for t in targets for _ in range(t.capacity)][:max(rows, 1)]
        bounds = np.linspace(0, rows, len(slots) + 1).astype(int)
        return [(target, int(a), int(b)) for target, a, b in zip(slots, bounds[:-1], bounds[1:])
                if b > a]

    async def _send(self, inputs: dict[str, np.ndarray], target: SamplerTarget):
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self.deadline_s, RETRY_FIRST_S
        while True:
            try:
                outputs = await asyncio.to_thread(target.call, inputs)
            except SamplerCallError as error:
                if not error.retryable or loop.time() > deadline:
                    raise
                self._mark_down(target, error)
                self.on_retry()
                now = time.monotonic()
                others = [t for t in self.targets if t is not target and t.is_up(now)]
                if others:
                    target = max(others, key=lambda t: t.capacity)
                    continue
                if loop.time() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                target = min(self.targets, key=lambda t: t.down_until)
                continue
            if target.failures:
                log.warning("sampler %s is serving again", target.name)
                target.failures = 0
            rows = len(inputs["random_seed"])
            self.rows_sent[target.name] = self.rows_sent.get(target.name, 0) + rows
            return outputs

    def _mark_down(self, target: SamplerTarget, error: Exception) -> None:
        target.failures += 1
        target.down_until = time.monotonic() + self.probe_after_s
        log.warning("sampler %s failed (%s); its rows go elsewhere, and it is tried again in "
                    "%.1f s", target.name, error, self.probe_after_s)


def build_pool(endpoints: str, local_call: SamplerCall | None, local_capacity: int,
               on_retry: Callable[[], None] = lambda: None) -> SamplerPool:
    """The pool for an `llm` model's `sampler_endpoints` setting: ``local``
    is `local_call` (BLS to this server's instances, `local_capacity`
    shards), host:port a remote server's sampler model."""
    targets = []
    for name in parse_endpoints(endpoints):
        if name == LOCAL:
            if local_call is None:
                raise ValueError("sampler_endpoints includes 'local' but this server has no "
                                 "local sampler call")
            targets.append(SamplerTarget(LOCAL, local_call, local_capacity))
        else:
            remote = RemoteSampler(name)
            targets.append(SamplerTarget(name, remote, remote.capacity()))
    return SamplerPool(targets, on_retry)
