"""The PyTorch engine against the plain Hugging Face forward (full recompute,
no cache), with sequences joining and leaving and steps over subsets."""
import dataclasses

import numpy as np
import pytest
import torch

from simple_sampler.models import load_model
from simple_sampler.serving.torch_engine import TorchEngine

TOLERANCE = 1e-3  # max abs logit difference, float32


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_logits_match_full_recompute_as_sequences_join_and_leave(model_and_tokenizer,
                                                                 batch_invariant):
    model, tokenizer = model_and_tokenizer
    engine = TorchEngine(model, max_batch_size=3, max_context=64, batch_invariant=batch_invariant)
    texts = {"a": "The capital of France is", "b": "Once upon a time, in a small village,",
             "c": "def fibonacci(n):", "d": "1, 2, 3,"}
    tokens = {key: tokenizer(text)["input_ids"] for key, text in texts.items()}
    # Each entry: sequences to add, sequences to release, then the step's subset.
    schedule = [(["a", "b"], [], ["a", "b"]),
                ([], [], ["b"]),          # a subset: a waits
                (["c"], [], ["c", "a"]),  # c prefills while a decodes
                ([], ["b"], ["a", "c"]),
                (["d"], [], ["d"]),       # d reuses b's slot: a and c are not neighbours
                ([], [], ["c", "a", "d"]),
                ([], ["a"], ["d", "c"])]
    worst = 0.0
    for joining, leaving, subset in schedule:
        for key in joining:
            engine.add(key, tokens[key])
        for key in leaving:
            engine.release(key)
        logits = engine.step(subset)
        assert logits.dtype == torch.float32 and logits.shape == (len(subset), engine.vocab_size)
        for row, key in enumerate(subset):
            assert engine.length(key) == len(tokens[key])
            worst = max(worst, (logits[row] - reference_logits(model, tokens[key])).abs().max().item())
        chosen = logits.argmax(dim=-1).tolist()
        engine.append(subset, chosen)
        for key, token in zip(subset, chosen):
            tokens[key].append(token)
    assert worst < TOLERANCE


def test_greedy_chat_answer_names_paris(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = TorchEngine(model, max_batch_size=2, max_context=128)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    engine.add(0, prompt)
    answer = []
    for _ in range(12):
        token = int(engine.step([0])[0].argmax())
        answer.append(token)
        engine.append([0], [token])
    assert "Paris" in tokenizer.decode(answer)


def test_misuse_is_reported(model_and_tokenizer):
    model, _ = model_and_tokenizer
    engine = TorchEngine(model, max_batch_size=1, max_context=8)
    with pytest.raises(ValueError, match=r"prompt_ids must hold 1 to 7 tokens"):
        engine.add("x", list(range(8)))
    with pytest.raises(ValueError, match=r"prompt_ids must be token ids in \[0, 49152\)"):
        engine.add("x", [49152])
    engine.add("x", [1, 2])
    with pytest.raises(RuntimeError, match="max_batch_size=1"):
        engine.add("y", [1])
    with pytest.raises(KeyError, match="unknown sequence 'y'"):
        engine.step(["y"])
    engine.step(["x"])
    with pytest.raises(ValueError, match="no pending token"):
        engine.step(["x"])
    engine.append(["x"], [5])
    with pytest.raises(ValueError, match="already has a pending token"):
        engine.append(["x"], [6])
    engine.release("x")
    engine.release("x")  # a second release is harmless
    assert engine.num_free_slots == 1
    with pytest.raises(ValueError, match=r"max_context must be in \[2, 8192\]"):
        TorchEngine(model, max_context=10**6)


# The inline (in-data-plane, torch) sampler of the baseline mode.

from conftest import P_VALUE_FLOOR, fails_the_fit, goodness_of_fit, repeated_batch  # noqa: E402

from simple_sampler import History, SamplingBatch, SamplingParams, sample  # noqa: E402
from simple_sampler.reference import probabilities  # noqa: E402
from simple_sampler.serving.inline import sample_torch  # noqa: E402

HISTORY = History(prompt_ids=[0, 1, 2, 9], output_ids=[3, 3, 4, 5])


def inline_case(name: str, row: np.ndarray) -> tuple[SamplingParams, History, int]:
    """(params, history, draws) of a case on `row`. The penalties' history and
    the bias take ids of the row's head, so that they move mass the
    truncations keep; the draws make a temperature 2% off fail (60,000 for
    top_k 40 at T 0.7, whose 2% error is 0.013 away in TV)."""
    if name == "top_k":
        return SamplingParams(temperature=0.7, top_k=40, seed=1), HISTORY, 60_000
    head = [int(t) for t in np.argsort(-row)[:6]]
    history = History(prompt_ids=[head[0], head[1], head[2], head[5]],
                      output_ids=[head[3], head[3], head[4], head[5]])
    params = SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.4,
                            logit_bias={head[3]: 2.0, head[1]: -1.0})
    return params, history, 10_000


def reference_of(row: np.ndarray, params: SamplingParams, history: History) -> np.ndarray:
    return probabilities(row, SamplingBatch.from_params([params], [history]), 0)


@pytest.mark.parametrize("name", ["top_k", "penalties_bias"])
def test_inline_draws_follow_the_reference_distribution(zipf_rows, name):
    row = zipf_rows[1]  # V = 1000
    params, history, draws = inline_case(name, row)
    probs = reference_of(row, params, history)
    if params.logit_bias:  # precondition: the penalties and the bias each move the reference
        for neutral in (dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0),
                        dict(logit_bias={})):
            without = reference_of(row, dataclasses.replace(params, **neutral), history)
            assert 0.5 * np.abs(probs - without).sum() > 0.05, neutral
    batch = repeated_batch(params, draws, history)
    tokens, _ = sample_torch(torch.from_numpy(np.broadcast_to(row, (draws, row.size)).copy()), batch)
    counts = np.bincount(tokens, minlength=row.size)
    assert goodness_of_fit(counts, probabilities(row, batch, 0)) > P_VALUE_FLOOR
    # power: the same draws reject the reference of a temperature 2% off
    for factor in (0.98, 1.02):
        wrong = dataclasses.replace(params, temperature=params.temperature * factor)
        assert fails_the_fit(counts, reference_of(row, wrong, history)), factor


def test_inline_greedy_and_logprobs_agree_with_the_kernels(zipf_rows):
    rows = np.stack([zipf_rows[2]] * 3)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, stop_token_ids=[11],
                             min_tokens=9, logit_bias={5: 3.0}),
              SamplingParams(temperature=0.8, top_k=5, seed=3), SamplingParams(temperature=0.0)]
    batch = SamplingBatch.from_params(params, [HISTORY] * 3)
    tokens, logprobs = sample_torch(torch.from_numpy(rows), batch)
    expected = sample(rows, batch)
    greedy = [0, 2]  # the seeded row draws from another random stream
    assert tokens[greedy].tolist() == expected.token_ids[greedy].tolist()
    assert np.allclose(logprobs[greedy], expected.logprobs[greedy], atol=1e-4)


def test_inline_seeded_draw_is_batch_invariant(zipf_rows):
    row = zipf_rows[2]
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone, _ = sample_torch(torch.from_numpy(row[None].copy()),
                            SamplingBatch.from_params([seeded], steps=[5]))
    others = [SamplingParams(temperature=1.0, seed=s) for s in range(5)]
    together, _ = sample_torch(torch.from_numpy(np.stack([row] * 6)),
                               SamplingBatch.from_params(others + [seeded], steps=[0] * 5 + [5]))
    assert together[-1] == alone[0]
