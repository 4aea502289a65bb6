"""One peer engine held in its own process: vLLM (run with the vLLM venv's python) or transformers.

`bench_peers.py` starts one of these per (model, engine, speculation setting), so that every
engine stays loaded and warm while the benchmark interleaves timed runs across all of them. It
imports neither mtp_jax nor JAX: vLLM lives in its own venv (see README.md).

    <python> peer_worker.py CONFIG.json

CONFIG: {"engine": "vllm" | "transformers", "model": DIR, "dtype": "float32", "max_model_len": N,
"speculative": null | {...vLLM speculative_config...}, "kv_cache_gib": G, "enable_prefix_caching": false}.

Protocol, one JSON object per line: the worker writes {"ready": true, "info": {...}} once loaded
(or {"error": ...}), then answers each request line read from stdin:
  {"op": "generate", "prompts": [[ids]], "new_tokens": N} ->
      {"seconds": wall time of the generate call, "tokens": [[ids]], "spec": {counter deltas} | null}
  {"op": "quit"} -> exits.
The replies go to the original stdout; everything the engine prints (vLLM logs to stdout) is sent
to stderr, which the benchmark writes to a log file.

vLLM spawns worker processes, so this file keeps its work under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time


def _vllm_counters(llm) -> dict[str, float]:
    """The cumulative speculative-decoding counters of a vLLM engine (empty when not speculating)."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in (
            "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
        ):
            out[metric.name.split(":", 1)[1]] = float(getattr(metric, "value", 0.0))
    return out


class VllmEngine:
    def __init__(self, cfg: dict):
        from vllm import LLM

        self.llm = LLM(
            model=cfg["model"],
            skip_tokenizer_init=True,
            dtype=cfg.get("dtype", "float32"),
            max_model_len=cfg["max_model_len"],
            speculative_config=cfg.get("speculative"),
            seed=0,
            enable_prefix_caching=cfg.get("enable_prefix_caching", False),
            disable_log_stats=False,
        )  # the spec-decode counters need the stats
        self.speculative = cfg.get("speculative") is not None

    def generate(self, prompts: list[list[int]], new_tokens: int):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # Greedy, exactly new_tokens tokens: ignore_eos keeps going past EOS without masking it (min_tokens
        # would mask it and change the argmax where EOS wins), like mtp_jax with stop_tokens=[].
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        before = _vllm_counters(self.llm) if self.speculative else {}
        start = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        spec = None
        if self.speculative:
            after = _vllm_counters(self.llm)
            spec = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        return seconds, [list(o.outputs[0].token_ids) for o in outputs], spec

    @staticmethod
    def info() -> dict:
        import torch
        import transformers
        import vllm

        env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "KMP_", "LD_PRELOAD"))}
        return dict(
            vllm=vllm.__version__,
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            env=env,
            frontend_torch_threads=torch.get_num_threads(),
        )


class TransformersEngine:
    def __init__(self, cfg: dict):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        dtype = getattr(torch, cfg.get("dtype", "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=dtype).eval()
        # No stopping at EOS and no EOS masking (min_new_tokens would mask it): exactly new_tokens tokens.
        self.model.generation_config.eos_token_id = None

    def generate(self, prompts: list[list[int]], new_tokens: int):
        torch = self.torch
        ids = torch.tensor(prompts)  # equal-length prompts: no padding
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            seconds = time.perf_counter() - start
        return seconds, out[:, ids.shape[1] :].tolist(), None

    @staticmethod
    def info() -> dict:
        import torch
        import transformers

        return dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            torch_threads=torch.get_num_threads(),
        )


def main() -> None:
    cfg = json.loads(open(sys.argv[1]).read())
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # engine logs (and its child processes' stdout) go to stderr

    def send(obj) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    kind = {"vllm": VllmEngine, "transformers": TransformersEngine}[cfg["engine"]]
    try:
        start = time.perf_counter()
        engine = kind(cfg)
        info = kind.info() | dict(load_seconds=time.perf_counter() - start, pid=os.getpid())
    except Exception as error:  # reported to the benchmark, which records the peer as failed
        send({"error": f"{type(error).__name__}: {error}"})
        raise
    send({"ready": True, "info": info})
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        try:
            seconds, tokens, spec = engine.generate(request["prompts"], request["new_tokens"])
            send({"seconds": seconds, "tokens": tokens, "spec": spec})
        except Exception as error:
            send({"error": f"{type(error).__name__}: {error}"})
    send({"bye": True})


if __name__ == "__main__":
    main()
