"""The memory plan of decoding a model on a device mesh: per-device bytes of its weights, KV cache and
decode state, from the config alone.

Nothing is read or allocated on a device, and the devices need not exist: the model is built abstractly
(`abstract_model`: shapes and dtypes only, its MTP modules included), the decode state as
`DecodeEngine.init_state` builds it (`abstract_decode_state`: `jax.eval_shape` of
`mtp_jax.decode.state.init_state`), and every array is placed by the rules the engine places it by
(`mtp_jax.sharding.param_logical_axes`, `mtp_jax.cache.logical_axes`, `DecodeState.logical_axes`,
`mtp_jax.sharding.resolve`) on a `jax.sharding.AbstractMesh`, so a plan for 16 devices runs on one CPU.
A `NamedSharding` gives every device a shard of the same size, so one device's bytes are every device's.

Counted, per device: the weights by dtype (FP8 kernels and their float32 scales included when the config
quantizes), the main model's KV cache (GQA keys and values, or MLA's latent and rope key: C + R entries per
position and layer, replicated over `tensor`), the MTP modules' caches (one for eagle, K for vanilla and
parallel) and the rest of the decode state (tokens, logprobs, drafts, draft probabilities when drafts are
sampled, vanilla's hidden window, counters). The cache capacity is `max_length` tokens: the engine adds no
positions for the K drafts (positions past the capacity are dropped, `mtp_jax.cache`). A hybrid model's
(Qwen3.5's) step also holds, for every Gated DeltaNet layer, what its verify forward keeps until the commit
selects one state per row (`mtp_jax.cache.RecurrentCandidates`, placed by its `LOGICAL_AXES`): the state
before and after each of the K+1 tokens, float32 [B, K+2, Hv, Dk, Dv], and the conv inputs [B, W-1+K+1, C]
(K = 0 when not speculating). These temporaries, about K+2 times the recurrent states' cache, have a line of
their own, in the total (qwen3.5-small, batch 32, K = 7: 118 MB, more than its weights, caches and state
together; XLA may need less where it can skip copies: a plain step of it, unscanned on CPU, keeps about a
third). Not counted: a step's other activations and XLA's other temporary buffers (small for the decode steps
of attention layers; a long prefill's can reach gigabytes: chunk it), and the runtime's own reserve (give the
memory the allocator may use: on GPU JAX's `bytes_limit`, 75% of the card unless
`XLA_PYTHON_CLIENT_MEM_FRACTION` says otherwise).

Units: bytes; the table prints GB = 10**9 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh
from jax.sharding import PartitionSpec as P

from mtp_jax.cache import PagedCache, PageLayout, RecurrentCache, RecurrentCandidates
from mtp_jax.cache import logical_axes as cache_axes
from mtp_jax.checkpoints.format import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, CheckpointError
from mtp_jax.checkpoints.hf_config import config_from_hf
from mtp_jax.checkpoints.names import shared_copies
from mtp_jax.config import ModelConfig
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.decode.state import DecodeState, init_state
from mtp_jax.model import Transformer, abstract_model
from mtp_jax.sharding import MESH_AXES, param_logical_axes, parse_mesh_spec, resolve

GB = 10**9
SEARCH_AXES = ("data", "expert", "tensor")  # what the smallest-mesh search splits (fsdp is for training)
MAX_SEARCH_DEVICES = 1024
# safetensors dtype -> (NumPy name, bytes per element)
_SAFETENSORS_DTYPES = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F64": ("float64", 8),
}

_Entry = tuple[tuple[int, ...], str, P]  # (shape, dtype name, logical axes) of one array
MeshLike = str | Mapping[str, int] | Mesh | AbstractMesh  # what `mesh_sizes` takes


def abstract_decode_state(
    model: Transformer,
    *,
    max_batch: int,
    max_length: int,
    speculative: SpeculativeConfig | None = None,
    pages: PageLayout | None = None,
) -> tuple[DecodeState, jax.ShapeDtypeStruct]:
    """The `DecodeState` (and padded prompts int32 [B, min(16, S)]) that `init_state` builds for `max_batch`
    rows of capacity `max_length` tokens (its attention caches paged with `pages`), as `jax.ShapeDtypeStruct`s
    (`jax.eval_shape`; the host arrays it fills, tokens and logprobs [B, S], are made but never reach a
    device). `model` may be abstract.

    Raises ValueError for a max_batch that is not an int >= 1, and `init_state`'s errors: TypeError /
    ValueError for max_length outside [2, max_position_embeddings], ValueError for a `speculative` the model
    cannot serve.
    """
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    prompts = [[0]] * max_batch
    build = functools.partial(
        init_state, model, prompts, max_new_tokens=1, max_length=max_length, speculative=speculative, pages=pages
    )
    return jax.eval_shape(build)


def mesh_sizes(mesh: MeshLike) -> dict[str, int]:
    """Every axis of `MESH_AXES` -> its size in `mesh`: a spec ("expert=8,tensor=2"), a mapping, a `Mesh` or
    an `AbstractMesh` (absent axes: 1). Raises ValueError for a bad spec or a size of -1 (the rest of the
    devices: unknown to a plan)."""
    sizes = dict(mesh.shape) if hasattr(mesh, "shape") else parse_mesh_spec(mesh)
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh axes {sorted(unknown)} are not among {MESH_AXES}")
    if -1 in sizes.values():
        raise ValueError(f"mesh {mesh!r}: a plan needs every axis size (-1, the rest of the devices, is unknown here)")
    return {axis: int(sizes.get(axis, 1)) for axis in MESH_AXES}


def mesh_text(sizes: Mapping[str, int]) -> str:
    """`{"expert": 8, "tensor": 2, ...}` -> "expert=8,tensor=2 (16 devices)": the spec of the axes of size > 1
    and the device count ("1 device" for a mesh of one)."""
    spec = ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if sizes.get(a, 1) > 1)
    return f"{spec} ({math.prod(sizes.values())} devices)" if spec else "1 device"


def _abstract_mesh(sizes: Mapping[str, int]) -> AbstractMesh:
    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _entries(tree, logical_tree) -> list[_Entry]:
    """(shape, dtype, logical spec) of every array of `tree`, with `logical_tree`'s matching specs."""
    out = []
    jax.tree.map(lambda x, spec: out.append((tuple(x.shape), np.dtype(x.dtype).name, spec)), tree, logical_tree)
    return out


