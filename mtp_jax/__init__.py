"""mtp_jax: Multi-Token Prediction (DeepSeek-V3 MTP modules) in JAX — models, training, speculative decoding.

Dimension letters, used in every shape in this package:
  B batch rows, T new tokens per row in a forward, S cache capacity (tokens), E hidden size,
  H query heads, G key/value heads, D head size, V vocabulary, K draft tokens per step
  (`num_speculative_tokens`), L_b committed tokens of row b (`lengths[b]`). The number of MTP
  modules is `num_nextn_predict_layers` (DeepSeek's name; "D" in docs/MTP_SPEC.md).

The semantics every part keeps are pinned in docs/MTP_SPEC.md (cache, MTP modules, acceptance, commit,
metrics, fixed shapes).
"""

from mtp_jax import _moved
from mtp_jax.cache import KVCache
from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR, load_pretrained, save_pretrained
from mtp_jax.compilation_cache import enable_compilation_cache
from mtp_jax.config import ModelConfig, RopeScaling
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate, stream
from mtp_jax.decode.metrics import SpeculativeMetrics
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.decode.state import DecodeState, GenerationResult
from mtp_jax.decode.text import TextStream, stream_text
from mtp_jax.model import Transformer, init_model
from mtp_jax.sharding import make_mesh

_moved.install()  # the 0.1 module paths, for one release (`mtp_jax._moved`)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL_DIR",
    "DecodeEngine",
    "DecodeState",
    "GenerationResult",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "SamplingParams",
    "SpeculativeConfig",
    "SpeculativeMetrics",
    "TextStream",
    "Transformer",
    "enable_compilation_cache",
    "generate",
    "init_model",
    "load_pretrained",
    "make_mesh",
    "save_pretrained",
    "stream",
    "stream_text",
]
