"""One table of sampling parameters (params.RULES): every place that lists
them is derived from it or pinned here, so a parameter added to the table and
missed anywhere fails a test instead of being silently ignored."""
import dataclasses
import re

import numpy as np
import pytest

from conftest import PARAM_ON as ON
from simple_sampler import baselines, reference, schema
from simple_sampler.frontend.protocol import Sampling
from simple_sampler.handoff import FALLBACK_NEUTRAL
from simple_sampler.params import PARAMS, RULES, TRUNCATIONS, SamplingBatch, SamplingParams, any_on
from simple_sampler import _sampling
from simple_sampler.sampling import KERNEL_FIELDS, ROW_SCALARS, kernel_params
from simple_sampler.serving.batch_state import SCALAR_COLUMNS, BatchState
from simple_sampler.shvs.hot_vocab import untruncated_rows
from simple_sampler.triton.sampler_codec import SCALAR_INPUTS, batch_arrays
from simple_sampler.triton.sampler_decode import decode_request

VOCAB = 32


def test_every_parameter_has_an_on_value_that_passes_its_rule():
    assert set(ON) == set(PARAMS)
    for param in RULES:
        assert param.rule(np.asarray([ON[param.name]], param.dtype)).all()
        assert param.rule(np.asarray([param.neutral], param.dtype)).all()
        assert not param.is_off(np.asarray(ON[param.name], param.dtype))
        assert param.is_off(np.asarray(param.neutral, param.dtype))


def test_hand_written_declarations_match_the_table():
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    batch_fields = {f.name for f in dataclasses.fields(SamplingBatch)}
    for param in RULES:
        assert defaults[param.name] == param.neutral, param.name
        assert param.name in batch_fields, param.name
    assert {p.name for p in TRUNCATIONS} == {p.name for p in RULES if p.truncates}
    # Each implementation of the semantics has an op for each truncation.
    assert set(reference.TRUNCATE) == {p.name for p in TRUNCATIONS}
    assert set(baselines.ON_LOGITS) | set(baselines.ON_SORTED) == {p.name for p in TRUNCATIONS}
    # The OpenAI front door declares each (as vLLM's extensions where OpenAI has none).
    assert {p.name for p in RULES} <= set(Sampling.model_fields)


def test_derived_places_are_the_tables_projections():
    names = [p.name for p in RULES]
    assert SCALAR_COLUMNS[:-1] == tuple((p.name, p.dtype, p.neutral) for p in RULES)
    assert FALLBACK_NEUTRAL == tuple(p for p in RULES if p.kind != "scale")
    assert sorted(field for field, _ in SCALAR_INPUTS.values()) == sorted(names)
    for model in (schema.SAMPLER, schema.ENSEMBLE):
        carried = {t.param: t for t in model.inputs if t.param in PARAMS}
        assert set(carried) == set(names), model.name
        for param in RULES:
            tensor = carried[param.name]
            assert tensor.default == param.neutral
            assert np.dtype(tensor.numpy).kind == np.dtype(param.dtype).kind


def test_the_kernels_row_struct_is_the_tables_projection():
    """sampling.ROW_SCALARS (from the table) has the layout of the C struct
    RowScalars (cython_kernels/row_scalars.pxd): same fields, offsets, size."""
    assert list(KERNEL_FIELDS) == [p.name for p in RULES]
    assert ROW_SCALARS.names == (*(name for p in RULES for name, _, _ in KERNEL_FIELDS[p.name]),
                                 "seed", "step")
    size, offsets = _sampling.row_scalars_layout()
    assert ROW_SCALARS.itemsize == size
    assert {name: ROW_SCALARS.fields[name][1] for name in ROW_SCALARS.names} == offsets


def one_row(**params) -> SamplingBatch:
    return SamplingBatch.from_params([SamplingParams(seed=1, **params)])


@pytest.mark.parametrize("param", RULES, ids=lambda p: p.name)
def test_each_parameter_reaches_every_derived_place(param):
    on, neutral = one_row(**{param.name: ON[param.name]}), one_row()
    assert getattr(on, param.name)[0] == ON[param.name]
    for kind in ("scale", "penalty", "truncation"):
        assert any_on(on, kind)[0] == (param.kind == kind)
        assert not any_on(neutral, kind)[0]
    assert untruncated_rows(on)[0] == (not param.truncates)
    assert untruncated_rows(neutral)[0]

    # The kernels' row scalars see it, in its own fields.
    kernel_on = kernel_params(on, VOCAB, 0, 1)[0]["scalars"]
    kernel_neutral = kernel_params(neutral, VOCAB, 0, 1)[0]["scalars"]
    changed = {name for name in ROW_SCALARS.names if kernel_on[name] != kernel_neutral[name]}
    assert changed and changed <= {name for name, _, _ in KERNEL_FIELDS[param.name]}

    # The persistent batch keeps it; the sampler codec carries it both ways.
    state = BatchState(2, 8)
    slot = state.add(SamplingParams(seed=1, **{param.name: ON[param.name]}), [1, 2])
    assert getattr(state.batch(np.array([slot])), param.name)[0] == ON[param.name]
    arrays = batch_arrays(on)
    arrays["logits"] = np.zeros((1, VOCAB), np.float32)
    assert getattr(decode_request(arrays, VOCAB).batch, param.name)[0] == ON[param.name]
    tensor = next(name for name, (field, _) in SCALAR_INPUTS.items() if field == param.name)
    bad = dict(arrays, **{tensor: np.full_like(arrays[tensor], -5 if param.dtype == np.int64
                                               else np.nan)})
    with pytest.raises(ValueError, match=re.escape(f"row 0: {tensor} must be {param.allowed}")):
        decode_request(bad, VOCAB)


@pytest.mark.parametrize("param", TRUNCATIONS, ids=lambda p: p.name)
def test_each_truncation_changes_the_reference_and_the_baseline(param):
    """The float64 reference and the torch baseline apply each truncation
    (inline draws through the baseline's)."""
    import torch  # the baseline's dependency

    row = np.linspace(3.0, -3.0, VOCAB)
    on, neutral = one_row(**{param.name: ON[param.name]}), one_row()
    p_on, p_neutral = reference.probabilities(row, on, 0), reference.probabilities(row, neutral, 0)
    assert (p_on == 0).sum() > (p_neutral == 0).sum()
    logits = torch.from_numpy(row[None, :].astype(np.float32))
    assert torch.isinf(baselines.truncate(logits, on)).sum() > 0
    assert torch.isinf(baselines.truncate(logits, neutral)).sum() == 0
    assert ((p_on == 0) == torch.isinf(baselines.truncate(logits, on))[0].numpy()).all()
