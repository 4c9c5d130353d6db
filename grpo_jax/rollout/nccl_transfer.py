"""The trainer's end of vLLM's in-memory NCCL weight transfer, without torch.

This module owns the JAX side of vLLM 0.32's dense NCCL weight-transfer backend
(``vllm/distributed/weight_transfer/nccl_engine.py``): a minimal ctypes binding of libnccl and
libcudart (``Communicator``: rank 0 of a group whose other ranks are the vLLM workers), the check
that the transfer can run here (``unavailable_reason``), and the JSON payloads of the server's
RL endpoints (``worker_init_info``, ``update_info``). vllm_sidecar.py drives the HTTP side.

vLLM 0.32's protocol for a torch-free trainer (``NCCLWeightTransferInitInfo``, "Torch-free trainers
(e.g. JAX) ... mint an ncclUniqueId themselves"):
  * The server runs with ``--weight-transfer-config '{"backend": "nccl"}'`` and
    ``VLLM_SERVER_DEV_MODE=1`` (which mounts ``/get_world_size``, ``/init_weight_transfer_engine``,
    ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``).
  * The trainer mints a 128-byte ``ncclUniqueId`` and POSTs it, standard base64, to
    ``/init_weight_transfer_engine`` with ``rank_offset=1`` and ``world_size = 1 + workers``;
    every worker then blocks in ``ncclCommInitRank`` until the trainer joins as rank 0, and
    immediately issues a one-element float32 ``all_reduce`` (its warm-up), which the trainer must
    match before any other collective (``Communicator.warm_up``).
  * Each push: ``/start_weight_update``, then ``/update_weights`` with the names, torch dtype names
    and shapes of every tensor (the workers allocate and receive them in that order), answered
    only after the trainer has ``ncclBroadcast`` every tensor from rank 0; then
    ``/finish_weight_update``. ``packed=False``: one broadcast per tensor, so the trainer never
    needs a staging buffer (vLLM's packed mode concatenates into 1 GB chunks).

The tensors broadcast are ``hf_export.device_tensor`` outputs (HF names and layout, the params'
dtype), so the workers load exactly what a disk export would hold. Buffers are handed to NCCL
by ``jax.Array.unsafe_buffer_pointer`` after ``block_until_ready``, on the legacy default CUDA
stream, which is synchronised before the buffer is released.
"""

from __future__ import annotations

import base64
import ctypes
import importlib.util
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

NCCL_UNIQUE_ID_BYTES = 128
_NCCL_DTYPES = {  # ncclDataType_t
    np.dtype(np.int8): 0,
    np.dtype(np.uint8): 1,
    np.dtype(np.int32): 2,
    np.dtype(np.int64): 4,
    np.dtype(np.float16): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.float64): 8,
    np.dtype(jnp.bfloat16): 9,
}
_NCCL_SUM = 0


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def _candidates(package: str, names: Sequence[str]) -> list[str]:
    """The pip package's copy first (what jax[cuda12] loads), then the loader's search path."""
    paths = []
    spec = importlib.util.find_spec(package) if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        paths += [os.path.join(root, "lib", n) for n in names]
    return [p for p in paths if os.path.exists(p)] + list(names)


def _load(what: str, package: str, names: Sequence[str], env: str) -> ctypes.CDLL:
    tried = ([os.environ[env]] if os.environ.get(env) else []) + _candidates(package, names)
    errors = []
    for path in tried:
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise OSError(f"cannot load {what} (set {env}); tried " + "; ".join(errors))


def _libraries() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    nccl = _load("libnccl", "nvidia.nccl", ("libnccl.so.2", "libnccl.so"), "GRPO_JAX_NCCL_LIBRARY")
    cudart = _load(
        "libcudart",
        "nvidia.cuda_runtime",
        ("libcudart.so.12", "libcudart.so.13", "libcudart.so"),
        "GRPO_JAX_CUDART_LIBRARY",
    )
    nccl.ncclGetErrorString.restype = ctypes.c_char_p
    nccl.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
    nccl.ncclCommInitRank.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        _UniqueId,
        ctypes.c_int,
    ]
    nccl.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    nccl.ncclAllReduce.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    nccl.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    nccl.ncclBroadcast.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    nccl.ncclCommAbort.argtypes = [ctypes.c_void_p]
    cudart.cudaGetErrorString.restype = ctypes.c_char_p
    cudart.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
    return nccl, cudart


def unavailable_reason() -> str | None:
    """Why the NCCL transfer cannot run in this process, or None when it can (as far as known).

    Needs a CUDA JAX backend and a loadable libnccl and libcudart (jax[cuda12] installs both as
    pip packages). The server side (vLLM's endpoints, a GPU worker) is checked by the sidecar.
    """
    platform = jax.devices()[0].platform
    if platform != "gpu":
        return f"the JAX backend is {platform!r}, not a CUDA GPU"
    try:
        _libraries()
    except OSError as e:
        return str(e)
    except AttributeError as e:  # a library without the NCCL / CUDA runtime symbols
        return f"unusable NCCL or CUDA runtime library: {e}"
    return None


