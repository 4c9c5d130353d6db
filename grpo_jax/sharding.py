"""One device mesh and the logical-axis rules that map every array of a GRPO run onto it.

Owns: the mesh axes ``AXES = ("data", "fsdp", "sequence", "tensor")`` and ``make_mesh``; the
logical-axis rules table ``LOGICAL_RULES`` (overridable through ``config.mesh.rules``); and the
shardings derived from it for parameters, optimizer state and batches. It knows no model internals:
parameter layouts come from ``model.logical_axes(config)`` (a pytree of ``PartitionSpec``s over
logical names), and optimizer state is matched to parameters by tree path.

Parallelism (levanter's parameter-vs-compute split, maxtext's pure-fsdp rules):
  * FSDP (ZeRO-3): every parameter's ``embed`` dimension is split over ``fsdp``; XLA all-gathers
    a weight just before use and reduce-scatters its gradient.
  * Tensor parallelism (Megatron): ``heads``, ``kv_heads``, ``mlp`` and ``vocab`` over ``tensor``.
  * Expert parallelism (MoE layers): the expert weights [E, D, F] are split by expert over
    ``fsdp`` (``expert``), their model dimension over ``sequence`` (``expert_embed``, what is
    left of ``embed``'s split: one mesh axis cannot split two dimensions) and their width over
    ``tensor`` (``mlp``), so every expert weight is split as finely as a dense one, with whole
    experts per FSDP device. The same devices hold a share of the batch (verl / Megatron fold
    expert parallelism into data parallelism the same way), and the 3-entry mesh shape needs
    no new axis. ``config.mesh.rules`` can map ``expert`` elsewhere (``tensor``; then give
    ``mlp`` another axis or None).
  * Data parallelism: the leading batch axis of activations is split over ``("data", "fsdp")``, so
    FSDP devices also each see a different slice of the batch.
  * Sequence parallelism (Ulysses, verl's ``ulysses_sequence_parallel_size``): the token axis of
    activations (``seq``) is split over ``sequence``; around attention the queries, keys and
    values switch to whole rows split by head (``attn_seq`` / ``attn_heads``: an all-to-all that
    GSPMD inserts), and back after it. The ``sequence`` devices of a row also hold a share of
    every parameter (``embed`` over ``("fsdp", "sequence")``, as verl's FSDP shards over all
    ranks, its sequence groups included), and see the same rows: data parallelism is over
    data x fsdp = devices / (sequence x tensor). The axis has size 1 unless asked for, which
    changes nothing.

Decisions:
  * Meshes use ``AxisType.Auto`` on every axis. jax 0.10 defaults ``jax.make_mesh`` to
    ``Explicit`` axes, under which every einsum whose operands are sharded inconsistently (FSDP
    weights against a batch-sharded activation) must name its output sharding; Auto leaves those
    intermediate layouts to XLA's sharding propagation, so model code stays mesh-free. The same
    mesh works under ``jax.set_mesh`` and with newer releases that keep Auto.
  * No silent replication: a logical name missing from the rules, a mesh axis used twice in one
    spec, or a mesh axis product that does not divide the dimension raises ``ValueError`` naming
    the array, the dimension and the sizes. Replication happens only where a rule says ``None``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "sequence", "tensor")
BATCH_AXES = ("data", "fsdp")
# config.mesh.shape's three-entry form names these; the sequence axis is then sized by
# actor.ulysses_sequence_parallel_size (make_mesh's `sequence`).
SHAPE_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# (logical name, mesh axis or axes or None = replicated). The first rule for a name wins.
LOGICAL_RULES: Rules = (
    # Parameters: FSDP on the model dimension, Megatron tensor parallelism on the rest.
    ("embed", ("fsdp", "sequence")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    # MoE experts (grpo_jax/models/moe.py): expert parallelism over the FSDP devices; an
    # expert's model dimension takes the rest of `embed`'s split.
    ("expert", "fsdp"),
    ("expert_embed", "sequence"),
    ("layers", None),  # the stacked-layer axis of scanned parameters and of the KV cache
    # Activations and caches: data parallel over every non-tensor device.
    ("batch", BATCH_AXES),
    ("seq", "sequence"),
    # Inside attention (Ulysses): whole rows, the heads split over the sequence devices too.
    ("attn_seq", None),
    ("attn_heads", ("tensor", "sequence")),
    ("attn_kv_heads", ("tensor", "sequence")),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def mesh_shape(shape: Sequence[int], sequence: int | None = None) -> tuple[int, ...]:
    """``shape`` as one entry per axis of ``AXES``: a three-entry (data, fsdp, tensor) shape gets
    a sequence axis of size `sequence` (None: 1); a four-entry one says its own, which must be
    `sequence` (or -1) when that is given."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == len(SHAPE_AXES):
        return (shape[0], shape[1], int(sequence or 1), shape[2])
    if len(shape) == len(AXES):
        if sequence is not None and shape[2] not in (-1, sequence):
            raise ValueError(
                f"mesh shape {shape} has a sequence axis of {shape[2]}, but "
                f"actor.ulysses_sequence_parallel_size is {sequence}; give the same size in both, "
                "or a three-entry (data, fsdp, tensor) shape"
            )
        return shape
    raise ValueError(
        f"mesh shape {shape} must have 3 entries {SHAPE_AXES} or 4 entries {AXES}"
    )


