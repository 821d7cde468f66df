"""BatchState: the persistent columnar batch gives the rows the per-step
rebuild (SamplingBatch.from_params) gave, and the same tokens."""
import numpy as np
import pytest

from simple_sampler import SamplingParams
from simple_sampler.histories import checked_lists
from simple_sampler.params import History, SamplingBatch
from simple_sampler.row_arena import RowArena
from simple_sampler.row_reader import RowReader
from simple_sampler.sampling import sample
from simple_sampler.serving.batch_state import STOP_COLUMNS, BatchState

VOCAB = 50


def random_params(rng: np.random.Generator, seed: int) -> SamplingParams:
    penalties = rng.integers(0, 4)  # 0: none, 1: repetition, 2: presence, 3: frequency
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.7, 1.0])), top_k=int(rng.choice([0, 5])),
        top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0.0, 0.05])),
        repetition_penalty=1.3 if penalties == 1 else 1.0,
        presence_penalty=0.8 if penalties == 2 else 0.0,
        frequency_penalty=0.6 if penalties == 3 else 0.0,
        seed=seed, min_tokens=int(rng.integers(0, 4)),
        logit_bias={int(t): float(rng.normal()) for t in rng.choice(VOCAB, rng.integers(0, 3),
                                                                    replace=False)},
        stop_token_ids=[int(t) for t in rng.choice(VOCAB, rng.integers(0, 3), replace=False)])


def grown_state(rng, rows=12, steps=5, max_context=40, arena=None):
    """A state whose rows joined at different steps, and their Python histories."""
    state, params, histories, slots = BatchState(rows + 4, max_context, arena=arena), [], [], []
    for step in range(steps):
        for _ in range(rows // steps + 1):
            if len(slots) < rows:
                params.append(random_params(rng, seed=len(slots)))
                histories.append(History(rng.integers(0, VOCAB, rng.integers(1, 9)).tolist(), []))
                slots.append(state.add(params[-1], histories[-1].prompt_ids))
        tokens = rng.integers(0, VOCAB, len(slots))
        state.append(np.array(slots), tokens.astype(np.int32))
        for history, token in zip(histories, tokens.tolist()):
            history.output_ids.append(token)
    return state, np.array(slots), params, histories


def rows_of(offsets, ids):
    return [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def test_batch_matches_the_rebuild_row_for_row():
    rng = np.random.default_rng(0)
    state, slots, params, histories = grown_state(rng)
    order = rng.permutation(len(slots))  # a lane's rows in any slot order
    got = state.batch(slots[order])
    want = SamplingBatch.from_params([params[i] for i in order], [histories[i] for i in order],
                                     vocab_size=VOCAB)
    got.validate(VOCAB)
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "step"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for name in ("bias", "ban"):
        assert rows_of(getattr(got, f"{name}_offsets"), getattr(got, f"{name}_ids")) == \
            rows_of(getattr(want, f"{name}_offsets"), getattr(want, f"{name}_ids")), name
    np.testing.assert_array_equal(got.bias_values, want.bias_values)
    assert any(rows_of(got.ban_offsets, got.ban_ids)), "no row bans a stop id: a weak test"
    # histories only where a penalty reads them
    prompts, outputs = rows_of(got.prompt_offsets, got.prompt_ids), rows_of(got.output_offsets,
                                                                            got.output_ids)
    for row, i in enumerate(order):
        p = params[i]
        penalized = p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
        # the prompt as its distinct ids, ascending: which ids it holds is what the penalty reads
        assert prompts[row] == (sorted(set(histories[i].prompt_ids)) if p.repetition_penalty != 1
                                else [])
        assert outputs[row] == (histories[i].output_ids if penalized else [])


def test_ranges_are_gathered_and_checked_as_slices_would_be():
    """``_sampling.range_lists`` (``ranges_csr``, ``checked_lists``): the
    CSR of the slices, empty ranges and ranges ending at a row's end among
    them; the first range outside one row of [first, first + rows x
    row_len), or the first id outside [0, vocab) (negative ones too),
    named; nothing else refused."""
    from simple_sampler import _sampling

    rng = np.random.default_rng(5)
    rows_of, row_len, first = 6, 50, 100
    end = first + rows_of * row_len
    flat = rng.integers(0, 64, end + 20).astype(np.int32)  # ids past the region's rows too
    row = rng.integers(0, rows_of, 40)
    starts = first + row * row_len + rng.integers(0, row_len, 40)
    stops = np.minimum(starts + rng.integers(0, 30, 40), first + (row + 1) * row_len)
    stops[:3] = starts[:3]  # empty
    offsets, ids, bad_row, bad_id = _sampling.range_lists(flat, starts, stops, first, row_len,
                                                          rows_of, 64)
    assert (bad_row, bad_id) == (-1, -1) and ids.dtype == np.int32
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(stops - starts)]))
    np.testing.assert_array_equal(ids, np.concatenate([flat[a:b] for a, b in zip(starts, stops)]))
    int64 = np.iinfo(np.int64)
    for row_, start, stop in ((7, first - 1, first), (8, first + 45, first + 55),
                              (9, first + 10, first + 9), (10, end, end + 1),
                              (11, int64.min, first), (12, first, int64.max)):
        bad = starts.copy(), stops.copy()
        bad[0][row_], bad[1][row_] = start, stop
        assert _sampling.range_lists(flat, *bad, first, row_len, rows_of, 64)[2] == row_
    listed = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)])
    for token in (64, -1, -(2**31)):
        written = flat.copy()
        written[rng.choice(listed, 2)] = token
        _, got, bad_row, bad_id = _sampling.range_lists(written, starts, stops, first, row_len,
                                                        rows_of, 64)
        first_bad = np.flatnonzero((got < 0) | (got >= 64))[0]
        assert bad_row == -1 and bad_id == first_bad and got[bad_id] == token
    nothing = np.zeros(0, np.int64)
    assert _sampling.range_lists(np.zeros(0, np.int32), nothing, nothing, 0, 1, 0, 64)[2:] == (-1, -1)
    with pytest.raises(ValueError, match="is not within the 420 ids"):
        _sampling.range_lists(flat, starts, stops, first, row_len, 2**62, 64)