def _device_bytes(entries: list[_Entry], mesh: AbstractMesh) -> dict[str, int]:
    """Bytes by dtype that one device holds of `entries` placed on `mesh` (`resolve`)."""
    sizes, out = dict(mesh.shape), Counter()
    for (shape, dtype, logical), count in Counter(entries).items():
        shard = list(shape)
        for dim, axes in enumerate(resolve(logical, shape, mesh)):
            for axis in (axes,) if isinstance(axes, str) else axes or ():
                shard[dim] //= sizes[axis]  # resolve splits only dimensions the axes divide
        out[dtype] += count * math.prod(shard) * np.dtype(dtype).itemsize
    return dict(out)


def _verify_candidates(cache, new_tokens: int):
    """The `RecurrentCandidates` (abstract) that a verify forward of `new_tokens` tokens per row keeps of the
    recurrent layers of `cache` (abstract; a stacked layer axis leads where the model scans), in its tree
    (`()` in place of every other cache): states [B, T+1, Hv, Dk, Dv], conv [B, W-1+T, C]."""

    def one(node):
        if not isinstance(node, RecurrentCache):
            return ()
        state, conv = node.state, node.conv
        return RecurrentCandidates(
            states=jax.ShapeDtypeStruct((*state.shape[:-3], new_tokens + 1, *state.shape[-3:]), state.dtype),
            conv=jax.ShapeDtypeStruct((*conv.shape[:-2], conv.shape[-2] + new_tokens, conv.shape[-1]), conv.dtype),
        )

    return jax.tree.map(one, cache, is_leaf=lambda node: hasattr(node, "LOGICAL_AXES") or isinstance(node, PagedCache))


