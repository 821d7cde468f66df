"""`bench serve-cost`'s servers: the model repository each one serves (the
project's models on the SIMULATED engine at a pace, and the floor model
beside them) and its sampler instances' settings."""
from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from ...settings import SIMULATED_DTYPES, LlmSettings, SamplerSettings

#: pace name -> (a ms, b ms per sequence) of the simulated step a + b * B.
PACES = {"instant": (0.0, 0.0),
         "gpu": (LlmSettings.sim_step_a_ms, LlmSettings.sim_step_b_ms)}
FLOOR_MODEL = "floor"
#: The sampler's hot set for hot-first (model_repository/simple_sampler/).
HOT_VOCAB_PROFILE = "hot_vocab.npz"


def sampler_settings(batch: int, instances: int, dtype: str,
                     handoff: str = LlmSettings.handoff) -> SamplerSettings:
    """The sampler instances' settings; hot-first gives them the repository's
    hot set (``row_transport``'s servers do the same)."""
    return SamplerSettings(sampler_instances=instances, sampler_max_batch_size=batch,
                           logits_dtype=SIMULATED_DTYPES[dtype],
                           hot_vocab_profile=HOT_VOCAB_PROFILE if handoff == "hot-first" else "")


def build_repository(destination: Path, pace: str, batch: int, instances: int,
                     micro_batches: int, vocab: int, dtype: str,
                     sampling_mode: str = LlmSettings.sampling_mode,
                     shard_min_rows: int = LlmSettings.sampler_shard_min_rows,
                     handoff: str = LlmSettings.handoff,
                     send_threads: int = LlmSettings.send_threads) -> Path:
    from ...launch.serve import assemble_repository
    from ...launch.templates import fill_file

    a, b = PACES[pace]
    sampler = sampler_settings(batch, instances, dtype, handoff)
    llm = LlmSettings(engine="simulated", sim_vocab=vocab, sim_dtype=dtype, sim_step_a_ms=a,
                      sim_step_b_ms=b, micro_batches=micro_batches, sampler_shards=instances,
                      engine_max_batch_size=batch, generate_max_batch_size=batch,
                      max_context=512, sampling_mode=sampling_mode,
                      sampler_shard_min_rows=shard_min_rows, handoff=handoff,
                      hot_vocab_profile=sampler.hot_vocab_profile, send_threads=send_threads)
    assemble_repository(destination, sampler, llm)
    floor = destination / FLOOR_MODEL
    source = resources.files("simple_sampler.bench").joinpath("floor")
    (floor / "1").mkdir(parents=True)
    shutil.copyfile(str(source.joinpath("model.py")), floor / "1" / "model.py")
    shutil.copyfile(str(source.joinpath("config.pbtxt")), floor / "config.pbtxt")
    fill_file(floor / "config.pbtxt", {"max_batch_size": batch, "step_a_ms": a, "step_b_ms": b})
    return destination
