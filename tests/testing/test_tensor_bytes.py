"""pccl.testing.tensor_bytes: raw bytes of any supported tensor, for bit-identity asserts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pccl.testing import tensor_bytes


def test_numpy_and_torch_give_their_c_order_bytes() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert tensor_bytes(a) == a.tobytes()
    assert tensor_bytes(a.T) == np.ascontiguousarray(a.T).tobytes()  # non-contiguous: C order
    t = torch.from_numpy(a)
    assert tensor_bytes(t) == a.tobytes()
    assert tensor_bytes(t.T) == np.ascontiguousarray(a.T).tobytes()
    bf = torch.arange(5, dtype=torch.bfloat16)
    assert tensor_bytes(bf) == bf.view(torch.int16).numpy().tobytes()


def test_tells_apart_what_value_equality_does_not() -> None:
    assert tensor_bytes(np.array([0.0])) != tensor_bytes(np.array([-0.0]))


def test_refuses_other_types() -> None:
    with pytest.raises(TypeError):
        tensor_bytes([1.0, 2.0])