@dataclasses.dataclass(frozen=True)
class _Arrays:
    """What a plan places: the abstract weights, the main cache, the MTP caches, the rest of the state and the
    recurrent states a verify forward keeps (none for a model without recurrent layers)."""

    config: ModelConfig
    max_batch: int
    weights: list[_Entry]
    kv_cache: list[_Entry]
    mtp_cache: list[_Entry]
    state: list[_Entry]
    candidates: list[_Entry]

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        max_batch: int,
        max_length: int,
        speculative: SpeculativeConfig | None,
        pages: PageLayout | None = None,
    ) -> _Arrays:
        model = abstract_model(config)
        _, params = nnx.split(model)  # all of the model's state, as the engine's `static_split` passes it
        state, _ = abstract_decode_state(
            model, max_batch=max_batch, max_length=max_length, speculative=speculative, pages=pages
        )
        axes = state.logical_axes()
        no_caches = state.replace(cache=(), draft=state.draft.replace(caches=()))
        rest_axes = axes.replace(cache=(), draft=axes.draft.replace(caches=()))
        # verify runs the main model over [t_{L-1}, d_1 .. d_K]: K + 1 tokens (`mtp_jax.decode.step.verify`)
        candidates = _verify_candidates(state.cache, state.draft.tokens.shape[1] + 1)
        return cls(
            config=config,
            max_batch=max_batch,
            weights=_entries(params, param_logical_axes(params)),
            kv_cache=_entries(state.cache, cache_axes(state.cache)),
            mtp_cache=_entries(state.draft.caches, cache_axes(state.draft.caches)),
            state=_entries(no_caches, rest_axes),
            candidates=_entries(candidates, cache_axes(candidates)),
        )

    def check_mesh(self, sizes: Mapping[str, int]) -> None:
        """ValueError where the engine refuses `sizes`: experts the `expert` axis does not divide."""
        c, n = self.config, sizes["expert"]
        if c.ffn_type == "moe" and c.n_routed_experts % n:
            raise ValueError(
                f"expert parallelism needs n_routed_experts ({c.n_routed_experts}) to be a multiple of the "
                f"mesh's expert axis ({n})"
            )

    def device_bytes(self, sizes: Mapping[str, int]) -> tuple[dict[str, int], int, int, int, int]:
        """(weights by dtype, KV cache, MTP caches, rest of the state, recurrent states kept by a verify
        forward): one device's bytes on mesh `sizes`."""
        mesh = _abstract_mesh(sizes)
        rest = (self.kv_cache, self.mtp_cache, self.state, self.candidates)
        return _device_bytes(self.weights, mesh), *(sum(_device_bytes(e, mesh).values()) for e in rest)

    def total_bytes(self, sizes: Mapping[str, int]) -> int:
        weights, *rest = self.device_bytes(sizes)
        return sum(weights.values()) + sum(rest)


@dataclasses.dataclass(frozen=True)
class MeshFit:
    """A mesh (every axis of `MESH_AXES` -> its size) and the bytes per device a plan needs on it."""

    mesh: dict[str, int]
    total_bytes: int

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values())


def _smallest_mesh(arrays: _Arrays, device_memory_bytes: int, max_devices: int) -> MeshFit | None:
    """The mesh of fewest devices on which `arrays` fit in `device_memory_bytes` per device, or None.

    Searched: every data x expert x tensor split of 1, 2, 4, .. `max_devices` devices, each axis a power of
    two, data dividing the batch and expert the routed experts (no expert split for a dense model). Among
    the meshes of the fewest devices that fit, the one needing the fewest bytes per device (ties: the larger
    tensor axis, then the larger expert axis).
    """
    moe = arrays.config.ffn_type == "moe"
    n = 1
    while n <= max_devices:
        fits = []
        for data_log in range(n.bit_length()):
            for expert_log in range(n.bit_length() - data_log):
                data, expert = 2**data_log, 2**expert_log
                tensor = n // (data * expert)
                if arrays.max_batch % data or (expert > 1 and (not moe or arrays.config.n_routed_experts % expert)):
                    continue
                sizes = {**dict.fromkeys(MESH_AXES, 1), "data": data, "expert": expert, "tensor": tensor}
                total = arrays.total_bytes(sizes)
                if total <= device_memory_bytes:
                    fits.append((total, -tensor, -expert, sizes))
        if fits:
            total, *_, sizes = min(fits, key=lambda fit: fit[:3])
            return MeshFit(mesh=sizes, total_bytes=total)
        n *= 2
    return None


