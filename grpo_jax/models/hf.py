"""Hugging Face checkpoints: config.json + safetensors in, sharded safetensors and PEFT adapters out.

Reading (`load_hf_checkpoint`): `HF_TO_JAX` maps every HF tensor name onto a params path and a
layout (torch Linear weights are [out, in]; grpo_jax keeps [in, out] with heads split), each
param is placed in its sharding as soon as it is read. GGUF files share the table
(grpo_jax/models/gguf.py).

Writing: params as a transformers / vLLM checkpoint: ``save`` (the export), the
list of HF tensors a params tree maps to (``hf_tensors``, in transformers' save order), the
shard plan (``plan_shards``, huggingface_hub's rule) and the per-tensor gather
(``device_tensor`` / ``host_tensor``) that the vLLM sidecar's in-memory weight push shares.

Design:
  * One tensor at a time. Each HF tensor (a layer slice of a stacked param, transposed to torch's
    ``[out, in]``) is cut out and laid out on the devices by one jitted program whose output is
    replicated over the param's mesh, so a param split over hosts (FSDP across processes, not
    fully addressable anywhere) becomes one whole tensor on every device; the writer copies that
    one tensor to host, writes it and drops it. The program is compiled once per param (the layer
    index is a traced argument). Every process runs every program in the same order (they are
    collectives); only process 0 opens files.
  * Host memory is bounded by the largest tensor, independent of ``max_shard_bytes``: the
    safetensors format is a little-endian u64 header length, a JSON header (dtype, shape and
    ``data_offsets`` of every tensor) padded with spaces to 8 bytes, then the raw bytes. All
    shapes and dtypes are known before anything is gathered, so the header of a shard is written
    first and its tensors are streamed after it. (``safetensors.numpy.save_file`` takes a whole
    dict, i.e. a whole shard, in memory: 5 GB per shard at the default size.) The bytes equal
    what ``save_file`` writes for the same tensors: tensors ordered by dtype (wider first, in
    safetensors' dtype order) then name, compact JSON, ``{"format": "pt"}`` metadata.
  * The layout is transformers 5's ``save_pretrained``: tensors sorted by ``natural_key`` (its
    ``dot_natural_key``: ``lm_head``, embedding, then layer by layer, final norm), split into
    shards by huggingface_hub's ``split_state_dict_into_shards_factory`` rule (greedy in that
    order; a tensor larger than ``max_shard_bytes`` gets a shard of its own), written as
    ``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``
    (``metadata.total_size``, ``metadata.total_parameters``, ``weight_map``;
    ``json.dumps(indent=2, sort_keys=True)``), or one ``model.safetensors`` and no index when
    everything fits one shard. tests/test_hf_export.py checks the files byte for byte against
    transformers' own ``save_pretrained`` of the same weights.
  * Lossless: tensors are written in the params' dtype (bf16 stays bf16), and config.json's
    ``dtype`` / ``torch_dtype`` say which.
  * Files are written as ``.<name>.partial`` and renamed when complete; weight files a previous
    export left in the directory that this one does not write are removed first, so an index
    never points at stale shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.models import config as config_lib
from grpo_jax.models import transformer

# 5 GiB shards (transformers 4's default; 5 writes "50GB" ones): a few files for a 7B model.
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype names, and their rank in safetensors' Dtype enum (data is ordered by it,
# highest first, then by name).
_SAFETENSORS_DTYPES = {
    np.dtype(np.float16): ("F16", 0),
    np.dtype(jax.numpy.bfloat16): ("BF16", 1),
    np.dtype(np.float32): ("F32", 2),
    np.dtype(np.float64): ("F64", 3),
}


# ---------------------------------------------------------------------------------------------
# Reading


# (HF tensor name, params path, layout). "{i}" is the layer index: those params are stacked on L.
# Layouts (HF torch Linear weights are [out, in]):
#   same:       identical shape (embedding, norm scales)
#   bias:       HF [n*H]     <-> params [n, H]
#   linear:     HF [out, in] <-> params [in, *out]   (q/k/v [D,n,H], gate/up [D,F], lm_head [D,V])
#   linear_out: HF [out, in] <-> params [*in, out]   (o_proj [N,H,D], down [F,D])
HF_TO_JAX = (
    ("model.embed_tokens.weight", "embed/embedding", "same"),
    ("model.norm.weight", "final_norm/scale", "same"),
    ("lm_head.weight", "lm_head/kernel", "linear"),
    ("model.layers.{i}.input_layernorm.weight", "layers/input_norm/scale", "same"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers/post_attn_norm/scale", "same"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers/attn/q_proj/kernel", "linear"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers/attn/k_proj/kernel", "linear"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers/attn/v_proj/kernel", "linear"),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers/attn/q_proj/bias", "bias"),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers/attn/k_proj/bias", "bias"),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers/attn/v_proj/bias", "bias"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers/attn/o_proj/kernel", "linear_out"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers/attn/q_norm/scale", "same"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers/attn/k_norm/scale", "same"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers/mlp/gate_proj/kernel", "linear"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers/mlp/up_proj/kernel", "linear"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers/mlp/down_proj/kernel", "linear_out"),
    # Qwen3-MoE layers (grpo_jax/models/moe.py): the router, and each expert "{e}" as its own
    # tensors, the layout of the hub's checkpoints and of transformers 5's save_pretrained
    # (which fuses them in memory only). Their params are stacked on the MoE layers, then E.
    ("model.layers.{i}.mlp.gate.weight", "layers/moe/router/kernel", "linear"),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "layers/moe/gate_proj/kernel", "linear"),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "layers/moe/up_proj/kernel", "linear"),
    (
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        "layers/moe/down_proj/kernel",
        "linear_out",
    ),
)


# Checkpoint entries that carry no weights of their own (HF recomputes them or ties them).
_IGNORED_HF = re.compile(r"(.*\.rotary_emb\.inv_freq)$")


def _hf_regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(\d+)").replace(r"\{e\}", r"(\d+)")
    return re.compile(pattern + "$")


def tensor_indices(
    config: config_lib.ModelConfig, template: str, param: str
) -> list[tuple[dict[str, int], tuple[int, ...]]]:
    """The HF tensors of one ``HF_TO_JAX`` entry: (the template's ``format`` fields, the index
    into the param's leading axes) of each.

    A layered param is stacked on the layers that have it: every layer for attention and
    norms; in a MoE model, the dense layers for ``layers/mlp`` and the MoE layers for
    ``layers/moe`` (row ``config.ffn_row(i)``); an expert template also indexes the expert.
    """
    if "{i}" not in template:
        return [({}, ())]
    ffn = param.startswith(("layers/mlp/", "layers/moe/"))
    out = []
    for i, is_moe in enumerate(config.moe_layers):
        if ffn and is_moe != param.startswith("layers/moe/"):
            continue
        row = config.ffn_row(i) if ffn else i
        if "{e}" in template:
            out += [({"i": i, "e": e}, (row, e)) for e in range(config.num_experts)]
        else:
            out.append(({"i": i}, (row,)))
    return out


def hf_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape of a (per-layer) param of `shape`."""
    match layout:
        case "same":
            return shape
        case "bias":
            return (math.prod(shape),)
        case "linear":
            return (math.prod(shape[1:]), shape[0])
        case "linear_out":
            return (shape[-1], math.prod(shape[:-1]))
    raise ValueError(f"unknown HF layout {layout!r}")


def from_hf_layout(layout: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layout in ("linear", "linear_out"):
        x = x.T
    return x.reshape(shape)


def _resolve_checkpoint_dir(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"HF checkpoint path {path!r} is a file; pass the directory")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        # A hub id: download config and safetensors (needs network access).
        import huggingface_hub

        return huggingface_hub.snapshot_download(
            path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]
        )
    raise ValueError(f"HF checkpoint {path!r} is neither a local directory nor a hub id")


def _safetensors_files(ckpt_dir: str) -> list[str]:
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(ckpt_dir, n) for n in names]
    names = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"no *.safetensors weights in HF checkpoint {ckpt_dir!r}")
    return [os.path.join(ckpt_dir, n) for n in names]


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    shardings: Callable[[config_lib.ModelConfig, Any], Any] | None = None,
) -> tuple[config_lib.ModelConfig, dict]:
    """Reads a HF Qwen2/Qwen3/Llama checkpoint (config.json + safetensors) into params.

    Args:
      path: local directory (single ``model.safetensors`` or sharded with
        ``model.safetensors.index.json``), or a hub id resolved with huggingface_hub.
      dtype: param and compute dtype of the returned config; weights are cast to it.
      shardings: optional ``(config, abstract_params) -> pytree of jax.sharding.Sharding``. Each
        param is then placed with ``jax.device_put(x, sharding)`` as soon as it is read, so the
        model never sits whole on one device. Host memory holds one (layer-stacked) param at a
        time.

    Returns:
      (config, params).

    Raises:
      ValueError: unsupported architecture, a missing or unexpected tensor, or a shape mismatch.
    """
    ckpt_dir = _resolve_checkpoint_dir(path)
    config = config_lib.ModelConfig.from_hf(ckpt_dir)
    if _hf_architecture(ckpt_dir) in config_lib.SEQUENCE_CLASSIFIERS:
        raise ValueError(
            f"{ckpt_dir!r} is a {_hf_architecture(ckpt_dir)} (a reward model, no LM head); "
            "load it with load_hf_sequence_classifier"
        )
    config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
    params, _ = _read_params(ckpt_dir, config, shardings)
    return config, params


