"""``sampling.dlpack_array``: a CPU DLPack capsule (what Triton's
``pb_utils.Tensor.to_dlpack()`` gives the sampler model for a BF16 input,
which ``as_numpy`` refuses) as numpy, bfloat16 included, without torch.
torch's own ``to_dlpack`` stands in for the Python backend's producer: the
same capsule protocol (an unconsumed "dltensor" whose destructor frees it)."""
import gc

import ml_dtypes
import numpy as np
import pytest
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from simple_sampler.sampling import dlpack_array


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, ml_dtypes.bfloat16),
                                             (torch.float16, np.float16),
                                             (torch.float32, np.float32)])
def test_the_array_is_the_tensor_in_place(dtype, expected):
    tensor = torch.randn(3, 7).to(dtype)
    array = dlpack_array(to_dlpack(tensor))
    assert array.dtype == expected and array.shape == (3, 7) and not array.flags.writeable
    np.testing.assert_array_equal(array.astype(np.float32), tensor.float().numpy())
    tensor[1, 2] = 42.0  # the same memory, not a copy
    assert array[1, 2] == 42.0


def test_the_array_keeps_the_tensor_alive():
    tensor = torch.arange(4096, dtype=torch.float32).to(torch.bfloat16).reshape(64, 64)
    expected = tensor.float().numpy().copy()
    array = dlpack_array(to_dlpack(tensor))
    del tensor
    gc.collect()
    torch.zeros(64, 64, dtype=torch.bfloat16).fill_(-1)  # reuse freed memory if any was
    np.testing.assert_array_equal(array.astype(np.float32), expected)


def test_an_empty_tensor_and_a_one_dimensional_one():
    assert dlpack_array(to_dlpack(torch.zeros(0, 5, dtype=torch.bfloat16))).shape == (0, 5)
    np.testing.assert_array_equal(dlpack_array(to_dlpack(torch.arange(5.0))), np.arange(5.0))


def test_what_it_refuses_is_named():
    consumed = to_dlpack(torch.zeros(2, 2))
    from_dlpack(consumed)  # torch took it: renamed "used_dltensor"
    with pytest.raises(ValueError, match="unconsumed DLPack capsule"):
        dlpack_array(consumed)
    with pytest.raises(ValueError, match="unconsumed DLPack capsule"):
        dlpack_array(np.zeros(3))
    with pytest.raises(ValueError, match="type code 0 of 64 bits"):
        dlpack_array(to_dlpack(torch.zeros(2, 2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="row-major contiguous"):
        dlpack_array(to_dlpack(torch.zeros(3, 4).t()))
