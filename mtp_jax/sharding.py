"""Placement on a device mesh: the mesh from a short spec, one table of logical-axis rules, and the
functions that turn logical axes into `jax.sharding` shardings (GSPMD; `shard_map` where a collective
must be explicit: the MoE experts, the Pallas kernel, the greedy draft argmax).

Every mesh has the four axes of `MESH_AXES` (absent ones of size 1), so one rule table serves all:

- `data`: data parallelism, batch rows (decode rows, training sequences);
- `fsdp`: fully sharded data parallelism (training): batch rows too, and every parameter's `embed`
  axis (and with it the optimizer state);
- `expert`: expert parallelism, the routed experts of MoE layers (`mtp_jax.layers.moe`);
- `tensor`: tensor parallelism (Megatron-LM, Shoeybi et al. 2019): attention heads, the FFN width,
  the vocabulary of the embedding and the head.

Parameters carry logical axis names in their `logical_axes` metadata, set at the layers' choke points
(`mtp_jax.layers.linear.linear`, the embedding, the experts, the router); a parameter without it is
replicated. Caches and the decode state name theirs in `mtp_jax.cache.logical_axes` and
`mtp_jax.decode.state.DecodeState.logical_axes`. `resolve` maps names to mesh axes by `LOGICAL_RULES`; a
dimension the mesh axes do not divide is replicated instead (e.g. 2 KV heads on `tensor=4`: the KV
cache is replicated over `tensor`, as vLLM does when TP exceeds the KV heads), except the batch,
which raises. MLA's latent cache has no head axis: it is replicated over `tensor` and sharded over
the batch axes only (every head reads the whole latent).

Inside jit the mesh comes from the context (`jax.set_mesh(mesh)`); `constrain` is a no-op without one,
so the models run unchanged on one device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtp_jax.cpu_extension import reads_vocab, vocab_stats
from mtp_jax.distributed import initialize_distributed  # noqa: F401  (re-exported: its documented path)
from mtp_jax.validation import is_int

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical axis -> mesh axes, in order (several: the dimension is split over their product).
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),  # decode rows, training sequences
    "embed": ("fsdp",),  # parameters' hidden-size axis (activations' hidden axis is never sharded)
    "vocab": ("tensor",),  # embedding rows, head columns, logits
    "heads": ("tensor",),  # attention heads: q/k/v/o projections (head-major), MLA's q_b_proj, kv_b_proj
    "kv_heads": ("tensor",),  # the KV cache's head axis
    "mlp": ("tensor",),  # the dense FFN width (gate/up columns, down rows)
    "experts": ("expert",),  # routed experts
    "moe_mlp": (),  # an expert's width: experts are whole on their device
    "latent": (),  # MLA's kv_lora_rank (cache and kv_b_proj rows): replicated
    "q_lora": (),  # MLA's q_lora_rank
    "layers": (),  # the leading axis of stacked layers (`ModelConfig.scan_layers`)
    "cache_sequence": (),  # the cache's position axis
    "head_dim": (),
}


def parse_mesh_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
    """`"data=2,tensor=4"` (or a mapping) -> `{"data": 2, "tensor": 4}`; one size may be -1 (the rest).

    Raises ValueError for an axis not in `MESH_AXES`, a repeated axis, a size that is not an int >= 1
    (or -1), or a malformed entry.
    """
    if isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"mesh spec must be like 'data=2,tensor=4', got {spec!r}")
        items = []
        for part in spec.split(","):
            name, sep, size = part.partition("=")
            if not sep:
                raise ValueError(f"mesh spec entry {part.strip()!r} is not 'axis=size' (in {spec!r})")
            try:
                items.append((name.strip(), int(size)))
            except ValueError:
                raise ValueError(f"mesh axis {name.strip()!r} needs an integer size, got {size.strip()!r}") from None
    sizes: dict[str, int] = {}
    for name, size in items:
        if name not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {name!r}; the axes are {MESH_AXES}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} is given twice")
        if not is_int(size) or (size < 1 and size != -1):
            raise ValueError(f"mesh axis {name!r} needs a size >= 1 (or -1: the rest), got {size!r}")
        sizes[name] = size
    if list(sizes.values()).count(-1) > 1:
        raise ValueError("at most one mesh axis may have size -1")
    return sizes


def make_mesh(spec: str | Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` with the axes `MESH_AXES` (those not in `spec` of size 1) over `devices` (default all
    of `jax.devices()`, every process's), axis types Auto (GSPMD).

    Raises ValueError when the sizes' product is not the number of devices (naming both).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(spec)
    known = math.prod(s for s in sizes.values() if s != -1)
    for name, size in sizes.items():
        if size == -1:
            if len(devices) % known:
                raise ValueError(f"mesh {spec!r}: {len(devices)} devices are not a multiple of {known}")
            sizes[name] = len(devices) // known
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"mesh {spec!r} has {math.prod(shape)} devices but {len(devices)} are given "
            f"(jax.devices(): {jax.device_count()})"
        )
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _mesh_sizes(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def on_mesh(mesh: Mesh | None):
    """`jax.set_mesh(mesh)` as a context manager, or a context that does nothing for `mesh` None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def batch_rows(mesh: Mesh | None) -> int:
    """How many ways `mesh` splits the batch rows ("batch": data x fsdp); 1 without a mesh. A decode or
    training batch must be a multiple of it."""
    return 1 if mesh is None else math.prod(_mesh_sizes(mesh).get(axis, 1) for axis in LOGICAL_RULES["batch"])


