"""Top logprobs through the decode loop (``GenerationRequest.num_top_logprobs``):
every sampler the llm model can run gives each token the n most likely
tokens, ranked and valued as the float64 reference ranks them, and asking
for them never changes a token."""
import asyncio

import numpy as np
import pytest
import torch

from simple_sampler import SamplingParams
from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.decoder import Decoder
from simple_sampler.serving.generation import GenerationRequest
from simple_sampler.serving.samplers import threaded
from simple_sampler.serving.text import TextCodec
from simple_sampler.shvs.hot_vocab import HotVocab
from simple_sampler.triton.generate_io import decode_generate
from simple_sampler.triton.generate_outputs import encode_event
from simple_sampler.triton.hot_first_sampler import HotFirstSampler
from simple_sampler.triton.sampler_pool import SamplerPool
from simple_sampler.triton.sampler_targets import SamplerTarget
from simple_sampler.triton.sampler_serve import serve_request

from fakes import VOCAB, FakeEngine, FakeTokenizer

#: (num_top_logprobs, parameters) of the requests of one run: greedy, plain,
#: truncated and biased rows, untruncated ones (which hot-first decides from
#: their compact rows, unless asking made them need their full row)
ASKS = [(1, SamplingParams(temperature=0.0)),
        (3, SamplingParams(seed=2, temperature=0.7, top_p=0.8)),
        (5, SamplingParams(seed=3, top_k=4, logit_bias={5: 3.0})),
        (20, SamplingParams(seed=4, temperature=1.3, min_p=0.05)),
        (2, SamplingParams(seed=6)), (4, SamplingParams(seed=7, temperature=0.9)),
        (0, SamplingParams(seed=1)),
        (0, SamplingParams(seed=5, top_p=0.9))]


class NoisyEngine(FakeEngine):
    """Random logits keyed by the sequence's length (ties among ids 8-11 at
    each step, so that their order is the tie rule's), each step's rows
    kept by (sequence, length) for the reference."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rows = {}

    def step(self, seq_ids):
        super().step(seq_ids)
        logits = torch.empty((len(seq_ids), VOCAB))
        for row, seq_id in enumerate(seq_ids):
            length = len(self.ids[seq_id])
            values = np.random.default_rng([seq_id, length]).normal(size=VOCAB) * 2
            values[8:12] = values[8]
            logits[row] = torch.from_numpy(values.astype(np.float32))
            self.rows[seq_id, length] = logits[row].numpy().astype(np.float64)
        return logits


def local_pool(hot=None, capacity=3):
    """A SamplerPool of the sampler model's code in-process, over three
    slots and one row per request at least, so that a step of ASKS is split
    over requests that ask for different n, and one for none (its answer
    has no top logprobs)."""
    call = lambda inputs: serve_request(inputs, 0, hot).outputs  # noqa: E731
    return SamplerPool([SamplerTarget("local", call, capacity)], min_rows=1)


SAMPLERS = {
    "threaded kernels": lambda: dict(mode="simple", sampler=threaded()),
    "inline torch": lambda: dict(mode="inline"),
    "inline kernels": lambda: dict(mode="inline_kernels"),
    "sampler pool": lambda: dict(mode="simple", sampler=local_pool()),
    "hot first": lambda: dict(mode="simple", sampler=HotFirstSampler(
        local_pool(HOT), HOT, cold_top=4)),
}
HOT = HotVocab(np.arange(1, 9), VOCAB)


def run(asks, return_log_probs: bool = True, **decoder_args):
    """Each request's events, and the engine (its rows)."""
    engine = NoisyEngine(max_batch_size=len(asks))
    requests = [GenerationRequest(prompt_ids=[1 + i, 2], max_tokens=6, sampling=params,
                                  ignore_end=True, return_log_probs=return_log_probs,
                                  num_top_logprobs=n)
                for i, (n, params) in enumerate(asks)]

    async def collect(handle):
        return [event async for event in handle]

    async def main():
        decoder = Decoder(engine, TextCodec(FakeTokenizer()), **decoder_args)
        await decoder.start()
        handles = [decoder.submit(r) for r in requests]
        results = await asyncio.gather(*(collect(h) for h in handles))
        await decoder.close()
        return results
    return asyncio.run(main()), engine