def load_hf_sequence_classifier(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    shardings: Callable[[config_lib.ModelConfig, Any], Any] | None = None,
) -> tuple[config_lib.ModelConfig, dict, jax.Array]:
    """Reads a HF Qwen2/Qwen3/Llama ``*ForSequenceClassification`` checkpoint: the backbone
    (``model.*``, the table of ``load_hf_checkpoint``) and its score head (``score.weight``
    [num_labels, D], no bias), for grpo_jax/models/reward_head.py.

    The returned config has ``tie_word_embeddings=True``: the checkpoint has no LM head, and a
    tied config is the backbone without one (the head is never used to score).

    Returns:
      (config, params, score_DL): score_DL is ``score.weight`` transposed, float32 ``dtype``,
      replicated (it is tiny).

    Raises:
      ValueError: not a sequence classifier, or a missing, unexpected or mis-shaped tensor.
    """
    ckpt_dir = _resolve_checkpoint_dir(path)
    hf_arch = _hf_architecture(ckpt_dir)
    if hf_arch not in config_lib.SEQUENCE_CLASSIFIERS:
        raise ValueError(
            f"{ckpt_dir!r} is a {hf_arch}, not one of "
            f"{sorted(config_lib.SEQUENCE_CLASSIFIERS)} (config.json 'architectures')"
        )
    config = config_lib.ModelConfig.from_hf(ckpt_dir)
    config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype, tie_word_embeddings=True)
    params, extra = _read_params(ckpt_dir, config, shardings, extra=(_SCORE,))
    score_LD = extra[_SCORE]
    if score_LD.ndim != 2 or score_LD.shape[1] != config.hidden_size:
        raise ValueError(
            f"{hf_arch} tensor {_SCORE!r} has shape {tuple(score_LD.shape)}, expected "
            f"[num_labels, {config.hidden_size}]"
        )
    return config, params, jnp.asarray(score_LD.T.astype(dtype))


