"""Shared helpers: identical rows drawn under many seeds, and a chi-square
goodness-of-fit check against the float64 reference."""
import numpy as np
import pytest
from scipy import stats

from simple_sampler.params import History, SamplingBatch, SamplingParams
from simple_sampler.sampling import sample
from simple_sampler.shvs import HotVocab

#: A fit is rejected below this p-value. Seeds are fixed, so every test is
#: deterministic; the power checks in test_exactness.py show that a
#: distribution 1% off in total variation falls far below it.
P_VALUE_FLOOR = 1e-4

#: A value that turns each sampling parameter of params.RULES on (exact in
#: float32, the wire's type). A parameter added to the table needs one here:
#: test_params_table's key check fails first; the truncations' values are
#: then drawn through SHVS (test_shvs) and the compact rows (test_handoff).
PARAM_ON = {"temperature": 0.5, "top_k": 5, "top_p": 0.75, "min_p": 0.25,
            "repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": -0.5}


def repeated_batch(params: SamplingParams, draws: int, history: History | None = None,
                   step: int = 0) -> SamplingBatch:
    """`draws` copies of one row's parameters with seeds 0 .. draws-1."""
    batch = SamplingBatch.from_params([params], [history or History()], [step])
    size = lambda a: np.repeat(a, draws)
    ragged = lambda offsets: np.arange(draws + 1, dtype=np.int64) * offsets[1]
    tile = lambda ids: np.tile(ids, draws)
    return SamplingBatch(
        temperature=size(batch.temperature), top_k=size(batch.top_k), top_p=size(batch.top_p),
        min_p=size(batch.min_p), repetition_penalty=size(batch.repetition_penalty),
        presence_penalty=size(batch.presence_penalty),
        frequency_penalty=size(batch.frequency_penalty),
        seed=np.arange(draws, dtype=np.uint64), step=size(batch.step),
        bias_offsets=ragged(batch.bias_offsets), bias_ids=tile(batch.bias_ids),
        bias_values=tile(batch.bias_values),
        ban_offsets=ragged(batch.ban_offsets), ban_ids=tile(batch.ban_ids),
        prompt_offsets=ragged(batch.prompt_offsets), prompt_ids=tile(batch.prompt_ids),
        output_offsets=ragged(batch.output_offsets), output_ids=tile(batch.output_ids),
    )


def draw_counts(row: np.ndarray, params: SamplingParams, draws: int,
                history: History | None = None, **kwargs) -> tuple[np.ndarray, SamplingBatch]:
    """Token counts of `draws` samples of one row (rows broadcast, not copied)."""
    batch = repeated_batch(params, draws, history)
    rows = np.broadcast_to(row, (draws, row.shape[-1]))
    tokens = sample(rows, batch, return_logprobs=False, **kwargs).token_ids
    return np.bincount(tokens, minlength=row.shape[-1]), batch


def _chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
    observed, expected = observed[expected > 0], expected[expected > 0]
    if expected.size < 2:
        return 1.0
    expected = expected * (observed.sum() / expected.sum())
    return float(stats.chisquare(observed, expected).pvalue)


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray, groups: int = 32) -> float:
    """p-value of counts against probs, the smaller of two chi-square tests:
    per token (bins with an expected count below 5 pooled), which catches
    errors concentrated on a few tokens, and over `groups` bins of about
    equal mass in rank order, which catches smooth distortions (a wrong
    temperature, a shifted truncation) spread thinly over many tokens.
    Draws outside the support fail outright."""
    assert counts[probs == 0].sum() == 0, (
        f"drew tokens of probability 0: {np.flatnonzero((probs == 0) & (counts > 0))[:10]}")
    order = np.lexsort((np.arange(probs.size), -probs))
    expected = probs[order] * counts.sum()
    observed = counts[order].astype(np.float64)
    big = expected >= 5
    per_token = _chi_square(np.append(observed[big], observed[~big].sum()),
                            np.append(expected[big], expected[~big].sum()))
    edges = np.searchsorted(np.cumsum(probs[order]), np.linspace(0, 1, groups + 1)[1:-1])
    grouped_expected = np.add.reduceat(expected, np.unique(np.r_[0, edges]))
    grouped_observed = np.add.reduceat(observed, np.unique(np.r_[0, edges]))
    grouped = _chi_square(grouped_observed, grouped_expected)
    return min(per_token, grouped)


