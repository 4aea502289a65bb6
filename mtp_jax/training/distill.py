"""Self-distillation data: a model's own continuations of prompts, stored as a training corpus for its MTP heads.

At decode time the MTP heads must predict what the main model generates, so fine-tuning them on the model's
own generations raises their draft acceptance (vllm-project/speculators' MTP recipe: train the drafter on
the target's outputs). `distill` generates those outputs with the batched decode loop (`generate`: the whole
loop one jitted `lax.while_loop`, speculative decoding on by default) and writes them as a data directory
that `mtp_jax.training.data.load_corpus_dir` reads back (`mtp-jax train --data DIR`).

Samples. Sample j of a split is prompt_j followed by the model's continuation of up to `max_new_tokens`
tokens: greedy (temperature 0, the default; speculative greedy equals plain greedy token for token) or
sampled at `temperature` with the sample's own seed `sample_seed(seed, split, j)`, so that a sample does not
depend on which others share its batch. Each sample is one document ending with an EOS: a continuation cut
by one of the model's stop tokens (its EOS ids) ends with it already; any other gets the model's first EOS
id appended.

Prompts: a prompts file (the last ones held out) or windows of a corpus's train and held-out documents
(`mtp_jax.training.prompts`).

Output directory (`out`):
  distill.json          the manifest: the settings a rerun must match, the chunks done (with the SHA-256 of
                        each), "complete"; replaced atomically after every chunk
  chunks/NNNNNN.npz     samples [c C, (c + 1) C) of the run's order (train samples, then held-out ones):
                        tokens, offsets, prompt_lengths, stopped; removed once the data set is complete
  tokenizer.json        the model's, copied byte for byte
  {train,heldout}_tokens.npy          int32 [N]: the samples end to end, each ending with an EOS
  {train,heldout}_offsets.npy         int64 [samples + 1]: sample i is tokens[offsets[i]:offsets[i + 1]]
  {train,heldout}_prompt_lengths.npy  int32 [samples]: its first prompt_lengths[i] tokens are the prompt
  corpus.json           written last: eos_id, counts, the settings (`load_corpus_dir` needs it)
  distill.lock          flock'ed while a process distills into `out`, holding its process id (a second
                        one is refused: `run_dir.locked`)

Resume and safety. Every file is written to a temporary name, fsynced and renamed into place (the directory
fsynced too), and a chunk is recorded in the manifest only once its file is in place, so a kill at any
point (SIGKILL, power loss) leaves whole chunks and a manifest naming a subset of them. A rerun with the
same settings checks each recorded chunk's SHA-256 and generates the missing ones, each exactly as before
(a chunk's batches, their padding and its samples' seeds depend on the chunk's index alone), so the final
arrays are byte-identical to an uninterrupted run's. A rerun with other settings is refused naming each
(`SettingsDiffer`), as is an `out` that holds anything but a distillation; one process at a time (a lock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import pathlib
import shutil
import time

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from mtp_jax.checkpoints.hf_config import config_from_hf
from mtp_jax.checkpoints.pretrained import inference_dtype, load_pretrained
from mtp_jax.checkpoints.writing import is_model_file
from mtp_jax.config import ModelConfig
from mtp_jax.decode.generation import generate
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.model import Transformer
from mtp_jax.training import data
from mtp_jax.training.prompts import HELDOUT, TRAIN, PromptSource, corpus_prompts, file_prompts
from mtp_jax.training.run_dir import locked

FORMAT = 1  # of distill.json and the chunk files
MANIFEST, LOCK, CHUNKS = "distill.json", "distill.lock", "chunks"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """How to distill (every field is a setting a resume must match; the derived ones are recorded too).

    num_samples: train samples; default the number of train prompts of a prompts file, else 1024.
    heldout_samples: held-out samples (>= 1); default ceil(3% of the prompts) of a prompts file (held out
      from its end), else ceil(3% of num_samples).
    max_new_tokens: tokens generated per sample at most. prompt_len: tokens of a corpus window prompt.
    batch_size: rows decoded together; chunk_size: samples per chunk file, a multiple of batch_size
      (default the largest multiple <= 256, at least batch_size).
    seed, temperature: sampling (temperature 0: greedy); sample j of split s uses `sample_seed(seed, s, j)`.
    speculative: "auto" (eagle with DeepSeek-style MTP modules, parallel with parallel heads, none without
      MTP modules), "eagle", "vanilla", "parallel" or "none"; num_speculative_tokens: K (default 3 for eagle,
      else the model's MTP modules). dtype: of the weights and compute (default `inference_dtype`'s).
    """

    num_samples: int | None = None
    heldout_samples: int | None = None
    max_new_tokens: int = 256
    prompt_len: int = 64
    batch_size: int = 16
    chunk_size: int | None = None
    seed: int = 0
    temperature: float = 0.0
    speculative: str = "auto"
    num_speculative_tokens: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        for name, low in (("num_samples", 1), ("heldout_samples", 1), ("chunk_size", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an int >= {low} (or None for the default), got {value!r}")
        for name in ("max_new_tokens", "prompt_len", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.chunk_size is not None and self.chunk_size % self.batch_size:
            raise ValueError(f"chunk_size ({self.chunk_size}) must be a multiple of batch_size ({self.batch_size})")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.speculative not in ("auto", "eagle", "vanilla", "parallel", "none"):
            raise ValueError(f"speculative must be auto, eagle, vanilla, parallel or none, got {self.speculative!r}")

    @property
    def samples_per_chunk(self) -> int:
        return self.chunk_size or max(self.batch_size, 256 // self.batch_size * self.batch_size)


class SettingsDiffer(ValueError):
    """`out` holds a distillation made with other settings: `differences` lists (setting, saved, given)."""

    def __init__(self, out: pathlib.Path, differences: list[tuple[str, object, object]]):
        self.out, self.differences = out, differences
        listed = "; ".join(f"{k} (saved {a!r}, given {b!r})" for k, a, b in differences)
        super().__init__(
            f"{out} holds a data set distilled with other settings: {listed}. Rerun with the saved settings to "
            "continue or keep it, or choose another output directory"
        )


@dataclasses.dataclass(frozen=True)
class DistillResult:
    """What `distill` did: the output corpus, the samples generated by this call, its speculative metrics."""

    corpus: data.Corpus
    generated_samples: int
    seconds: float
    mean_acceptance_length: float | None


def sample_seed(seed: int, split: int, index: int) -> int:
    """The sampling seed (uint32) of sample `index` of `split` (TRAIN 0, HELDOUT 1)."""
    return int(np.random.SeedSequence([seed, split, index]).generate_state(1)[0])


# ----------------------------------------------------------------------------------------------
# The settings a run is made with.


def model_fingerprint(model_dir: str | pathlib.Path) -> str:
    """SHA-256 (hex) over a model directory's model files (`is_model_file`: config, weights, tokenizer),
    each file's name and content: it reads every weight once (about a second per GB)."""
    model_dir = pathlib.Path(model_dir)
    h = hashlib.sha256()
    for file in sorted(p for p in model_dir.iterdir() if p.is_file() and is_model_file(p.name)):
        with open(file, "rb") as f:
            h.update(file.name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def speculative_choice(config: DistillConfig, model_config: ModelConfig) -> tuple[str, int | None]:
    """(method, K) that `config.speculative` and `num_speculative_tokens` resolve to for this model."""
    method = config.speculative
    if method == "auto":
        if model_config.num_nextn_predict_layers == 0:
            method = "none"
        else:
            method = "parallel" if model_config.mtp_style == "parallel" else "eagle"
    if method == "none":
        return method, None
    k = config.num_speculative_tokens
    if k is None:
        k = 3 if method == "eagle" else max(model_config.num_nextn_predict_layers, 1)
    return method, k


def _settings(
    config: DistillConfig,
    model_config: ModelConfig,
    model_digest: str,
    source: PromptSource,
    dtype: str | None,
    eos_id: int,
) -> dict:
    """Every setting the samples depend on, resolved (what distill.json records and a rerun must match)."""
    num_samples = config.num_samples or source.default_samples
    heldout = config.heldout_samples or source.default_heldout or max(1, math.ceil(0.03 * num_samples))
    method, k = speculative_choice(config, model_config)
    return {
        "format": FORMAT,
        "model": model_digest,
        "prompts": f"{source.kind} {source.digest}",
        "num_samples": num_samples,
        "heldout_samples": heldout,
        "max_new_tokens": config.max_new_tokens,
        "prompt_len": config.prompt_len if source.kind == "corpus" else None,
        "batch_size": config.batch_size,
        "chunk_size": config.samples_per_chunk,
        "seed": config.seed,
        "temperature": float(config.temperature),
        "speculative": method,
        "num_speculative_tokens": k,
        "dtype": dtype,
        "max_length": min(model_config.max_position_embeddings, source.max_prompt_len + config.max_new_tokens),
        "eos_id": eos_id,
    }


# ----------------------------------------------------------------------------------------------
# Files: atomic writes, the lock, the manifest, the chunks.


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: pathlib.Path, content: bytes) -> None:
    """`content` into `path`: written to `.name.tmp-PID` beside it, fsynced, renamed over it, the directory
    fsynced; a kill leaves the old file or the new one, never a part of either."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _locked(out: pathlib.Path) -> contextlib.AbstractContextManager[None]:
    """`run_dir.locked` on out/distill.lock: one distillation at a time (the kernel drops the flock when the
    process dies); ValueError, naming the holder's process id, when another holds it."""
    return locked(out, LOCK, what="output directory", user="distillation", error=ValueError)


