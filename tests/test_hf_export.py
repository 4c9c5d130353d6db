"""Tests for grpo_jax.models.hf: sharded, tensor-by-tensor HF safetensors export.

Invariants: the export reloads bit for bit (model.load_hf_checkpoint, several shards, f32 and
bf16); its files are byte-identical to transformers' save_pretrained of the same weights and its
logits equal ours (HF parity); the shard split is huggingface_hub's; an FSDP-sharded export, on
8 fake devices and across two real JAX processes, equals the unsharded one byte for byte; and the
writer holds one gathered tensor at a time.
"""

import dataclasses
import json
import os
import tracemalloc
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
import reference
import safetensors.numpy
import workers

from grpo_jax import model, sharding
from grpo_jax.models import hf as hf_lib

# 20 kB shards: the tiny f32 model (4 kB..16 kB tensors, about 100 kB in all) needs 6 or 7.
SMALL_SHARDS = 20_000

CONFIGS = {
    "tiny_tied_f32": model.ModelConfig.tiny(),
    "qwen2_untied_bf16": model.ModelConfig.tiny(
        tie_word_embeddings=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    ),
    "llama_untied": model.ModelConfig.tiny(arch="llama", qkv_bias=False, tie_word_embeddings=False),
}


def _small_shards(config):
    """SMALL_SHARDS scaled to the param dtype (10 kB for bf16), so every model needs several."""
    return SMALL_SHARDS * np.dtype(config.param_dtype).itemsize // 4


def _params(config, seed=0):
    return model.init_params(config, jax.random.key(seed))


def _files(path):
    return {p.name: p.read_bytes() for p in Path(path).iterdir()}


def _assert_bitwise(got, want):
    flat_got = dict(jax.tree_util.tree_leaves_with_path(got))
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
    assert flat_got.keys() == flat_want.keys()
    for path, x in flat_want.items():
        y = flat_got[path]
        assert y.dtype == x.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(y).view(np.uint8), np.asarray(x).view(np.uint8), jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_is_bitwise_through_several_shards(name, tmp_path):
    config = CONFIGS[name]
    params = _params(config)
    hf_lib.save(config, params, tmp_path, max_shard_bytes=_small_shards(config))

    index = json.loads((tmp_path / hf_lib.INDEX_FILE).read_text())
    shards = sorted(n for n in os.listdir(tmp_path) if n.startswith("model-"))
    assert len(shards) >= 5 and set(index["weight_map"].values()) == set(shards)
    assert shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    tensors = hf_lib.hf_tensors(config, params)
    assert sorted(index["weight_map"]) == sorted(t.name for t in tensors)
    # total_size is the data bytes: each file is its header plus its tensors' bytes.
    headers = sum(8 + int.from_bytes((tmp_path / s).read_bytes()[:8], "little") for s in shards)
    assert index["metadata"]["total_size"] + headers == sum(
        (tmp_path / s).stat().st_size for s in shards
    )
    itemsize = np.dtype(config.param_dtype).itemsize
    assert index["metadata"]["total_size"] == index["metadata"]["total_parameters"] * itemsize
    assert not list(tmp_path.glob(".*"))  # no .partial file left

    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["dtype"] == hf_config["torch_dtype"] == np.dtype(config.param_dtype).name
    loaded_config, loaded = model.load_hf_checkpoint(tmp_path, dtype=config.param_dtype)
    assert loaded_config == config
    _assert_bitwise(loaded, params)


def test_single_file_when_everything_fits_equals_safetensors_save_file(tmp_path):
    config = CONFIGS["qwen2_untied_bf16"]
    params = _params(config)
    hf_lib.save(config, params, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    # safetensors' own writer, given the whole state dict at once, writes the same bytes.
    safetensors.numpy.save_file(
        model.to_hf_state_dict(config, params), tmp_path / "whole", metadata={"format": "pt"}
    )
    assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "whole").read_bytes()
    want = config.to_hf_dict() | {"dtype": "bfloat16", "torch_dtype": "bfloat16"}
    assert (tmp_path / "config.json").read_text() == json.dumps(want, indent=2, sort_keys=True)


def test_tied_model_exported_untied_for_vllm(tmp_path):
    config = CONFIGS["tiny_tied_f32"]
    params = _params(config)
    hf_lib.save(config, params, tmp_path, untie_embeddings=True, max_shard_bytes=SMALL_SHARDS)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    untied, loaded = model.load_hf_checkpoint(tmp_path)
    assert not untied.tie_word_embeddings
    np.testing.assert_array_equal(loaded["lm_head"]["kernel"], params["embed"]["embedding"].T)


