"""The data-plane contract (serving/engine.py) for every engine: TorchEngine
on the real SmolLM2 (slow: loads the model), TrtLlmEngine over the fake of
TensorRT-LLM's API (tests/fake_tensorrt_llm.py) and SimulatedEngine, whose
synthetic rows depend on no token (its rows are checked in test_simulated.py;
here only its bookkeeping and errors).

Each engine comes with its model's reference row for a token list (a full
recompute, or the fake's model), so a row that went to the wrong sequence,
lost a token or kept the engine's own choice instead of the appended one
shows up as a mismatch. Tokens are appended off the argmax on purpose: the
engine must continue with the decision plane's token, not its own pick.
"""
import json
import time

import pytest
import torch

from fake_tensorrt_llm import LLM, SamplingParams, model_row
from fakes import reference_logits, tiny
from simple_sampler.models import load_model
from simple_sampler.serving.engine import Closable, Engine, SelfScheduling, SequenceTable
from simple_sampler.serving.engines import ENGINES
from simple_sampler.serving.simulated import SimulatedEngine, SimulatedSpec
from simple_sampler.serving.static_decode import StaticEngine
from simple_sampler.serving.torch_engine import TorchEngine
from simple_sampler.serving.trtllm import TrtLlmEngine


@pytest.fixture(scope="module")
def smollm2():
    return load_model()[0]


def _torch(request, tmp_path, max_batch_size, max_context):
    model = request.getfixturevalue("smollm2")
    engine = TorchEngine(model, max_batch_size=max_batch_size, max_context=max_context)
    return engine, lambda tokens: reference_logits(model, tokens), 1e-3


def _static(request, tmp_path, max_batch_size, max_context):
    model = tiny("llama")  # a tiny random Llama (tests/test_static_decode.py)
    engine = StaticEngine(model, max_batch_size=max_batch_size, max_context=max_context)
    return engine, lambda tokens: reference_logits(model, tokens), 1e-4


def _simulated(request, tmp_path, max_batch_size, max_context):
    spec = SimulatedSpec(vocab=128_256, dtype="float32", step_a_ms=0.0, step_b_ms=0.0)
    engine = SimulatedEngine(spec, max_batch_size=max_batch_size, max_context=max_context)
    return engine, lambda tokens: torch.zeros(spec.vocab), float("inf")


def _tensorrt_llm(request, tmp_path, max_batch_size, max_context):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50}))
    engine = TrtLlmEngine.from_source(tmp_path, max_batch_size=max_batch_size,
                                      max_context=max_context, api=(LLM, SamplingParams),
                                      step_timeout_s=10)
    return engine, lambda tokens: model_row(tokens, 50)[:50], 0.0


#: engine name -> (request, tmp_path, max_batch_size, max_context) -> (engine,
#: reference(tokens), tolerance): a test instance of each engine and its model's row
FACTORIES = {"torch": _torch, "static": _static, "simulated": _simulated,
             "tensorrt_llm": _tensorrt_llm}
SLOW = {"torch"}  # loads SmolLM2


def test_every_registered_engine_is_held_to_the_contract():
    assert set(FACTORIES) == set(ENGINES), "an engine of ENGINES needs a factory here"


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                        for name in ENGINES])
def make_engine(request, tmp_path):
    """make_engine(max_batch_size, max_context) -> (engine, reference(tokens), tolerance),
    for each engine of the registry (serving/engines.ENGINES)."""
    if request.param not in FACTORIES:
        pytest.fail(f"engine {request.param!r} has no factory in FACTORIES")
    made = []

    def make(max_batch_size, max_context):
        engine, reference, tolerance = FACTORIES[request.param](request, tmp_path, max_batch_size,
                                                                max_context)
        made.append(engine)
        return engine, reference, tolerance

    yield make
    for engine in made:
        if isinstance(engine, Closable):
            engine.close()


def ready_group(engine, ids):
    """The ids the engine has rows for now (all of them without wait_ready)."""
    if not isinstance(engine, SelfScheduling):
        return list(ids)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # fail, not spin, if another sequence holds the rows
        ready = engine.wait_ready(ids)
        if ready:
            return ready
    raise AssertionError(f"no row for any of {ids} within 10 s")


