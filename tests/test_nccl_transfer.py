"""Tests for grpo_jax.nccl_transfer on CPU: the payloads and the calls the binding makes.

No NCCL runs here: the libraries are replaced by recorders, so these check which buffers,
counts, dtypes and ranks reach libnccl and libcudart, not the transfer itself (that needs a GPU:
scripts/gpu_check.sh). tests/test_vllm.py checks the payloads against vLLM's own dataclasses.
"""

import base64

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax import model, sharding
from grpo_jax.models import hf
from grpo_jax.rollout import nccl_transfer


def test_unavailable_on_cpu_names_the_backend():
    assert nccl_transfer.unavailable_reason() == "the JAX backend is 'cpu', not a CUDA GPU"


def test_worker_init_info_is_vllms_torch_free_rendezvous():
    unique_id = bytes([251, 255] * 64)
    info = nccl_transfer.worker_init_info(unique_id, world_size=5)
    assert info == {
        "rank_offset": 1,
        "world_size": 5,
        "nccl_unique_id_b64": base64.b64encode(unique_id).decode(),  # standard, not URL-safe
        "packed": False,
    }
    assert "+" in info["nccl_unique_id_b64"] and "/" in info["nccl_unique_id_b64"]
    with pytest.raises(ValueError, match="128 bytes, got 127"):
        nccl_transfer.worker_init_info(unique_id[:-1], world_size=5)
    with pytest.raises(ValueError, match="world_size 1"):
        nccl_transfer.worker_init_info(unique_id, world_size=1)


def test_update_info_lists_the_export_tensors_in_order():
    config = model.ModelConfig.tiny(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    tensors = hf.hf_tensors(
        config, model.abstract_params(config), untie_embeddings=True
    )  # shapes only: nothing is gathered
    info = nccl_transfer.update_info(tensors)
    assert info["names"][:2] == ["lm_head.weight", "model.embed_tokens.weight"]
    assert info["names"] == [t.name for t in tensors]
    assert set(info["dtype_names"]) == {"bfloat16"}
    assert info["shapes"][0] == [128, 32]  # lm_head [V, D], from the tied embedding
    bad = [hf.HFTensor("x", "p", None, "same", (2,), np.dtype(np.complex64))]
    with pytest.raises(ValueError, match="'x' has dtype complex64"):
        nccl_transfer.update_info(bad)


class _Recorder:
    """Stands in for a ctypes.CDLL: every call is recorded and answers `result`."""

    def __init__(self, result=0):
        self.calls, self.result = [], result

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name == "ncclCommInitRank":
                args[0]._obj.value = 1234  # the ncclComm_t written through the pointer
            if name.endswith("GetErrorString"):
                return b"fake error"
            return self.result

        return call


@pytest.fixture
def libs(monkeypatch):
    nccl, cudart = _Recorder(), _Recorder()
    monkeypatch.setattr(nccl_transfer, "_libraries", lambda: (nccl, cudart))
    return nccl, cudart


def test_communicator_calls(libs):
    nccl, cudart = libs
    device = jax.devices()[3]
    comm = nccl_transfer.Communicator(bytes(range(128)), world_size=3, device=device)
    name, (_, world_size, uid, rank) = nccl.calls[0]
    assert (name, world_size, bytes(uid.internal), rank) == (
        "ncclCommInitRank", 3, bytes(range(128)), 0
    )  # fmt: skip
    assert cudart.calls == [("cudaSetDevice", (3,))]

    comm.warm_up()  # one float32 (7) element, summed (0), in place, on the default stream
    name, (send, recv, count, dtype, op, handle, stream) = nccl.calls[1]
    assert (name, send == recv, count, dtype, op, handle.value, stream) == (
        "ncclAllReduce", True, 1, 7, 0, 1234, None
    )  # fmt: skip

    # A replicated bf16 tensor goes out from this device's copy: all its elements, as bf16 (9).
    mesh = sharding.make_mesh((1, 8, 1))
    x = jax.device_put(jnp.arange(12, dtype=jnp.bfloat16), NamedSharding(mesh, PartitionSpec()))
    (local,) = [s.data for s in x.addressable_shards if s.device == device]
    comm.broadcast(x)
    name, (send, recv, count, dtype, root, handle, stream) = nccl.calls[2]
    assert (name, send, recv, count, dtype, root, stream) == (
        "ncclBroadcast", local.unsafe_buffer_pointer(), local.unsafe_buffer_pointer(), 12, 9, 0,
        None,
    )  # fmt: skip
    # Synchronised after each collective, before the buffer may be freed.
    assert [c[0] for c in cudart.calls].count("cudaStreamSynchronize") == 2

    split = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, PartitionSpec("fsdp")))
    with pytest.raises(ValueError, match="no whole copy on the NCCL device"):
        comm.broadcast(split)
    comm.close()
    comm.close()
    assert [c[0] for c in nccl.calls].count("ncclCommAbort") == 1


def test_nccl_errors_are_raised_with_their_message(monkeypatch):
    nccl, cudart = _Recorder(result=3), _Recorder()
    monkeypatch.setattr(nccl_transfer, "_libraries", lambda: (nccl, cudart))
    with pytest.raises(RuntimeError, match=r"ncclCommInitRank failed: NCCL error 3 \(fake error\)"):
        nccl_transfer.Communicator(bytes(128), world_size=2, device=jax.devices()[0])
