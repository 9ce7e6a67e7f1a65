"""In-place element-wise reduction used by the ring (private).

Stand-in until :mod:`pccl.kernels.reduce` lands; it then becomes a thin alias of
``pccl.kernels.reduce.reduce_into``. Accumulation happens in the tensor's own dtype (integers
wrap around like the dtype does). AVG never reaches this function: the communicator divides by
the world size after the SUM.
"""

from __future__ import annotations

import numpy as np

from .._errors import InvalidArgumentError
from .._types import ReduceOp

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def reduce_into(acc: np.ndarray, other: np.ndarray, op: ReduceOp) -> None:
    """``acc = acc <op> other`` element-wise, in place, in ``acc``'s dtype.

    Raises:
        InvalidArgumentError: ``op`` is not SUM, PROD, MIN or MAX.
    """
    ufunc = _UFUNCS.get(op)
    if ufunc is None:
        raise InvalidArgumentError(f"the ring cannot reduce with {op!r} (AVG is SUM then a division)")
    ufunc(acc, other, out=acc)