_SCORE = "score.weight"  # *ForSequenceClassification's head: Linear(D, num_labels, bias=False)


def _hf_architecture(ckpt_dir: str) -> str:
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        archs = json.load(f).get("architectures") or ["<no architectures>"]
    return archs[0]


def _read_params(
    ckpt_dir: str,
    config: config_lib.ModelConfig,
    shardings: Callable[[config_lib.ModelConfig, Any], Any] | None,
    *,
    extra: Sequence[str] = (),
) -> tuple[dict, dict[str, np.ndarray]]:
    """(params placed in their shardings, the host arrays of the `extra` tensor names)."""
    from safetensors import safe_open  # Deferred: only checkpoint IO needs it.

    abstract = transformer.abstract_params(config)
    flat_abstract = dict(transformer.flatten_params(abstract))
    flat_shardings = (
        dict(transformer.flatten_params(shardings(config, abstract))) if shardings else {}
    )
    hf_arch = config_lib.ARCH_TO_HF[config.arch]

    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(safe_open(f, framework="numpy"))
            for f in _safetensors_files(ckpt_dir)
        ]
        where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118 (safe_open handle, not a dict)
        # Which checkpoint tensors feed which param (and layer).
        sources: dict[str, dict[tuple[int, ...], str]] = {}
        unexpected = []
        for key in where:
            for template, jax_name, _ in HF_TO_JAX:
                m = _hf_regex(template).match(key)
                if m and jax_name in flat_abstract:
                    sources.setdefault(jax_name, {})[tuple(int(g) for g in m.groups())] = key
                    break
            else:
                tied_head = key == "lm_head.weight" and config.tie_word_embeddings
                if not (tied_head or key in extra or _IGNORED_HF.match(key)):
                    unexpected.append(key)
        if unexpected:
            raise ValueError(
                f"{hf_arch} checkpoint {ckpt_dir!r} has unexpected tensors {unexpected[:8]}"
            )

        flat = {}
        for template, jax_name, layout in HF_TO_JAX:
            if jax_name not in flat_abstract:
                continue
            spec = flat_abstract[jax_name]
            indices = tensor_indices(config, template, jax_name)
            depth = len(indices[0][1])  # the stacked axes (layers, experts) each tensor indexes
            shape = spec.shape[depth:]
            parts = []
            for fields, _ in indices:
                key = sources.get(jax_name, {}).get(tuple(fields.values()))
                if key is None:
                    missing = template.format(**fields)
                    raise ValueError(
                        f"{hf_arch} checkpoint {ckpt_dir!r} is missing tensor {missing!r}"
                    )
                x = where[key].get_tensor(key)
                if tuple(x.shape) != hf_shape(layout, shape):
                    raise ValueError(
                        f"{hf_arch} tensor {key!r} has shape {tuple(x.shape)}, expected "
                        f"{hf_shape(layout, shape)} from config.json"
                    )
                parts.append(from_hf_layout(layout, x, shape).astype(spec.dtype))
            stacked = np.stack(parts).reshape(spec.shape) if depth else parts[0]
            flat[jax_name] = place(stacked, flat_shardings.get(jax_name))
            del parts
        missing = [key for key in extra if key not in where]
        if missing:
            raise ValueError(f"{hf_arch} checkpoint {ckpt_dir!r} is missing tensor {missing[0]!r}")
        extras = {key: where[key].get_tensor(key) for key in extra}
    return transformer.unflatten_params(flat), extras


