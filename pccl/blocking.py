"""The blocking API, compatible with the established PCCL Python bindings (pypccl).

Existing PCCL user code (``Communicator``, ``MasterNode``, ``SharedState``, ``TensorInfo``, ``ReduceOp``,
``Attribute``, ``PCCLError``, ...) runs on top of the native async core in :mod:`pccl.peer.communicator`
and :mod:`pccl.master.server`.

How it works: one daemon thread per process runs ``trio.run`` (the *core*). Every :class:`Communicator` and
:class:`MasterNode` of the process lives in that one trio loop; a blocking call submits its coroutine with
``trio.from_thread.run`` (with the core's trio token) and waits for the answer. Long-lived things (a
connected communicator, a running master) are tasks in the core's nursery; they hold only an internal session
object, never the public object, so a public object that is garbage collected closes what it owns.

Threading rules (the established ones):

* Each method may be called from any user thread; calls from different threads run concurrently in the core.
* ``all_reduce_async`` may be launched from one thread and its handle waited on from another.
* ``update_topology``, ``optimize_topology`` and ``sync_shared_state`` raise ``PCCLError`` with result
  ``PENDING_ASYNC_OPS`` while a collective of this communicator is still running (launched and not finished).
* Calling the blocking API from inside the core thread (for example from a progress callback) raises
  ``PCCLError`` with ``INVALID_USAGE`` instead of deadlocking.

Objects clean up on ``close()``, on leaving a ``with`` block, when garbage collected, and at interpreter exit
(an ``atexit`` hook closes every communicator and master, then stops the core thread, each step bounded in
time).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import trio

from ._address import format_address, parse_address, parse_addresses
from ._config import MasterConfig, PeerConfig
from ._env import master_address, master_origin
from ._errors import (
    HelloRefusedError,
    InvalidArgumentError,
    InvalidBufferError,
    InvalidUsageError,
    MasterConnectionError,
    PCCLError,
    PendingAsyncOpsError,
    RankConnectionLostError,
    Result,
    TooFewPeersError,
)
from ._rawmem import address_of, is_address, view_at
from ._types import (
    Attribute,
    DataType,
    DeviceType,
    DistributionHint,
    QuantizationAlgorithm,
    QuantizationOptions,
    ReduceInfo,
    ReduceOp,
    SharedStateSyncInfo,
    SharedStateSyncStrategy,
)
from .kernels import backend
from .master.server import MasterServer
from .peer.shared_state import SharedState, TensorInfo

log = logging.getLogger("pccl.blocking")

T = TypeVar("T")

#: Bound on every wait that cleanup does (closing a communicator, stopping a master, stopping the core):
#: cleanup must never hang the caller, least of all at interpreter exit.
CLOSE_TIMEOUT = 5.0

#: Seconds between connection attempts in :meth:`Communicator.connect` (one second, as the established
#: bindings: a peer started together with its master waits for the master to come up).
_CONNECT_RETRY_INTERVAL = 1.0

#: How many times :meth:`Communicator.sync_shared_state` runs a sync again after a participant was lost
#: during it (the established library completes the sync without the lost peer; ours aborts it for every
#: participant, atomically, and every survivor runs it again).
_SYNC_RETRIES_ON_PEER_LOSS = 8


# ----------------------------------------------------------------------------------------------------------
# data-type helpers (the established DataType carries these as methods; ours are functions)


def datatype_from_torch(torch_dtype: Any) -> DataType:
    """The :class:`DataType` of a ``torch.dtype``.

    Raises:
        InvalidArgumentError: unsupported dtype (bool, complex, ...) or torch is not imported.
    """
    return backend.torch_to_dtype(torch_dtype)


def datatype_to_torch(datatype: DataType) -> Any:
    """The ``torch.dtype`` of a :class:`DataType` (imports torch).

    Raises:
        InvalidArgumentError: torch is not installed or has no such dtype.
    """
    return backend.dtype_to_torch(DataType(datatype))


def datatype_from_numpy(np_dtype: Any) -> DataType:
    """The :class:`DataType` of a numpy dtype (``ml_dtypes.bfloat16`` maps to BFLOAT16).

    Raises:
        InvalidArgumentError: unsupported dtype or non-native byte order.
    """
    return backend.numpy_to_dtype(np_dtype)


def datatype_to_numpy(datatype: DataType) -> np.dtype[Any]:
    """The numpy dtype of a :class:`DataType` (BFLOAT16: ``ml_dtypes.bfloat16`` when installed).

    Raises:
        InvalidArgumentError: unknown data type.
    """
    return backend.dtype_to_numpy(DataType(datatype))


# ----------------------------------------------------------------------------------------------------------
# reduce descriptors (established names and fields)


@dataclass
class ReduceOperandDescriptor:
    """What the operands of a reduce are.

    Args:
        datatype: element type of the send/recv buffers; must match the tensors.
        distribution_hint: accepted for compatibility; it does not change the result.
    """

    datatype: DataType
    distribution_hint: DistributionHint = DistributionHint.NONE


@dataclass
class ReduceDescriptor:
    """One reduce: element count, operation, tag, operand and quantization descriptors.

    Args:
        count: elements reduced: the first ``count`` elements of the (flattened) buffers.
        op: the reduction.
        tag: concurrent operations need distinct tags.
        operand_descriptor: operand data type (checked against the tensors).
        quantization_options: wire compression; ``None`` or algorithm NONE sends full precision.
    """

    count: int
    op: ReduceOp
    tag: int
    operand_descriptor: ReduceOperandDescriptor
    quantization_options: QuantizationOptions | None = None

    def __post_init__(self) -> None:
        # As the established bindings: the options are always there; "none given" is full precision.
        if self.quantization_options is None:
            self.quantization_options = QuantizationOptions(self.operand_descriptor.datatype,
                                                            QuantizationAlgorithm.NONE)


class ReduceOpDescriptor:
    """A reduce together with its buffers, for :meth:`Communicator.all_reduce_multiple_with_retry`.

    Build it with :meth:`from_torch`, :meth:`from_numpy` or :meth:`from_cupy`: the descriptor keeps
    references to the buffers, so they stay alive as long as the descriptor does. The established form
    ``ReduceOpDescriptor(sendbuf_ptr, recvbuf_ptr, reduce_descriptor)`` with raw host addresses (``int``)
    works too: ``reduce_descriptor.count`` elements of ``operand_descriptor.datatype`` at each address, memory
    the caller keeps alive.

    Attributes:
        send, recv: the buffers (numpy views for raw addresses).
        sendbuf_ptr, recvbuf_ptr: their addresses, as in the established bindings.
        reduce_descriptor: the reduce.

    Raises:
        InvalidBufferError: a null address.
    """

    def __init__(self, send: Any, recv: Any, reduce_descriptor: ReduceDescriptor) -> None:
        if is_address(send) or is_address(recv):
            dtype = DataType(reduce_descriptor.operand_descriptor.datatype)
            send = view_at(send, reduce_descriptor.count, dtype) if is_address(send) else send
            recv = view_at(recv, reduce_descriptor.count, dtype) if is_address(recv) else recv
        self.send = send
        self.recv = recv
        self.reduce_descriptor = reduce_descriptor

    @property
    def sendbuf_ptr(self) -> int:
        """The address of the send buffer."""
        return address_of(self.send)

    @property
    def recvbuf_ptr(self) -> int:
        """The address of the receive buffer."""
        return address_of(self.recv)

    @staticmethod
    def from_torch(send: Any, recv: Any, reduce_descriptor: ReduceDescriptor) -> ReduceOpDescriptor:
        """Describe a reduce over two contiguous torch tensors (``send`` may be ``recv``).

        Raises:
            InvalidArgumentError: not torch tensors, not contiguous, dtype/device/size mismatch.
        """
        return ReduceOpDescriptor._checked(
            send, recv, reduce_descriptor, backend.is_torch_tensor, "from_torch needs two torch tensors"
        )

    @staticmethod
    def from_numpy(send: np.ndarray[Any, Any], recv: np.ndarray[Any, Any],
                   reduce_descriptor: ReduceDescriptor) -> ReduceOpDescriptor:
        """Describe a reduce over two C-contiguous numpy arrays (``send`` may be ``recv``).

        Raises:
            InvalidArgumentError: not numpy arrays, not contiguous, dtype/size mismatch.
        """
        return ReduceOpDescriptor._checked(
            send, recv, reduce_descriptor, _is_numpy, "from_numpy needs two numpy arrays"
        )

    @staticmethod
    def from_cupy(send: Any, recv: Any, reduce_descriptor: ReduceDescriptor) -> ReduceOpDescriptor:
        """Describe a reduce over two C-contiguous cupy arrays on one GPU (``send`` may be ``recv``).

        Raises:
            InvalidArgumentError: not cupy arrays, not contiguous, dtype/device/size mismatch.
        """
        return ReduceOpDescriptor._checked(
            send, recv, reduce_descriptor, backend.is_cupy_array, "from_cupy needs two cupy arrays"
        )

    @staticmethod
    def _checked(send: Any, recv: Any, reduce_descriptor: ReduceDescriptor, is_kind: Callable[[object], bool],
                 refusal: str) -> ReduceOpDescriptor:
        if not (is_kind(send) and is_kind(recv)):
            raise InvalidBufferError(f"ReduceOpDescriptor.{refusal}")
        _check_pair(send, recv, reduce_descriptor.count)
        return ReduceOpDescriptor(send, recv, reduce_descriptor)

    def __repr__(self) -> str:
        d = self.reduce_descriptor
        return f"<ReduceOpDescriptor count={d.count} op={ReduceOp(d.op).name} tag={d.tag}>"


def _is_numpy(t: object) -> bool:
    return isinstance(t, np.ndarray)


def _check_pair(send: Any, recv: Any, count: int | None) -> DataType:
    """Validate a send/recv pair (dtype, size, same device); returns their data type.

    Raises:
        InvalidBufferError: the pair is unusable (an AssertionError too, as the established checks).
    """
    try:
        backend.check_same_device(backend.device_index(send), backend.device_index(recv))
        sd = backend.describe(send)
        rd = backend.describe(recv)
    except InvalidArgumentError as exc:
        raise InvalidBufferError(exc.message) from None
    if sd.dtype != rd.dtype:
        raise InvalidBufferError(f"send is {sd.dtype.name} but recv is {rd.dtype.name}")
    if sd.count != rd.count:
        raise InvalidBufferError(f"send has {sd.count} elements but recv has {rd.count}")
    if count is not None and not 0 < count <= sd.count:
        raise InvalidBufferError(f"count {count} out of range for tensors of {sd.count} elements")
    return sd.dtype


def _flat_prefix(t: Any, count: int) -> Any:
    """The first ``count`` elements of a contiguous tensor, as a flat view sharing its memory."""
    return t.reshape(-1)[:count]


@dataclass(frozen=True)
class _Operand:
    """A validated reduce, ready for the async core."""

    send: Any
    recv: Any
    op: ReduceOp
    tag: int
    quantization: QuantizationOptions | None


def _prepare(send: Any, recv: Any, *, op: Any, tag: Any, count: int | None,
             operand_descriptor: ReduceOperandDescriptor | None,
             quantization_options: QuantizationOptions | None) -> _Operand:
    """Check a reduce's arguments like the established bindings do, raising PCCLError instead of asserting."""
    if recv is None:
        recv = send
    if not any(is_kind(send) and is_kind(recv)
               for is_kind in (_is_numpy, backend.is_torch_tensor, backend.is_cupy_array)):
        raise InvalidBufferError(
            f"unsupported input types {type(send).__name__}, {type(recv).__name__}: send and recv must "
            "both be torch.Tensor, both be numpy.ndarray or both be cupy.ndarray")
    dtype = _check_pair(send, recv, count)
    try:
        op = ReduceOp(op)
    except ValueError:
        raise InvalidArgumentError(f"unknown reduce op {op!r}") from None
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 2**63:
        raise InvalidArgumentError(f"tag must be a non-negative 64-bit integer, got {tag!r}")
    q: QuantizationOptions | None = None
    try:
        if operand_descriptor is not None and DataType(operand_descriptor.datatype) != dtype:
            said = DataType(operand_descriptor.datatype).name
            raise InvalidArgumentError(f"operand_descriptor says {said} but the tensors are {dtype.name}")
        if quantization_options is not None and \
                QuantizationAlgorithm(quantization_options.algorithm) != QuantizationAlgorithm.NONE:
            q = QuantizationOptions(quantized_datatype=DataType(quantization_options.quantized_datatype),
                                    algorithm=QuantizationAlgorithm(quantization_options.algorithm))
    except ValueError as exc:
        if isinstance(exc, PCCLError):
            raise
        raise InvalidArgumentError(f"bad operand or quantization descriptor: {exc}") from None
    if count is not None:
        send, recv = _flat_prefix(send, count), _flat_prefix(recv, count)
    # The async core copies GPU tensors to the host in its own thread, on that thread's current stream: make
    # the work this (the caller's) thread queued on its current stream to produce ``send`` finish first.
    backend.sync_current_stream(send)
    return _Operand(send=send, recv=recv, op=op, tag=tag, quantization=q)


