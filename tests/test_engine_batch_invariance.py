"""The PyTorch engine's batch-invariant mode: one sequence's logits are
bitwise the same whatever else is in its steps (docs/SERVING.md, "Same
seed, same text").

The sequence under test is fed a fixed script of tokens, so every run asks
the engine the same question at every step; only the company changes:
alone, with 1, 7 and 31 others of other lengths, others already decoding
when it joins, others joining and leaving while it decodes, in shuffled
step orders (a new order and split every tick). Its logits must be equal
with ``torch.equal`` (bitwise), not close: an untruncated draw near the
boundary between two tokens flips on a difference in the last bit.
"""
import random

import pytest
import torch

from simple_sampler.models import load_model
from simple_sampler.serving.torch_engine import TorchEngine

STEPS = 8
CONTEXT = 256


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model()


def run(model, prompt: list[int], script: list[int], others: list[tuple[list[int], int, int]],
        batch_invariant: bool, seed: int) -> list[torch.Tensor]:
    """The target's logits at each of its STEPS steps. ``others``: (prompt,
    joins at tick, leaves at tick); the target joins at tick 0; ticks before
    0 let others prefill and decode before it arrives. Each tick steps every
    active sequence, in an order shuffled by ``seed``, sometimes split in
    two engine steps."""
    engine = TorchEngine(model, max_batch_size=32, max_context=CONTEXT,
                         batch_invariant=batch_invariant)
    shuffle = random.Random(seed)
    first = min([0] + [join for _, join, _ in others])
    active, seen = [], []
    for tick in range(first, STEPS):
        for index, (other, join, leave) in enumerate(others):
            if tick == join:
                engine.add(index, other)
                active.append(index)
            if tick == leave:
                engine.release(index)
                active.remove(index)
        if tick == 0:
            engine.add("target", prompt)
            active.append("target")
        order = shuffle.sample(active, len(active))
        cut = shuffle.randrange(1, len(order) + 1)
        for part in (order[:cut], order[cut:]):
            if not part:
                continue
            logits = engine.step(part)
            tokens = [script[tick] if key == "target" else 1000 + 37 * tick + key for key in part]
            if "target" in part:
                seen.append(logits[part.index("target")].clone())
            engine.append(part, tokens)
    return seen


def compositions(tokenizer) -> dict[str, list[tuple[list[int], int, int]]]:
    """Company for the target: (prompt, join tick, leave tick)."""
    rng = random.Random(7)
    words = ("Once upon a time the river ran dry and the village gathered to decide what "
             "could be done about the long summer ahead of them all").split()

    def prompt(length: int) -> list[int]:
        return tokenizer(" ".join(rng.choice(words) for _ in range(length)))["input_ids"]

    never = STEPS + 1
    return {
        "alone": [],
        "1 other": [(prompt(40), 0, never)],
        "7 others, some already decoding": [(prompt(3 + 9 * i), -(i % 3), never) for i in range(7)],
        "31 others joining and leaving": [(prompt(2 + 5 * (i % 12)), i % 5 - 2, never if i % 4 else 3 + i % 4)
                                          for i in range(31)],
    }


def target_and_script(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    script = tokenizer(" Waves fold the grey light back into the deep, slow tide")["input_ids"]
    assert len(script) >= STEPS
    return prompt, script


def test_logits_are_bitwise_equal_whatever_the_company(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt, script = target_and_script(tokenizer)
    alone = run(model, prompt, script, [], batch_invariant=True, seed=0)
    assert len(alone) == STEPS
    # one order seed a company: every tick already draws its own order and split
    for seed, (name, others) in enumerate(compositions(tokenizer).items(), start=1):
        together = run(model, prompt, script, others, batch_invariant=True, seed=seed)
        differing = [step for step, (a, b) in enumerate(zip(alone, together))
                     if not torch.equal(a, b)]
        assert not differing, (f"{name} (order seed {seed}): logits differ at steps "
                               f"{differing}, by up to "
                               f"{max((alone[s] - together[s]).abs().max().item() for s in differing):.3g}")


def test_models_it_cannot_run_invariantly_are_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tiny = Qwen2ForCausalLM(Qwen2Config(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        vocab_size=16, max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"batch_invariant supports llama models \(SmolLM2\), not 'qwen2'"):
        TorchEngine(tiny, max_batch_size=2, max_context=16, batch_invariant=True)
    TorchEngine(tiny, max_batch_size=2, max_context=16)  # the ordinary forward takes it


def test_the_setting_reaches_the_engine_and_is_refused_for_tensorrt_llm(tmp_path):
    from simple_sampler.settings import LlmSettings, SamplerSettings
    from simple_sampler.triton.llm_service import build_engine
    from simple_sampler.launch.serve import assemble_repository

    with pytest.raises(ValueError, match="batch_invariant applies to engine torch only, not tensorrt_llm"):
        LlmSettings(engine="tensorrt_llm", model="/m", batch_invariant=True).validate()
    with pytest.raises(ValueError, match="batch_invariant applies to engine torch only, not tensorrt_llm"):
        build_engine(LlmSettings(engine="tensorrt_llm", model="/m", batch_invariant=True))
    for text, value in (("true", True), ("false", False), ("False", False)):
        assert LlmSettings.from_parameters({"batch_invariant": text}).batch_invariant is value
    with pytest.raises(ValueError, match="batch_invariant must be true or false, got 'yes'"):
        LlmSettings.from_parameters({"batch_invariant": "yes"})
    for setting in (False, True):
        repository = assemble_repository(tmp_path / str(setting), SamplerSettings(),
                                         LlmSettings(batch_invariant=setting))
        config = (repository / "llm" / "config.pbtxt").read_text()
        assert (f'key: "batch_invariant"\n  value: {{ string_value: "{str(setting).lower()}" }}'
                in config)
