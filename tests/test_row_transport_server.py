"""Both row transports through a real server give the same seeded tokens
(docs/COPIES.md): the simulated engine's rows (bfloat16, V = 128,256) reach
the two sampler instances by reference to the llm model's shared-memory
arena, or inside the BLS requests. Requests go one at a time, so both
servers step the same bank rows in the same order. The arena's regions
exist while the server runs and are gone after it stops."""
import os

import pytest

from simple_sampler.client import GenerateClient
from simple_sampler.row_arena import PREFIX, SHM_DIR
from simple_sampler.settings import LlmSettings, SamplerSettings
from simple_sampler.launch.serve import assemble_repository, shared_memory_bytes
from simple_sampler.launch.server import TritonServer
from simple_sampler.launch.supervisor import list_stubs

pytestmark = pytest.mark.slow
SEEDS = (7, 8, 9, 10)
#: SmolLM2's rows behind the simulated bank are computed at the llm model's
#: first start on a machine (then cached): minutes on a loaded 2-core one.
STARTUP_TIMEOUT_S = 900
PARAMS = ({"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9},
          {"temperature": 1.0, "top_k": 50, "repetition_penalty": 1.2})


def regions(owners=None) -> set[str]:
    """The row regions in /dev/shm; of `owners` (pids) only when given: other
    servers on the machine (other jobs) make and unlink regions of their own."""
    found = {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}
    if owners is None:
        return found
    return {name for name in found if any(f"-{pid}-" in name for pid in owners)}


def generate_all(tmp_path, transport: str, handoff: str = "full"):
    profile = "hot_vocab.npz" if handoff == "hot-first" else ""
    sampler = SamplerSettings(sampler_instances=2, sampler_max_batch_size=8, logits_dtype="bf16",
                              hot_vocab_profile=profile)
    llm = LlmSettings(engine="simulated", sim_vocab=128_256, sim_dtype="bfloat16",
                      sim_step_a_ms=1.0, sim_step_b_ms=0.0, engine_max_batch_size=8,
                      max_context=256, sampler_shards=2, row_transport=transport,
                      handoff=handoff, hot_vocab_profile=profile)
    repository = assemble_repository(tmp_path / f"{transport}-{handoff}", sampler, llm)
    log = tmp_path / f"{transport}-{handoff}.log"
    server = TritonServer(repository, log_path=log, shm_bytes=shared_memory_bytes(sampler))
    try:
        server.start(timeout=STARTUP_TIMEOUT_S)
        owners = [stub.pid for stub in list_stubs(server.process.pid) if stub.model == "llm"]
        during = regions(owners)
        client = GenerateClient(server.grpc_url, "grpc")
        answers = []
        for params in PARAMS:
            for seed in SEEDS:
                answer = client.generate("Tell me about the sea.", seed=seed, max_tokens=6,
                                         min_length=6, return_log_probs=True,
                                         exclude_input_in_output=True, **params)
                answers.append((answer.token_ids, answer.logprobs))
    finally:
        server.stop()
    assert regions(owners) == set(), f"{transport}: a region outlived the server"
    return answers, during, log.read_text()


def test_arena_and_bls_give_the_same_seeded_tokens_and_the_arena_leaves_nothing(tmp_path):
    arena, arena_regions, arena_log = generate_all(tmp_path, "arena")
    bls, bls_regions, bls_log = generate_all(tmp_path, "bls")
    assert "through the shared-memory arena" in arena_log
    assert len(arena_regions) == 2, "the ring and the engine's shared bank"
    assert "shared-memory arena" not in bls_log and not bls_regions
    assert all(len(tokens) == 6 for tokens, _ in arena)
    assert len({tuple(tokens) for tokens, _ in arena}) > len(arena) // 2  # really sampled
    assert arena == bls


def test_hot_first_rows_run_end_to_end_on_the_simulated_engine(tmp_path):
    """serve --engine simulated --handoff hot-first: compact rows from the
    engine's summary, the rest whole from the arena. Greedy rows are decided
    exactly as on full rows (the same argmax); sampled rows follow the same
    distribution by another draw order, so only their count is checked."""
    full, _, _ = generate_all(tmp_path, "arena")
    hot, _, log = generate_all(tmp_path, "arena", "hot-first")
    assert "rows cross to the sampler hot-first" in log
    greedy = len(SEEDS)
    assert [tokens for tokens, _ in hot[:greedy]] == [tokens for tokens, _ in full[:greedy]]
    assert all(len(tokens) == 6 for tokens, _ in hot)