def place(value: np.ndarray, sharding=None) -> jax.Array:
    """A host array on its devices: split by `sharding` when given (the loaders' last step)."""
    return jnp.asarray(value) if sharding is None else jax.device_put(value, sharding)


def to_hf_state_dict(
    config: config_lib.ModelConfig, params, *, untie_embeddings: bool = False
) -> dict:
    """Params as a dict of HF tensor names -> host numpy arrays in the params' dtype.

    Args:
      untie_embeddings: for a tied model, also emit ``lm_head.weight`` (a copy of the embedding),
        as vLLM's weight reload expects.
    """
    transformer.check_params(config, params)
    flat = dict(transformer.flatten_params(params))
    out = {}
    for template, jax_name, layout in HF_TO_JAX:
        if jax_name not in flat:
            continue
        host = np.asarray(jax.device_get(flat[jax_name]))
        for fields, index in tensor_indices(config, template, jax_name):
            out[template.format(**fields)] = np.ascontiguousarray(to_hf_layout(layout, host[index]))
    if config.tie_word_embeddings and untie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].copy()
    return out


# ---------------------------------------------------------------------------------------------
# Writing


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor of the checkpoint and where it comes from in the params.

    Attributes:
      name: HF tensor name, e.g. ``model.layers.3.mlp.up_proj.weight``.
      param: flat params path, e.g. ``layers/mlp/up_proj/kernel``.
      layer: index into the stacked ``L`` axis (a MoE model's feed-forward stacks: the row,
        ``config.ffn_row``), or None for an unstacked param.
      layout: ``model.HF_TO_JAX`` layout (``same``, ``bias``, ``linear``, ``linear_out``).
      shape: HF (torch) shape.
      dtype: numpy dtype, the param's (the export never casts).
      expert: index into the expert axis after the layer axis (MoE experts), else None.
    """

    name: str
    param: str
    layer: int | None
    layout: str
    shape: tuple[int, ...]
    dtype: np.dtype
    expert: int | None = None

    @property
    def index(self) -> tuple[int, ...]:
        """The leading indices of the param that give this tensor."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def to_hf_layout(layout: str, y):
    """A (per-layer) param in HF's layout (torch Linear weights are [out, in]); jnp or np."""
    match layout:
        case "same":
            return y
        case "bias":
            return y.reshape(-1)
        case "linear":
            return y.reshape(y.shape[0], -1).T
        case "linear_out":
            return y.reshape(-1, y.shape[-1]).T
    raise ValueError(f"unknown HF layout {layout!r}")