def test_same_tokens_as_the_rebuild():
    """Rows without penalties get no history: their draws must not change.
    A row's logprob comes where it asked for it (the state's want_logprobs),
    NaN elsewhere."""
    rng = np.random.default_rng(1)
    state, slots, params, histories = grown_state(rng, rows=64)
    asked = np.arange(len(slots)) % 3 == 0
    state.want_logprobs[slots] = asked
    logits = rng.normal(size=(len(slots), VOCAB)).astype(np.float32)
    got = sample(logits, state.batch(slots))
    want = sample(logits, SamplingBatch.from_params(params, histories, vocab_size=VOCAB))
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_allclose(got.logprobs[asked], want.logprobs[asked], rtol=1e-6)
    assert np.isnan(got.logprobs[~asked]).all()


def test_a_prompt_repeating_its_ids_is_sent_once_each_and_draws_the_same_tokens():
    """A long prompt holds its ids several times; the batch sends each once,
    ascending, and every row draws the token (and logprob) the full prompt
    gives (at these sizes the whole prompt takes the kernels' bitmap
    grouping, and the distinct ids their sort)."""
    rng = np.random.default_rng(3)
    vocab, rows = 3000, 6
    state, slots, params, histories = BatchState(rows, 4096), [], [], []
    for row in range(rows):
        prompt = rng.integers(0, 400, int(rng.integers(500, 3000))).tolist()  # ids repeat
        params.append(SamplingParams(repetition_penalty=1.3 if row % 3 else 1.0,
                                     presence_penalty=0.4 if row % 2 else 0.0, seed=row))
        histories.append(History(prompt, []))
        slots.append(state.add(params[-1], prompt, want_logprobs=True))
    slots = np.array(slots)
    batch = state.batch(slots)
    for row, prompt in enumerate(rows_of(batch.prompt_offsets, batch.prompt_ids)):
        expected = sorted(set(histories[row].prompt_ids)) if row % 3 else []
        assert prompt == expected and (not row % 3 or len(prompt) < len(histories[row].prompt_ids))
    logits = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    want = sample(logits, SamplingBatch.from_params(params, histories, vocab_size=vocab))
    got = sample(logits, batch)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)


@pytest.mark.parametrize("most_stop_ids", [1, 2, STOP_COLUMNS, STOP_COLUMNS + 1])
def test_a_steps_bans_in_numpy_are_the_per_row_passs(most_stop_ids):
    """Rows with at most STOP_COLUMNS stop ids (the end ids of a model, the
    usual request) get their bans from the columns; they are the per-row
    pass's bans, for rows short of min_tokens and not, beside a row with no
    stop id (and, with more, through the pass itself)."""
    from simple_sampler.serving.batch_state import _sparse_ragged

    rng = np.random.default_rng(2)
    state, slots = BatchState(24, 16), []
    for row in range(20):
        stops = rng.choice(VOCAB, rng.integers(0, most_stop_ids + 1), replace=False).tolist()
        slots.append(state.add(SamplingParams(seed=row, min_tokens=int(rng.integers(0, 4)),
                                              stop_token_ids=stops), [1, 2]))
    slots, banned = np.array(slots), 0
    for token in range(4):
        short = state.length[slots] - state.prompt_length[slots] < state.columns["min_tokens"][slots]
        got = state._ban_lists(slots, short)
        want = _sparse_ragged(len(slots), state._bans(slots, short))
        assert rows_of(*got) == rows_of(*want) and got[1].dtype == want[1].dtype == np.int32
        np.testing.assert_array_equal(state.batch(slots).ban_offsets, want[0])
        banned += want[1].size
        state.append(slots, np.full(len(slots), token, np.int32))
    assert banned, "no row banned a stop id: a weak test"


def legacy_bad_word_bans(history: list[int], words: list[list[int]]) -> list[int]:
    return [w[-1] for w in words if len(w) == 1 or history[len(history) - len(w) + 1:] == w[:-1]]