def _prepare_pair(send: Any, recv: Any, tag: Any) -> tuple[Any, Any]:
    """Check a collective's buffers (one library, one device, one dtype) and tag like :func:`_prepare`;
    their sizes are the kind's to check (the async core does, before voting). ``recv`` None: ``send``."""
    if recv is None:
        recv = send
    if not any(is_kind(send) and is_kind(recv)
               for is_kind in (_is_numpy, backend.is_torch_tensor, backend.is_cupy_array)):
        raise InvalidBufferError(
            f"unsupported input types {type(send).__name__}, {type(recv).__name__}: send and recv must "
            "both be torch.Tensor, both be numpy.ndarray or both be cupy.ndarray")
    try:
        backend.check_same_device(backend.device_index(send), backend.device_index(recv))
        sd, rd = backend.describe(send), backend.describe(recv)
    except InvalidArgumentError as exc:
        raise InvalidBufferError(exc.message) from None
    if sd.dtype != rd.dtype:
        raise InvalidBufferError(f"send is {sd.dtype.name} but recv is {rd.dtype.name}")
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 2**63:
        raise InvalidArgumentError(f"tag must be a non-negative 64-bit integer, got {tag!r}")
    backend.sync_current_stream(send)  # as _prepare: the caller's stream has produced ``send``
    return send, recv