def reference_top(row: np.ndarray, params: SamplingParams, n: int):
    """The n most likely (id, logprob) of a float64 row under softmax(z), z
    the biased logits over the temperature (1 for a greedy row), ties by
    lower id."""
    z = row.copy()
    for token, bias in params.logit_bias.items():
        z[token] += bias
    z /= params.temperature if params.temperature >= 1e-5 else 1.0
    logprobs = z - np.logaddexp.reduce(z)
    order = np.lexsort((np.arange(z.size), -logprobs))[:n]
    return order.tolist(), logprobs[order]


@pytest.mark.parametrize("kind", SAMPLERS)
def test_each_token_gets_its_rows_top_logprobs_and_the_same_token(kind):
    arguments = SAMPLERS[kind]()
    asked, engine = run(ASKS, **arguments)
    plain, _ = run([(0, params) for _, params in ASKS], **SAMPLERS[kind]())
    for request, ((n, params), events) in enumerate(zip(ASKS, asked)):
        tokens = [t for e in events for t in e.token_ids]
        assert tokens == [t for e in plain[request] for t in e.token_ids], \
            "asking for top logprobs changed a token"
        chosen = [p for e in events for p in e.logprobs]
        tops = [pairs for e in events for pairs in e.top_logprobs]
        assert len(tops) == (len(tokens) if n else 0)
        for step, (token, pairs) in enumerate(zip(tokens, tops)):
            ids, logprobs = reference_top(engine.rows[request, 2 + step], params, n)
            assert [i for i, _ in pairs] == ids, (kind, request, step)
            np.testing.assert_allclose([p for _, p in pairs], logprobs, rtol=0, atol=2e-5)
            if token in ids:  # the chosen token's logprob is its entry's, to the bit
                assert chosen[step] == dict(pairs)[token]
    if kind == "hot first":
        assert arguments["sampler"].stats["rows"] > 0


@pytest.mark.parametrize("kind", SAMPLERS)
def test_raw_logprobs_are_the_rows_own_whatever_the_sampler(kind):
    """LlmSettings.logprobs_mode raw_logprobs (vLLM's default): every
    sampler gives each token's logprob and its n most likely as the model's
    own log_softmax of the row, no bias or temperature applied; the tokens
    are those drawn without logprobs (the hot-first handoff's too: its
    compact decision's, the logprobs scored on the full rows)."""
    asked, engine = run(ASKS, logprobs_mode="raw_logprobs", **SAMPLERS[kind]())
    plain, _ = run([(0, params) for _, params in ASKS], return_log_probs=False,
                   **SAMPLERS[kind]())
    for request, ((n, _), events) in enumerate(zip(ASKS, asked)):
        tokens = [t for e in events for t in e.token_ids]
        assert tokens == [t for e in plain[request] for t in e.token_ids], (kind, request)
        tops = [pairs for e in events for pairs in e.top_logprobs]
        for step, (token, logprob) in enumerate(zip(tokens, (p for e in events
                                                            for p in e.logprobs))):
            ids, logprobs = reference_top(engine.rows[request, 2 + step], SamplingParams(), VOCAB)
            assert logprob == pytest.approx(logprobs[ids.index(token)], abs=2e-5)
            if n:
                assert [i for i, _ in tops[step]] == ids[:n], (kind, request, step)
                np.testing.assert_allclose([p for _, p in tops[step]], logprobs[:n], atol=2e-5)


def test_a_sampler_that_gives_none_has_such_requests_refused_by_name():
    async def plain_sampler(logits, batch):  # answers tokens and logprobs only
        return np.zeros(len(batch), np.int64), np.zeros(len(batch), np.float32)

    with pytest.raises(InvalidRequest, match="num_top_logprobs must be 0 here"):
        run([(2, SamplingParams())], mode="simple", sampler=plain_sampler)
    events, _ = run([(0, SamplingParams())], mode="simple", sampler=plain_sampler)
    assert events[0][-1].finish_reason == "length"


@pytest.mark.parametrize("n, logprobs, message", [
    (21, True, r"num_top_logprobs must be an integer in \[0, 20\], got 21"),
    (-1, True, r"in \[0, 20\], got -1"),
    (2, False, "num_top_logprobs needs return_log_probs true")])
def test_bad_asks_name_the_field(n, logprobs, message):
    request = GenerationRequest(prompt_ids=[1], return_log_probs=logprobs, num_top_logprobs=n)
    with pytest.raises(InvalidRequest, match=message):
        request.validate(VOCAB)