def make_mesh(
    shape: Sequence[int] = (-1, 1, 1),
    *,
    devices: Sequence[Any] | None = None,
    sequence: int | None = None,
) -> Mesh:
    """Builds the ``("data", "fsdp", "sequence", "tensor")`` mesh; at most one ``-1`` entry
    fills the rest.

    Args:
      shape: three ints (data, fsdp, tensor), e.g. ``(-1, 1, 1)`` (all devices data parallel)
        or ``(1, 8, 1)``, or four (data, fsdp, sequence, tensor).
      devices: devices to use (default: all global devices, so multi-host meshes span hosts).
      sequence: the sequence axis (actor.ulysses_sequence_parallel_size; None: 1, or what a
        four-entry shape says): ``(1, -1, 1)`` with ``sequence=4`` on 8 devices is (1, 2, 4, 1).

    Returns:
      A ``Mesh`` with ``AxisType.Auto`` axes (see the module docstring for why).

    Raises:
      ValueError: if ``shape`` does not have 3 or 4 entries, has more than one ``-1``, has an
        entry below 1 other than ``-1``, or its product differs from the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    if sequence is not None and sequence < 1:
        raise ValueError(f"sequence axis of {sequence}: it must be >= 1")
    shape = mesh_shape(shape, sequence)
    if shape.count(-1) > 1 or any(s < 1 and s != -1 for s in shape):
        raise ValueError(f"mesh shape {shape}: entries must be >= 1, with at most one -1 (fill)")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"mesh shape {shape}: {len(devices)} devices not divisible by {known}")
        shape = tuple(len(devices) // known if s == -1 else s for s in shape)
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"mesh shape {shape} needs {math.prod(shape)} devices, have {len(devices)}"
        )
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def validate_rules(rules: Sequence[Sequence[Any]]) -> Rules:
    """Normalises rules (e.g. lists from a ConfigDict) to a hashable tuple and checks them.

    Raises:
      ValueError: on a malformed pair, a duplicate logical name, or an unknown mesh axis.
    """
    out, seen = [], set()
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(f"rule {rule!r} must be a (logical_name, mesh_axes) pair")
        name, axes = rule
        if name in seen:
            raise ValueError(f"logical name {name!r} has more than one rule")
        seen.add(name)
        if axes is not None and not isinstance(axes, str):
            axes = tuple(axes)
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            if axis not in AXES:
                raise ValueError(f"rule {rule!r}: mesh axis {axis!r} is not one of {AXES}")
        out.append((name, axes))
    return tuple(out)


def rules_from_config(rules: Sequence[Sequence[Any]] | None) -> Rules:
    """``config.mesh.rules``: None keeps ``LOGICAL_RULES``; a table replaces it whole (validated)."""
    return LOGICAL_RULES if rules is None else validate_rules(rules)


def logical_to_mesh_spec(
    logical_spec: PartitionSpec, rules: Rules = LOGICAL_RULES
) -> PartitionSpec:
    """Maps one ``PartitionSpec`` of logical names to one of mesh axes.

    Raises:
      ValueError: if a logical name has no rule or two dimensions map to the same mesh axis.
    """
    table = dict(validate_rules(rules))
    mesh_dims, used = [], []
    for name in logical_spec:
        if name is None:
            mesh_dims.append(None)
            continue
        if isinstance(name, tuple):
            raise TypeError(f"{logical_spec}: give one logical name per dimension, got {name}")
        if name not in table:
            raise ValueError(f"logical name {name!r} in {logical_spec} has no rule in {rules}")
        axes = table[name]
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            if axis in used:
                raise ValueError(f"{logical_spec}: mesh axis {axis!r} would shard two dimensions")
            used.append(axis)
        mesh_dims.append(axes)
    return PartitionSpec(*mesh_dims)


def _check_divisible(path: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> None:
    if len(spec) > len(shape):
        raise ValueError(f"{path}: spec {spec} has more dimensions than shape {tuple(shape)}")
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        parts = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
        if size % parts:
            raise ValueError(
                f"{path}: dimension {dim} of size {size} cannot be split {parts} ways over mesh "
                f"axes {axes} (mesh {dict(mesh.shape)}); change config.mesh.shape or the rule"
            )


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def logical_to_mesh_sharding(
    logical_tree: Any, mesh: Mesh, rules: Rules = LOGICAL_RULES, *, shapes: Any = None
) -> Any:
    """Maps a pytree of logical ``PartitionSpec``s to a pytree of ``NamedSharding``s.

    Args:
      logical_tree: pytree whose leaves are ``PartitionSpec``s of logical names.
      mesh: the mesh from ``make_mesh``.
      rules: logical-axis rules (``LOGICAL_RULES`` or ``config.mesh.rules``).
      shapes: optional pytree of the same structure whose leaves have ``.shape``
        (arrays or ``ShapeDtypeStruct``s); when given, every split is checked to divide.

    Returns:
      Pytree of ``NamedSharding`` with the structure of ``logical_tree``.
    """
    rules = validate_rules(rules)
    spec_tree = jax.tree.map(
        lambda s: logical_to_mesh_spec(s, rules), logical_tree, is_leaf=_is_spec
    )
    if shapes is not None:
        flat_specs, treedef = jax.tree_util.tree_flatten_with_path(spec_tree, is_leaf=_is_spec)
        flat_shapes = treedef.flatten_up_to(shapes)
        for (path, spec), x in zip(flat_specs, flat_shapes):
            _check_divisible(jax.tree_util.keystr(path), x.shape, spec, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=_is_spec)


def _model_logical_axes(config: Any, *, adapters: bool = False) -> Any:
    """``model.logical_axes(config)`` (or ``model.adapter_logical_axes``) as logical names, also
    inside ``use_mesh``.

    NNX resolves partition metadata through the active flax logical-axis rules and checks it
    against the active mesh, so under ``use_mesh`` it would hand back mesh axes (or reject the
    logical names). An empty abstract mesh and empty rules keep the logical names.
    """
    from grpo_jax import model  # lazy: keeps this module importable without flax

    no_mesh = jax.sharding.AbstractMesh((), ())
    with jax.sharding.use_abstract_mesh(no_mesh), nn.logical_axis_rules(()):
        return model.adapter_logical_axes(config) if adapters else model.logical_axes(config)


def param_shardings(config: Any, mesh: Mesh, rules: Rules = LOGICAL_RULES) -> Any:
    """Shardings for the parameters of ``model.ModelConfig`` ``config``, checked against shapes."""
    from grpo_jax import model  # lazy: keeps this module importable without flax

    return logical_to_mesh_sharding(
        _model_logical_axes(config), mesh, rules, shapes=model.abstract_params(config)
    )


def adapter_shardings(config: Any, mesh: Mesh, rules: Rules = LOGICAL_RULES) -> Any:
    """Shardings for the LoRA adapters of ``config`` (grpo_jax/models/lora.py): each A / B is split like
    its kernel on the input / output axes, the rank axis replicated; checked against shapes."""
    from grpo_jax import model  # lazy: keeps this module importable without flax

    return logical_to_mesh_sharding(
        _model_logical_axes(config, adapters=True), mesh, rules,
        shapes=model.abstract_adapters(config),
    )  # fmt: skip


def init_sharded_params(
    config: Any, mesh: Mesh, rng: jax.Array, rules: Rules = LOGICAL_RULES
) -> Any:
    """Initialises parameters directly into their shardings (big_vision/nanodo shape-first init).

    ``jax.jit(init_params, out_shardings=...)`` lets XLA create each shard on its own device, so no
    device ever holds the full model.
    """
    from grpo_jax import model

    shardings = param_shardings(config, mesh, rules)
    return jax.jit(model.init_params, static_argnums=0, out_shardings=shardings)(config, rng)


def batch_sharding(
    mesh: Mesh, ndim: int, axes: tuple[str, ...] = BATCH_AXES
) -> NamedSharding:
    """Leading axis over `axes` (``("data", "fsdp")``; the sampler's rows may take
    `rollout_rows`'), the other ``ndim - 1`` axes replicated."""
    if ndim < 1:
        raise ValueError(f"a batch array needs a leading batch axis, got ndim={ndim}")
    return NamedSharding(mesh, PartitionSpec(axes, *(None,) * (ndim - 1)))


# The sampler's rows split over every non-tensor device: a sequence group's devices (which the
# update gives one row's tokens) each decode rows of their own, as verl's rollout replicas do.
ROLLOUT_BATCH_AXES = ("data", "fsdp", "sequence")


def rollout_batch_axes(mesh: Mesh, num_prompts: int) -> tuple[str, ...]:
    """The mesh axes the native sampler splits `num_prompts` prompts over: ROLLOUT_BATCH_AXES
    when the mesh has a sequence axis and they divide, else BATCH_AXES (the batch's own)."""
    sizes = dict(mesh.shape)
    if sizes.get("sequence", 1) == 1:
        return BATCH_AXES
    if num_prompts % math.prod(sizes[a] for a in ROLLOUT_BATCH_AXES):
        return BATCH_AXES
    return ROLLOUT_BATCH_AXES


def rollout_rules(rules: Rules, axes: tuple[str, ...]) -> Rules:
    """`rules` for sampling over batch `axes`: "batch" over them and, since decoding is row
    by row, no token split ("seq" replicated: no Ulysses in the sampler's prefill)."""
    return tuple(
        (name, axes if name == "batch" else None if name == "seq" else mesh_axes)
        for name, mesh_axes in validate_rules(rules)
    )


def rollout_rows(mesh: Mesh, rules: Rules, num_prompts: int) -> tuple[tuple[str, ...], Rules]:
    """(batch axes, rules) the native sampler runs `num_prompts` prompts under: the batch's
    own axes and `rules`, or with sequence parallelism every non-tensor device and
    `rollout_rules` (engines.NativeEngine; the planner plans the same)."""
    axes = rollout_batch_axes(mesh, num_prompts)
    return axes, (rules if axes == BATCH_AXES else rollout_rules(rules, axes))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device (scalars, step counters, RNG keys)."""
    return NamedSharding(mesh, PartitionSpec())


def abstract_with_shardings(abstract_tree: Any, sharding_tree: Any) -> Any:
    """Attaches shardings to a ``ShapeDtypeStruct`` tree (for AOT lowering and orbax restore)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract_tree,
        sharding_tree,
    )