def natural_key(name: str) -> tuple:
    """transformers' ``dot_natural_key``: dot-separated parts, numbers compared as numbers.

    transformers 5 sorts the state dict by it before sharding (``revert_weight_conversion``), so
    ``lm_head.weight`` comes first and ``model.layers.2`` before ``model.layers.10``.
    """
    parts = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            text = part.rstrip("0123456789")
            digits = part[len(text) :]
            parts.append((1, text, int(digits)) if digits else (1, text))
    return tuple(parts)


def hf_tensors(
    config: config_lib.ModelConfig, params, *, untie_embeddings: bool = False
) -> list[HFTensor]:
    """The checkpoint's tensors in transformers' save order (``natural_key``), none gathered.

    Args:
      config: the params' model config.
      params: params tree (``model.init_params`` layout); leaves need ``.shape`` and ``.dtype``.
      untie_embeddings: for a tied model, also list ``lm_head.weight`` (read from the embedding).

    Raises:
      ValueError: a param is missing, unexpected or mis-shaped for ``config``.
    """
    transformer.check_params(config, params)
    flat = dict(transformer.flatten_params(params))
    sources = {template: (param, layout) for template, param, layout in HF_TO_JAX}
    if config.tie_word_embeddings and untie_embeddings:
        sources["lm_head.weight"] = ("embed/embedding", "same")  # [V, D] is lm_head's layout too

    out = []
    for template, (param, layout) in sources.items():
        if param not in flat:
            continue  # a bias Llama does not have, the head of a tied model
        x = flat[param]
        indices = tensor_indices(config, template, param)
        per_tensor = jax.ShapeDtypeStruct(x.shape[len(indices[0][1]) :], x.dtype)
        shape = tuple(jax.eval_shape(functools.partial(to_hf_layout, layout), per_tensor).shape)
        for fields, index in indices:
            layer, expert = (*index, None, None)[:2]
            name = template.format(**fields)
            out.append(HFTensor(name, param, layer, layout, shape, np.dtype(x.dtype), expert))
    return sorted(out, key=lambda t: natural_key(t.name))


def plan_shards(tensors: Sequence[HFTensor], max_shard_bytes: int) -> list[list[HFTensor]]:
    """huggingface_hub's split: greedy in order; a tensor over the limit gets its own shard.

    As in ``split_state_dict_into_shards_factory``, an oversized tensor's shard is appended
    without closing the shard being filled, so the shard order can differ from tensor order.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards, current, size = [], [], 0
    for t in tensors:
        if t.nbytes > max_shard_bytes:
            shards.append([t])
            continue
        if size + t.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


def shard_filenames(num_shards: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000k-of-0000N.safetensors``."""
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]


