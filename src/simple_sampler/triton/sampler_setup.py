"""The sampler pool and row arena an llm model's settings ask for
(``LlmService``): its ``sampler_endpoints`` as targets (this server's
instances by BLS, other servers' sampler models), and the shared-memory
arena its local instances read rows from."""
from __future__ import annotations

import logging
from typing import Callable

from ..addresses import LOCAL, parse_endpoints
from ..serving.engines import engine_spec
from ..settings import LOGITS_ITEMSIZE, LlmSettings
from .sampler_pool import SamplerPool
from .sampler_targets import RemoteSampler, SamplerCall, SamplerTarget

log = logging.getLogger(__name__)


def build_arena(settings, engine):
    """The row arena for an llm model's settings (``row_transport`` arena,
    local instances among the endpoints), or None: slots for two calls in
    flight per micro-batch, each holding the engine's largest step in the
    dtype its rows come in (``EngineSpec.logits_dtype``; float32 where it
    names none). An engine with ``share_rows(arena)`` moves its host copy
    of the rows into the arena (referenced there, no copy per step; where
    /dev/shm has no room for them, they stay and are copied into a slot each
    step). A host where the arena cannot be made (no /dev/shm) keeps the BLS
    transport."""
    from ..row_arena import RowArena

    if settings.row_transport != "arena" or LOCAL not in parse_endpoints(settings.sampler_endpoints):
        return None
    itemsize = LOGITS_ITEMSIZE[engine_spec(settings.engine).logits_dtype(settings) or "fp32"]
    try:
        arena = RowArena(2 * settings.micro_batches,
                         engine.max_batch_size * engine.vocab_size * itemsize)
    except OSError as error:
        log.warning("row_transport arena: no shared-memory arena here (%s); rows go inside "
                    "the BLS requests", error)
        return None
    if hasattr(engine, "share_rows"):
        try:
            engine.share_rows(arena)
        except OSError as error:  # the simulated engine's bank: copied into a slot each step
            log.warning("row_transport arena: the engine's rows stay where they are (%s)", error)
    log.info("rows reach the local sampler instances through the shared-memory arena %s",
             ", ".join(arena.names))
    return arena


def capacity_of(config: dict | None) -> int:
    """A sampler model's instance count from its configuration (1 unknown)."""
    if config is None:
        return 1
    return max(1, sum(int(group.get("count", 1)) for group in config.get("instance_group", [])))


def build_pool(endpoints: str, local_call: SamplerCall | None, local_capacity: int,
               on_retry: Callable[[], None] = lambda: None, arena=None,
               min_rows: int = LlmSettings.sampler_shard_min_rows,
               lanes: int = LlmSettings.micro_batches, hot_set: int | None = None,
               vocab_size: int = 0) -> SamplerPool:
    """The pool for an `llm` model's `sampler_endpoints` setting: ``local``
    is `local_call` (BLS to this server's instances, `local_capacity`
    shards; rows by reference to `arena` when given), host:port a remote
    server's sampler model; min_rows: its `sampler_shard_min_rows`; lanes:
    its `micro_batches`; hot_set: the fingerprint of the hot set the remote
    servers must hold (``RemoteSampler``), None: unchecked; vocab_size: the
    decode loop's V (0: unknown), which they must sample (``RemoteSampler.check``,
    for each endpoint that can be asked now)."""
    targets = []
    for name in parse_endpoints(endpoints):
        if name == LOCAL:
            if local_call is None:
                raise ValueError("sampler_endpoints includes 'local' but this server has no "
                                 "local sampler call")
            targets.append(SamplerTarget(LOCAL, local_call, local_capacity,
                                         shares_memory=arena is not None))
        else:
            remote = RemoteSampler(name, hot_set=hot_set, vocab_size=vocab_size)
            config = remote.configuration()
            if config is not None:
                remote.check(config)
            targets.append(SamplerTarget(name, remote, capacity_of(config), probe=remote.ready))
    return SamplerPool(targets, on_retry, arena=arena, min_rows=min_rows, lanes=lanes)