def fails_the_fit(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Whether `goodness_of_fit` rejects counts against probs: a p-value
    under P_VALUE_FLOOR, or draws outside probs' support (for power checks
    against a wrong distribution whose support may differ)."""
    try:
        return goodness_of_fit(counts, probs) < P_VALUE_FLOOR
    except AssertionError:
        return True


def moved_one_percent(probs: np.ndarray) -> np.ndarray:
    """probs with 1% of the mass moved from its most to its least likely
    token of the support: a distribution about 1% away in TV, for power
    checks. Where the most likely token has less than 1% more than the next
    (a flat row's tokens hold 0.03% each), the 1% comes off the fewest most
    likely tokens, cut down to one level, so that none goes negative."""
    support = np.flatnonzero(probs)
    descending = np.sort(probs[support])[::-1]
    levels = (np.cumsum(descending) - 0.01) / np.arange(1, descending.size + 1)
    level = levels[np.argmax(levels >= np.append(descending[1:], 0.0))]
    moved = np.minimum(probs, level)
    moved[support[np.argmin(probs[support])]] += 0.01
    assert moved.min() >= 0 and abs(moved.sum() - probs.sum()) < 1e-9, "a distribution"
    return moved


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


@pytest.fixture(scope="session")
def zipf_rows() -> np.ndarray:
    """Rows shaped like LLM logits: a power-law head over a Gaussian bulk."""
    rng = np.random.default_rng(1234)
    rows = []
    for vocab in (50, 1000, 4096):
        ranks = rng.permutation(vocab) + 1
        rows.append((-1.1 * np.log(ranks) + 0.3 * rng.standard_normal(vocab)).astype(np.float32))
    return rows


#: the width of `make_rows`' rows and `make_requests`' token ids
MIXED_VOCAB = 5000


def make_rows(rng, count, vocab=MIXED_VOCAB):
    """float32 [count, vocab] rows: power-law heads over Gaussian bulks, every
    third row flat (broad truncations), 7 columns -inf."""
    ranks = np.argsort(rng.random((count, vocab)), axis=1) + 1.0
    rows = -1.1 * np.log(ranks) + 0.4 * rng.standard_normal((count, vocab))
    rows[::3] = 0.02 * rng.standard_normal((len(rows[::3]), vocab))   # flat: broad truncations
    rows[:, rng.integers(0, vocab, 7)] = -np.inf
    return rows.astype(np.float32)


def make_requests(rng, count, seed_base=0, vocab=MIXED_VOCAB):
    """A mixed set of rows: every truncation kind, greedy, penalties, bias,
    min_tokens bans, different seeds, steps and histories."""
    kinds = [
        dict(),
        dict(temperature=0.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_k=40),
        dict(top_k=20, min_p=0.05),
        dict(min_p=0.1),
        dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02),
        dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
        dict(temperature=0.0, repetition_penalty=1.2),
        dict(top_p=0.5, repetition_penalty=0.9, presence_penalty=-0.5),
        dict(temperature=2.0),
        dict(top_p=0.99, frequency_penalty=-0.3),
    ]
    params, histories, steps = [], [], []
    for i in range(count):
        kind = dict(kinds[i % len(kinds)])
        if rng.random() < 0.4:
            kind["logit_bias"] = {int(t): float(rng.normal(0, 3))
                                  for t in rng.choice(vocab, 4, replace=False)}
        if rng.random() < 0.3:
            kind["min_tokens"] = 4
            kind["stop_token_ids"] = [int(t) for t in rng.choice(vocab, 2, replace=False)]
        params.append(SamplingParams(seed=seed_base + int(rng.integers(0, 2**63)), **kind))
        histories.append(History(
            prompt_ids=rng.integers(0, vocab, int(rng.integers(0, 40))).tolist(),
            output_ids=rng.integers(0, vocab, int(rng.integers(0, 8))).tolist()))
        steps.append(int(rng.integers(0, 1000)))
    return params, histories, steps


#: the width of `zipf_row`
ZIPF_VOCAB = 4096


@pytest.fixture(scope="session")
def zipf_row() -> np.ndarray:
    """One 4,096-token row shaped like LLM logits (the SHVS, handoff and cold
    draw tests' row; `hot_sets` gives its hot sets)."""
    rng = np.random.default_rng(99)
    return (-1.1 * np.log(rng.permutation(ZIPF_VOCAB) + 1.0)
            + 0.3 * rng.standard_normal(ZIPF_VOCAB)).astype(np.float32)


def hot_sets(row: np.ndarray) -> dict[str, HotVocab]:
    """Hot sets from kind to kind: covering the head, missing most of the
    mass (the coldest tokens), random, and one token."""
    order = np.argsort(-row)
    rng = np.random.default_rng(3)
    return {
        "head": HotVocab(order[:600], row.size),
        "misses-most-mass": HotVocab(order[-1500:], row.size),
        "random": HotVocab(rng.choice(row.size, 700, replace=False), row.size),
        "one-token": HotVocab(order[:1], row.size),
    }


#: the llm server's context: the prompt plus max_tokens must fit
LLM_CONTEXT = 512


def llm_server_settings():
    """llm_server's settings (SmolLM2 in batch-invariant mode, 2 sampler
    instances), fresh: a test that must stop or kill its server starts one
    with these, and `sampled_tokens` from llm_server are then its tokens too."""
    from simple_sampler.settings import LlmSettings, SamplerSettings

    return (SamplerSettings(sampler_instances=2, sampler_max_batch_size=64, vocab_size=49_152),
            LlmSettings(engine_max_batch_size=32, max_context=LLM_CONTEXT, sampler_shards=2,
                        batch_invariant=True))  # the seed tests rely on it (docs/SERVING.md)


def small_llm_server(tmp_path_factory, **llm):
    """A generator of a real tritonserver on SmolLM2 with one sampler instance,
    8 sequences of 256 tokens and the LlmSettings `llm` (a module's server
    fixture yields from it)."""
    from simple_sampler.launch.serve import assemble_repository
    from simple_sampler.launch.server import TritonServer
    from simple_sampler.settings import LlmSettings, SamplerSettings

    repository = assemble_repository(
        tmp_path_factory.mktemp("repository"),
        SamplerSettings(sampler_instances=1, sampler_max_batch_size=8, vocab_size=49_152),
        LlmSettings(engine_max_batch_size=8, max_context=256, **llm))
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    with TritonServer(repository, log_path=log) as running:
        yield running


@pytest.fixture(scope="session")
def llm_server(tmp_path_factory):
    """The whole repository on a real tritonserver (`llm_server_settings`), on
    free loopback ports, shared by the tests that talk to it."""
    from simple_sampler.launch.serve import assemble_repository
    from simple_sampler.launch.server import TritonServer

    repository = assemble_repository(tmp_path_factory.mktemp("repository"), *llm_server_settings())
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    with TritonServer(repository, log_path=log) as running:
        yield running


#: `sampled_tokens`' seeds and length
SAMPLED_SEEDS, SAMPLED_TOKENS = range(16), 64


@pytest.fixture(scope="session")
def sampled_tokens(llm_server) -> dict[int, list[int]]:
    """{seed: tokens}: SAMPLED_SEEDS' streams of fakes.PROMPT (fakes.SAMPLED,
    SAMPLED_TOKENS tokens) from llm_server, 16 at once. (seed, step) decide
    each draw on batch-invariant logits, so a server of the same engine settings
    gives them at any concurrency, and a run with a smaller max_tokens gives
    a prefix of them: the reference of the tests that fault or spread such a
    server, made once for all of them."""
    from fakes import SAMPLED, Streams

    streams = Streams(llm_server.grpc_url, SAMPLED_SEEDS, max_tokens=SAMPLED_TOKENS,
                      **SAMPLED).join()
    assert not streams.errors, streams.errors
    return streams.tokens


@pytest.fixture(scope="session")
def codec():
    """SmolLM2's text codec (its tokenizer and chat template), loaded once;
    the front door's tests read prompts with it."""
    from simple_sampler.serving.text import TextCodec

    return TextCodec.from_source()
