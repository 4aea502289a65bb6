"""Model directories: Hugging Face layout (config.json, safetensors, tokenizer.json), MTP modules included.

A directory written by `save_pretrained` loads in `transformers` as the main model (its MTP
tensors sit at DeepSeek-V3's `model.layers.{L + j}.*` names, which `transformers` ignores) and
back here with its MTP modules (`mtp_jax.checkpoints`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh
from tokenizers import Tokenizer

from mtp_jax.checkpoints import atomic_dir
from mtp_jax.checkpoints.format import CONFIG_FILE, CheckpointError
from mtp_jax.checkpoints.reading import load_hf_checkpoint, read_hf_files, stored_dtype
from mtp_jax.checkpoints.writing import is_model_file, write_hf_files
from mtp_jax.layers import onednn
from mtp_jax.model import Transformer, abstract_model
from mtp_jax.mtp import make_mtp_modules

DEFAULT_MODEL_DIR = Path(__file__).parent.parent / "assets" / "demo"
TOKENIZER_FILE = "tokenizer.json"


def _read_tokenizer(file: str | os.PathLike) -> Tokenizer:
    """The tokenizer in a tokenizer.json; a CheckpointError naming the file when it is not one."""
    return _parse_tokenizer(Path(file).read_bytes(), file)


def _parse_tokenizer(data: bytes, shown: str | os.PathLike) -> Tokenizer:
    """The tokenizer in the bytes of a tokenizer.json; a CheckpointError naming it (as `shown`) when it is not one."""
    try:
        return Tokenizer.from_buffer(data)
    except Exception as error:  # the tokenizers library raises a bare Exception for a bad file
        raise CheckpointError(f"{shown} is not a valid tokenizer.json: {error}") from error


def load_pretrained(
    path: str | os.PathLike | None = None,
    *,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    dequantize: bool = False,
    dequantize_mtp: bool = False,
) -> tuple[Transformer, Tokenizer]:
    """The model and its HF `tokenizers.Tokenizer` from a directory (default: the bundled demo model).

    The weights, config.json and tokenizer.json come from one save even while another process
    overwrites `path` (`atomic_dir.read_dir`), and a save that a kill interrupted is finished
    first (see `mtp_jax.checkpoints.load_hf_checkpoint`). `dtype` ("float32", "bfloat16", "float16"): the
    model's weights and compute, default the checkpoint's (`inference_dtype` picks float32 for
    decoding on a CPU). `mesh`: the parameters are read shard by shard straight onto it
    (`load_hf_checkpoint`'s `mesh`). `dequantize`: an FP8 checkpoint's weights dequantized on load
    instead of kept in FP8 (`load_hf_checkpoint`'s); `dequantize_mtp`: its MTP modules only (the trunk
    kept FP8, `load_hf_checkpoint`'s).

    Raises:
      FileNotFoundError: the directory, config.json, the weights or tokenizer.json are missing.
      CheckpointError naming the file: tokenizer.json is not a valid tokenizer, or its vocabulary
        (added tokens included) is larger than the model's vocab_size; and the errors of
        `mtp_jax.checkpoints.load_hf_checkpoint` (corrupt files, a checkpoint that does not match its config).
      OSError: `path` was replaced by concurrent saves during each attempt to read it.
    """
    path = Path(DEFAULT_MODEL_DIR if path is None else path)
    return atomic_dir.read_dir(path, lambda root: _read_pretrained(root, path, dtype, mesh, dequantize, dequantize_mtp))


def inference_dtype(path: str | os.PathLike | None = None, asked: str | None = None) -> tuple[str | None, str | None]:
    """The dtype to decode a model directory's checkpoint in (default: the bundled demo model), and why
    it is not the stored one (None when it is). (None, None) when the directory or its config.json
    cannot be read: `load_pretrained` then names the problem. A dtype `asked` for (a --dtype flag) is
    returned as it is.

    On the CPU backend a checkpoint stored in bfloat16 or float16 decodes in float32, unless its dtype's
    matmuls go to oneDNN (`mtp_jax.layers.onednn.routed_dtypes()`: bfloat16 with the optional
    `extensions/onednn` built, on a CPU with AVX512-BF16; a medium step 1.3-1.6x faster than XLA's,
    `benchmarks/bench_onednn.py`): without it XLA:CPU has no half-precision matrix-vector kernel, so
    at batch 1 a bfloat16 matmul runs as a two-row GEMM (`layers.linear.dot_general`), at 0.88-1.0x
    float32's decoding speed on this project's CPU; at batch 8 bfloat16 is 1.03-1.29x faster and takes
    half the memory (`benchmarks/bench_dtype.py`: pass the dtype explicitly to keep it). Elsewhere the
    stored dtype. `mtp-jax generate` and
    `mtp-jax serve` use this when --dtype is not given; `load_pretrained` itself always defaults to
    the stored dtype (a save after a load keeps it).
    """
    if asked is not None:
        return asked, None
    path = Path(DEFAULT_MODEL_DIR if path is None else path)
    try:
        stored = stored_dtype(path)
    except (OSError, ValueError):  # missing or unreadable: the load that follows reports it, as it always has
        return None, None
    if stored == "float32" or jax.default_backend() != "cpu" or stored in onednn.routed_dtypes():
        return stored, None
    return "float32", (
        f"{path} stores {stored} weights: decoding in float32 on the CPU backend, where XLA:CPU's "
        f"{stored} matmuls are slower than float32 at batch 1 (docs/benchmarks.md); "
        f"pass --dtype {stored} to keep them (half the memory, faster at batch 8)"
    )


def _read_pretrained(
    root: Path, shown: Path, dtype: str | None, mesh: Mesh | None, dequantize: bool, dequantize_mtp: bool
) -> tuple[Transformer, Tokenizer]:
    """`load_pretrained` of the directory `root`, named `shown` in errors; tokenizer.json is read first."""
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {shown} does not exist")
    if not (root / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {shown}")
    data = (root / TOKENIZER_FILE).read_bytes()  # before the weights, which take longest
    model = read_hf_files(
        root, dtype=dtype, mesh=mesh, dequantize=dequantize, dequantize_mtp=dequantize_mtp, shown=shown
    )
    tokenizer = _parse_tokenizer(data, shown / TOKENIZER_FILE)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > model.config.vocab_size:
        raise CheckpointError(
            f"{shown / TOKENIZER_FILE} has {size} tokens, more than the model's "
            f"vocab_size={model.config.vocab_size} in {shown / CONFIG_FILE}"
        )
    return model, tokenizer


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    *,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    overwrite: bool = False,
) -> None:
    """Writes config.json and the weights (`mtp_jax.checkpoints.write_hf_files`) and tokenizer.json, atomically.

    `tokenizer` is a `tokenizers.Tokenizer` or the path of a tokenizer.json (copied byte for
    byte); None writes none. Everything goes into one atomic directory swap, as in
    `mtp_jax.checkpoints.save_hf_checkpoint`: a kill leaves the old model and tokenizer or the new ones, and
    an overwrite drops the old tokenizer files, so a tokenizer.json in `path` is always the one
    saved with its weights.

    Raises:
      FileExistsError: as `mtp_jax.checkpoints.save_hf_checkpoint` (`path` not empty and `overwrite` False, ...).
      ValueError: the tokenizer's vocabulary (added tokens included) is larger than the model's
        vocab_size; a `mtp_jax.checkpoints.CheckpointError` naming the file when the tokenizer path is not
        a valid tokenizer.json. Nothing is written then.
    """
    if tokenizer is not None:
        loaded = tokenizer if isinstance(tokenizer, Tokenizer) else _read_tokenizer(tokenizer)
        size = loaded.get_vocab_size(with_added_tokens=True)
        if size > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer{'' if loaded is tokenizer else f' {tokenizer}'} has {size} tokens, "
                f"more than the model's vocab_size={model.config.vocab_size}"
            )
    with atomic_dir.replace_dir(path, overwrite=overwrite, owned=is_model_file) as new:
        write_hf_files(model, new)
        if isinstance(tokenizer, Tokenizer):
            tokenizer.save(str(new / TOKENIZER_FILE))
        elif tokenizer is not None:
            shutil.copyfile(tokenizer, new / TOKENIZER_FILE)


def init_from_pretrained(
    path: str | os.PathLike,
    *,
    num_nextn_predict_layers: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    dequantize_mtp: bool = False,
) -> Transformer:
    """A model from a Hugging Face-format directory (`load_hf_checkpoint`) with D MTP modules.

    `num_nextn_predict_layers`, if given, sets D: modules the checkpoint has are kept (the first
    D), the others are initialised at random (seed `seed`). This is how `--mtp-only --init-from`
    adds MTP heads to an existing model. `dtype` ("float32", "bfloat16") sets the weights' and the
    compute dtype (default: the checkpoint's). `mesh`: the checkpoint's parameters are read shard by
    shard straight onto it (`load_hf_checkpoint`); new MTP modules start on the default device.
    `dequantize_mtp`: for an FP8 checkpoint, the MTP modules (kept and new) in float `param_dtype` beside
    the FP8 trunk (`Fp8Config.quantize_mtp=False`; what `mtp_only` training of an FP8 model needs).
    """
    loaded = load_hf_checkpoint(path, dtype=dtype, mesh=mesh, dequantize_mtp=dequantize_mtp)
    d = loaded.config.num_nextn_predict_layers if num_nextn_predict_layers is None else num_nextn_predict_layers
    if d == loaded.config.num_nextn_predict_layers:
        return loaded
    config = loaded.config.replace(num_nextn_predict_layers=d)
    model = abstract_model(config)  # no random main model: it is replaced
    model.mtp = make_mtp_modules(config, nnx.Rngs(seed))
    kept = [(p, v) for p, v in nnx.to_flat_state(nnx.state(loaded, nnx.Param)) if p[0] != "mtp" or int(p[1]) < d]
    nnx.update(model, nnx.from_flat_state(kept))
    return model