def new_unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` (128 bytes) for rank 0 to share with the workers."""
    nccl, _ = _libraries()
    uid = _UniqueId()
    _check(nccl, nccl.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid.internal)


def worker_init_info(unique_id: bytes, *, world_size: int) -> dict:
    """``init_info`` of ``/init_weight_transfer_engine`` (vLLM's ``NCCLWeightTransferInitInfo``).

    Args:
      unique_id: the 128 bytes of ``new_unique_id``.
      world_size: 1 (this trainer, rank 0) + the server's TP x PP x DP workers.
    """
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an ncclUniqueId has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    if world_size < 2:
        raise ValueError(f"world_size {world_size} must count the trainer and >= 1 worker")
    return {
        "rank_offset": 1,  # the workers follow the trainer's rank 0
        "world_size": world_size,
        # Standard base64 (vLLM refuses the URL-safe alphabet).
        "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
        "packed": False,
    }


def update_info(tensors) -> dict:
    """``update_info`` of ``/update_weights`` (``NCCLWeightTransferUpdateInfo``) for HFTensors.

    The workers allocate ``torch.empty(shape, dtype=getattr(torch, dtype_name))`` for each entry
    and receive it from the next broadcast, so the order is the broadcast order.
    """
    for t in tensors:
        if t.dtype not in _NCCL_DTYPES:
            raise ValueError(f"tensor {t.name!r} has dtype {t.dtype}, which NCCL cannot send")
    return {
        "names": [t.name for t in tensors],
        "dtype_names": [t.dtype.name for t in tensors],  # torch attribute names
        "shapes": [list(t.shape) for t in tensors],
    }


def _check(nccl, result: int, what: str) -> None:
    if result != 0:
        message = nccl.ncclGetErrorString(result).decode(errors="replace")
        raise RuntimeError(f"{what} failed: NCCL error {result} ({message})")


class Communicator:
    """Rank 0 (the sender) of an NCCL group with the vLLM workers, bound to one JAX GPU device.

    ``__init__`` blocks in ``ncclCommInitRank`` until every worker has joined (there is no
    timeout: call it while the server's ``/init_weight_transfer_engine`` is in flight).
    """

    def __init__(self, unique_id: bytes, *, world_size: int, device: jax.Device):
        self._nccl, self._cudart = _libraries()
        self.device = device
        self._set_device()
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, NCCL_UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        _check(
            self._nccl,
            self._nccl.ncclCommInitRank(ctypes.byref(comm), world_size, uid, 0),
            "ncclCommInitRank",
        )
        self._comm = comm

    def _set_device(self) -> None:
        # The comm and the default stream belong to the calling thread's current device.
        self._cuda(self._cudart.cudaSetDevice(self.device.local_hardware_id), "cudaSetDevice")

    def _sync(self) -> None:
        self._cuda(self._cudart.cudaStreamSynchronize(None), "cudaStreamSynchronize")

    def _cuda(self, err: int, what: str) -> None:
        if err != 0:
            message = self._cudart.cudaGetErrorString(err).decode(errors="replace")
            raise RuntimeError(f"{what} failed: CUDA error {err} ({message})")

    def _local(self, x: jax.Array) -> jax.Array:
        for shard in x.addressable_shards:
            if shard.device == self.device and shard.data.shape == x.shape:
                return shard.data.block_until_ready()
        raise ValueError(f"array {x.shape} has no whole copy on the NCCL device {self.device}")

    def warm_up(self) -> None:
        """The one-element float32 all-reduce every vLLM worker issues right after joining."""
        self._set_device()
        x = jax.device_put(jnp.zeros((1,), jnp.float32), self.device).block_until_ready()
        ptr = x.unsafe_buffer_pointer()
        float32 = _NCCL_DTYPES[np.dtype(np.float32)]
        result = self._nccl.ncclAllReduce(ptr, ptr, 1, float32, _NCCL_SUM, self._comm, None)
        _check(self._nccl, result, "ncclAllReduce (warm-up)")
        self._sync()

    def broadcast(self, x: jax.Array) -> None:
        """Sends ``x`` (whole on this communicator's device) from rank 0 to every worker."""
        self._set_device()
        local = self._local(x)
        ptr = local.unsafe_buffer_pointer()
        dtype = _NCCL_DTYPES[np.dtype(local.dtype)]
        result = self._nccl.ncclBroadcast(ptr, ptr, local.size, dtype, 0, self._comm, None)
        _check(self._nccl, result, "ncclBroadcast")
        self._sync()  # before `local` may be freed

    def close(self) -> None:
        """Frees the communicator (idempotent).

        ``ncclCommAbort`` rather than ``ncclCommDestroy``: it never waits on the peers, which
        matters when the server (the other ranks) has died.
        """
        comm, self._comm = self._comm, None
        if comm is not None:
            self._nccl.ncclCommAbort(comm)
