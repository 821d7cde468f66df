"""Structured outputs (serving/structured.py): guides refused by name, the
grammar's mask applied exactly, the masked rows sampled from the float64
reference's distribution, and the decode loop's guided requests held to
their grammars on every sampling path, their neighbours untouched."""
import asyncio
import json
import re
import time

import numpy as np
import pytest
import torch

from conftest import P_VALUE_FLOOR, draw_counts, goodness_of_fit, repeated_batch, total_variation
from simple_sampler import reference
from simple_sampler.params import SamplingParams
from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.decoder import Decoder
from simple_sampler.serving.generation import GenerationRequest
from simple_sampler.serving.inline import sample_torch
from simple_sampler.serving.samplers import kernel_sample, threaded
from simple_sampler.serving.structured import Grammars, Guide, StepMasks, bitmask_of, unpacked
from simple_sampler.serving.text import TextCodec, load_tokenizer


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's; the tests that take it need llguidance (the GPU host's
    offline bundle has none: the CUDA test below does not)."""
    pytest.importorskip("llguidance")
    return load_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize("guide, named", [
    (Guide("yaml", "a: 1"), "guided_decoding_guide_type must be one of json, json_schema"),
    (Guide("json", "{}"), "guided_decoding_guide must hold nothing (empty)"),
    (Guide("regex"), "guided_decoding_guide must hold a regular expression"),
    (Guide("regex", "(ab"), "guided_decoding_guide is not a regular expression"),
    (Guide("json_schema", "{not json"), "guided_decoding_guide is not a JSON schema"),
    (Guide("choice", '"red"'), "guided_decoding_guide is not a JSON list of strings"),
    (Guide("ebnf_grammar", "root ::= item"), "guided_decoding_guide is not an EBNF"),
])
def test_a_bad_guide_is_refused_naming_the_input(grammars, tokenizer, guide, named):
    with pytest.raises(InvalidRequest, match=re.escape(named)):
        grammars.matcher(guide, [tokenizer.eos_token_id])


def test_without_llguidance_a_guided_request_is_refused_with_the_reason(tokenizer, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llguidance.hf", None)
    with pytest.raises(InvalidRequest, match="the llguidance package is not installed"):
        Grammars(tokenizer, len(tokenizer), [2]).matcher(Guide("json"), [2])


def test_a_guide_precompiled_is_not_compiled_again_and_a_bad_one_waits_for_the_loop(
        tokenizer, monkeypatch):
    """``precompile`` (a worker thread's, LlmService) fills the cache the
    decode loop's ``matcher`` reads; a guide that does not compile raises
    nothing there, and is refused by ``matcher`` as any request is."""
    grammars = Grammars(tokenizer, len(tokenizer), [2])
    compiles = []
    grammar = Guide.grammar
    monkeypatch.setattr(Guide, "grammar", lambda self: compiles.append(self) or grammar(self))
    guide = Guide("regex", "[ab]{3}")
    grammars.precompile(guide)
    grammars.matcher(guide, [2])
    grammars.matcher(guide, [2])
    assert compiles == [guide]
    grammars.precompile(Guide("regex", "(ab"))
    with pytest.raises(InvalidRequest, match="not a regular expression"):
        grammars.matcher(Guide("regex", "(ab"), [2])


@pytest.mark.parametrize("end_ids", [[], [7]])
def test_a_guided_request_needs_model_end_ids_that_end_it(grammars, end_ids):
    with pytest.raises(InvalidRequest, match="ignore_eos, end_id -1 and another end_id cannot"):
        grammars.matcher(Guide("regex", "a+"), end_ids)


def test_the_applied_mask_is_the_grammars_and_the_engines_rows_stay(grammars, tokenizer):
    """A step of three rows, the first and last guided: exactly the tokens
    llguidance's own numpy helper rules out are -inf, in a copy; the middle
    row and the engine's tensor are as they were (bfloat16 and float16 too)."""
    llguidance_numpy = pytest.importorskip("llguidance.numpy")
    regex, json_object = (grammars.matcher(Guide("regex", r"[0-9]{2}-x"), [2]),
                          grammars.matcher(Guide("json"), [2]))
    masks = grammars.masks([regex, None, json_object], [None] * 3)
    assert masks.rows.tolist() == [0, 2]
    vocab = len(tokenizer)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
        before = logits.clone()
        masked = masks.applied(logits)
        assert torch.equal(logits, before) and torch.equal(masked[1], logits[1])
        for index, row in enumerate((0, 2)):
            expected = logits[row].float().numpy().copy()
            llguidance_numpy.apply_token_bitmask_inplace(expected, masks.bitmask[index])
            assert np.array_equal(masked[row].float().numpy(), expected)
    digits = {tokenizer.decode([t]) for t in np.flatnonzero(masks.allowed()[0])}
    # a GPU's way (the bitmask unpacked on the device), run here on the CPU's tensors
    assert torch.equal(unpacked(torch.from_numpy(masks.bitmask), vocab), masks.allowed_on("cpu"))
    assert digits and all(re.fullmatch(r"[0-9]{1,2}(-x?)?", text) for text in digits), digits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_host_rows_mask_kernel_copies_allowed_bits_exactly(dtype):
    """_sampling.masked_rows against numpy: a vocabulary that ends inside a
    word, rows strided in a wider bank, words all set, all clear and mixed,
    any row order: allowed tokens' bits copied as they are (NaN and inf
    too), the others -inf, unguided rows whole; bad shapes refused by name."""
    from simple_sampler import _sampling
    from simple_sampler.sampling import kernel_rows

    rng = np.random.default_rng(7)
    vocab, size = 1000, 6
    bank = torch.from_numpy(rng.standard_normal((size, vocab + 24)).astype(np.float32)).to(dtype)
    bank[1, 5], bank[4, 6] = float("nan"), float("inf")
    logits = bank[:, :vocab]  # rows strided: a view of a wider bank
    guided = np.array([4, 1, 3], np.int64)
    words = (vocab + 31) // 32
    bitmask = rng.integers(-2**31, 2**31, (3, words), dtype=np.int64).astype(np.int32)
    bitmask[0, :5], bitmask[1, 5:9] = -1, 0
    masks = StepMasks(guided, bitmask, vocab)
    masked = masks.applied(logits)
    allowed = masks.allowed()
    expected = logits.clone()
    for index, row in enumerate(guided):
        expected[row][torch.from_numpy(~allowed[index])] = float("-inf")
    as_bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    assert torch.equal(masked.view(as_bits), expected.view(as_bits))
    rows, code = kernel_rows(logits)
    with pytest.raises(ValueError, match="guided must be distinct rows in"):
        _sampling.masked_rows(rows, code, np.array([1, 1], np.int64), bitmask[:2],
                              np.empty_like(rows))
    with pytest.raises(ValueError, match="bitmask must be"):
        _sampling.masked_rows(rows, code, guided, bitmask[:, 1:].copy(), np.empty_like(rows))


def test_spare_rows_are_kept_for_later_steps_of_their_width_and_dtype():
    """A guided step's masked-rows buffer comes back for a later step of at
    most its rows, its V and dtype; the last two given back are kept."""
    from simple_sampler.serving.data_plane import SpareRows

    spares = SpareRows()
    first = spares.take(torch.zeros(8, 100))
    assert first.shape == (8, 100) and spares.take(torch.zeros(8, 100)) is not first
    spares.give_back(first)
    assert spares.take(torch.zeros(9, 100)) is not first  # too few rows
    assert spares.take(torch.zeros(4, 100, dtype=torch.bfloat16)) is not first
    assert spares.take(torch.zeros(4, 100)) is first
    buffers = [spares.take(torch.zeros(2, 100)) for _ in range(3)]
    for buffer in buffers:
        spares.give_back(buffer)
    assert [id(b) for b in spares.buffers] == [id(b) for b in buffers[1:]]
    with pytest.raises(ValueError, match="kept must be at least 1"):
        SpareRows(kept=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_steps_rows_masked_on_cuda_are_the_cpus():
    """On a GPU the bitmask is unpacked on the device (``unpacked``): the
    masked rows are the host's, bit for bit (bfloat16, V not a multiple of 32)."""
    vocab = 1000
    rng = np.random.default_rng(5)
    bitmask = rng.integers(-2**31, 2**31, (2, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    masks = StepMasks(np.array([0, 2]), bitmask, vocab)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(masks.applied(logits.cuda()).cpu(), masks.applied(logits))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=20, min_p=0.02),
], ids=["t1", "t-p", "t-k-minp"])
@pytest.mark.parametrize("sampler", ["kernels", "torch"])
def test_a_masked_row_is_sampled_from_the_reference_over_the_allowed_tokens(params, sampler):
    """A row masked by a bitmask (allowed tokens scattered over words, a
    whole word ruled out, bits past V) draws each allowed token with the
    float64 reference's probability of the unmasked row renormalized over
    the allowed ones, and never a ruled-out token."""
    vocab, draws = 1000, 60_000
    rng = np.random.default_rng(7)
    row = rng.normal(0, 2, vocab).astype(np.float32)
    allowed = rng.random(vocab) < 0.3
    allowed[64:96] = False
    allowed[int(np.argmax(np.where(allowed, row, -np.inf)))] = True
    bits = np.zeros(32 * ((vocab + 31) // 32), np.uint8)
    bits[:vocab] = allowed
    bitmask = np.packbits(bits.reshape(1, -1), axis=1, bitorder="little").view(np.int32)
    masked = StepMasks(np.array([0]), bitmask, vocab).applied(torch.from_numpy(row[None]))[0]
    if sampler == "kernels":
        counts, batch = draw_counts(masked.numpy(), params, draws)
    else:  # one batched pass over copies of the row
        batch = repeated_batch(params, draws // 3)
        tokens = sample_torch(masked.expand(draws // 3, vocab).contiguous(), batch)[0]
        counts = np.bincount(np.asarray(tokens), minlength=vocab)
    probs = reference.probabilities(np.where(allowed, row, -np.inf).astype(np.float32), batch, 0)
    assert counts[~allowed].sum() == 0
    p_value = goodness_of_fit(counts, probs)
    assert p_value > P_VALUE_FLOOR, f"p={p_value:.2e}, TV={total_variation(counts, probs):.4f}"


class RandomRowsEngine:
    """Seeded random logits over SmolLM2's vocabulary (each sequence's row
    a function of its length and last token): no model, the tokenizer's
    ids."""

    label = "RandomRowsEngine"

    def __init__(self, vocab, max_batch_size=4, max_context=256):
        self.vocab_size, self.max_batch_size, self.max_context = vocab, max_batch_size, max_context
        self.ids = {}

    def add(self, seq_id, prompt_ids, max_tokens=None):
        self.ids[seq_id] = list(prompt_ids)

    def step(self, seq_ids):
        rows = [torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(
            len(self.ids[s]) * 100_003 + self.ids[s][-1])) * 3 for s in seq_ids]
        return torch.stack(rows)

    def append(self, seq_ids, token_ids):
        for seq_id, token in zip(seq_ids, token_ids):
            self.ids[seq_id].append(token)

    def release(self, seq_id):
        del self.ids[seq_id]

    def length(self, seq_id):
        return len(self.ids[seq_id])


async def collect(handle):
    return [event async for event in handle]


def run(tokenizer, requests, mode="simple", micro_batches=1, launch_ahead="off", end_ids=()):
    """Events per request of `requests` decoded together; `mode` "hot-first":
    the llm model's hot-first sampler in-process, over a hot set of every
    third id (``bench.serve_sim.measuring.hot_first_sampler``)."""
    async def main():
        engine = RandomRowsEngine(len(tokenizer))
        sampler = None
        if mode == "simple":
            sampler = threaded(kernel_sample)
        elif mode == "hot-first":
            from simple_sampler.bench.serve_sim.measuring import hot_first_sampler
            from simple_sampler.shvs.hot_vocab import HotVocab

            vocab = engine.vocab_size
            sampler = hot_first_sampler(engine, HotVocab(np.arange(0, vocab, 3), vocab), 2)
        decoder = Decoder(engine, TextCodec(tokenizer, end_ids), mode="simple" if sampler else mode,
                          sampler=sampler, micro_batches=micro_batches,
                          launch_ahead=launch_ahead)
        await decoder.start()
        handles = [decoder.submit(request) for request in requests]
        results = await asyncio.gather(*(collect(handle) for handle in handles))
        await decoder.close()
        return results
    return asyncio.run(main())


GUIDES = [Guide("json_schema", json.dumps(SCHEMA)),
          Guide("regex", r"[0-9]{3}-[a-z]{2}"), Guide("choice", '["yes", "no", "maybe"]'),
          Guide("ebnf_grammar", 'root ::= "(" [ab]+ ")"')]


def held_to(guide, text):
    """Whether `text` is a whole output of `guide`."""
    if guide.type == "json_schema":
        value = json.loads(text)
        return set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue") \
            and isinstance(value["ok"], bool)
    pattern = {"regex": r"[0-9]{3}-[a-z]{2}", "choice": "yes|no|maybe",
               "ebnf_grammar": r"\([ab]+\)"}[guide.type]
    return re.fullmatch(pattern, text) is not None


@pytest.mark.parametrize("mode, micro_batches, launch_ahead", [
    ("simple", 1, "off"), ("simple", 2, "on"), ("hot-first", 1, "on"), ("inline", 1, "off"),
    ("inline_kernels", 1, "on")])
def test_guided_requests_follow_their_grammar_and_their_neighbours_are_untouched(
        tokenizer, mode, micro_batches, launch_ahead):
    """Random rows over SmolLM2's vocabulary (the sampler's hardest case for
    a grammar: nothing in the model leads it): each guided request's text is
    a whole output of its grammar, ended by the end id; an unguided seeded
    request beside them draws the tokens it draws alone."""
    def request(guide, seed):
        return GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=160, guide=guide,
                                 sampling=SamplingParams(temperature=0.6, seed=seed))
    plain = GenerationRequest(prompt_ids=[5, 6], max_tokens=12,
                              sampling=SamplingParams(temperature=1.0, seed=99))
    results = run(tokenizer, [request(g, i) for i, g in enumerate(GUIDES)] + [plain], mode,
                  micro_batches, launch_ahead)
    for guide, events in zip(GUIDES, results):
        text = "".join(e.text for e in events)
        assert events[-1].error is None and events[-1].finish_reason == "stop", events[-1]
        assert held_to(guide, text), (guide, text)
    alone = run(tokenizer, [plain], mode)[0]
    assert [t for e in results[-1] for t in e.token_ids] == [t for e in alone for t in e.token_ids]


def test_a_steps_masks_are_filled_while_its_forward_runs(tokenizer, monkeypatch):
    """Each guided step's forward begins before its masks are filled (the
    data-plane thread waits for them only to apply them), and the request
    is still held to its grammar."""
    order = []
    fill, forward = Grammars.masks, RandomRowsEngine.step

    def slow_fill(self, matchers, allowed):
        time.sleep(0.05)
        order.append("masks")
        return fill(self, matchers, allowed)

    def recorded_forward(self, seq_ids):
        order.append("forward")
        return forward(self, seq_ids)

    monkeypatch.setattr(Grammars, "masks", slow_fill)
    monkeypatch.setattr(RandomRowsEngine, "step", recorded_forward)
    guide = GUIDES[1]
    events = run(tokenizer, [GenerationRequest(prompt_ids=[1, 2], max_tokens=40, guide=guide,
                                               sampling=SamplingParams(seed=5))])[0]
    assert held_to(guide, "".join(e.text for e in events)), events
    assert len(order) >= 4 and order == ["forward", "masks"] * (len(order) // 2), order


def test_masks_that_fail_fail_their_step_and_the_decoder_goes_on(tokenizer, monkeypatch):
    """A failure filling a step's masks (raised on the loop's thread while
    the forward runs) ends that step's requests with the error; the data-plane
    thread is not left waiting, and the next request is served."""
    fill = Grammars.masks
    failing = {"left": 1}

    def failing_fill(self, matchers, allowed):
        if failing["left"]:
            failing["left"] -= 1
            raise RuntimeError("the mask fill broke")
        return fill(self, matchers, allowed)

    monkeypatch.setattr(Grammars, "masks", failing_fill)

    async def main():
        decoder = Decoder(RandomRowsEngine(len(tokenizer)), TextCodec(tokenizer),
                          sampler=threaded(kernel_sample))
        await decoder.start()
        guided = GenerationRequest(prompt_ids=[1, 2], max_tokens=40, guide=GUIDES[1],
                                   sampling=SamplingParams(seed=5))
        broken = await collect(decoder.submit(guided))
        served = await asyncio.wait_for(collect(decoder.submit(guided)), 60)
        await decoder.close()
        return broken, served

    broken, served = asyncio.run(main())
    assert broken[-1].error == "RuntimeError: the mask fill broke", broken[-1]
    assert served[-1].error is None and held_to(GUIDES[1], "".join(e.text for e in served))


def test_a_guided_steps_masked_rows_go_into_the_samplers_arena(tokenizer):
    """With a sampler that reads rows in place from a row arena (the sampler
    pool), a guided step's masked rows are written into a slot taken there:
    the sampler claims them where they lie (no copy on the way to its
    instances); once the guided request is done, its neighbour's rows are
    the engine's own. The arena's region is gone after."""
    from simple_sampler.row_arena import RowArena
    from simple_sampler.sampling import logits_array

    arena = RowArena(2, 2 * len(tokenizer) * 4)
    in_slot = []
    sample = threaded(kernel_sample)

    class ArenaSampler:
        def __init__(self):
            self.arena = arena

        async def __call__(self, logits, batch):
            lease = arena.reference(logits_array(logits))
            in_slot.append(lease is not None and lease.slot >= 0)
            try:
                return await sample(logits, batch)
            finally:
                if lease is not None:
                    lease.release()

    async def main():
        decoder = Decoder(RandomRowsEngine(len(tokenizer)), TextCodec(tokenizer),
                          sampler=ArenaSampler(), micro_batches=1)
        await decoder.start()
        guided = decoder.submit(GenerationRequest(prompt_ids=[1, 2], max_tokens=40,
                                                  guide=GUIDES[1],
                                                  sampling=SamplingParams(seed=5)))
        plain = decoder.submit(GenerationRequest(prompt_ids=[3], max_tokens=30,
                                                 sampling=SamplingParams(seed=6)))
        results = await asyncio.gather(collect(guided), collect(plain))
        await decoder.close()
        return results

    try:
        guided, plain = asyncio.run(main())
    finally:
        arena.close()
    steps = sum(len(e.token_ids) for e in guided)  # its end id's step too
    assert held_to(GUIDES[1], "".join(e.text for e in guided)) and plain[-1].error is None
    assert in_slot[:steps] == [True] * steps and not any(in_slot[steps:]), (steps, in_slot)


@pytest.mark.parametrize("mode", ["simple", "inline"])
def test_a_grammar_complete_before_min_tokens_ends_its_request_naming_why(tokenizer, mode):
    """Two digits asked, five tokens at least: once the grammar is complete
    only the end id may follow and min_tokens bans it; the request ends with
    its digits and an error naming both fields; its neighbour is served."""
    stuck = GenerationRequest(prompt_ids=[1, 2], max_tokens=16, guide=Guide("regex", "[0-9]{2}"),
                              sampling=SamplingParams(min_tokens=5, seed=1))
    plain = GenerationRequest(prompt_ids=[5], max_tokens=6, sampling=SamplingParams(seed=2))
    stuck_events, plain_events = run(tokenizer, [stuck, plain], mode)
    assert re.fullmatch("[0-9]{2}", "".join(e.text for e in stuck_events)), stuck_events
    assert stuck_events[-1].error.startswith(
        "guided_decoding_guide's output is complete, so only an end id may follow, and none "
        "can be taken here (min_tokens, bad_words, logit_bias or allowed_token_ids ban them, "
        "or the model's logits do): "), stuck_events[-1]
    assert "every token is banned" in stuck_events[-1].error  # the sampler's own reason
    assert plain_events[-1].error is None and plain_events[-1].num_output_tokens == 6


def test_allowed_token_ids_alone_and_with_a_grammar_mask_the_rows_to_them(grammars):
    """vLLM's allowed_token_ids: a row's mask is exactly those ids; with a
    grammar, the ids both allow; a row with neither is not masked."""
    vocab = grammars.vocab_size
    digits = grammars.matcher(Guide("regex", "[0-9]+"), [2])
    first = grammars.masks([digits], [None]).allowed()[0]
    ids = [5, 31, 32, 33, vocab - 1, *np.flatnonzero(first)[:3].tolist()]
    masks = grammars.masks([None, None, digits], [bitmask_of(ids, vocab), None,
                                                  bitmask_of(ids, vocab)])
    assert masks.rows.tolist() == [0, 2]
    assert np.flatnonzero(masks.allowed()[0]).tolist() == sorted(set(ids))
    assert np.flatnonzero(masks.allowed()[1]).tolist() == np.flatnonzero(first)[:3].tolist()


@pytest.mark.parametrize("mode", ["simple", "hot-first", "inline"])
def test_a_request_with_allowed_token_ids_generates_only_those(tokenizer, mode):
    """On random rows over SmolLM2's vocabulary, alone and with a grammar:
    every token generated is one of allowed_token_ids (the end id among
    them ends the guided one); bad input refused by name."""
    allowed = [int(t) for t in tokenizer(" yes no maybe 0 1 2")["input_ids"]]
    plain = GenerationRequest(prompt_ids=[1, 2], max_tokens=24, allowed_token_ids=allowed,
                              sampling=SamplingParams(temperature=1.0, seed=3))
    guided = GenerationRequest(prompt_ids=[1, 2], max_tokens=24,
                               allowed_token_ids=[*allowed, tokenizer.eos_token_id],
                               guide=Guide("regex", "[0-9]+"),
                               sampling=SamplingParams(temperature=1.0, seed=4))
    results = run(tokenizer, [plain, guided], mode)
    for request, events in zip((plain, guided), results):
        ids = [t for e in events for t in e.token_ids]
        assert ids and set(ids) <= set(request.allowed_token_ids), ids
        assert events[-1].error is None
    assert re.fullmatch("[0-2]+", "".join(e.text for e in results[1])), results[1]
    assert len([t for e in results[0] for t in e.token_ids]) == 24  # no end id: its length


@pytest.mark.parametrize("allowed, named", [([], "non-empty list of token ids"),
                                            ([49152], "token ids in [0, 49152)")])
def test_bad_allowed_token_ids_are_refused_by_name(tokenizer, allowed, named):
    with pytest.raises(InvalidRequest, match=re.escape(named)):
        GenerationRequest(prompt_ids=[1], allowed_token_ids=allowed).validate(49152)


@pytest.mark.parametrize("sampling", [SamplingParams(min_tokens=3),
                                      SamplingParams(logit_bias={2: float("-inf")})],
                         ids=["min_tokens", "logit_bias"])
def test_allowed_token_ids_all_banned_at_the_first_step_are_refused(tokenizer, sampling):
    async def main():
        decoder = Decoder(RandomRowsEngine(len(tokenizer)), TextCodec(tokenizer),
                          sampler=threaded(kernel_sample))
        with pytest.raises(InvalidRequest, match="allowed_token_ids leaves no token"):
            decoder.submit(GenerationRequest(prompt_ids=[1], allowed_token_ids=[2],
                                             sampling=sampling))
    asyncio.run(main())


@pytest.mark.parametrize("mode", ["simple", "hot-first", "inline", "inline_kernels"])
def test_a_grammar_and_allowed_ids_that_share_no_token_end_the_request_alone(tokenizer, mode):
    """Digits asked of a row allowed only letters: every token banned. The
    request ends with the samplers' refusal on every path (the in-line
    torch sampler refuses it too, where it once drew token 0), and its
    neighbour is served."""
    letters = [int(t) for t in tokenizer(" a b c")["input_ids"]]
    stuck = GenerationRequest(prompt_ids=[1, 2], max_tokens=8, allowed_token_ids=letters,
                              guide=Guide("regex", "[0-9]+"),
                              sampling=SamplingParams(temperature=1.0, seed=1))
    plain = GenerationRequest(prompt_ids=[5], max_tokens=6,
                              sampling=SamplingParams(temperature=1.0, seed=2))
    stuck_events, plain_events = run(tokenizer, [stuck, plain], mode)
    assert "every token is banned" in (stuck_events[-1].error or ""), stuck_events[-1]
    assert plain_events[-1].error is None and plain_events[-1].num_output_tokens == 6


def test_a_guided_request_ends_at_its_own_end_id_the_models_others_banned(tokenizer):
    """A model of two end ids (2 and 1): a guided request that names one
    ends there, the other never drawn (the grammar, once complete, allows
    both); without end_id, either ends it."""
    def request(end_id, seed):
        return GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=40, end_id=end_id,
                                 guide=Guide("choice", '["yes", "no"]'),
                                 sampling=SamplingParams(temperature=1.0, seed=seed))
    results = run(tokenizer, [request(end_id, seed) for end_id in (1, 2, None)
                              for seed in range(4)], end_ids=(2, 1))
    for index, events in enumerate(results):
        end_id = (1, 2, None)[index // 4]
        ids = [t for e in events for t in e.token_ids]
        assert events[-1].finish_reason == "stop" and ids[-1] in ((1, 2) if end_id is None
                                                                  else (end_id,)), events[-1]
        assert "".join(e.text for e in events) in ("yes", "no")


def test_a_guided_request_with_ignore_eos_is_refused_at_submission(tokenizer):
    async def main():
        decoder = Decoder(RandomRowsEngine(len(tokenizer)), TextCodec(tokenizer),
                          sampler=threaded(kernel_sample))
        with pytest.raises(InvalidRequest, match="ignore_eos, end_id -1 and another end_id"):
            decoder.submit(GenerationRequest(prompt_ids=[1], guide=Guide("json"),
                                             ignore_end=True))
        assert decoder.num_queued == 0
    asyncio.run(main())


@pytest.mark.parametrize("guide", [Guide("json"), Guide("json_schema", json.dumps(SCHEMA))])
def test_smollm2_answers_in_json_when_guided_and_in_prose_when_not(tokenizer, guide):
    """The real model, greedy, asked for a JSON object: held to any JSON
    object (or the schema), its answer parses (and fits); the same request
    unguided answers otherwise (the mask, not the prompt, made it)."""
    from simple_sampler.models import load_model
    from simple_sampler.serving.torch_engine import TorchEngine

    model, _ = load_model()

    async def main(request):
        decoder = Decoder(TorchEngine(model, max_batch_size=2, max_context=256),
                          TextCodec(tokenizer), sampler=threaded(kernel_sample))
        await decoder.start()
        events = await collect(decoder.submit(request))
        await decoder.close()
        return "".join(e.text for e in events), events[-1]
    ask = dict(text="Give me a JSON object describing the sky's color.", chat=True, max_tokens=60,
               sampling=SamplingParams(temperature=0.0))
    text, last = asyncio.run(main(GenerationRequest(**ask, guide=guide)))
    assert last.finish_reason == "stop" and last.error is None, last
    value = json.loads(text)
    assert isinstance(value, dict) and (guide.type == "json" or held_to(guide, text)), text
    prose, _ = asyncio.run(main(GenerationRequest(**ask)))
    assert prose != text


# How a guide arrives: TensorRT-LLM's inputs, vLLM's structured_outputs.

def decoded_guide(**inputs):
    from simple_sampler.triton.generate_io import decode_generate

    arrays = {name: np.array([[value.encode() if isinstance(value, str) else value]], object)
              for name, value in inputs.items()}
    return decode_generate({"text_input": np.array([[b"hi"]], object), **arrays}).request.guide


def test_allowed_token_ids_come_as_the_input_and_as_vllms_parameter():
    from simple_sampler.triton.generate_io import decode_generate
    from simple_sampler.triton.vllm_params import vllm_inputs

    text = {"text_input": np.array([[b"hi"]], object)}
    request = decode_generate({**text, "allowed_token_ids": np.array([[3, 9]], np.int32)}).request
    assert request.allowed_token_ids == [3, 9]
    assert decode_generate(text).request.allowed_token_ids is None
    inputs, _ = vllm_inputs(np.array([b'{"allowed_token_ids": [3, 9]}'], object), None)
    assert inputs["allowed_token_ids"].tolist() == [[3, 9]]


def test_tensorrt_llms_two_inputs_make_the_guide_and_a_guide_alone_is_refused():
    assert decoded_guide() is None
    assert decoded_guide(guided_decoding_guide_type="json") == Guide("json")
    assert decoded_guide(guided_decoding_guide_type="regex",
                         guided_decoding_guide=r"\d+") == Guide("regex", r"\d+")
    with pytest.raises(InvalidRequest, match="guided_decoding_guide needs "
                                             "guided_decoding_guide_type"):
        decoded_guide(guided_decoding_guide=r"\d+")


@pytest.mark.parametrize("fields, guide", [
    ({"json": SCHEMA}, Guide("json_schema", json.dumps(SCHEMA))),
    ({"json": json.dumps(SCHEMA), "disable_fallback": False, "whitespace_pattern": None},
     Guide("json_schema", json.dumps(SCHEMA))),
    ({"regex": "[ab]+"}, Guide("regex", "[ab]+")),
    ({"choice": ["yes", "no"]}, Guide("choice", '["yes", "no"]')),
    ({"grammar": 'root ::= "a"'}, Guide("ebnf_grammar", 'root ::= "a"')),
    ({"json_object": True}, Guide("json")),
    ({"json_object": True, "disable_any_whitespace": True},
     Guide("json_schema", '{"type": "object", "x-guidance": {"whitespace_flexible": false}}')),
    # as Triton's vLLM backend takes it: the object's JSON text, a backend named
    (json.dumps({"regex": "[ab]+", "backend": "xgrammar"}), Guide("regex", "[ab]+")),
])
@pytest.mark.parametrize("name", ["structured_outputs", "guided_decoding"])
def test_vllms_structured_outputs_become_the_two_inputs(fields, guide, name):
    from simple_sampler.triton.vllm_params import vllm_inputs

    payload = np.array([json.dumps({name: fields}).encode()], object)
    inputs, places = vllm_inputs(payload, None)
    assert places["guided_decoding_guide_type"] == f"sampling_parameters.{name}"
    assert Guide(inputs["guided_decoding_guide_type"][0, 0],
                 inputs.get("guided_decoding_guide", [[""]])[0][0]) == guide


@pytest.mark.parametrize("fields, named", [
    ({"regex": "a", "choice": ["b"]}, "must name exactly one of json, regex"),
    ({}, "must name exactly one of"),
    ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern is not "
                                                "supported"),
    ({"regex": "a", "disable_any_whitespace": True}, "applies to a JSON schema"),
    ({"json": "{oops"}, "structured_outputs.json is not JSON"),
    ({"regex": 5}, "structured_outputs.regex must be a string"),
    ({"json": 0, "regex": "a"}, "must name exactly one of"),
    ({"json_object": 1}, "structured_outputs.json_object must be true"),
    ({"regex": "a", "backend": "outlines"}, "structured_outputs.backend must be one of auto"),
    ({"json": {"x-guidance": 3}, "disable_any_whitespace": True}, "is an object"),
    ({"json": {"type": "object"}, "disable_any_whitespace": "false"},
     "structured_outputs.disable_any_whitespace must be true or false, got 'false'"),
    ({"json": {"type": "object"}, "disable_any_whitespace": 0},
     "structured_outputs.disable_any_whitespace must be true or false, got 0"),
    ("{oops", "structured_outputs is not JSON"),
])
def test_a_structured_outputs_object_that_asks_what_is_not_done_is_refused_by_name(fields,
                                                                                     named):
    with pytest.raises(InvalidRequest, match=re.escape(named)):
        Guide.of_vllm(fields, "structured_outputs")


def test_bench_guided_takes_its_options_over_quicks_sizes(monkeypatch):
    """`bench guided --quick --loop-batches` (none): --quick's sizes with
    the option given over them, not both passed twice."""
    import argparse

    from simple_sampler.bench import guided
    from simple_sampler.bench.guided import measuring

    seen = {}
    monkeypatch.setattr(measuring, "run", lambda **sizes: seen.update(sizes) or {})
    guided.measure(argparse.Namespace(quick=True, batches=None, steps=None, repeats=None,
                                      loop_batches=[]))
    assert seen == {**guided.QUICK, "loop_batches": []}


def test_a_guide_checked_for_a_field_names_that_field_alone():
    """``Guide.check(place)`` (the doors' check of what a client sent)
    names the client's field, and not the llm model's tensor beside it."""
    with pytest.raises(InvalidRequest) as refused:
        Guide("regex").check("guided_regex")
    assert str(refused.value) == "guided_regex must hold a regular expression (Rust regex syntax)"
    with pytest.raises(InvalidRequest, match=r"^tools \(a tool's parameters\) is not a JSON schema"):
        Guide("json_schema", '{"type": "nonsense"}').check("tools (a tool's parameters)")