def index_json(files: Sequence[tuple[str, Sequence[HFTensor]]]) -> str:
    """``model.safetensors.index.json`` exactly as transformers' ``save_pretrained`` writes it."""
    tensors = [t for _, shard in files for t in shard]
    index = {
        "metadata": {
            "total_parameters": sum(t.numel for t in tensors),
            "total_size": sum(t.nbytes for t in tensors),
        },
        "weight_map": {t.name: fname for fname, shard in files for t in shard},
    }
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def _file_order(shard: Sequence[HFTensor]) -> list[HFTensor]:
    """safetensors' data order: by dtype rank, highest first, then by name."""
    for t in shard:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {t.name!r} has dtype {t.dtype}, not one safetensors takes")
    return sorted(shard, key=lambda t: (-_SAFETENSORS_DTYPES[t.dtype][1], t.name))


def safetensors_header(ordered: Sequence[HFTensor]) -> bytes:
    """The 8-byte length plus the JSON header (space-padded to 8 bytes) of one shard file."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in ordered:
        header[t.name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype][0],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)
    return struct.pack("<Q", len(data)) + data


# ---------------------------------------------------------------------------------------------
# Gathering one tensor


def _extract(x, *index, layout: str):
    for i in index:  # the layer row, then the expert
        x = jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
    return to_hf_layout(layout, x)


@functools.lru_cache(maxsize=256)
def _program(layout: str, out_sharding):
    return jax.jit(functools.partial(_extract, layout=layout), out_shardings=out_sharding)


def device_tensor(x, t: HFTensor) -> jax.Array:
    """HF tensor ``t`` of param ``x``, whole on every device that holds a part of ``x``.

    A collective when ``x`` spans processes: every process must call it, in the same order.

    Args:
      x: the param ``t.param`` (a jax.Array, sharded or not, or a numpy array).
      t: the tensor to cut out (``t.layer``) and lay out (``t.layout``).

    Returns:
      A jax.Array of shape ``t.shape``: replicated over ``x``'s mesh for a ``NamedSharding``,
      else wherever XLA places it (``x`` is then fully addressable).

    Raises:
      ValueError: ``x`` is not fully addressable and its sharding is not a ``NamedSharding``.
    """
    if isinstance(x, np.ndarray):
        host = x[t.index]
        return jax.numpy.asarray(np.ascontiguousarray(to_hf_layout(t.layout, host)))
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        out_sharding = NamedSharding(sharding.mesh, PartitionSpec())
    elif x.is_fully_addressable:
        out_sharding = None
    else:
        raise ValueError(
            f"param {t.param!r} spans processes with a {type(sharding).__name__}; "
            "hf_export needs a NamedSharding to replicate one tensor at a time"
        )
    return _program(t.layout, out_sharding)(x, *(np.int32(i) for i in t.index))


def iter_device_tensors(
    config: config_lib.ModelConfig, params, *, untie_embeddings: bool = False
) -> Iterator[tuple[HFTensor, jax.Array]]:
    """``hf_tensors`` paired with their ``device_tensor``, gathered one at a time as consumed."""
    flat = dict(transformer.flatten_params(params))
    for t in hf_tensors(config, params, untie_embeddings=untie_embeddings):
        yield t, device_tensor(flat[t.param], t)


def host_tensor(x, t: HFTensor) -> np.ndarray:
    """``device_tensor`` copied to this host (C-contiguous, the param's dtype)."""
    out = device_tensor(x, t)
    # A fully addressable result may still be split over this host's devices: np.asarray joins
    # it. Otherwise it is replicated (NamedSharding, P()) and any local copy is the whole.
    local = out if out.is_fully_addressable else out.addressable_data(0)
    return np.ascontiguousarray(np.asarray(local))


# ---------------------------------------------------------------------------------------------
# save


def _stale_weight_files(path: str, keep: set[str]) -> list[str]:
    names = []
    for name in os.listdir(path):
        stem = name.removesuffix(".safetensors")
        sharded = stem.startswith("model-") and "-of-" in stem and name.endswith(".safetensors")
        if (name in (SINGLE_FILE, INDEX_FILE) or sharded) and name not in keep:
            names.append(name)
    return names


def _write_atomic(path: str, data: bytes | str) -> None:
    partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")
    with open(partial, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(partial, path)


def save(
    config: config_lib.ModelConfig,
    params,
    path: str | os.PathLike,
    *,
    untie_embeddings: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Writes params as a HF checkpoint (safetensors + config.json) into directory ``path``.

    Every process must call it (the per-tensor gathers are collectives); only process 0 writes,
    and when it returns on any process the export is complete. Host memory holds one tensor at a
    time (see the module docstring). transformers' ``AutoModelForCausalLM.from_pretrained``,
    vLLM and ``model.load_hf_checkpoint`` read the result.

    Args:
      config: the params' model config (config.json comes from ``config.to_hf_dict``).
      params: params tree, device arrays (sharded over any mesh, across processes too) or numpy.
      path: output directory, created if needed. Weight files of an earlier export there that
        this one does not overwrite are removed.
      untie_embeddings: write a tied model untied (``lm_head.weight`` plus
        ``tie_word_embeddings: false``), as vLLM's weight reload needs.
      max_shard_bytes: shard size limit (transformers' ``max_shard_size``); one tensor larger
        than it gets a shard of its own.

    Raises:
      ValueError: params that do not match ``config``, or a dtype safetensors cannot store.
      OSError: process 0 could not write (on the other processes: RuntimeError naming it).
    """
    path = os.fspath(path)
    tensors = hf_tensors(config, params, untie_embeddings=untie_embeddings)
    shards = plan_shards(tensors, max_shard_bytes)
    files = list(zip(shard_filenames(len(shards)), [_file_order(s) for s in shards]))
    flat = dict(transformer.flatten_params(params))
    writer = jax.process_index() == 0
    multiprocess = jax.process_count() > 1
    error: BaseException | None = None

    def guarded(fn, *args):
        # Process 0 keeps taking part in the gathers after a write error (the other processes
        # would hang in the next collective otherwise) and reports it at the end.
        nonlocal error
        if error is None:
            try:
                return fn(*args)
            except OSError as e:
                if not multiprocess:
                    raise
                error = e
        return None

    if writer:
        os.makedirs(path, exist_ok=True)
        for name in _stale_weight_files(path, {fname for fname, _ in files}):
            os.remove(os.path.join(path, name))
    for fname, ordered in files:
        target = os.path.join(path, fname)
        partial = os.path.join(path, f".{fname}.partial")
        f = guarded(open, partial, "wb") if writer else None
        if f is not None:
            guarded(f.write, safetensors_header(ordered))
        for t in ordered:
            if writer:
                value = host_tensor(flat[t.param], t)
                if f is not None and error is None:
                    guarded(f.write, value.reshape(-1).view(np.uint8).data)
                del value
            else:
                device_tensor(flat[t.param], t).block_until_ready()
        if f is not None:
            f.close()
            guarded(os.replace, partial, target)
    if writer:
        if len(files) > 1:
            guarded(_write_atomic, os.path.join(path, INDEX_FILE), index_json(files))
        hf_config = config.to_hf_dict(untie_embeddings=untie_embeddings)
        # The dtype the weights were written in (params may have been cast after loading).
        hf_config["dtype"] = hf_config["torch_dtype"] = str(tensors[0].dtype)
        text = json.dumps(hf_config, indent=2, sort_keys=True)
        guarded(_write_atomic, os.path.join(path, "config.json"), text)
    if multiprocess:
        from jax.experimental import multihost_utils

        ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
        if not int(ok):
            if error is not None:
                raise error
            raise RuntimeError(f"process 0 failed to write the HF export to {path!r}; see its log")


# ---------------------------------------------------------------------------------------------
# PEFT adapters (LoRA)

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # PeftModel wraps the HF model as base_model.model
# (PEFT tensor, adapter leaf, HF layout of that leaf)
_PEFT_LAYOUTS = (("lora_A", "lora_a", "linear_out"), ("lora_B", "lora_b", "linear"))


def adapter_tensors(config: config_lib.ModelConfig, adapters) -> list[HFTensor]:
    """The PEFT tensors of LoRA `adapters` (grpo_jax/models/lora.py), in transformers' save order.

    Each targeted kernel's HF name ``model.layers.{i}.<module>.weight`` gives
    ``base_model.model.model.layers.{i}.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight``
    [out, r], in torch's Linear layout: A [*in, r] flattens its input axes (the kernel's HF
    flattening, layout ``linear_out``), B [r, *out] its output axes (``linear``).

    Raises:
      ValueError: `adapters` do not match the config's rank and targets.
    """
    transformer.check_adapters(config, adapters)
    flat = dict(transformer.flatten_params(adapters))
    out = []
    for template, param, _ in HF_TO_JAX:
        stem = param.removesuffix("/kernel")
        if f"{stem}/lora_a" not in flat:
            continue
        module = template.removesuffix(".weight")
        for suffix, leaf, layout in _PEFT_LAYOUTS:
            x = flat[f"{stem}/{leaf}"]
            per_layer = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
            shape = tuple(jax.eval_shape(functools.partial(to_hf_layout, layout), per_layer).shape)
            for i in range(config.num_layers):
                name = f"{_PEFT_PREFIX}{module.format(i=i)}.{suffix}.weight"
                out.append(HFTensor(name, f"{stem}/{leaf}", i, layout, shape, np.dtype(x.dtype)))
    return sorted(out, key=lambda t: natural_key(t.name))


def peft_config(config: config_lib.ModelConfig, *, base_model_name_or_path: str = "") -> dict:
    """adapter_config.json of a PEFT LoRA adapter with the config's rank, alpha and targets."""
    alpha = config.lora_alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.lora_rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": sorted(config.lora_targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_adapter(
    config: config_lib.ModelConfig, adapters, path: str | os.PathLike, *,
    base_model_name_or_path: str = "",
) -> None:  # fmt: skip
    """Writes LoRA `adapters` as a PEFT adapter directory: ``adapter_model.safetensors`` (one
    file, float32, PEFT's names) and ``adapter_config.json``.

    ``peft.PeftModel.from_pretrained(hf_base_model, path)`` and vLLM's ``/v1/load_lora_adapter``
    read it. Like `save`, a collective over the adapters' mesh: every process must call it, only
    process 0 writes, and host memory holds one tensor at a time.

    Args:
      config: the ModelConfig with the adapters' rank, alpha and targets.
      adapters: the adapters pytree (lora.init_adapters layout), sharded or not.
      path: output directory, created if needed.
      base_model_name_or_path: recorded in adapter_config.json (PEFT's pointer to the base).
    """
    path = os.fspath(path)
    ordered = _file_order(adapter_tensors(config, adapters))
    flat = dict(transformer.flatten_params(adapters))
    if jax.process_index() != 0:
        for t in ordered:
            device_tensor(flat[t.param], t).block_until_ready()
        return
    os.makedirs(path, exist_ok=True)
    partial = os.path.join(path, f".{ADAPTER_FILE}.partial")
    with open(partial, "wb") as f:
        f.write(safetensors_header(ordered))
        for t in ordered:
            f.write(host_tensor(flat[t.param], t).reshape(-1).view(np.uint8).data)
    os.replace(partial, os.path.join(path, ADAPTER_FILE))
    text = json.dumps(peft_config(config, base_model_name_or_path=base_model_name_or_path),
                      indent=2, sort_keys=True)  # fmt: skip
    _write_atomic(os.path.join(path, ADAPTER_CONFIG), text)
