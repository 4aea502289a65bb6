"""Checkpoints: the Hugging Face format (`format`), its tensor names (`names`), reading, writing,
config.json (`hf_config`), model directories with their tokenizer (`pretrained`), heads-only exports
over a source checkpoint (`heads_only`) and atomic saves (`atomic_dir`). The public names are re-exported here."""

from mtp_jax.checkpoints.format import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE_BYTES,
    INDEX_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    CheckpointError,
)
from mtp_jax.checkpoints.heads_only import export_mtp_heads
from mtp_jax.checkpoints.hf_config import MTP_CONVENTION_FIELDS, config_from_hf, config_to_hf
from mtp_jax.checkpoints.names import FUSED_MODULES, hf_name, hf_names
from mtp_jax.checkpoints.pretrained import (
    DEFAULT_MODEL_DIR,
    inference_dtype,
    load_pretrained,
    save_pretrained,
)
from mtp_jax.checkpoints.reading import load_hf_checkpoint, read_hf_files, stored_dtype
from mtp_jax.checkpoints.writing import hf_tensors, is_model_file, save_hf_checkpoint, write_hf_files

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_SIZE_BYTES",
    "DEFAULT_MODEL_DIR",
    "FUSED_MODULES",
    "INDEX_FILE",
    "MTP_CONVENTION_FIELDS",
    "TOKENIZER_FILES",
    "WEIGHTS_FILE",
    "CheckpointError",
    "config_from_hf",
    "config_to_hf",
    "export_mtp_heads",
    "hf_name",
    "hf_names",
    "hf_tensors",
    "inference_dtype",
    "is_model_file",
    "load_hf_checkpoint",
    "load_pretrained",
    "read_hf_files",
    "save_hf_checkpoint",
    "save_pretrained",
    "stored_dtype",
    "write_hf_files",
]
