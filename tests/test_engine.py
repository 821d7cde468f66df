"""The PyTorch engine against the plain Hugging Face forward (full recompute,
no cache), with sequences joining and leaving and steps over subsets."""
import pytest
import torch

from simple_sampler.serving.engine import TorchEngine, load_model

TOLERANCE = 1e-3  # max abs logit difference, float32


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_logits_match_full_recompute_as_sequences_join_and_leave(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = TorchEngine(model, max_batch_size=3, max_context=64)
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
