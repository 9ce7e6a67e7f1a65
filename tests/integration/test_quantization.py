"""Quantized all-reduce through the full stack: bit-identical results, bounded error, fewer bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl import DataType, QuantizationAlgorithm, QuantizationOptions, ReduceOp
from pccl.peer.communicator import Communicator

from ._cluster import loopback_cluster

COUNT = 100_003


async def _run(
    comms: list[Communicator], xs: list[np.ndarray], op: ReduceOp, q: QuantizationOptions | None
) -> list[pccl.ReduceInfo]:
    infos: list[Any] = [None] * len(comms)

    async def one(i: int) -> None:
        infos[i] = await comms[i].all_reduce(xs[i], op=op, quantization=q)

    async with trio.open_nursery() as n:
        for i in range(len(comms)):
            n.start_soon(one, i)
    return infos


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algo", [QuantizationAlgorithm.MIN_MAX, QuantizationAlgorithm.ZERO_POINT_SCALE])
async def test_quantized_bit_identical_and_bounded(n: int, algo: QuantizationAlgorithm) -> None:
    async with loopback_cluster(n) as cl:
        for dtype in (np.float16, np.float32, np.float64):
            for op in (ReduceOp.SUM, ReduceOp.AVG):
                for qd, levels in ((DataType.UINT8, 255), (DataType.UINT16, 65535)):
                    rng = np.random.default_rng(n * 7 + int(op))
                    data = [rng.random(COUNT).astype(dtype) for _ in range(n)]
                    xs = [d.copy() for d in data]
                    await _run(cl.comms, xs, op, QuantizationOptions(quantized_datatype=qd, algorithm=algo))
                    assert all(x.tobytes() == xs[0].tobytes() for x in xs), (dtype, op, qd)
                    exact = np.sum([d.astype(np.float64) for d in data], axis=0)
                    if op == ReduceOp.AVG:
                        exact /= n
                    err = np.max(np.abs(xs[0].astype(np.float64) - exact))
                    # n quantization steps (n-1 partial sums + the owner's final one), each off by at
                    # most half a level of a range no wider than n (inputs in [0, 1)); ZPS spans
                    # 12 standard deviations over the levels instead of the min-max range.
                    span = n if algo == QuantizationAlgorithm.MIN_MAX else 12 * 0.3 * n
                    bound = n * (span / levels) + (np.finfo(dtype).eps * n * 4)
                    if op == ReduceOp.AVG:
                        bound /= n
                    assert err <= bound, (dtype, op, qd, err, bound)
                    assert err > 0 or qd == DataType.UINT16  # quantization really happened


async def test_quantized_tx_is_about_a_quarter() -> None:
    async with loopback_cluster(3) as cl:
        data = [np.random.default_rng(i).random(1 << 20).astype(np.float32) for i in range(3)]
        plain = await _run(cl.comms, [d.copy() for d in data], ReduceOp.SUM, None)
        quant = await _run(
            cl.comms,
            [d.copy() for d in data],
            ReduceOp.SUM,
            QuantizationOptions(quantized_datatype=DataType.UINT8, algorithm=QuantizationAlgorithm.MIN_MAX),
        )
        for p, q in zip(plain, quant, strict=True):
            ratio = q.tx_bytes / p.tx_bytes
            assert 0.24 <= ratio <= 0.27, ratio


async def test_quantization_rejected_for_integers() -> None:
    async with loopback_cluster(2) as cl:
        with pytest.raises(pccl.InvalidArgumentError):
            await cl.comms[0].all_reduce(
                np.ones(4, np.int32),
                quantization=QuantizationOptions(
                    quantized_datatype=DataType.UINT8, algorithm=QuantizationAlgorithm.MIN_MAX
                ),
            )
