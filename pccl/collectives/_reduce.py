"""In-place element-wise reduction used by the ring (private).

A thin alias of :func:`pccl.kernels.reduce.reduce_into`: accumulation happens in the tensor's own
dtype (integers wrap around like the dtype does; float16/bfloat16 round after every pairwise
operation). The ring only ever passes SUM, PROD, MIN or MAX: AVG is SUM followed by the
communicator's division by the world size.
"""

from __future__ import annotations

from ..kernels.reduce import reduce_into

__all__ = ["reduce_into"]