def _path_keys(path: tuple[Any, ...]) -> tuple[Any, ...]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
        else:
            out.append(str(k))
    return tuple(out)


def opt_state_shardings(
    abstract_opt_state: Any, abstract_params: Any, param_sharding_tree: Any, mesh: Mesh
) -> Any:
    """Shardings for optimizer state that mirror the parameters it tracks.

    Optax states hold copies of the parameter tree (Adam's ``mu``/``nu``), possibly nested in
    chains, ``masked`` or ``inject_hyperparams`` wrappers. A state leaf whose tree path ends with a
    parameter's path and whose shape equals that parameter's gets the parameter's sharding; scalar
    leaves (step counts, injected hyperparameters) are replicated.

    Args:
      abstract_opt_state: ``jax.eval_shape(tx.init, abstract_params)``.
      abstract_params: parameter ``ShapeDtypeStruct`` tree.
      param_sharding_tree: shardings for ``abstract_params`` (from ``param_shardings``).
      mesh: the mesh.

    Raises:
      ValueError: for a non-scalar state leaf that matches no parameter (never replicated silently).
    """
    param_paths, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    param_sh = treedef.flatten_up_to(param_sharding_tree)
    by_path = {_path_keys(p): (x.shape, s) for (p, x), s in zip(param_paths, param_sh, strict=True)}

    def match(path, leaf):
        keys = _path_keys(path)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and tuple(hit[0]) == tuple(leaf.shape):
                return hit[1]
        if not leaf.shape:
            return replicated(mesh)
        raise ValueError(
            f"optimizer state leaf {jax.tree_util.keystr(path)} {leaf.shape} matches no parameter"
        )

    return jax.tree_util.tree_map_with_path(match, abstract_opt_state)


def tx_state_shardings(tx: Any, abstract_params: Any, param_sharding_tree: Any, mesh: Mesh) -> Any:
    """``opt_state_shardings`` for ``optax`` transformation ``tx`` initialised on the params."""
    abstract_opt_state = jax.eval_shape(tx.init, abstract_params)
    return opt_state_shardings(abstract_opt_state, abstract_params, param_sharding_tree, mesh)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules = LOGICAL_RULES):
    """``jax.set_mesh(mesh)`` plus ``flax.linen.logical_axis_rules(rules)``.

    model.py annotates activations with ``nn.with_logical_constraint``; those annotations act
    only while logical-axis rules are active. train.py and plan.py therefore call (trace) every
    jitted step inside ``with sharding.use_mesh(mesh, rules):``.
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(validate_rules(rules)):
        yield mesh


def shard_fn(mesh: Mesh, rules: Rules = LOGICAL_RULES) -> Callable[[Any, Any], Any]:
    """The ``shardings=`` callable for ``model.load_hf_checkpoint``: (config, abstract) -> tree."""

    def fn(config, abstract_params):
        return logical_to_mesh_sharding(
            _model_logical_axes(config), mesh, rules, shapes=abstract_params
        )

    return fn