def test_a_new_export_removes_the_weight_files_of_an_old_one(tmp_path):
    config = CONFIGS["tiny_tied_f32"]
    hf_lib.save(config, _params(config, seed=1), tmp_path, max_shard_bytes=SMALL_SHARDS)
    (tmp_path / "tokenizer.json").write_text("{}")  # not a weight file: kept
    params = _params(config, seed=2)
    hf_lib.save(config, params, tmp_path)  # fits one file now
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "tokenizer.json"]
    _assert_bitwise(model.load_hf_checkpoint(tmp_path)[1], params)


def test_shard_plan_is_huggingface_hubs_split():
    from huggingface_hub import split_state_dict_into_shards_factory

    rng = np.random.default_rng(0)
    for trial in range(20):
        sizes = rng.integers(1, 40, size=rng.integers(1, 30)) * 4  # some exceed the limit
        limit = int(rng.integers(20, 100))
        tensors = [
            hf_lib.HFTensor(f"t{i}", "p", None, "same", (int(s) // 4,), np.dtype(np.float32))
            for i, s in enumerate(sizes)
        ]
        split = split_state_dict_into_shards_factory(
            {t.name: t for t in tensors},
            get_storage_size=lambda t: t.nbytes,
            filename_pattern="model{suffix}.safetensors",
            max_shard_size=limit,
        )
        shards = hf_lib.plan_shards(tensors, limit)
        ours = dict(zip(hf_lib.shard_filenames(len(shards)), shards))
        assert {f: [t.name for t in s] for f, s in ours.items()} == split.filename_to_tensors
        assert sum(t.nbytes for t in tensors) == split.metadata["total_size"]


def test_params_that_do_not_match_the_config_are_refused(tmp_path):
    config = CONFIGS["tiny_tied_f32"]
    params = _params(config)
    del params["layers"]["mlp"]["up_proj"]
    with pytest.raises(ValueError, match=r"missing \['layers/mlp/up_proj/kernel'\]"):
        hf_lib.save(config, params, tmp_path)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# HF parity: transformers reads the export, and writes the same files itself.


@pytest.mark.reference("hf")
@pytest.mark.parametrize("name", ["tiny_tied_f32", "qwen2_untied_bf16"])
def test_transformers_loads_the_export_and_writes_the_same_files(name, tmp_path):
    torch, transformers = reference.hf()
    config = CONFIGS[name]
    # Weights at 0.1 instead of 0.02 (norm scales kept at 1): logits of a few units, not flat.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if "scale" in jax.tree_util.keystr(path) else (x * 5).astype(x.dtype),
        _params(config),
    )
    hf_lib.save(config, params, tmp_path / "ours", max_shard_bytes=_small_shards(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert hf.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype.name]

    # Logits in float32 on both sides (bf16 weights upcast exactly): torch's kernels against
    # XLA's, within a few hundred ulps of the largest logit (tests/numerics.py).
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids_BT = np.random.default_rng(0).integers(0, config.vocab_size, (2, 7))
    with torch.no_grad():
        ref = hf32(input_ids=torch.from_numpy(ids_BT)).logits.numpy()
    f32 = dataclasses.replace(config, dtype=jnp.float32, param_dtype=jnp.float32)
    params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ours = np.asarray(model.forward(f32, params32, ids_BT, np.ones_like(ids_BT)))
    assert np.abs(ref).max() > 1.0
    numerics.assert_close(ours, ref, ulps=512)

    # transformers' own sharded save of the same model: the same index and the same shard bytes.
    hf.save_pretrained(tmp_path / "hf", max_shard_size=_small_shards(config))
    theirs = _files(tmp_path / "hf")
    ours_files = _files(tmp_path / "ours")
    weights = sorted(n for n in theirs if "safetensors" in n)
    assert weights == sorted(n for n in ours_files if "safetensors" in n) and len(weights) > 5
    for n in weights:
        assert ours_files[n] == theirs[n], n


# ---------------------------------------------------------------------------------------------
# Sharded params: FSDP over 8 fake devices, and across two processes.


def test_fsdp_sharded_export_equals_the_unsharded_one(tmp_path):
    config = CONFIGS["qwen2_untied_bf16"]
    mesh = sharding.make_mesh((1, 8, 1))
    params = sharding.init_sharded_params(config, mesh, jax.random.key(0))
    kernel = params["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, ("fsdp", "sequence"), "tensor")
    assert {s.data.shape for s in kernel.addressable_shards} == {(2, 4, 64)}  # D=32 split 8 ways
    hf_lib.save(config, params, tmp_path / "fsdp", max_shard_bytes=_small_shards(config))
    hf_lib.save(config, _params(config), tmp_path / "one", max_shard_bytes=_small_shards(config))
    assert _files(tmp_path / "fsdp") == _files(tmp_path / "one")


_TWO_PROCESS_SCRIPT = """
import os, sys
pid, port, out, shard_bytes = int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
import jax
import workers
from grpo_jax import distributed, model, sharding
from grpo_jax.models import hf as hf_export
assert distributed.maybe_initialize(
    coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
config = model.ModelConfig.tiny()
mesh = sharding.make_mesh((1, 4, 1))  # FSDP over both processes' devices
params = sharding.init_sharded_params(config, mesh, jax.random.key(0))
# Each process writes to its own directory: only process 0's may appear.
hf_export.save(config, params, os.path.join(out, f"p{pid}"), untie_embeddings=True,
               max_shard_bytes=shard_bytes)
addressable = [x.is_fully_addressable for x in jax.tree.leaves(params)]
workers.answer([pid, jax.process_count(), len(jax.devices()), any(addressable)])
"""


def test_two_processes_export_params_neither_holds_whole(tmp_path):
    out = tmp_path / "out"
    results = workers.run(_TWO_PROCESS_SCRIPT, tmp_path / "workers", args=(out, SMALL_SHARDS),
                          timeout=180)  # fmt: skip
    assert results == [[0, 2, 4, False], [1, 2, 4, False]]
    assert sorted(os.listdir(out)) == ["p0"]

    config = model.ModelConfig.tiny()
    params = _params(config)
    hf_lib.save(config, params, tmp_path / "single", untie_embeddings=True,
                   max_shard_bytes=SMALL_SHARDS)  # fmt: skip
    assert _files(out / "p0") == _files(tmp_path / "single")
    untied, loaded = model.load_hf_checkpoint(out / "p0")
    assert not untied.tie_word_embeddings
    del loaded["lm_head"]
    _assert_bitwise(loaded, params)


# ---------------------------------------------------------------------------------------------
# Host memory.


def test_writer_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    # 16 layers, D=256: the largest tensor (embedding 1024 x 256 f32) is 1 MiB of 29 MiB.
    config = model.ModelConfig.tiny(
        num_layers=16, hidden_size=256, intermediate_size=512, vocab_size=1024, head_dim=16
    )
    params = _params(config)
    tensors = hf_lib.hf_tensors(config, params)
    largest = max(t.nbytes for t in tensors)
    total = sum(t.nbytes for t in tensors)
    assert total > 25 * largest
    shard = 8 * 2**20

    live, peak_live = {}, [0]
    gather = hf_lib.host_tensor

    def tracked(x, t):
        # A numpy-owned copy, so tracemalloc sees it (np.asarray of a CPU jax.Array may alias
        # XLA's buffer), and a finalizer to know when the writer dropped it.
        value = np.array(gather(x, t), copy=True)
        live[id(value)] = value.nbytes
        weakref.finalize(value, live.pop, id(value))
        peak_live[0] = max(peak_live[0], sum(live.values()))
        return value

    monkeypatch.setattr(hf_lib, "host_tensor", tracked)
    hf_lib.save(config, params, tmp_path / "warm", max_shard_bytes=shard)  # compile first
    tracemalloc.start()
    try:
        hf_lib.save(config, params, tmp_path / "out", max_shard_bytes=shard)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        # The measurement has teeth: a gather-everything writer shows the whole model.
        whole = model.to_hf_state_dict(config, params)
        safetensors.numpy.save_file(whole, tmp_path / "whole.safetensors")
        del whole
        _, peak_old = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_live[0] == largest  # never two gathered tensors alive at once
    # One tensor plus Python's own allocations (about 0.25 MiB measured), far below one shard.
    assert peak < 2 * largest < shard, (peak, largest)
    assert peak_old > total / 2
    _assert_bitwise(model.load_hf_checkpoint(tmp_path / "out")[1], params)
