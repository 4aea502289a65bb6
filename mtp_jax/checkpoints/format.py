"""The Hugging Face checkpoint format mtp_jax reads and writes: its file names and its error.

Format (what `transformers`' `save_pretrained` writes and `from_pretrained` reads):
  - `config.json`: a `LlamaConfig` / `Qwen2Config` / `MistralConfig` / `DeepseekV3Config` /
    `Glm4MoeConfig` as JSON, mapped to and from `ModelConfig` by `mtp_jax.checkpoints.hf_config`.
  - `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
    `model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {name: file}}.

The tensor names are `mtp_jax.checkpoints.names`'; `reading` loads, `writing` saves.
"""

from __future__ import annotations

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The tokenizer files of a model directory (`tokenizers` and `transformers` names): an overwriting
# save drops them with the old weights (`is_model_file`), so no stale tokenizer sits beside new ones.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
DEFAULT_MAX_SHARD_SIZE_BYTES = 5_000_000_000  # transformers 4.x's default "5GB"
_MAX_LISTED = 20  # names shown per category in a CheckpointError message


class CheckpointError(ValueError):
    """A checkpoint file is corrupt or its tensors do not match the model.

    The message names the file; for tensors, `missing`, `unexpected` and `mismatched` list them.
    """

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=()):
        self.missing, self.unexpected, self.mismatched = (
            list(names or ()) for names in (missing, unexpected, mismatched)
        )
        parts = [message]
        for label, names in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("mismatched", self.mismatched),
        ):
            if names:
                shown = ", ".join(names[:_MAX_LISTED])
                more = f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
                parts.append(f"{label} ({len(names)}): {shown}{more}")
        super().__init__("; ".join(parts))
