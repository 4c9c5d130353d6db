"""Mixture-of-experts feed-forward (Qwen3-MoE): top-k routing, grouped experts, load balancing.

A MoE layer replaces the dense SwiGLU MLP with E SwiGLU experts and a linear router (Shazeer
et al. 2017; Qwen3 technical report). Each token goes to the A experts of highest router
probability and gets their outputs weighted by those probabilities, renormalised to sum to 1
when ``norm_topk_prob`` (HF ``Qwen3MoeTopKRouter``: softmax in float32, ``topk``, then the
division).

Design:
  * The experts run as one grouped matmul per projection (``jax.lax.ragged_dot``; megablox's
    GMM on TPU is the same contraction): the X·A (token, expert) assignments are sorted by
    expert, so each expert's rows are contiguous and ``group_sizes`` says how many each has.
    No capacity factor and no dropped tokens: the result equals HF's per-expert loop.
  * Under a mesh the experts are computed where the tokens are (verl's FSDP MoE): a
    ``shard_map`` gives each device its own tokens (X split as the rules split ``batch``, then
    ``seq``) and the layer's expert weights whole, all-gathered from their ``expert`` /
    ``expert_embed`` split (their gradients summed back onto it), but for each expert's width
    F, split as the rules split ``mlp`` with the outputs summed over those devices. The sort and
    the grouped matmuls are then each device's X / devices tokens, never the global batch
    (which GSPMD cannot partition: it would replicate the sorted assignments).
  * The paged engine vmaps its shards' programs with the weights unbatched, which jax 0.10's
    ragged_dot cannot batch: a ``custom_vmap`` runs the batch's tokens as one set of tokens,
    under a ``custom_vjp`` that keeps the gradient ragged_dot's own.
  * XLA:CPU lowers ragged_dot to a dense masked dot over every expert (temporaries E times a
    grouped matmul's); GPU and TPU compilers have a grouped matmul. The planner, compiling on
    CPU devices for those, traces inside ``capacity_stand_in``: batched dense matmuls over the
    assignments padded to a balanced capacity, with the grouped matmul's buffers.
  * Router replay (verl's ``actor.router_replay``): ``route`` takes the experts to use instead
    of its own top-k, and then weights them by the current router's probabilities, renormalised
    as above; the routing then follows the recorded one (the rollout's, R3, or the old-log-prob
    pass's, R2) while the router still gets gradients. A token whose recorded experts are
    ``no_route(E)`` (nothing was recorded there: the padding, a rollout's last token, which is
    never fed back) routes by its own top-A, as verl's replay does for rows without a route.
    Recorded experts are stored in ``routing_dtype(E)`` (uint8 up to 255 experts: 8 bytes a
    token and MoE layer for Qwen3-30B-A3B's A = 8).
  * The auxiliary load-balancing loss is HF's ``load_balancing_loss_func`` (Switch Transformer,
    Fedus et al. 2021, eqs. 4-6): over the real tokens of all MoE layers together,
    E * sum_e f_e * P_e with f_e the share of the top-A assignments that chose expert e and P_e
    the mean router probability of e. The layers' per-expert sums (``RouterStats``) are
    reduced here, so the trainer never holds the [layers, tokens, E] router logits.

Shapes: X tokens (B·T flattened), D hidden, E experts, A experts per token
(``num_experts_per_tok``), F an expert's width (``moe_intermediate_size``), Y = X·A
assignments, Lm MoE layers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def routing_dtype(num_experts: int):
    """The smallest unsigned integer type that holds the expert ids 0..E-1 and ``no_route``:
    the dtype recorded routing is stored in (uint8 up to E = 255, else uint16)."""
    return np.uint8 if num_experts < np.iinfo(np.uint8).max else np.uint16


def no_route(num_experts: int) -> int:
    """The id that marks a token without recorded experts (the dtype's largest value)."""
    return int(np.iinfo(routing_dtype(num_experts)).max)


def route(logits_XE, num_experts_per_tok: int, *, norm_topk_prob: bool, experts_XA=None):
    """Top-A routing of HF's Qwen3MoeTopKRouter.

    Args:
      logits_XE: router logits.
      num_experts_per_tok: A.
      norm_topk_prob: divide the A probabilities by their sum (config.norm_topk_prob).
      experts_XA: optional experts to use (router replay) instead of the top-A; a token whose
        first id is not an expert (>= E, ``no_route``) takes its own top-A.

    Returns:
      (probs_XE float32 softmax, weights_XA in logits' dtype, experts_XA int32, replayed_X
      bool: the token followed experts_XA, None without them).
    """
    probs_XE = jax.nn.softmax(logits_XE.astype(jnp.float32), axis=-1)
    weights_XA, own_XA = jax.lax.top_k(probs_XE, num_experts_per_tok)
    replayed_X = None
    if experts_XA is not None:
        experts_XA = experts_XA.astype(jnp.int32)
        replayed_X = experts_XA[:, 0] < probs_XE.shape[-1]
        own_XA = jnp.where(replayed_X[:, None], experts_XA, own_XA)
        weights_XA = jnp.take_along_axis(probs_XE, own_XA, axis=-1)
    if norm_topk_prob:
        weights_XA = weights_XA / jnp.sum(weights_XA, axis=-1, keepdims=True)
    return probs_XE, weights_XA.astype(logits_XE.dtype), own_XA.astype(jnp.int32), replayed_X


def differs(probs_XE, experts_XA):
    """bool [X]: the router's own top-A (of probs_XE) is not the set experts_XA."""
    _, own_XA = jax.lax.top_k(probs_XE, experts_XA.shape[-1])
    return jnp.any(jnp.sort(own_XA, axis=-1) != jnp.sort(experts_XA, axis=-1), axis=-1)


def grouped_swiglu(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD):
    """sum_a weights[x, a] * down_e(silu(gate_e(x)) * up_e(x)), e = experts[x, a].

    Every assignment is one row of three grouped matmuls (``ragged_dot``) over the rows sorted
    by expert; the rows go back to token order before the weighted sum. Under a mesh each
    device computes its own tokens' experts (``_local_experts``); vmappable over leading axes
    (``_batchable_swiglu``).

    Returns:
      y_XD in x's dtype.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return _experts(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD)
    tokens = _token_axes(mesh, x_XD.shape[0])
    (mlp,) = nn.logical_to_mesh_axes(("mlp",))
    if set(_names(mlp)) & set(_names(tokens)):
        raise ValueError(
            f"the logical rules split the experts' width (`mlp` -> {mlp}) over a mesh axis "
            f"that also splits the tokens ({tokens}); map `mlp` in config.mesh.rules to an "
            "axis that splits neither `batch` nor `seq`"
        )
    # The weights enter whole but for their width: GSPMD all-gathers them from their
    # `expert` / `expert_embed` split (one layer at a time, inside the layer scan) and sums
    # their gradients back onto it. (An explicit all_gather in here could not name the FSDP
    # axis under the paged engine's vmap, whose spmd_axis_name holds it.)
    Ps = jax.sharding.PartitionSpec
    rows, w_in, w_out = Ps(tokens), Ps(None, None, mlp), Ps(None, mlp, None)
    local = functools.partial(_local_experts, mlp=mlp)
    per_device = jax.shard_map(
        local, in_specs=(rows, rows, rows, w_in, w_in, w_out), out_specs=rows,
        check_vma=False,  # the grouped matmuls' custom rules carry no vma
    )  # fmt: skip
    return per_device(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD)


def _names(axes) -> tuple[str, ...]:
    """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _token_axes(mesh, num_tokens: int) -> tuple[str, ...]:
    """The mesh axes that split the token axis X (B·T flattened row-major): the rules' `batch`
    axes, then their `seq` axes (Ulysses), each kept while the product still divides X (a decode
    step's X = B rows is not split over `sequence`; those devices then repeat its experts)."""
    batch, seq = nn.logical_to_mesh_axes(("batch", "seq"))
    axes, size = [], 1
    for name in (*_names(batch), *_names(seq)):
        if num_tokens % (size * mesh.shape[name]) == 0:
            axes.append(name)
            size *= mesh.shape[name]
    return tuple(axes)


def _local_experts(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD, *, mlp):
    """One device's tokens through the layer's whole experts (verl's FSDP MoE), with this
    device's share of each expert's width F (`mlp`): the partial outputs are summed over
    those devices (Megatron's row-parallel down projection)."""
    y_XD = _experts(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD)
    return y_XD if mlp is None else jax.lax.psum(y_XD, mlp)


def _experts(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD):
    """The grouped matmuls on one device, or their planning stand-in (``capacity_stand_in``)."""
    args = (x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD)
    if _STAND_IN.get():
        return _capacity_swiglu(*args)
    return _differentiable_swiglu(*args)


@jax.custom_vjp
def _differentiable_swiglu(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD):
    """``_sorted_swiglu``, vmappable (its primal is ``_batchable_swiglu``) and differentiable
    (``custom_vmap`` alone has no reverse mode): the gradient is ``_sorted_swiglu``'s own. A
    gradient taken under vmap with unbatched weights still meets ragged_dot's batching rule;
    only the paged engine vmaps, and it takes none."""
    return _batchable_swiglu(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD)


def _swiglu_fwd(*args):
    return jax.vjp(_sorted_swiglu, *args)


def _swiglu_bwd(vjp_fn, dy_XD):
    return vjp_fn(dy_XD)


_differentiable_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_batching.custom_vmap
def _batchable_swiglu(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD):
    """``_sorted_swiglu`` with a batching rule: jax 0.10's ragged_dot batches only when all three
    operands (weights and group sizes too) are batched along axis 0 ("ragged_dot vmap over any
    dim but 0 - NYI"), and the paged engine vmaps its shards' programs with the weights
    unbatched."""
    return _sorted_swiglu(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD)


@_batchable_swiglu.def_vmap
def _batchable_swiglu_rule(axis_size, in_batched, *args):
    def batched(a, b):
        return a if b else jnp.broadcast_to(a, (axis_size, *a.shape))

    tokens, weights = args[:3], args[3:]
    if any(in_batched[3:]):  # one layer's experts per batch entry: a loop over the entries
        args = tuple(batched(a, b) for a, b in zip(args, in_batched))
        return jax.lax.map(lambda a: _batchable_swiglu(*a), args), True
    # Tokens are independent: the batch's tokens are one set of tokens for the same experts
    # (calling the function again handles vmaps further out).
    flat = tuple(
        batched(a, b).reshape(axis_size * a.shape[int(b)], *a.shape[1 + int(b):])
        for a, b in zip(tokens, in_batched)
    )  # fmt: skip
    y_XD = _batchable_swiglu(*flat, *weights)
    return y_XD.reshape(axis_size, -1, y_XD.shape[-1]), True


def _sort_by_expert(experts_XA, num_experts: int):
    """(order_Y, sizes_E): the assignments in expert order (stable) and each expert's count."""
    expert_Y = experts_XA.reshape(-1)
    order_Y = jnp.argsort(expert_Y, stable=True)
    return order_Y, jnp.bincount(expert_Y, length=num_experts).astype(jnp.int32)


def _unsort(y_YD, order_Y, weights_XA):
    """The rows of y_YD back to (token, assignment) order (a gather by the inverse permutation),
    weighted and summed over the assignments: y_XD."""
    X, A = weights_XA.shape
    y_XAD = jnp.take(y_YD, jnp.argsort(order_Y), axis=0).reshape(X, A, -1)
    return jnp.einsum("XAD,XA->XD", y_XAD, weights_XA.astype(y_XAD.dtype))


def _sorted_swiglu(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD):
    """The grouped matmuls proper (``ragged_dot``) over the assignments sorted by expert."""
    A = experts_XA.shape[1]
    order_Y, sizes_E = _sort_by_expert(experts_XA, gate_EDF.shape[0])
    x_YD = jnp.take(x_XD, order_Y // A, axis=0)
    gate_YF = jax.lax.ragged_dot(x_YD, gate_EDF, sizes_E)
    up_YF = jax.lax.ragged_dot(x_YD, up_EDF, sizes_E)
    h_YF = jax.nn.silu(gate_YF) * up_YF
    return _unsort(jax.lax.ragged_dot(h_YF, down_EFD, sizes_E), order_Y, weights_XA)


# Planning (grpo_jax/planner/): XLA:CPU lowers ragged_dot to a dense dot of every row with
# every expert, masked ([Y, E, F] temporaries), where GPU and TPU compilers run a grouped
# matmul ([Y, F]); compiled on CPU devices for those, the experts run as `_capacity_swiglu`.
_STAND_IN = contextvars.ContextVar("grpo_jax_moe_capacity_stand_in", default=False)


@contextlib.contextmanager
def capacity_stand_in():
    """While tracing inside, the experts run as ``_capacity_swiglu``: a memory stand-in for the
    grouped matmul whose outputs are NOT the model's (planning only). jit's trace caches do not
    key on the switch (a nested jitted function traced outside would be reused inside), so
    entering and leaving it clears them."""
    jax.clear_caches()
    token = _STAND_IN.set(True)
    try:
        yield
    finally:
        _STAND_IN.reset(token)
        jax.clear_caches()


def _capacity_swiglu(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD):
    """The buffers of a grouped matmul without one: the sorted assignments padded to a balanced
    capacity C = ceil(Y / E) rows an expert and run as batched dense matmuls [E, C, D] @
    [E, D, F]. Same rows in and out as ``_sorted_swiglu`` (Y x D, Y x F), but each row meets
    the expert of its slot, not its own: the values are meaningless."""
    E, D = gate_EDF.shape[:2]
    A = experts_XA.shape[1]
    order_Y, _ = _sort_by_expert(experts_XA, E)
    Y = order_Y.shape[0]
    C = -(-Y // E)
    x_ECD = jnp.pad(jnp.take(x_XD, order_Y // A, axis=0), ((0, E * C - Y), (0, 0)))
    x_ECD = x_ECD.reshape(E, C, D)
    h_ECF = jax.nn.silu(jnp.einsum("ECD,EDF->ECF", x_ECD, gate_EDF)) * jnp.einsum(
        "ECD,EDF->ECF", x_ECD, up_EDF
    )
    y_YD = jnp.einsum("ECF,EFD->ECD", h_ECF, down_EFD).reshape(E * C, D)[:Y]
    return _unsort(y_YD, order_Y, weights_XA)


def sparse_ffn(
    x_XD, router_DE, gate_EDF, up_EDF, down_EFD, *, num_experts_per_tok: int,
    norm_topk_prob: bool, experts_XA=None,
):  # fmt: skip
    """The whole MoE block (HF Qwen3MoeSparseMoeBlock) on tokens x_XD, all in x's dtype.

    Args:
      experts_XA: optional experts to route to (router replay), see ``route``.

    Returns:
      (y_XD, probs_XE float32, experts_XA int32, replayed_X bool or None), see ``route``.
    """
    logits_XE = jnp.dot(x_XD, router_DE)
    probs_XE, weights_XA, experts_XA, replayed_X = route(
        logits_XE, num_experts_per_tok, norm_topk_prob=norm_topk_prob, experts_XA=experts_XA
    )
    y_XD = grouped_swiglu(x_XD, weights_XA, experts_XA, gate_EDF, up_EDF, down_EFD)
    return y_XD, probs_XE, experts_XA, replayed_X


@flax.struct.dataclass
class RouterStats:
    """Per MoE layer, what the router did over the real tokens of a forward pass.

    Attributes:
      experts_LmBTA: int32, the experts each token was routed to (rollout records for replay).
      counts_LmE: float32, how many of the real tokens' assignments went to each expert.
      probs_LmE: float32, the sum over real tokens of each expert's router probability.
      tokens: float32 scalar, the number of real tokens (the same in every layer).
      replayed_Lm: float32, the real tokens that followed replayed experts (0 without replay).
      mismatched_Lm: float32, of those, the ones whose router's own top-A is another set of
        experts (router replay's mismatch).
    """

    experts_LmBTA: jax.Array
    counts_LmE: jax.Array
    probs_LmE: jax.Array
    tokens: jax.Array
    replayed_Lm: jax.Array
    mismatched_Lm: jax.Array


def layer_stats(probs_XE, experts_XA, valid_X, replayed_X=None):
    """(counts_E, probs_E, replayed, mismatched) of one layer over the tokens with valid_X
    (0/1 weights); the last two count the replayed tokens (``route``'s replayed_X) and those
    of them the router itself would have sent elsewhere (0 without replay)."""
    E = probs_XE.shape[-1]
    valid_X = valid_X.astype(jnp.float32)
    A = experts_XA.shape[-1]
    counts_E = jnp.zeros((E,), jnp.float32).at[experts_XA.reshape(-1)].add(jnp.repeat(valid_X, A))
    probs_E = jnp.einsum("XE,X->E", probs_XE, valid_X)
    if replayed_X is None:
        return counts_E, probs_E, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    replayed_X = valid_X * replayed_X.astype(jnp.float32)
    mismatched = jnp.sum(replayed_X * differs(probs_XE, experts_XA).astype(jnp.float32))
    return counts_E, probs_E, jnp.sum(replayed_X), mismatched


def load_balancing_loss(stats: RouterStats):
    """HF's ``load_balancing_loss_func`` (with the attention mask) from the layers' sums.

    HF pools the layers before the product: f_e and P_e are sums over every MoE layer's real
    tokens divided by layers x tokens. 0.0 without MoE layers.
    """
    num_layers, E = stats.counts_LmE.shape
    if num_layers == 0:
        return jnp.zeros((), jnp.float32)
    rows = stats.tokens * num_layers
    tokens_per_expert_E = jnp.sum(stats.counts_LmE, axis=0) / rows
    prob_per_expert_E = jnp.sum(stats.probs_LmE, axis=0) / rows
    return E * jnp.sum(tokens_per_expert_E * prob_per_expert_E)


def mismatch_rate(stats: RouterStats):
    """The share of the replayed (MoE layer, real token) pairs whose router's own top-A differs
    from the replayed experts (0 when nothing was replayed)."""
    return jnp.sum(stats.mismatched_Lm) / jnp.maximum(jnp.sum(stats.replayed_Lm), 1.0)


def load_shares(stats: RouterStats):
    """(max_Lm, min_Lm): per MoE layer, the largest and smallest expert's share of the
    assignments (1/E each when balanced)."""
    share_LmE = stats.counts_LmE / jnp.maximum(jnp.sum(stats.counts_LmE, -1, keepdims=True), 1.0)
    return jnp.max(share_LmE, axis=-1), jnp.min(share_LmE, axis=-1)