def check_out(out: pathlib.Path) -> None:
    """FileExistsError when `out` is a file, or a directory without a manifest that holds anything but
    what a starting distillation leaves (its lock, its temporary files)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output directory {out} is a file")
    if not out.is_dir() or (out / MANIFEST).is_file():
        return
    foreign = sorted(e.name for e in out.iterdir() if e.name != LOCK and not e.name.startswith(f".{MANIFEST}.tmp-"))
    if foreign:
        raise FileExistsError(
            f"output directory {out} is not empty and holds no distillation (no {MANIFEST}; it holds "
            f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): choose an empty or new directory"
        )


def _read_manifest(out: pathlib.Path, settings: dict) -> dict | None:
    """out's manifest, None when there is none; SettingsDiffer when it was made with other settings."""
    if not (out / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
        saved, _, _ = manifest["settings"], manifest["chunks"], manifest["complete"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{out / MANIFEST} is damaged ({error}); choose another output directory") from None
    differences = [(k, saved.get(k), v) for k, v in settings.items() if saved.get(k) != v]
    if differences:
        raise SettingsDiffer(out, differences)
    return manifest


def _write_manifest(out: pathlib.Path, manifest: dict) -> None:
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())


def _num_chunks(settings: dict) -> int:
    return -(-(settings["num_samples"] + settings["heldout_samples"]) // settings["chunk_size"])


def _chunk_path(out: pathlib.Path, c: int) -> pathlib.Path:
    return out / CHUNKS / f"{c:06d}.npz"


def _chunk_intact(out: pathlib.Path, c: int, manifest: dict) -> bool:
    """Whether the manifest records chunk c and its file is there with the SHA-256 recorded."""
    entry = manifest["chunks"].get(str(c))
    try:
        return entry is not None and hashlib.sha256(_chunk_path(out, c).read_bytes()).hexdigest() == entry["sha256"]
    except OSError:
        return False


def _write_chunk(out: pathlib.Path, c: int, arrays: dict[str, np.ndarray]) -> str:
    """Chunk c's file, written atomically; returns its SHA-256 (hex)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(_chunk_path(out, c), buffer.getvalue())
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def _finish(out: pathlib.Path, settings: dict, tokenizer_file: pathlib.Path) -> None:
    """tokenizer.json, the split files and, last, corpus.json, from the chunks."""
    parts = []
    for c in range(_num_chunks(settings)):
        with np.load(_chunk_path(out, c)) as chunk:
            parts.append({k: chunk[k] for k in ("tokens", "offsets", "prompt_lengths", "stopped")})
    tokens = np.concatenate([p["tokens"] for p in parts])
    lengths = np.concatenate([np.diff(p["offsets"]) for p in parts])  # [samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # [samples + 1]
    prompt_lengths = np.concatenate([p["prompt_lengths"] for p in parts])
    stopped = np.concatenate([p["stopped"] for p in parts])
    write_atomic(out / "tokenizer.json", tokenizer_file.read_bytes())
    n, total = settings["num_samples"], len(lengths)
    metadata = {"source": "distill", "eos_id": settings["eos_id"], "settings": settings}
    for split, lo, hi in (("train", 0, n), ("heldout", n, total)):
        split_tokens = tokens[offsets[lo] : offsets[hi]]
        write_atomic(out / f"{split}_tokens.npy", _npy(split_tokens))
        write_atomic(out / f"{split}_offsets.npy", _npy(offsets[lo : hi + 1] - offsets[lo]))
        write_atomic(out / f"{split}_prompt_lengths.npy", _npy(prompt_lengths[lo:hi]))
        metadata[f"num_{split}_documents"] = hi - lo
        metadata[f"num_{split}_tokens"] = int(split_tokens.size)
        appended = np.count_nonzero(~stopped[lo:hi])  # the EOS ids added after continuations that did not stop
        metadata[f"num_{split}_generated_tokens"] = int(lengths[lo:hi].sum() - prompt_lengths[lo:hi].sum() - appended)
        metadata[f"{split}_stopped_fraction"] = float(stopped[lo:hi].mean())
    write_atomic(out / "corpus.json", json.dumps(metadata, indent=1).encode())


# ----------------------------------------------------------------------------------------------
# Generation.


def _speculative_config(settings: dict) -> SpeculativeConfig | None:
    if settings["speculative"] == "none":
        return None
    return SpeculativeConfig(method=settings["speculative"], num_speculative_tokens=settings["num_speculative_tokens"])


def generate_chunk(
    model: Transformer, source: PromptSource, settings: dict, c: int
) -> tuple[dict[str, np.ndarray], dict]:
    """Chunk c's samples, as the arrays of its file (tokens int32 [N], offsets int64 [n + 1], prompt_lengths
    int32 [n], stopped bool [n]), and its counts (generated tokens, verify steps, accepted drafts).

    Its batches depend on c alone: samples [c C + i B, c C + (i + 1) B) of the run's order, a short last
    batch padded with copies of its first row (discarded), so every batch has one shape and a rerun gives
    the same samples."""
    s, speculative = settings, _speculative_config(settings)
    rows = range(c * s["chunk_size"], min((c + 1) * s["chunk_size"], s["num_samples"] + s["heldout_samples"]))
    samples, prompt_lengths, stopped = [], [], []
    counts = {"generated_tokens": 0, "num_steps": 0, "num_accepted": 0}
    for first in range(rows.start, rows.stop, s["batch_size"]):
        batch = range(first, min(first + s["batch_size"], rows.stop))
        ids = [(TRAIN, j) if j < s["num_samples"] else (HELDOUT, j - s["num_samples"]) for j in batch]
        prompts = [source.prompt(split, j, s["seed"]) for split, j in ids]
        sampling = [SamplingParams(temperature=s["temperature"], seed=sample_seed(s["seed"], *i)) for i in ids]
        pad = s["batch_size"] - len(ids)
        result = generate(
            model,
            prompts + prompts[:1] * pad,
            max_new_tokens=s["max_new_tokens"],
            sampling=sampling + sampling[:1] * pad,
            max_length=s["max_length"],
            speculative=speculative,
        )
        for prompt, tokens, reason in zip(prompts, result.tokens, result.finish_reasons, strict=False):
            samples.append(np.asarray(prompt + tokens + ([] if reason == "stop" else [s["eos_id"]]), np.int32))
            prompt_lengths.append(len(prompt))
            stopped.append(reason == "stop")
            counts["generated_tokens"] += len(tokens)
        if result.metrics is not None:
            counts["num_steps"] += result.metrics.num_steps
            counts["num_accepted"] += result.metrics.num_accepted
    arrays = {
        "tokens": np.concatenate(samples),
        "offsets": np.concatenate([[0], np.cumsum([len(x) for x in samples])]).astype(np.int64),
        "prompt_lengths": np.asarray(prompt_lengths, np.int32),
        "stopped": np.asarray(stopped, bool),
    }
    return arrays, counts


def _prompt_source(
    tokenizer_file: pathlib.Path,
    config: DistillConfig,
    prompts_file: str | os.PathLike | None,
    corpus: data.Corpus | str | os.PathLike | None,
) -> PromptSource:
    """The prompts of `prompts_file`, else of `corpus` (refused unless its tokenizer is the model's)."""
    if prompts_file is not None:
        return file_prompts(prompts_file, Tokenizer.from_file(str(tokenizer_file)), config.heldout_samples)
    corpus = corpus if isinstance(corpus, data.Corpus) else data.load_corpus_dir(corpus)
    if not data.same_tokenizer(corpus.tokenizer_path, tokenizer_file):
        raise ValueError(
            f"the corpus in {corpus.work_dir} was tokenized with another tokenizer than the model's "
            f"({tokenizer_file}): prepare it with prepare_corpus(..., tokenizer_path={str(tokenizer_file)!r})"
        )
    return corpus_prompts(corpus, config.prompt_len)


def _generate_missing(
    out: pathlib.Path, manifest: dict, model: Transformer, source: PromptSource, progress: bool
) -> dict[str, int]:
    """Generates every chunk that is not intact (`_chunk_intact`), in order, each written and then recorded in
    the manifest; returns the samples generated and their verify steps and accepted drafts."""
    settings = manifest["settings"]
    total, size = settings["num_samples"] + settings["heldout_samples"], settings["chunk_size"]
    todo = [c for c in range(_num_chunks(settings)) if not _chunk_intact(out, c, manifest)]
    (out / CHUNKS).mkdir(exist_ok=True)
    done = total - sum(min(size, total - c * size) for c in todo)
    counts = {"samples": 0, "num_steps": 0, "num_accepted": 0}
    with tqdm(total=total, initial=done, unit="sample", disable=not progress, dynamic_ncols=True) as bar:
        for c in todo:
            start = time.perf_counter()
            arrays, chunk = generate_chunk(model, source, settings, c)
            digest = _write_chunk(out, c, arrays)
            seconds = time.perf_counter() - start
            n = len(arrays["prompt_lengths"])
            manifest["chunks"][str(c)] = {"sha256": digest, "samples": n, "seconds": round(seconds, 3), **chunk}
            _write_manifest(out, manifest)  # only now is chunk c done
            counts["samples"] += n
            counts["num_steps"] += chunk["num_steps"]
            counts["num_accepted"] += chunk["num_accepted"]
            bar.update(n)
            postfix = {"tok_s": f"{chunk['generated_tokens'] / seconds:.0f}"}
            if counts["num_steps"]:
                postfix["accept_len"] = f"{1 + counts['num_accepted'] / counts['num_steps']:.2f}"
            bar.set_postfix(postfix)
    return counts


def distill(
    model_dir: str | os.PathLike,
    out: str | os.PathLike,
    config: DistillConfig = DistillConfig(),
    *,
    prompts_file: str | os.PathLike | None = None,
    corpus: data.Corpus | str | os.PathLike | None = None,
    progress: bool = True,
) -> DistillResult:
    """Distills the model in `model_dir` into the data directory `out` (layout, resume and safety: module
    docstring) and returns the finished corpus (`data.load_corpus_dir(out)`).

    Prompts come from `prompts_file` or from `corpus` (a `data.Corpus`, or the path of a data directory
    `load_corpus_dir` reads) whose tokenizer must be the model's. An `out` already complete with the same
    settings is returned as it is, nothing generated.

    Raises:
      SettingsDiffer (a ValueError): `out` holds a distillation made with other settings.
      FileExistsError: `out` is a file, or a non-empty directory that holds no distillation.
      FileNotFoundError: the model directory, its config.json or tokenizer.json, or the prompts are missing.
      ValueError: both or neither of prompts_file and corpus; bad prompts (`file_prompts`, `corpus_prompts`);
        a corpus of another tokenizer; a prompt that leaves no room below max_position_embeddings; a model
        without an EOS id, or one that cannot serve the speculative method; `out` in use by another process.
    """
    model_dir, out = pathlib.Path(model_dir), pathlib.Path(out)
    if (prompts_file is None) == (corpus is None):
        raise ValueError("give one of prompts_file and corpus")
    check_out(out)  # before any slow work
    for name in ("config.json", "tokenizer.json"):
        if not (model_dir / name).is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no {name}")
    model_config = config_from_hf(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    tokenizer_file = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    source = _prompt_source(tokenizer_file, config, prompts_file, corpus)
    eos_ids = list(model_config.eos_token_ids) or [tokenizer.token_to_id(data.EOS_TOKEN)]
    if eos_ids[0] is None:
        raise ValueError(f"the model in {model_dir} has no eos_token_id and its tokenizer no {data.EOS_TOKEN}")
    dtype, _ = inference_dtype(model_dir, config.dtype)
    settings = _settings(config, model_config, model_fingerprint(model_dir), source, dtype, int(eos_ids[0]))
    if source.max_prompt_len >= settings["max_length"]:
        raise ValueError(
            f"a prompt of {source.max_prompt_len} tokens leaves no room to generate below the model's "
            f"max_position_embeddings ({model_config.max_position_embeddings})"
        )
    out.mkdir(parents=True, exist_ok=True)
    begin, counts = time.perf_counter(), {"samples": 0, "num_steps": 0, "num_accepted": 0}
    with _locked(out):
        check_out(out)  # again, under the lock
        manifest = _read_manifest(out, settings)
        if manifest is None or not manifest["complete"]:
            model, _ = load_pretrained(model_dir, dtype=dtype)
            speculative = _speculative_config(settings)
            if speculative is not None:
                speculative.check_model(model, model.config.vocab_size)
            if manifest is None:  # the settings are recorded only once the model is known to serve them
                manifest = {
                    "settings": settings,
                    "model_dir": str(model_dir.resolve()),
                    "chunks": {},
                    "complete": False,
                }
                _write_manifest(out, manifest)
            counts = _generate_missing(out, manifest, model, source, progress)
            _finish(out, settings, tokenizer_file)
            manifest["complete"] = True
            _write_manifest(out, manifest)
        shutil.rmtree(out / CHUNKS, ignore_errors=True)
        for stale in out.glob(".*.tmp-*"):
            stale.unlink(missing_ok=True)
    steps = counts["num_steps"]
    return DistillResult(
        corpus=data.load_corpus_dir(out),
        generated_samples=counts["samples"],
        seconds=time.perf_counter() - begin,
        mean_acceptance_length=1 + counts["num_accepted"] / steps if steps else None,
    )