def resolve(logical: P, shape: Sequence[int], mesh) -> P:
    """The mesh `PartitionSpec` of an array of `shape` whose dimensions have the `logical` names.

    Each name maps to its `LOGICAL_RULES` mesh axes of size > 1, not yet used by an earlier dimension.
    An entry `(name, block)` splits only at multiples of `block` (a flattened head-major axis splits
    between heads: `("heads", D)`); a dimension that the axes' product (times its block) does not
    divide is replicated, except "batch", which raises
    ValueError (a batch of 3 rows cannot be split over `data=2`); an empty array is replicated. Raises
    ValueError for an unknown name or a spec longer than the array's rank.
    """
    if len(logical) > len(shape):
        raise ValueError(f"logical axes {logical} have more entries than the array's shape {tuple(shape)}")
    if 0 in shape:  # nothing to split (XLA gives empty outputs no sharding either)
        return P()
    sizes, used, out = _mesh_sizes(mesh), set(), []
    for dim, name in zip(shape, logical, strict=False):
        if name is None:
            out.append(None)
            continue
        name, block = name if isinstance(name, tuple) else (name, 1)
        if name not in LOGICAL_RULES:
            raise ValueError(f"unknown logical axis {name!r}; the rules name {sorted(LOGICAL_RULES)}")
        axes = tuple(a for a in LOGICAL_RULES[name] if sizes.get(a, 1) > 1 and a not in used)
        size = math.prod(sizes[a] for a in axes)
        if dim % (size * block):
            if name == "batch":
                raise ValueError(
                    f"batch size {dim} is not a multiple of the mesh's batch axes {axes} "
                    f"({size} devices); use a batch of a multiple of {size} rows"
                )
            axes = ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def _context_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def axis_size(name: str) -> int:
    """The size of mesh axis `name` in the context mesh (1 without one, or when the mesh lacks it)."""
    mesh = _context_mesh()
    return 1 if mesh is None else _mesh_sizes(mesh).get(name, 1)


def context_spec(logical: P, shape: Sequence[int]) -> P | None:
    """`resolve` against the context mesh; None without one."""
    mesh = _context_mesh()
    return None if mesh is None else resolve(logical, shape, mesh)


def constrain(x: jax.Array, logical: P) -> jax.Array:
    """`x` constrained to the sharding its `logical` axes give on the context mesh (no mesh: `x`)."""
    pspec = context_spec(logical, x.shape)
    return x if pspec is None else jax.lax.with_sharding_constraint(x, pspec)


def constrain_tree(tree, logical_tree):
    """`constrain` over a pytree and its matching tree of logical `PartitionSpec`s."""
    return jax.tree.map(constrain, tree, logical_tree)