def decode_round(engine, ids, tokens, reference, tolerance):
    """Step every id once and append a token that is not the argmax. An
    engine with wait_ready is stepped in the groups it has rows for; each
    group is stepped in reverse order to check rows follow the ids given."""
    pending = list(ids)
    while pending:
        group = list(reversed(ready_group(engine, pending)))
        logits = engine.step(group)
        assert logits.dtype == torch.float32 and logits.shape == (len(group), engine.vocab_size)
        chosen = []
        for row, key in zip(logits, group):
            assert engine.length(key) == len(tokens[key])
            assert (row - reference(tokens[key])).abs().max().item() <= tolerance
            chosen.append((int(row.argmax()) + 1 + len(tokens[key])) % engine.vocab_size)
        engine.append(group, chosen)
        for key, token in zip(group, chosen):
            tokens[key].append(token)
            assert engine.length(key) == len(tokens[key])
        pending = [key for key in pending if key not in group]


def test_rows_follow_each_sequence_as_sequences_join_and_leave(make_engine):
    engine, reference, tolerance = make_engine(max_batch_size=3, max_context=32)
    assert engine.max_batch_size == 3 and engine.max_context == 32 and engine.vocab_size > 0
    tokens = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7, 8, 9], "d": [10]}
    # Each entry: sequences to add, to release, then one decode round of the active ones.
    schedule = [(["a", "b"], []), ([], []), (["c"], []), ([], ["b"]), (["d"], []), ([], ["a"]),
                ([], [])]
    active = []
    for joining, leaving in schedule:
        for key in joining:
            engine.add(key, tokens[key])
            assert engine.length(key) == len(tokens[key])
            active.append(key)
        for key in leaving:
            engine.release(key)
            active.remove(key)
        decode_round(engine, active, tokens, reference, tolerance)
    assert len(tokens["c"]) == 3 + 5 and len(tokens["d"]) == 1 + 3


def test_misuse_is_reported_and_released_ids_are_reusable(make_engine):
    engine, reference, tolerance = make_engine(max_batch_size=2, max_context=8)
    vocab = engine.vocab_size
    with pytest.raises(ValueError, match=r"prompt_ids must hold 1 to 7 tokens"):
        engine.add("x", list(range(8)))
    with pytest.raises(ValueError, match=r"prompt_ids must hold 1 to 7 tokens"):
        engine.add("x", [])
    with pytest.raises(ValueError, match=rf"prompt_ids must be token ids in \[0, {vocab}\)"):
        engine.add("x", [vocab])
    engine.add("x", [1, 2])
    with pytest.raises(ValueError, match="already active"):
        engine.add("x", [3])
    engine.add("y", [3])
    with pytest.raises(RuntimeError, match="max_batch_size=2"):
        engine.add("z", [1])
    with pytest.raises(KeyError, match="unknown sequence 'z'"):
        engine.step(["z"])
    with pytest.raises(ValueError, match="distinct"):
        engine.step(["x", "x"])
    with pytest.raises(ValueError, match="step it before appending"):
        engine.append(["x"], [1])
    # An engine with its own batches may schedule x and y in different
    # iterations: step what it has rows for, the other after that is answered.
    appended = {"x": 4, "y": 5}
    group = ready_group(engine, ["y", "x"])
    logits = engine.step(group)
    assert logits.shape == (len(group), vocab)
    with pytest.raises(ValueError, match="no pending token"):
        engine.step(group[-1:])
    with pytest.raises(ValueError, match="token_ids has 1 entries for 2 seq_ids"):
        engine.append(["x", "y"], [1])
    with pytest.raises(ValueError, match=rf"token_ids must be token ids in \[0, {vocab}\)"):
        engine.append(["x", "y"], [1, -1])
    engine.append(group, [appended[key] for key in group])
    rest = [key for key in ("y", "x") if key not in group]
    if rest:
        engine.step(ready_group(engine, rest))
        engine.append(rest, [appended[key] for key in rest])
    engine.release("y")
    engine.release("y")  # a cancel racing a finish: ignored
    with pytest.raises(KeyError, match="unknown sequence 'y'"):
        engine.length("y")
    engine.add("y", [6, 7])  # the slot and the id are free again
    tokens = {"x": [1, 2, 4], "y": [6, 7]}
    decode_round(engine, ["x", "y"], tokens, reference, tolerance)
    decode_round(engine, ["y", "x"], tokens, reference, tolerance)
    assert engine.length("x") == 5 and engine.length("y") == 4