@dataclasses.dataclass(frozen=True)
class CheckpointWeights:
    """The weights a checkpoint directory's safetensors files hold, read from their headers only.

    bytes_by_dtype: tensor bytes by dtype (NumPy names), every tensor of every file;
    shared_copy_bytes: of those, the tensors that are copies of shared ones (`checkpoints.names.shared_copies`:
      DeepSeek-V3's per-MTP-layer `embed_tokens` and `shared_head.head`, a tied model's `lm_head`), which
      the model holds once.
    """

    path: str
    num_tensors: int
    bytes_by_dtype: dict[str, int]
    shared_copy_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of decoding a model on a mesh (`memory_plan`); every device holds as much.

    mesh: every axis of `MESH_AXES` -> its size. weights_bytes: the weights by dtype (NumPy names).
    kv_cache_bytes: the main model's cache; mtp_cache_bytes: the MTP modules' caches; decode_state_bytes: the
    rest of the decode state; verify_states_bytes: the recurrent states a step's verify forward keeps (0
    without recurrent layers; module docstring). weights_total_bytes: the weights by dtype, unsharded (all of
    them once). device_memory_bytes: what one device has (None: unknown, no fit check). smallest_mesh: the
    mesh of fewest devices that fits, when device memory is known (None otherwise, or when none of up to
    `search_limit` devices does; searched: every `SEARCH_AXES` split over powers of two, data dividing the
    batch and expert the routed experts, the fewest bytes per device among equals). checkpoint: a checkpoint
    directory's header totals (`plan_checkpoint`).
    """

    mesh: dict[str, int]
    max_batch: int
    max_length: int
    speculative: SpeculativeConfig | None
    num_parameters: int
    weights_total_bytes: dict[str, int]
    weights_bytes: dict[str, int]
    kv_cache_bytes: int
    mtp_cache_bytes: int
    decode_state_bytes: int
    verify_states_bytes: int
    device_memory_bytes: int | None
    smallest_mesh: MeshFit | None
    search_limit: int
    checkpoint: CheckpointWeights | None = None
    pages: PageLayout | None = None

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def total_bytes(self) -> int:
        """Bytes per device: weights, caches, decode state and the recurrent states a verify forward keeps."""
        state = self.kv_cache_bytes + self.mtp_cache_bytes + self.decode_state_bytes + self.verify_states_bytes
        return sum(self.weights_bytes.values()) + state

    @property
    def fits(self) -> bool | None:
        """Whether `total_bytes` fits in the device memory (None: unknown)."""
        return None if self.device_memory_bytes is None else self.total_bytes <= self.device_memory_bytes

    def smallest_mesh_text(self) -> str:
        """What the search found, in words."""
        searched = f"{' x '.join(SEARCH_AXES)} over powers of two up to {self.search_limit} devices"
        if self.smallest_mesh is None:
            return f"none ({searched})"
        fit = self.smallest_mesh
        return f"{mesh_text(fit.mesh)}, {fit.total_bytes / GB:.2f} GB per device (searched {searched})"

    def pages_text(self) -> str:
        """ ", KV in N pages of P tokens" for a paged plan, else ""."""
        if self.pages is None:
            return ""
        return f", KV in {self.pages.num_pages:,} pages of {self.pages.page_size} tokens"

    def table(self, title: str = "model") -> str:
        """The plan as a text table (GB = 10**9 bytes)."""
        spec = self.speculative
        decoding = "plain" if spec is None else f"speculative {spec.method} K={spec.num_speculative_tokens}"
        unsharded = ", ".join(f"{d} {b / GB:,.2f} GB" for d, b in sorted(self.weights_total_bytes.items()))
        lines = [
            f"memory plan: {title} on {mesh_text(self.mesh)}",
            f"  decoding: batch {self.max_batch} x {self.max_length:,} tokens, {decoding}{self.pages_text()}",
            f"  parameters: {self.num_parameters:,} ({unsharded} unsharded)",
        ]
        if self.checkpoint is not None:
            ckpt = self.checkpoint
            stored = ", ".join(f"{d} {b / GB:,.2f} GB" for d, b in sorted(ckpt.bytes_by_dtype.items()))
            lines.append(
                f"  checkpoint: {ckpt.num_tensors} tensors, {ckpt.total_bytes / GB:,.2f} GB ({stored}; "
                f"{ckpt.shared_copy_bytes / GB:,.2f} GB of copies of shared tensors) against the plan's "
                f"{sum(self.weights_total_bytes.values()) / GB:,.2f} GB unsharded"
            )
        rows = [(f"weights {d}", b) for d, b in sorted(self.weights_bytes.items())]
        rows += [
            ("KV cache (main model)", self.kv_cache_bytes),
            ("KV cache (MTP modules)", self.mtp_cache_bytes),
            ("decode state (rest)", self.decode_state_bytes),
        ]
        if self.verify_states_bytes:  # a model with recurrent layers
            rows.append(("recurrent states kept by a verify step", self.verify_states_bytes))
        rows.append(("total", self.total_bytes))
        if self.device_memory_bytes is not None:
            rows.append(("device memory", self.device_memory_bytes))
        width = max(len(name) for name, _ in rows)
        lines += ["", f"  {'per device':<{width}}  {'GB':>10}  {'bytes':>19}"]
        lines += [f"  {name:<{width}}  {value / GB:>10,.2f}  {value:>19,}" for name, value in rows]
        lines.append("")
        if self.fits is None:
            lines.append("  fits: unknown (no device memory given or reported)")
        else:
            short = (self.total_bytes - self.device_memory_bytes) / GB
            lines.append(f"  fits: {'yes' if self.fits else f'no, {short:,.2f} GB short'}")
            lines.append(f"  smallest mesh that fits: {self.smallest_mesh_text()}")
        return "\n".join(lines)


def device_memory() -> int | None:
    """Bytes one device of the default backend may allocate (`memory_stats()["bytes_limit"]`; GPUs report
    it), or None where the backend reports none (CPU)."""
    stats = jax.devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def memory_plan(
    config: ModelConfig,
    mesh: MeshLike | None = None,
    *,
    max_batch: int,
    max_length: int,
    speculative: SpeculativeConfig | None = None,
    device_memory_bytes: int | None = None,
    search_limit: int = MAX_SEARCH_DEVICES,
    pages: PageLayout | None = None,
) -> MemoryPlan:
    """The memory plan of decoding `config`'s model (`DecodeEngine(model, speculative, mesh=mesh)`) with
    `max_batch` rows of capacity `max_length` tokens, from the config alone (module docstring).

    Args:
      mesh: a spec ("expert=8,tensor=2"), a mapping, a `Mesh` or an `AbstractMesh`; None: one device.
      speculative: the engine's `SpeculativeConfig` (None: plain decoding, no MTP caches).
      pages: the serving engine's KV pages (`mtp_jax.cache.PageLayout`): the attention caches are pools of
        `num_pages` pages (replicated over the batch axes, as the engine places them) instead of
        max_batch x max_length positions.
      device_memory_bytes: bytes one device has; None: `device_memory()` (the default backend's, when it
        reports it, else unknown: no fit check and no search).
      search_limit: the most devices the smallest-mesh search tries.

    Raises ValueError for a bad mesh (see `mesh_sizes`), a batch the mesh's data x fsdp axes do not divide,
    an expert axis that does not divide the routed experts, max_batch < 1, max_length outside [2,
    max_position_embeddings], a `speculative` the model cannot serve, or device_memory_bytes < 1.
    """
    sizes = mesh_sizes({} if mesh is None else mesh)
    if device_memory_bytes is None:
        device_memory_bytes = device_memory()
    elif not isinstance(device_memory_bytes, int) or device_memory_bytes < 1:
        raise ValueError(f"device_memory_bytes must be an int >= 1, got {device_memory_bytes!r}")
    if pages is not None and not isinstance(pages, PageLayout):
        raise ValueError(f"pages must be a PageLayout or None, got {pages!r}")
    arrays = _Arrays.build(config, max_batch, max_length, speculative, pages)
    arrays.check_mesh(sizes)
    weights, kv_cache, mtp_cache, state, candidates = arrays.device_bytes(sizes)
    total = Counter()
    for shape, dtype, _ in arrays.weights:
        total[dtype] += math.prod(shape) * np.dtype(dtype).itemsize
    return MemoryPlan(
        mesh=sizes,
        max_batch=max_batch,
        max_length=max_length,
        speculative=speculative,
        num_parameters=sum(math.prod(shape) for shape, _, _ in arrays.weights),
        weights_total_bytes=dict(total),
        weights_bytes=weights,
        kv_cache_bytes=kv_cache,
        mtp_cache_bytes=mtp_cache,
        decode_state_bytes=state,
        verify_states_bytes=candidates,
        device_memory_bytes=device_memory_bytes,
        smallest_mesh=None
        if device_memory_bytes is None
        else _smallest_mesh(arrays, device_memory_bytes, search_limit),
        search_limit=search_limit,
        pages=pages,
    )


def check_fits(plan: MemoryPlan) -> None:
    """Raises ValueError when `plan` does not fit its device memory, naming the GB per device needed and
    available, what they are made of and the smallest mesh that fits. Nothing when it fits or when the
    device memory is unknown."""
    if plan.fits is not False:
        return
    weights, verify = sum(plan.weights_bytes.values()), plan.verify_states_bytes
    verify_text = f", recurrent states kept by a verify step {verify / GB:,.2f} GB" if verify else ""
    raise ValueError(
        f"the model needs {plan.total_bytes / GB:,.2f} GB per device on mesh {mesh_text(plan.mesh)} "
        f"but {plan.device_memory_bytes / GB:,.2f} GB are available (weights "
        f"{weights / GB:,.2f} GB, KV cache {(plan.kv_cache_bytes + plan.mtp_cache_bytes) / GB:,.2f} GB, decode "
        f"state {plan.decode_state_bytes / GB:,.2f} GB{verify_text}, for batch {plan.max_batch} x "
        f"{plan.max_length} tokens{plan.pages_text()}); "
        f"the smallest mesh that fits: {plan.smallest_mesh_text()}"
    )


def checkpoint_weights(path: str | Path, config: ModelConfig | None = None) -> CheckpointWeights:
    """The tensor bytes of checkpoint directory `path`'s safetensors files by dtype, from their headers only
    (`model.safetensors`, else the shards `model.safetensors.index.json` names); `config` (default read from
    `path`) says which tensors are copies of shared ones.

    Raises FileNotFoundError without weights files, CheckpointError for an index without a weight map, a
    file that is not safetensors or a dtype this does not know.
    """
    from safetensors import SafetensorError, safe_open

    root = Path(path)
    config = read_config(root) if config is None else config
    if (root / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    elif (root / INDEX_FILE).is_file():
        index = _read_json(root / INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{root / INDEX_FILE} has no weight_map object (tensor name -> shard file name)")
        files = sorted(set(weight_map.values()))
    else:
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {root}")
    copies = set(shared_copies(config))
    by_dtype, copy_bytes, count = Counter(), 0, 0
    for file in files:
        try:
            with safe_open(root / file, framework="np") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    if tensor.get_dtype() not in _SAFETENSORS_DTYPES:
                        raise CheckpointError(f"{root / file}: {name} has dtype {tensor.get_dtype()}, unknown here")
                    dtype, itemsize = _SAFETENSORS_DTYPES[tensor.get_dtype()]
                    size = math.prod(tensor.get_shape()) * itemsize
                    by_dtype[dtype] += size
                    copy_bytes += size if name in copies else 0
                    count += 1
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{root / file} is not a readable safetensors file: {error}") from error
    return CheckpointWeights(
        path=str(root), num_tensors=count, bytes_by_dtype=dict(by_dtype), shared_copy_bytes=copy_bytes
    )


def _read_json(file: Path):
    try:
        return json.loads(file.read_bytes())
    except ValueError as error:
        raise CheckpointError(f"{file} is not valid JSON: {error}") from error


def read_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of checkpoint directory `path` (its config.json through `config_from_hf`).

    Raises FileNotFoundError without config.json, CheckpointError naming it for one that is not a config."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
    try:
        return config_from_hf(_read_json(file))
    except CheckpointError:
        raise
    except ValueError as error:
        raise CheckpointError(f"{file}: {error}") from error


def plan_checkpoint(
    path: str | Path,
    mesh: MeshLike | None = None,
    *,
    max_batch: int,
    max_length: int | None = None,
    speculative: SpeculativeConfig | None = None,
    device_memory_bytes: int | None = None,
    dtype: str | None = None,
    search_limit: int = MAX_SEARCH_DEVICES,
    pages: PageLayout | None = None,
) -> MemoryPlan:
    """`memory_plan` (paged with `pages`) for the model of checkpoint directory `path` (config.json; `dtype`
    overrides its stored dtype as `load_hf_checkpoint(dtype=)` does), with `checkpoint` holding the safetensors headers'
    byte totals (`checkpoint_weights`) to compare with the plan's unsharded weights. `max_length`
    defaults to the model's max positions. Nothing but config.json and the headers is read.

    Raises `read_config`'s, `checkpoint_weights`' and `memory_plan`'s errors; ValueError for a `dtype`
    other than "float32", "bfloat16" or "float16".
    """
    config = read_config(path)
    if dtype is not None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of ('float32', 'bfloat16', 'float16'), got {dtype!r}")
        config = config.replace(dtype=dtype, param_dtype=dtype)
    plan = memory_plan(
        config.replace(scan_layers=True),  # the same bytes per device as unrolled, built faster
        mesh,
        max_batch=max_batch,
        max_length=config.max_position_embeddings if max_length is None else max_length,
        speculative=speculative,
        device_memory_bytes=device_memory_bytes,
        search_limit=search_limit,
        pages=pages,
    )
    return dataclasses.replace(plan, checkpoint=checkpoint_weights(path, config))