def test_bad_words_ban_the_last_token_after_the_others():
    state = BatchState(4, 20)
    words = [[7], [3, 4], [1, 2, 9], [5, 6, 7, 8, 9, 10, 11]]  # the last is longer than the history
    first = state.add(SamplingParams(seed=0), [1, 2], bad_words_ids=words)
    second = state.add(SamplingParams(seed=0, min_tokens=2, stop_token_ids=[0]), [3],
                       bad_words_ids=[[3, 8]])
    histories, seen = {first: [1, 2], second: [3]}, []
    for token in (3, 1, 2):
        batch = state.batch(np.array([first, second]))
        bans = rows_of(batch.ban_offsets, batch.ban_ids)
        step = len(histories[second]) - 1
        assert bans[0] == legacy_bad_word_bans(histories[first], words)
        seen.append(bans[0])
        assert bans[1] == ([0] if step < 2 else []) + legacy_bad_word_bans(histories[second],
                                                                         [[3, 8]])
        state.append(np.array([first, second]), np.array([token, token], np.int32))
        for slot in (first, second):
            histories[slot].append(token)
    assert seen == [[7, 9], [7, 4], [7]]  # histories ... 1, 2 / ... 2, 3 / ... 3, 1


def test_a_released_slot_forgets_its_sequence():
    state = BatchState(1, 10)
    slot = state.add(SamplingParams(seed=3, logit_bias={1: 2.0}, repetition_penalty=1.2), [4, 5],
                     want_logprobs=True, bad_words_ids=[[6]])
    state.append(np.array([slot]), np.array([8], np.int32))
    state.release(slot)
    again = state.add(SamplingParams(seed=4), [9])
    batch = state.batch(np.array([again]))
    assert again == slot and batch.step.tolist() == [0] and batch.seed.tolist() == [4]
    assert batch.bias_ids.size == batch.ban_ids.size == batch.prompt_ids.size == 0
    assert batch.want_logprobs.tolist() == [False]
    with pytest.raises(RuntimeError, match="no free slot"):
        state.add(SamplingParams(seed=0), [1])


def test_histories_end_at_max_context():
    state = BatchState(2, 3)
    slot = state.add(SamplingParams(seed=0), [1, 2])
    state.append(np.array([slot]), np.array([3], np.int32))
    with pytest.raises(ValueError, match="max_context=3"):
        state.append(np.array([slot]), np.array([4], np.int32))
    with pytest.raises(ValueError, match="prompt_ids must hold 1 to 3 tokens"):
        state.add(SamplingParams(seed=0), [1, 2, 3, 4])


def test_histories_named_in_the_arena_are_the_lists_gathered_without_it():
    """With the sampler pool's arena, a step names its penalized rows' ids in
    the shared histories (``history_ref``) instead of gathering them: read
    through the region's name, as a sampler instance reads them, they are
    the lists gathered without the arena, row for row (any slot order, any
    subset of rows), and the kernels draw the same tokens; a step with no
    penalized row names nothing."""
    arena = RowArena(1, 64)
    try:
        plain, slots, params, _ = grown_state(np.random.default_rng(3), rows=30)
        shared, _, _, _ = grown_state(np.random.default_rng(3), rows=30, arena=arena)
        order = np.random.default_rng(4).permutation(len(slots))
        want, got = plain.batch(slots[order]), shared.batch(slots[order])
        assert got.history_ref is not None and not got.prompt_ids.size and not got.output_ids.size
        lists = checked_lists(got.history_ref.refs, RowReader().histories, VOCAB, len(order))
        listed = (want.prompt_offsets, want.prompt_ids, want.output_offsets, want.output_ids)
        assert listed[1].size and listed[3].size
        for wanted, read in zip(listed, lists):
            np.testing.assert_array_equal(read, wanted)
        picked = [7, 0, 3, 3]
        taken, want_taken = got.take(picked).with_histories(), want.take(picked)
        for name in ("prompt_offsets", "prompt_ids", "output_offsets", "output_ids"):
            np.testing.assert_array_equal(getattr(taken, name), getattr(want_taken, name))
        logits = np.random.default_rng(5).standard_normal((len(order), VOCAB)).astype(np.float32)
        np.testing.assert_array_equal(sample(logits, got).token_ids, sample(logits, want).token_ids)
        unpenalized = [slot for slot, p in zip(slots, params) if p.repetition_penalty == 1.0
                       and not p.presence_penalty and not p.frequency_penalty]
        assert unpenalized and shared.batch(np.array(unpenalized)).history_ref is None
    finally:
        arena.close()


def test_histories_stay_in_the_process_where_the_arena_has_no_room(caplog):
    """A /dev/shm without room for the histories (the reservation refused) is
    a warning: the state keeps them itself and its batches carry the lists."""
    class FullArena:
        def histories(self, slots, max_context):
            raise OSError(28, "No space left on device")

    state = BatchState(2, 8, arena=FullArena())
    state.add(SamplingParams(seed=1, presence_penalty=0.5), [3, 4])
    state.append(np.array([0]), np.array([5], np.int32))
    batch = state.batch(np.array([0]))
    assert batch.history_ref is None and batch.output_ids.tolist() == [5]
    assert "token histories stay in this process" in caplog.text