def test_the_generate_tensors_carry_them_token_by_token():
    """num_top_logprobs in; top_logprobs_ids and top_logprobs out, [tokens,
    n], padded -1 and -inf where a token has fewer (a vocabulary under n)."""
    decoded = decode_generate({"input_ids": np.array([[1, 2]], np.int32),
                               "return_log_probs": np.array([[True]]),
                               "num_top_logprobs": np.array([[3]], np.int32)})
    assert decoded.request.num_top_logprobs == 3
    assert decode_generate({"input_ids": np.array([[1]], np.int32)}).request.num_top_logprobs == 0
    [events], _ = run([(3, SamplingParams(seed=5))], mode="inline_kernels")
    events[-1].top_logprobs[-1] = events[-1].top_logprobs[-1][:2]  # as V = 2 would give
    events[-1].top_logprobs[-1][1] = (events[-1].top_logprobs[-1][1][0], -1e6)  # finite: kept
    outputs = encode_event(events[-1], top=3)
    ids, logprobs = outputs["top_logprobs_ids"], outputs["top_logprobs"]
    assert ids.shape == logprobs.shape == (1, 3) and ids.dtype == np.int32
    assert ids[0, 2] == -1 and logprobs[0, 2] == -9999.0  # JSON has no -inf
    assert [(int(i), float(p)) for i, p in zip(ids[0, :2], logprobs[0, :2])] == \
        events[-1].top_logprobs[-1]
    assert "top_logprobs_ids" not in encode_event(events[-1], top=0)


def test_a_refused_step_keeps_the_other_rows_top_logprobs():
    """Sampled again around a refused row (samplers.sample_around_refusals),
    each other row keeps its own top logprobs, also where the sampler pads
    them past the vocabulary (V = 8 under n = 20)."""
    from simple_sampler.params import SamplingBatch
    from simple_sampler.serving.samplers import result_parts, sample_around_refusals

    for vocab in (64, 8):
        logits = torch.from_numpy(np.random.default_rng(vocab).normal(size=(5, vocab))
                                  .astype(np.float32))
        logits[2, 3] = float("nan")
        batch = SamplingBatch.from_params([SamplingParams(seed=row) for row in range(5)])
        batch.num_top_logprobs = np.array([20, 0, 3, 2, 1], np.int32)
        pool = local_pool(capacity=2)

        async def around():
            try:
                await pool(logits, batch)
            except Exception as refusal:  # noqa: BLE001 - the refusal to sample around
                return await sample_around_refusals(pool, logits, batch, refusal)
        result, refused = asyncio.run(around())
        tokens, _, (ids, logprobs) = result_parts(result)
        assert sorted(refused) == [2] and tokens[2] == -1
        for row in (0, 3, 4):
            n = min(batch.num_top_logprobs[row], vocab)
            expected, values = reference_top(logits[row].double().numpy(),
                                             SamplingParams(), n)
            assert ids[row, :n].tolist() == expected
            np.testing.assert_allclose(logprobs[row, :n], values, atol=2e-5)


def test_only_a_message_that_begins_with_its_row_is_a_refusal():
    """Through BLS a sampler's error arrives without its code (Triton issue
    7804): a refusal begins with the row it names; a failure of the
    sampler's own begins with its type and is retried elsewhere."""
    from simple_sampler.serving.samplers import names_a_row

    assert names_a_row("row 3: logits must not contain NaN; found at column 7")
    assert not names_a_row("MemoryError: row 3: out of memory allocating the workspace")
    assert not names_a_row("Stub process 'simple_sampler_0_1' is not healthy.")


def test_a_chosen_token_among_its_top_logprobs_takes_its_entrys_value():
    """sampling.chosen_as_listed: the kernels compute the two an ulp apart;
    a row left undecided (token -1) or padded (-1), or whose logprob was not
    asked (NaN), is left as it is."""
    from simple_sampler.sampling import SampleOutput, chosen_as_listed

    out = SampleOutput(np.array([-1, 5, 7, 4]), np.array([-0.3, -1.0, np.nan, -2.5], np.float32),
                       np.array([[-1, -1], [5, 2], [7, 1], [1, 2]], np.int32),
                       np.array([[-np.inf] * 2, [-0.9, -2.0], [-0.1, -3.0], [-0.2, -0.4]],
                                np.float32), np.zeros(4, np.int8))
    logprobs = chosen_as_listed(out).logprobs
    assert logprobs[0] == np.float32(-0.3) and logprobs[1] == np.float32(-0.9)
    assert np.isnan(logprobs[2]) and logprobs[3] == np.float32(-2.5)