def test_capabilities_are_declared_by_protocol(make_engine):
    engine, _, _ = make_engine(max_batch_size=1, max_context=4)
    schedules_itself = isinstance(engine, TrtLlmEngine)
    assert isinstance(engine, SelfScheduling) == schedules_itself
    # TensorRT-LLM's workers and bridge; the torch engines' page-lock on the
    # row arena's ring (released before the ring is unmapped)
    assert isinstance(engine, Closable) == isinstance(engine, (TrtLlmEngine, TorchEngine))


def test_every_engine_has_the_contract_s_attributes(make_engine):
    """Every attribute the contract declares (the llm model reads ``label``
    and ``bridge_s`` from any engine, never through getattr with a default)."""
    engine, _, _ = make_engine(max_batch_size=1, max_context=4)
    missing = [name for name in Engine.__annotations__ if not hasattr(engine, name)]
    assert not missing, missing
    assert isinstance(engine.label, str) and engine.label
    bridged = isinstance(engine, TrtLlmEngine)  # the only engine with a bridge across processes
    assert isinstance(engine.bridge_s, float) and (engine.bridge_s >= 0.0 if bridged
                                                   else engine.bridge_s == 0.0)


def test_sequence_table_checks_and_messages():
    """The helper every engine tracks its sequences with: the contract's
    errors come from it, with a state the table does not look inside."""
    table = SequenceTable(vocab_size=10, max_batch_size=2, max_context=4)
    made = []
    make = lambda prompt: made.append(prompt) or {"tokens": list(prompt), "pending": True}
    with pytest.raises(ValueError, match=r"prompt_ids must hold 1 to 3 tokens"):
        table.add("a", [1, 2, 3, 4], make)
    with pytest.raises(ValueError, match=r"prompt_ids must be token ids in \[0, 10\), got 10"):
        table.add("a", [1, 10], make)
    assert made == []  # make runs only once every check passed
    state = table.add("a", [1, 2], make)
    assert table["a"] is state and made == [[1, 2]] and "a" in table and len(table) == 1
    with pytest.raises(ValueError, match="already active"):
        table.add("a", [1], make)
    table.add("b", [3], make)
    with pytest.raises(RuntimeError, match="max_batch_size=2"):
        table.add("c", [1], make)
    assert list(table) == ["a", "b"] and list(table.values())[0] is state

    pending = lambda s: s["pending"]
    length = lambda s: len(s["tokens"])
    with pytest.raises(KeyError, match="unknown sequence 'c'"):
        table.for_step(["c"], pending)
    with pytest.raises(ValueError, match="distinct"):
        table.for_step(["a", "a"], pending)
    with pytest.raises(ValueError, match="'a' already has a pending token"):
        table.for_append(["a"], [1], pending)
    assert table.for_step(["b", "a"], pending) == [table["b"], state]
    state["pending"] = False
    with pytest.raises(ValueError, match="'a' has no pending token"):
        table.for_step(["a"], pending)
    with pytest.raises(ValueError, match="token_ids has 1 entries for 2 seq_ids"):
        table.for_append(["a", "b"], [1], pending)
    with pytest.raises(ValueError, match=r"token_ids must be token ids in \[0, 10\), got -1"):
        table.for_append(["a"], [-1], pending)
    assert table.for_append(["a"], [7.0], pending, length) == ([state], [7])
    state["tokens"] += [7, 8]
    with pytest.raises(ValueError, match="'a' is at max_context=4 tokens"):
        table.for_append(["a"], [1], pending, length)
    state["pending"] = True
    with pytest.raises(ValueError, match="'a' is at max_context=4 tokens"):
        table.for_step(["a"], pending, length)
    assert table.release("a") is state and table.release("a") is None
    with pytest.raises(KeyError, match="unknown sequence 'a'"):
        table["a"]
    table.add("c", [1], make)  # the slot is free again


def test_every_engine_takes_the_request_s_max_tokens(make_engine):
    """add's optional max_tokens (the decode loop passes each request's own):
    the rows do not change with it, whatever the engine does with it."""
    engine, reference, tolerance = make_engine(max_batch_size=2, max_context=16)
    engine.add("x", [1, 2, 3], max_tokens=4)
    engine.add("y", [1, 2, 3])
    ready = ready_group(engine, ["x", "y"])
    rows = engine.step(ready)
    for seq_id, row in zip(ready, rows):
        assert float((row - reference([1, 2, 3])).abs().max()) <= tolerance, seq_id