# ----------------------------------------------------------------------------------------------------------
# the core thread


def _translate(exc: BaseException) -> BaseException:
    """Map what escapes the async core to one PCCLError (never a raw group or OSError)."""
    if isinstance(exc, PCCLError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        leaves: list[BaseException] = []

        def walk(e: BaseException) -> None:
            if isinstance(e, BaseExceptionGroup):
                for sub in e.exceptions:
                    walk(sub)
            else:
                leaves.append(e)

        walk(exc)
        for leaf in leaves:
            if isinstance(leaf, PCCLError):
                return leaf
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return exc
    if isinstance(exc, (trio.Cancelled, trio.RunFinishedError)):
        return InvalidUsageError("the pccl core thread stopped (is the interpreter exiting?)")
    err = PCCLError(f"internal error: {exc!r}", Result.INTERNAL_ERROR)
    err.__cause__ = exc
    return err


def _only_cancelled(exc: BaseException) -> bool:
    """True for ``trio.Cancelled`` and for an exception group (nested or not) made only of Cancelled."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(sub) for sub in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


class _Core:
    """The one background thread per process that runs the trio loop shared by every blocking object."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = -1
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._atexit_registered = False

    @property
    def running(self) -> bool:
        """True when the core thread of this process is alive."""
        t = self._thread
        return t is not None and t.is_alive() and self._pid == os.getpid() and self._token is not None

    def in_core_thread(self) -> bool:
        """True when called from the core thread itself."""
        return self._thread is not None and threading.current_thread() is self._thread

    def token(self) -> trio.lowlevel.TrioToken:
        """The trio token of the running core, starting the core thread on first use (or after a fork)."""
        with self._lock:
            if not self.running:
                self._start_locked()
            assert self._token is not None
            return self._token

    def _start_locked(self) -> None:
        # After os.fork() the child inherits our attributes but not the thread: start afresh.
        ready = threading.Event()
        box: dict[str, Any] = {}

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                box["token"] = trio.lowlevel.current_trio_token()
                box["nursery"] = nursery
                box["stop"] = stop = trio.Event()
                ready.set()
                await stop.wait()
                nursery.cancel_scope.cancel()

        def thread_main() -> None:
            try:
                trio.run(main)
            except BaseException:
                log.exception("the pccl core thread crashed")
            finally:
                ready.set()

        thread = threading.Thread(target=thread_main, name="pccl-core", daemon=True)
        thread.start()
        ready.wait()
        if "token" not in box:
            raise PCCLError("the pccl core thread failed to start", Result.INTERNAL_ERROR)
        self._thread = thread
        self._pid = os.getpid()
        self._token = box["token"]
        self._nursery = box["nursery"]
        self._stop = box["stop"]
        if not self._atexit_registered:
            atexit.register(_shutdown_at_exit)
            self._atexit_registered = True

    def _check_thread(self) -> None:
        if self.in_core_thread():
            raise InvalidUsageError(
                "blocking pccl calls cannot be made from the pccl core thread (for example from a progress "
                "callback); call them from your own threads")

    def call(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await afn(*args)`` in the core and return its result; errors come back as PCCLError."""
        self._check_thread()
        token = self.token()

        async def guarded() -> T:
            try:
                return await afn(*args)
            except BaseException as exc:
                translated = _translate(exc)
                if translated is exc:
                    raise
                raise translated from exc

        try:
            return trio.from_thread.run(guarded, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled) as exc:
            raise _translate(exc) from exc

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the synchronous ``fn(*args)`` in the core thread (for reading core-owned state safely)."""
        self._check_thread()
        token = self.token()
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled) as exc:
            raise _translate(exc) from exc

    def host(self, body: Callable[[Callable[[Any], None]], Awaitable[None]]) -> Any:
        """Start a long-lived task in the core's nursery; block until it calls ``started(value)``.

        An error raised by ``body`` before it calls ``started`` is raised here; one raised after is logged,
        so a hosted task can never take the core (and every other object of the process) down.
        """

        async def start() -> Any:
            assert self._nursery is not None

            async def hosted(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                started = False

                def mark_started(value: Any) -> None:
                    nonlocal started
                    started = True
                    task_status.started(value)

                try:
                    await body(mark_started)
                except BaseException as exc:
                    if not started or _only_cancelled(exc):
                        raise
                    log.exception("a pccl background task failed")

            return await self._nursery.start(hosted)

        return self.call(start)

    def run_soon(self, fn: Callable[[], None]) -> bool:
        """Schedule ``fn()`` in the core thread without waiting (safe from any thread, also from ``__del__``).

        Returns:
            False when there is no running core to schedule it in.
        """
        if not self.running or self._token is None:
            return False
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            return False
        return True

    def stop(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Stop the core thread (bounded wait). Later calls start a fresh one."""
        with self._lock:
            thread, stop = self._thread, self._stop
            if thread is None or stop is None or not self.running:
                return
            self.run_soon(stop.set)
            thread.join(timeout)
            if thread.is_alive():
                log.warning("the pccl core thread did not stop within %.1fs; abandoning it (daemon)", timeout)
            self._thread = None
            self._token = None
            self._nursery = None
            self._stop = None


_core = _Core()

# Live communicators, closed at interpreter exit. Weak: the core never keeps a public object alive.
_live_communicators: weakref.WeakSet[Communicator] = weakref.WeakSet()


# Masters that serve (run() and no interrupt() yet), whether or not their MasterNode still exists: as in the
# established bindings, a master keeps serving until it is interrupted, also past the end of the script.
_serving_masters: set[_MasterSession] = set()
_serving_lock = threading.Lock()


def _shutdown_at_exit() -> None:
    """atexit hook: close communicators, serve the masters still running until interrupted, stop the core.

    The masters' wait ends with Ctrl-C (SIGINT) or ``interrupt()`` from another thread; it is skipped when the
    script ended with an uncaught KeyboardInterrupt (the user interrupted it already). Every other step is
    bounded in time.
    """
    if not _core.running:
        return
    try:
        for comm in list(_live_communicators):
            try:
                comm.close()
            except Exception:
                log.debug("closing a communicator at exit failed", exc_info=True)
        if not isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
            _serve_until_interrupted()
    except KeyboardInterrupt:
        pass
    finally:
        with _serving_lock:
            sessions = [s for s in _serving_masters if s.pid == os.getpid()]
        for session in sessions:
            try:
                _core.call(session.stop, CLOSE_TIMEOUT)
            except BaseException:
                log.debug("stopping a master at exit failed", exc_info=True)
        _core.stop()


def _serve_until_interrupted() -> None:
    """Block while a master serves (the established library's MasterNode lifetime)."""
    while True:
        with _serving_lock:
            # (a forked child inherits the parent's set, not its masters: only this process's count)
            serving = [s for s in _serving_masters if not s.stopped.is_set() and s.pid == os.getpid()]
        if not serving:
            return
        session = serving[0]
        log.warning("the pccl master on %s:%d keeps serving until interrupted (Ctrl-C)", session.host,
                    session.port)
        while not session.stopped.wait(0.25):  # short waits: SIGINT is handled between them
            pass


def stop_serving_masters() -> list[str]:
    """Stop every master this process still serves after ``run()`` without an ``interrupt()``.

    A script's masters keep serving past its end (the established bindings' lifetime); a test harness must not
    wait for them at exit. The pytest plugin of :mod:`pccl.testing` calls this when the session ends.

    Returns:
        The ``"HOST:PORT"`` of each master that was still serving (empty when none was).
    """
    with _serving_lock:
        serving = [s for s in _serving_masters if not s.stopped.is_set() and s.pid == os.getpid()]
    for session in serving:
        try:
            _core.call(session.stop, CLOSE_TIMEOUT)
        except BaseException:
            log.debug("stopping a master failed", exc_info=True)
    return [f"{s.host}:{s.port}" for s in serving]


# ----------------------------------------------------------------------------------------------------------
# MasterNode


class _MasterSession:
    """A master served in the core. Hosted tasks reference this, never the public MasterNode."""

    def __init__(self, host: str, port: int, config: MasterConfig | None) -> None:
        self.server = MasterServer(config=config)
        self.host = host
        self.port = port
        self.scope: trio.CancelScope | None = None
        self.stopped = threading.Event()
        self.done = trio.Event()
        self.pid = os.getpid()

    async def serve(self, started: Callable[[Any], None]) -> None:
        from .transport import ConnectFailed

        def listening(bound: Any) -> None:
            self.port = int(bound[1])
            with _serving_lock:
                _serving_masters.add(self)
            started(bound)

        try:
            with trio.CancelScope() as scope:
                self.scope = scope
                try:
                    await self.server.serve(self.host, self.port, task_status=_StartedProxy(listening))
                except ConnectFailed as exc:
                    log.debug("the master cannot listen", exc_info=True)
                    raise PCCLError(str(exc), Result.SYSTEM_ERROR) from None
        finally:
            with _serving_lock:
                _serving_masters.discard(self)
            self.stopped.set()
            self.done.set()

    def cancel(self) -> None:
        if self.scope is not None:
            self.scope.cancel()

    async def stop(self, timeout: float) -> None:
        self.cancel()
        with trio.move_on_after(timeout):
            await self.done.wait()


class _StartedProxy:
    """Adapts a plain ``started(value)`` callback to the ``task_status`` protocol."""

    def __init__(self, started: Callable[[Any], None]) -> None:
        self._started = started

    def started(self, value: Any = None) -> None:
        self._started(value)


class MasterNode:
    """A master node run in the background (established API).

    Lifetime, as in the established bindings: once :meth:`run` returned, the master serves until
    :meth:`interrupt` (or :meth:`close`, or leaving a ``with`` block) stops it. Dropping the object does not
    stop it, and a script that ends while a master serves keeps serving until Ctrl-C (the exit hook waits),
    so a master script may end with ``master.run()``.

    Args:
        listen_address: ``"HOST:PORT"`` to bind, e.g. ``"0.0.0.0:48148"``; port 0 lets the system choose (read
            it back from :attr:`port` after :meth:`run`).
        config: master timeouts and limits (:class:`pccl.MasterConfig`); keyword-only extension.

    Raises:
        InvalidArgumentError: malformed address.
    """

    def __init__(self, listen_address: str, *, config: MasterConfig | None = None) -> None:
        self.listen_address = listen_address
        self._host, self._port = parse_address(listen_address)
        self._config = config
        self._lock = threading.Lock()
        self._session: _MasterSession | None = None
        self._bound: tuple[str, int] | None = None

    @property
    def running(self) -> bool:
        """True between :meth:`run` and :meth:`interrupt`."""
        s = self._session
        return s is not None and not s.stopped.is_set()

    def run(self) -> None:
        """Start serving. Returns as soon as the master listens; it keeps serving in the background.

        Raises:
            InvalidUsageError: already running.
            PCCLError: SYSTEM_ERROR when the address cannot be bound (e.g. in use).
        """
        with self._lock:
            if self.running:
                raise InvalidUsageError(f"the master on {self.listen_address} is already running")
            session = _MasterSession(self._host, self._port, self._config)
            bound = _core.host(session.serve)
            self._session = session
            self._bound = (str(bound[0]), int(bound[1]))
        log.info("master listening on %s:%d", *self._bound)

    def interrupt(self) -> None:
        """Stop the master and wait (bounded) until its port is released. A second call does nothing.

        Raises:
            InvalidUsageError: :meth:`run` was never called.
        """
        with self._lock:
            session = self._session
            if session is None:
                raise InvalidUsageError("interrupt() on a master that was never run()")
            if session.stopped.is_set():
                return
            if _core.in_core_thread():
                _core.run_soon(session.cancel)
                return
            _core.call(session.stop, CLOSE_TIMEOUT)

    def close(self) -> None:
        """Stop the master if it runs (unlike :meth:`interrupt`, never raises for a master never run)."""
        if self._session is not None:
            self.interrupt()

    @property
    def port(self) -> int:
        """The bound port (the real one when 0 was asked for).

        Raises:
            InvalidUsageError: :meth:`run` was never called.
        """
        return self._bound_address()[1]

    @property
    def address(self) -> str:
        """``"HOST:PORT"`` that peers on this machine can connect to (a wildcard host becomes loopback).

        Raises:
            InvalidUsageError: :meth:`run` was never called.
        """
        host, port = self._bound_address()
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _bound_address(self) -> tuple[str, int]:
        if self._bound is None:
            raise InvalidUsageError("the master has no address before run()")
        return self._bound

    def statistics(self) -> dict[str, Any]:
        """The master's summary (accepted/registered peers, connections, ...).

        Raises:
            InvalidUsageError: :meth:`run` was never called.
        """
        session = self._session
        if session is None:
            raise InvalidUsageError("statistics() on a master that was never run()")
        return _core.call_sync(session.server.statistics)

    def __enter__(self) -> MasterNode:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        # Nothing to do: a master that serves keeps serving until interrupted (its session is referenced by
        # _serving_masters; the exit hook waits for it), and one that never ran holds nothing.
        pass

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        where = f"{self._bound[0]}:{self._bound[1]}" if self._bound else self.listen_address
        return f"<MasterNode {where} {state}>"


# ----------------------------------------------------------------------------------------------------------
# Communicator


class AsyncReduceHandle:
    """The handle of an asynchronous collective: :meth:`Communicator.all_reduce_async` and the other
    ``*_async`` calls (``reduce_scatter_async``, ``all_gather_async``, ``broadcast_async``,
    ``reduce_async``, ``all_to_all_async``).

    :meth:`wait` may be called from any thread, any number of times.
    """

    def __init__(self, tag: int, future: concurrent.futures.Future[tuple[bool, Result, ReduceInfo]]) -> None:
        self.tag = tag
        self._future = future
        self.error: PCCLError | None = None
        """The error of a failed operation (available once :meth:`wait` returned)."""
        self.chunk: slice | None = None
        """reduce_scatter_async: the range of ``recv`` that holds this peer's chunk (once :meth:`wait`
        returned success); None otherwise."""

    def wait(self) -> tuple[bool, Result, ReduceInfo]:
        """Block until the operation finished.

        Returns:
            ``(is_success, status, info)``: ``status`` is a :class:`Result` (``SUCCESS`` on success, else the
            failure's code, e.g. ``RANK_CONNECTION_LOST``: retry, or ``TOO_FEW_PEERS``); on failure the output
            buffer holds what it held before the call.
        """
        return self._future.result()

    def done(self) -> bool:
        """True once the operation finished (``wait`` will not block)."""
        return self._future.done()

    def __repr__(self) -> str:
        return f"<AsyncReduceHandle tag={self.tag} {'done' if self.done() else 'running'}>"


class _CommSession:
    """A connected async communicator hosted in the core. Tasks reference this, never the public object."""

    def __init__(self, address: str, peer_group: int, pool_size: int, config: PeerConfig | None) -> None:
        self.address = address
        self.peer_group = peer_group
        self.pool_size = pool_size
        self.config = config
        self.comm: Any = None  # pccl.peer.communicator.Communicator once accepted
        self.ops: trio.Nursery | None = None
        self.scope: trio.CancelScope | None = None
        self.closing = False
        self.host_started = False
        self.connected = False
        self.done = trio.Event()

    async def run(self, started: Callable[[Any], None]) -> None:
        from .peer.communicator import open_communicator

        self.host_started = True
        try:
            with trio.CancelScope() as scope:
                self.scope = scope
                if self.closing:
                    scope.cancel()
                async with open_communicator(self.address, peer_group=self.peer_group,
                                             p2p_connection_pool_size=self.pool_size,
                                             config=self.config) as comm:
                    async with trio.open_nursery() as ops:
                        self.comm, self.ops = comm, ops
                        self.connected = True
                        started(None)
                        await trio.sleep_forever()
            if not self.connected:
                raise InvalidUsageError("the communicator was closed while connecting")
        finally:
            self.comm = None
            self.ops = None
            self.done.set()

    def cancel(self) -> None:
        self.closing = True
        if self.scope is not None:
            self.scope.cancel()

    async def stop(self, timeout: float) -> None:
        self.cancel()
        if self.host_started:
            with trio.move_on_after(timeout):
                await self.done.wait()


class Communicator:
    """A peer of a pccl run (established blocking API).

    Args:
        address: the master's ``"HOST:PORT"`` or ``(host, port)`` (port 48148 when omitted); None:
            ``$PCCL_MASTER``.
        peer_group: collectives and shared-state syncs run within a peer group.
        p2p_connection_pool_size: TCP connections per ring neighbour (0: the default, sized per
            partner from its round trip and its observed throughput, docs/topology.md).
        config: peer timeouts and limits (:class:`pccl.PeerConfig`); keyword-only extension.

    Raises:
        InvalidArgumentError: malformed address, negative peer group or pool size.
    """

    def __init__(self, address: str | tuple[str, int] | list[str | tuple[str, int]] | None = None,
                 peer_group: int = 0, p2p_connection_pool_size: int = 0, *,
                 config: PeerConfig | None = None) -> None:
        # fail now on a malformed address; several (a list or "h1:p,h2:p"): the master and its standbys
        self._origin = master_origin(address)  # " (from PCCL_MASTER=...)" for errors
        address = ",".join(format_address(h, p) for h, p in parse_addresses(master_address(address)))
        if isinstance(peer_group, bool) or not isinstance(peer_group, int) or not 0 <= peer_group < 2**32:
            raise InvalidArgumentError(f"peer_group must be an unsigned 32-bit integer, got {peer_group!r}")
        if p2p_connection_pool_size < 0:
            raise InvalidArgumentError("p2p_connection_pool_size must be >= 0")
        self.address = address
        self.peer_group = peer_group
        self.p2p_connection_pool_size = p2p_connection_pool_size
        self._config = config
        self._lock = threading.Lock()
        self._session: _CommSession | None = None
        self._pending_session: _CommSession | None = None  # the attempt connect() is making right now
        self._connecting = False
        self._closed = False
        self._closed_event = threading.Event()
        self._inflight: dict[int, str] = {}  # tag -> what runs under it (collectives of this peer)
        _live_communicators.add(self)

    # --- lifecycle -----------------------------------------------------------------------------------

    def connect(self, n_attempts: int = 5) -> None:
        """Connect to the master and return once this peer is accepted into the run.

        The first peer is accepted at once; later peers wait until the accepted peers call
        :meth:`update_topology`. A failed connection is retried ``n_attempts`` times in all, one second
        apart (as the established bindings).

        Raises:
            InvalidArgumentError: ``n_attempts < 1``.
            InvalidUsageError: already connected or connecting, or closed (also when closed meanwhile).
            MasterConnectionError: every attempt failed (result MASTER_CONNECTION_FAILED).
            HelloRefusedError: the master refused this peer (bad secret, another run or protocol
                version) or is no pccl master: not retried.
        """
        if n_attempts < 1:
            raise InvalidArgumentError("n_attempts must be >= 1")
        with self._lock:
            if self._closed:
                raise InvalidUsageError("connect() on a closed communicator")
            if self._connecting or self._session is not None:
                raise InvalidUsageError("connect() on a communicator that is already connected or connecting")
            self._connecting = True
        try:
            last: MasterConnectionError | None = None
            for attempt in range(1, n_attempts + 1):
                session = _CommSession(self.address, self.peer_group, self.p2p_connection_pool_size,
                                       self._config)
                with self._lock:
                    if self._closed:
                        raise InvalidUsageError("the communicator was closed while connecting")
                    self._pending_session = session
                try:
                    _core.host(session.run)
                except HelloRefusedError as exc:
                    # A bad secret, another run or protocol: every attempt would fail the same way.
                    raise HelloRefusedError(exc.message + self._origin) from None
                except MasterConnectionError as exc:
                    last = exc
                    log.warning("connecting to the master at %s failed (attempt %d/%d): %s",
                                self.address, attempt, n_attempts, exc.message)
                    if attempt < n_attempts and self._closed_event.wait(_CONNECT_RETRY_INTERVAL):
                        raise InvalidUsageError("the communicator was closed while connecting") from exc
                    continue
                except BaseException:
                    # KeyboardInterrupt in this thread (or any other error): the attempt may still be
                    # running in the core; make sure it does not stay connected behind our back.
                    session.closing = True
                    _core.run_soon(session.cancel)
                    raise
                finally:
                    with self._lock:
                        self._pending_session = None
                with self._lock:
                    self._session = session
                    closed = self._closed
                if closed:
                    # close() ran while the last step of connecting finished: honour it.
                    self._stop_session(session)
                    raise InvalidUsageError("the communicator was closed while connecting")
                log.info("connected to the master at %s", self.address)
                return
            assert last is not None
            log.debug("the last attempt failed with", exc_info=last)
            raise MasterConnectionError(
                f"could not connect to the master at {self.address}{self._origin} after {n_attempts} "
                f"attempt(s): {last.message}") from None
        finally:
            with self._lock:
                self._connecting = False

    def close(self) -> None:
        """Leave the run (the others see it like a failure, minus the wait) and free resources.

        Running async operations fail (their handles report ``INVALID_USAGE``). Idempotent; bounded in time;
        safe from any thread, including while another thread is blocked in :meth:`connect`.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closed_event.set()
            sessions = [s for s in (self._session, self._pending_session) if s is not None]
        for session in sessions:
            self._stop_session(session)

    def _stop_session(self, session: _CommSession) -> None:
        session.closing = True
        if _core.in_core_thread() or not _core.running:
            _core.run_soon(session.cancel)
            return
        try:
            _core.call(session.stop, CLOSE_TIMEOUT)
        except PCCLError:
            log.debug("stopping a communicator failed", exc_info=True)

    @property
    def connected(self) -> bool:
        """True after :meth:`connect` succeeded and until :meth:`close`."""
        s = self._session
        return s is not None and s.comm is not None and not self._closed

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        # Never block in a finalizer (it may even run in the core thread): schedule the close and return.
        try:
            if not self._closed:
                self._closed = True
                self._closed_event.set()
                for s in (self._session, self._pending_session):
                    if s is not None:
                        s.closing = True
                        _core.run_soon(s.cancel)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self.connected else "not connected"
        return f"<Communicator master={self.address} group={self.peer_group} {state}>"

    # --- plumbing ------------------------------------------------------------------------------------

    def _comm(self, what: str) -> tuple[_CommSession, Any]:
        """The connected session, or a clear INVALID_USAGE error."""
        if self._closed:
            raise InvalidUsageError(f"{what} on a closed communicator")
        s = self._session
        comm = s.comm if s is not None else None
        if s is None or comm is None:
            raise InvalidUsageError(f"{what} before connect(): call connect() first")
        return s, comm

    def _check_no_ops(self, what: str) -> None:
        with self._lock:
            if self._inflight:
                raise PendingAsyncOpsError(
                    f"{what} while {len(self._inflight)} collective(s) of this communicator are running "
                    f"(tags {sorted(self._inflight)}); wait for them first")

    @contextmanager
    def _tracking(self, tags: Sequence[int], what: str) -> Iterator[None]:
        self._track(tags, what)
        try:
            yield
        finally:
            self._untrack(tags)

    def _track(self, tags: Sequence[int], what: str) -> None:
        with self._lock:
            if len(set(tags)) != len(tags):
                raise InvalidUsageError(f"{what}: the same tag is used twice: {sorted(tags)}")
            busy = [t for t in tags if t in self._inflight]
            if busy:
                raise InvalidUsageError(f"{what}: tag(s) {busy} already running on this communicator "
                                        f"({', '.join(self._inflight[t] for t in busy)})")
            for t in tags:
                self._inflight[t] = what

    def _untrack(self, tags: Sequence[int]) -> None:
        with self._lock:
            for t in tags:
                self._inflight.pop(t, None)

    # --- queries and membership ------------------------------------------------------------------------

    def get_attribute(self, attribute: Attribute) -> int:
        """Read an attribute: GLOBAL_WORLD_SIZE, PEER_GROUP_WORLD_SIZE (alias LOCAL_WORLD_SIZE),
        NUM_DISTINCT_PEER_GROUPS, LARGEST_PEER_GROUP_WORLD_SIZE.

        Raises:
            InvalidUsageError: not connected.
            InvalidArgumentError: unknown attribute.
        """
        _, comm = self._comm("get_attribute")
        try:
            attr = Attribute(attribute)
        except ValueError:
            raise InvalidArgumentError(f"unknown attribute {attribute!r}") from None
        return int(_core.call_sync(comm.get_attribute, attr))

    def statistics(self) -> dict[str, Any]:
        """This peer's summary: peer id, world and group size, epoch, operations in flight, whether the
        master is reachable, the P2P pool, and where collectives spent their time (``phase_seconds``,
        ``last_op_phases``); see :meth:`pccl.AsyncCommunicator.statistics`.

        Raises:
            InvalidUsageError: not connected.
        """
        _, comm = self._comm("statistics")
        return dict(_core.call_sync(comm.statistics))

    def update_topology(self) -> None:
        """Vote to admit pending peers; returns when every accepted peer voted and connected its ring.

        Raises:
            InvalidUsageError: not connected.
            PendingAsyncOpsError: a collective of this communicator is still running (PENDING_ASYNC_OPS).
            UpdateTopologyFailedError: P2P setup failed somewhere; retry.
            MasterConnectionError: the master is lost.
        """
        _, comm = self._comm("update_topology")
        self._check_no_ops("update_topology")
        _core.call(comm.update_topology)

    def are_peers_pending(self) -> bool:
        """Collective query (every accepted peer calls it): are peers waiting to be admitted?

        Allowed while async collectives run.

        Raises:
            InvalidUsageError: not connected.
            MasterConnectionError: the master is lost.
        """
        _, comm = self._comm("are_peers_pending")
        return bool(_core.call(comm.are_peers_pending))

    def optimize_topology(self) -> None:
        """Vote to measure missing link bandwidths and re-solve the ring (no newcomers admitted).

        Raises:
            InvalidUsageError: not connected.
            PendingAsyncOpsError: a collective of this communicator is still running.
            TopologyOptimizationFailedError: retry.
        """
        _, comm = self._comm("optimize_topology")
        self._check_no_ops("optimize_topology")
        _core.call(comm.optimize_topology)

    def sync_shared_state(self, shared_state: SharedState,
                          strategy: SharedStateSyncStrategy = SharedStateSyncStrategy.ENFORCE_POPULAR,
                          ) -> SharedStateSyncInfo:
        """Synchronize ``shared_state`` with the peer group (a group vote).

        Tensors are updated in place and ``shared_state.revision`` is set to the group's revision. Increment
        the revision by one after each sync (the established pattern).

        Raises:
            InvalidUsageError: not connected.
            PendingAsyncOpsError: a collective of this communicator is still running.
            SharedStateSyncError: refused or failed; tensors unchanged.
        """
        _, comm = self._comm("sync_shared_state")
        if not isinstance(shared_state, SharedState):
            raise InvalidArgumentError("sync_shared_state needs a SharedState")
        try:
            strategy = SharedStateSyncStrategy(strategy)
        except ValueError:
            raise InvalidArgumentError(f"unknown shared-state sync strategy {strategy!r}") from None
        self._check_no_ops("sync_shared_state")
        for tensor_info in shared_state.tensor_infos:  # GPU tensors: see _prepare (per-thread streams)
            backend.sync_current_stream(tensor_info.tensor)
        for attempt in range(1, _SYNC_RETRIES_ON_PEER_LOSS + 1):
            try:
                info: SharedStateSyncInfo = _core.call(comm.sync_shared_state, shared_state, strategy)
                return info
            except RankConnectionLostError as exc:
                # A participant was lost during the sync. The master aborted it for every survivor (nothing
                # was applied anywhere) and each of them gets this same error, so each runs the sync again
                # without the lost peer: the survivors' sync succeeds, as in the established library.
                if attempt == _SYNC_RETRIES_ON_PEER_LOSS:
                    raise
                log.info("sync_shared_state: %s; running the sync again without the lost peer", exc.message)
        raise AssertionError("unreachable")

    # --- collectives ---------------------------------------------------------------------------------

    def all_reduce(self, send: Any, recv: Any, *, op: ReduceOp, tag: int = 0,
                   operand_descriptor: ReduceOperandDescriptor | None = None,
                   quantization_options: QuantizationOptions | None = None) -> ReduceInfo:
        """All-reduce ``send`` into ``recv`` (both numpy arrays, both torch tensors on one device, or both
        cupy arrays on one GPU; may be the same).

        Blocks until done. GPU tensors are staged through host memory: the caller's current CUDA stream is
        synchronized first (the work that produced ``send`` is done), ``send`` is copied to the host, and the
        result is in ``recv`` when the call returns. On failure ``recv`` holds exactly what it held before.

        Returns:
            ReduceInfo(local_world_size, tx_bytes, rx_bytes).

        Raises:
            InvalidUsageError: not connected, or ``tag`` already running.
            InvalidArgumentError: bad buffers (type, dtype, size, contiguity) or descriptor mismatch.
            TooFewPeersError: fewer than 2 peers in the group.
            RankConnectionLostError: a participant failed; retry.
        """
        _, comm = self._comm("all_reduce")
        o = _prepare(send, recv, op=op, tag=tag, count=None, operand_descriptor=operand_descriptor,
                     quantization_options=quantization_options)
        with self._tracking([o.tag], "all_reduce"):
            info: ReduceInfo = _core.call(_run_all_reduce, comm, o)
        return info

    def all_reduce_async(self, send: Any, recv: Any, *, op: ReduceOp, tag: int = 0,
                         operand_descriptor: ReduceOperandDescriptor | None = None,
                         quantization_options: QuantizationOptions | None = None) -> AsyncReduceHandle:
        """Launch an all-reduce and return at once; :meth:`AsyncReduceHandle.wait` gives the outcome.

        Do not touch ``send``/``recv`` until the handle is waited for. Launching a ``tag`` that is already
        running on this communicator raises at once. GPU tensors work as in :meth:`all_reduce` (the caller's
        current CUDA stream is synchronized at launch).

        Raises:
            InvalidUsageError: not connected, or ``tag`` already running.
            InvalidArgumentError: bad buffers or descriptor mismatch.
            TooFewPeersError: this peer is alone in its group (raised at launch, as the established bindings).
        """
        session, comm = self._comm("all_reduce_async")
        o = _prepare(send, recv, op=op, tag=tag, count=None, operand_descriptor=operand_descriptor,
                     quantization_options=quantization_options)
        return self._launch("all_reduce_async", session, comm, o.tag, functools.partial(_run_all_reduce, o=o))

    def all_reduce_multiple_with_retry(self, descriptors: Sequence[ReduceOpDescriptor], *,
                                       max_in_flight: int = 4) -> ReduceInfo:
        """Run several all-reduces concurrently (at most ``max_in_flight`` at once), retrying the ones that
        fail because a peer was lost, until all succeed or the group drops below 2 peers.

        Returns:
            Summed tx/rx bytes; ``local_world_size`` is the group size of the last successful operation
            (heuristic only, like the established library).

        Raises:
            InvalidUsageError: not connected, duplicate or already running tags.
            InvalidArgumentError: bad descriptors, ``max_in_flight < 1``.
            TooFewPeersError: the group dropped below 2 peers before all succeeded.
        """
        _, comm = self._comm("all_reduce_multiple_with_retry")
        if max_in_flight < 1:
            raise InvalidArgumentError("max_in_flight must be >= 1")
        items: list[dict[str, Any]] = []
        for d in descriptors:
            if not isinstance(d, ReduceOpDescriptor):
                raise InvalidArgumentError(f"expected ReduceOpDescriptor, got {type(d).__name__}")
            rd = d.reduce_descriptor
            o = _prepare(d.send, d.recv, op=rd.op, tag=rd.tag, count=rd.count,
                         operand_descriptor=rd.operand_descriptor,
                         quantization_options=rd.quantization_options)
            items.append({"send": o.send, "recv": o.recv, "op": o.op, "tag": o.tag,
                          "quantization": o.quantization})
        if not items:
            return ReduceInfo(local_world_size=self.get_attribute(Attribute.PEER_GROUP_WORLD_SIZE),
                              tx_bytes=0, rx_bytes=0)
        with self._tracking([i["tag"] for i in items], "all_reduce_multiple_with_retry"):
            info: ReduceInfo = _core.call(_run_multiple, comm, items, max_in_flight)
        return info


    # --- the other kinds (pccl.collectives.kinds): blocking, and with async handles ---------------------

    def reduce_scatter(self, send: Any, recv: Any = None, *, op: ReduceOp = ReduceOp.SUM,
                       tag: int = 0) -> tuple[ReduceInfo, slice]:
        """Reduce ``send`` across the group; this peer gets its own chunk (blocks until done).

        Returns:
            ``(info, chunk)``: ``recv[chunk]`` holds this peer's reduced chunk, the rest of ``recv`` is
            unchanged (see :meth:`pccl.Communicator.reduce_scatter <pccl.peer.communicator.Communicator>`).

        Raises:
            As :meth:`all_reduce`.
        """
        out: tuple[ReduceInfo, slice] = self._blocking("reduce_scatter", tag, _kind_call(
            "reduce_scatter", *_prepare_pair(send, recv, tag), op=ReduceOp(op), tag=tag))
        return out

    def all_gather(self, send: Any, recv: Any, *, tag: int = 0) -> ReduceInfo:
        """Gather every peer's ``send`` into ``recv`` (``group size x len(send)`` elements) in rank order.

        Raises:
            As :meth:`all_reduce`; INVALID_ARGUMENT when ``recv`` does not fit the group.
        """
        info: ReduceInfo = self._blocking("all_gather", tag, _kind_call(
            "all_gather", *_prepare_pair(send, recv, tag), tag=tag))
        return info

    def broadcast(self, tensor: Any, *, root: int = 0, tag: int = 0) -> ReduceInfo:
        """Overwrite ``tensor`` on every peer with the contents of rank ``root``'s.

        Raises:
            As :meth:`all_reduce`; INVALID_ARGUMENT for a ``root`` outside the group.
        """
        info: ReduceInfo = self._blocking("broadcast", tag, _kind_call(
            "broadcast", _prepare_pair(tensor, None, tag)[0], tag=tag, root=root))
        return info

    def reduce(self, send: Any, recv: Any = None, *, root: int = 0, op: ReduceOp = ReduceOp.SUM,
               tag: int = 0) -> ReduceInfo:
        """Reduce every peer's ``send`` into ``recv`` of rank ``root`` only (``recv`` None: in place);
        the other peers' ``recv`` keeps its bits.

        Raises:
            As :meth:`all_reduce`; INVALID_ARGUMENT for a ``root`` outside the group.
        """
        info: ReduceInfo = self._blocking("reduce", tag, _kind_call(
            "reduce", *_prepare_pair(send, recv, tag), op=ReduceOp(op), tag=tag, root=root))
        return info

    def all_to_all(self, send: Any, recv: Any = None, *, tag: int = 0) -> ReduceInfo:
        """Send block ``j`` of ``send`` (``group size`` equal blocks) to rank ``j``; block ``i`` of ``recv``
        comes from rank ``i`` (``recv`` None: in place).

        Raises:
            As :meth:`all_reduce`; INVALID_ARGUMENT when the sizes are not one block per peer.
        """
        info: ReduceInfo = self._blocking("all_to_all", tag, _kind_call(
            "all_to_all", *_prepare_pair(send, recv, tag), tag=tag))
        return info

    def reduce_scatter_async(self, send: Any, recv: Any = None, *, op: ReduceOp = ReduceOp.SUM,
                             tag: int = 0) -> AsyncReduceHandle:
        """:meth:`reduce_scatter`, launched; the handle's ``chunk`` names this peer's chunk once done."""
        return self._launch_kind("reduce_scatter_async", tag, _kind_call(
            "reduce_scatter", *_prepare_pair(send, recv, tag), op=ReduceOp(op), tag=tag))

    def all_gather_async(self, send: Any, recv: Any, *, tag: int = 0) -> AsyncReduceHandle:
        """:meth:`all_gather`, launched (see :meth:`all_reduce_async`)."""
        return self._launch_kind("all_gather_async", tag, _kind_call(
            "all_gather", *_prepare_pair(send, recv, tag), tag=tag))

    def broadcast_async(self, tensor: Any, *, root: int = 0, tag: int = 0) -> AsyncReduceHandle:
        """:meth:`broadcast`, launched (see :meth:`all_reduce_async`)."""
        return self._launch_kind("broadcast_async", tag, _kind_call(
            "broadcast", _prepare_pair(tensor, None, tag)[0], tag=tag, root=root))

    def reduce_async(self, send: Any, recv: Any = None, *, root: int = 0, op: ReduceOp = ReduceOp.SUM,
                     tag: int = 0) -> AsyncReduceHandle:
        """:meth:`reduce`, launched (see :meth:`all_reduce_async`)."""
        return self._launch_kind("reduce_async", tag, _kind_call(
            "reduce", *_prepare_pair(send, recv, tag), op=ReduceOp(op), tag=tag, root=root))

    def all_to_all_async(self, send: Any, recv: Any = None, *, tag: int = 0) -> AsyncReduceHandle:
        """:meth:`all_to_all`, launched (see :meth:`all_reduce_async`)."""
        return self._launch_kind("all_to_all_async", tag, _kind_call(
            "all_to_all", *_prepare_pair(send, recv, tag), tag=tag))

    def _blocking(self, what: str, tag: int, run: Callable[[Any], Awaitable[Any]]) -> Any:
        """Run one collective of the async core to its end, ``tag`` tracked meanwhile."""
        _, comm = self._comm(what)
        with self._tracking([tag], what):
            return _core.call(run, comm)

    def _launch_kind(self, what: str, tag: int, run: Callable[[Any], Awaitable[Any]]) -> AsyncReduceHandle:
        session, comm = self._comm(what)
        return self._launch(what, session, comm, tag, run)

    def _launch(self, what: str, session: _CommSession, comm: Any, tag: int,
                run: Callable[[Any], Awaitable[Any]]) -> AsyncReduceHandle:
        """Launch ``run(comm)`` in the session's nursery and return its handle at once. A peer alone in
        its group raises TOO_FEW_PEERS here (as the established bindings' all_reduce_async)."""
        group_size = int(_core.call_sync(comm.get_attribute, Attribute.PEER_GROUP_WORLD_SIZE))
        if group_size < 2:
            raise TooFewPeersError(f"{what} needs at least 2 peers in group {self.peer_group}, "
                                   f"it has {group_size}")
        future: concurrent.futures.Future[tuple[bool, Result, ReduceInfo]] = concurrent.futures.Future()
        handle = AsyncReduceHandle(tag, future)
        self._track([tag], what)
        untrack = self._untrack

        async def runner() -> None:
            outcome: tuple[bool, Result, ReduceInfo] | None = None
            try:
                got = await run(comm)
                if isinstance(got, tuple):  # reduce_scatter: (info, chunk)
                    got, handle.chunk = got
                outcome = (True, Result.SUCCESS, got)
            except PCCLError as exc:
                handle.error = exc
                outcome = (False, exc.result, _failed_info(comm))
            except trio.Cancelled:
                handle.error = InvalidUsageError("the communicator was closed while the operation ran")
                outcome = (False, Result.INVALID_USAGE, _failed_info(comm))
                raise
            except Exception as exc:
                log.exception("%s (tag %d) failed unexpectedly", what, tag)
                err = _translate(exc)
                handle.error = err if isinstance(err, PCCLError) else None
                outcome = (False, Result.INTERNAL_ERROR, _failed_info(comm))
            finally:
                # Untrack before resolving: once wait() returns, topology calls are allowed again.
                untrack([tag])
                future.set_result(outcome or (False, Result.INTERNAL_ERROR, _failed_info(comm)))

        def launch() -> None:
            if session.ops is None:
                raise InvalidUsageError(f"{what} on a communicator that is closing")
            session.ops.start_soon(runner)

        try:
            _core.call_sync(launch)
        except BaseException:
            self._untrack([tag])
            raise
        return handle


def _kind_call(kind: str, *args: Any, **kw: Any) -> Callable[[Any], Awaitable[Any]]:
    """``comm.<kind>(*args, **kw)`` of the async core, for :meth:`Communicator._blocking` / ``_launch``."""
    async def run(comm: Any) -> Any:
        return await getattr(comm, kind)(*args, **kw)

    return run


async def _run_all_reduce(comm: Any, o: _Operand) -> ReduceInfo:
    info: ReduceInfo = await comm.all_reduce(o.send, o.recv, op=o.op, tag=o.tag, quantization=o.quantization)
    return info


async def _run_multiple(comm: Any, items: list[dict[str, Any]], max_in_flight: int) -> ReduceInfo:
    info: ReduceInfo = await comm.all_reduce_multiple_with_retry(items, max_in_flight=max_in_flight)
    return info


def _failed_info(comm: Any) -> ReduceInfo:
    """ReduceInfo of a failed operation: nothing committed; the group size as last known."""
    try:
        world = int(comm.get_attribute(Attribute.PEER_GROUP_WORLD_SIZE))
    except Exception:
        world = 0
    return ReduceInfo(local_world_size=world, tx_bytes=0, rx_bytes=0)


__all__ = [
    "AsyncReduceHandle",
    "Attribute",
    "Communicator",
    "DataType",
    "DeviceType",
    "DistributionHint",
    "MasterNode",
    "PCCLError",
    "QuantizationAlgorithm",
    "QuantizationOptions",
    "ReduceDescriptor",
    "ReduceInfo",
    "ReduceOp",
    "ReduceOpDescriptor",
    "ReduceOperandDescriptor",
    "Result",
    "SharedState",
    "SharedStateSyncInfo",
    "SharedStateSyncStrategy",
    "TensorInfo",
    "datatype_from_numpy",
    "datatype_from_torch",
    "datatype_to_numpy",
    "datatype_to_torch",
    "stop_serving_masters",
]