def param_logical_axes(state: nnx.State) -> nnx.State:
    """The logical `PartitionSpec` of every parameter of `state` (`nnx.state(model)`): its
    `logical_axes` metadata, or P() (replicated) without it."""

    def logical(v):
        return v.replace(P(*v.get_metadata().get("logical_axes", ())))

    return jax.tree.map(logical, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_shardings(tree, logical_tree, mesh: Mesh):
    """`NamedSharding`s on `mesh` for a pytree of arrays and its matching tree of logical specs."""
    return jax.tree.map(lambda x, pspec: NamedSharding(mesh, resolve(pspec, x.shape, mesh)), tree, logical_tree)


def trim_specs(shardings):
    """A tree of `NamedSharding`s with each spec's trailing Nones dropped, as jitted calls return them:
    `NamedSharding` equality does not normalise them, so an input placed untrimmed and the same array
    coming back from a jitted call would compile that call twice."""

    def trimmed(sharding: NamedSharding) -> NamedSharding:
        pspec = list(sharding.spec)
        while pspec and pspec[-1] is None:
            pspec.pop()
        return NamedSharding(sharding.mesh, P(*pspec))

    return jax.tree.map(trimmed, shardings)


def place(tree, shardings):
    """Every array of `tree` on its sharding (a matching tree of `Sharding`s).

    An array already on (an equivalent of) its sharding is kept as it is. One process: `jax.device_put`.
    Several (`jax.distributed`): each process holds the whole value (the same on all) and transfers
    only the shards of its own devices (`jax.make_array_from_callback`); an array that already spans
    several processes (placed on a mesh before, e.g. a model trained sharded) is moved device to
    device by `jax.device_put` instead (no host copy).
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)  # a no-op for arrays already there

    def put(x, sharding):
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # np.asarray would raise
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def shard_params(params: nnx.State, mesh: Mesh) -> nnx.State:
    """`params` (`nnx.state(model)`) placed on `mesh` by their logical axes (see `param_logical_axes`)."""
    return place(params, named_shardings(params, param_logical_axes(params), mesh))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """`model` with its parameters placed on `mesh` (in place: `nnx.update`); returns it."""
    nnx.update(model, shard_params(nnx.state(model), mesh))
    return model


def to_host(tree):
    """`jax.device_get` that also works on arrays spread over several processes (every process gets
    the whole value: `multihost_utils.process_allgather`)."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def vocab_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32, the same index (the lowest on ties; the first NaN if any, NaN
    ranking above every number), computed as a max and then the lowest index holding it: single-output
    reductions that XLA:CPU vectorizes, 3-5x faster than the (value, index) pair reduction `jnp.argmax`
    lowers to over a 32k vocabulary (0.6 -> 0.2 ms for [8, 32000] float32). A row's NaNs are looked for
    apart: XLA:CPU's max drops them from rows of 4096 or more. On the CPU with the extension
    (`cpu_extension.reads_vocab`), float32 and bfloat16 rows take one pass of its `vocab_stats` instead, the
    same index."""
    if x.dtype in (jnp.float32, jnp.bfloat16) and reads_vocab():
        return vocab_stats(x)[0]
    nan = jnp.isnan(x)
    peak = jnp.max(x, axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == peak)  # a NaN row: its NaNs; else the maxima
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def argmax_last(x: jax.Array, logical: P) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (int32; the lowest index on ties, as jnp), for `x` whose last axis is
    named "vocab" in `logical`: when that axis is sharded over the context mesh's `tensor` axis, each
    device takes the max of its slice and the per-device (max, index) pairs are combined, instead of
    gathering the full logits (TensorRT-LLM's MTP under tensor parallelism does the same).
    """
    pspec = context_spec(logical, x.shape)
    if pspec is None or pspec[-1] is None:
        return vocab_argmax(x)
    vocab_axes = pspec[-1]
    lead = P(*pspec[:-1])

    def local(xs):
        shard = jax.lax.axis_index(vocab_axes)
        idx = vocab_argmax(xs)  # [..]
        best = jnp.take_along_axis(xs, idx[..., None], axis=-1)[..., 0]
        maxes = jax.lax.all_gather(best, vocab_axes, axis=-1)  # [.., n], in device order along vocab
        idxs = jax.lax.all_gather(idx + shard * xs.shape[-1], vocab_axes, axis=-1)
        winner = jnp.argmax(maxes, axis=-1)  # the first device holding the max: lowest global index
        return jnp.take_along_axis(idxs, winner[..., None], axis=-1)[..., 0]

    return jax.shard_map(local, in_specs=pspec, out_specs=lead, check_vma=False)(x)
