"""Fitting the worker's engine to the machine (node/engine/fit.py): pure arithmetic on made-up memory numbers (no GPU
here), the worker's refusal in one line naming the smallest machine that can, and doctor's table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from node.engine.fit import (
    MAX_GPU_SHARE,
    QWEN25_SHAPES,
    GiB,
    Machine,
    ModelShape,
    Workload,
    plan_engine,
    smallest_machine,
)

SHAPES = {s.name: s for s in QWEN25_SHAPES}
WORK = Workload(sequences=32, prompt_tokens=300, completion_tokens=1024)
H100 = Machine("NVIDIA H100", gpu_free_bytes=79 * GiB, gpu_total_bytes=80 * GiB, host_available_bytes=200 * GiB)
RTX4090 = Machine("RTX 4090", gpu_free_bytes=23 * GiB, gpu_total_bytes=24 * GiB, host_available_bytes=30 * GiB)
LAPTOP = Machine(host_available_bytes=16 * GiB)


def test_parameter_counts_match_the_published_models():
    # Qwen2.5 model cards: 0.49 B, 1.54 B, 3.09 B, 7.61 B, 14.7 B, 32.5 B (32.8 B with the untied head counted)
    got = {n: round(s.parameters() / 1e9, 2) for n, s in SHAPES.items()}
    assert got == {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62, "qwen2.5-14b": 14.77,
                   "qwen2.5-32b": 32.76}
    from node.devnet.profile import PROFILES

    assert SHAPES["qwen2.5-0.5b"].parameters() == PROFILES["qwen2.5-0.5b"].parameters()  # the devnet's real-shape profile
    config = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
              "vocab_size": 151936, "max_position_embeddings": 32768}
    assert ModelShape.from_config(config).parameters() == SHAPES["qwen2.5-0.5b"].parameters()
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_config({**config, "num_hidden_layers": True})


def test_gpu_plan_chooses_share_batch_and_sequence_limit():
    plan = plan_engine(SHAPES["qwen2.5-7b"], H100, WORK, engine="vllm", device="cuda")
    assert plan.fits and plan.max_batch == 32 and plan.max_model_len == 1324
    # weights 15.2 GB in bf16, KV 28 layers × 4 × 128 × 2 × 2 bytes = 57,344 B per token: 32 × 1,324 tokens = 2.4 GB
    assert plan.weights_bytes == SHAPES["qwen2.5-7b"].parameters() * 2 and plan.kv_bytes == 32 * 1324 * 57344
    assert plan.memory_share is not None and 0.2 < plan.memory_share < 0.35, "enough for the plan with slack, not the whole GPU"
    assert plan.memory_share * H100.gpu_total_bytes >= plan.weights_bytes + plan.kv_bytes + plan.other_bytes
    assert "GPU memory share 0.2" in plan.line() and "batch 32" in plan.line() and "1,324 tokens" in plan.line()
    # 32B takes what is free (up to the cap), never more than is free
    big = plan_engine(SHAPES["qwen2.5-32b"], H100, WORK, engine="vllm", device="cuda")
    assert big.fits and big.memory_share == pytest.approx(MAX_GPU_SHARE) and 24 <= big.max_batch <= 32
    busy = Machine("NVIDIA H100", gpu_free_bytes=70 * GiB, gpu_total_bytes=80 * GiB)  # another process holds 10 GiB
    squeezed = plan_engine(SHAPES["qwen2.5-32b"], busy, WORK, engine="vllm", device="cuda")
    assert squeezed.fits and squeezed.memory_share * 80 <= 70 and squeezed.max_batch < 32
    # the operator's share and batch are taken as given
    mine = plan_engine(SHAPES["qwen2.5-7b"], H100, WORK, engine="vllm", device="cuda", memory_share=0.5, max_batch=8)
    assert (mine.memory_share, mine.max_batch) == (0.5, 8)


def test_plan_counts_the_compute_dtype():
    """``join --dtype`` changes the engine's memory: a bf16 transformers engine holds half the float32 weights and cache
    (plus a float32 head with ``--fp32-logits``), a float32 vLLM engine on CUDA twice its bf16 default."""
    shape = SHAPES["qwen2.5-7b"]
    fp32 = plan_engine(shape, H100, WORK, engine="transformers", device="cuda")
    bf16 = plan_engine(shape, H100, WORK, engine="transformers", device="cuda", dtype="bfloat16")
    assert (fp32.weights_bytes, bf16.weights_bytes) == (shape.parameters() * 4, shape.parameters() * 2)
    assert bf16.kv_bytes * 2 == fp32.kv_bytes * bf16.max_batch // fp32.max_batch
    head = plan_engine(shape, H100, WORK, engine="transformers", device="cuda", dtype="bfloat16", fp32_head=True)
    assert head.weights_bytes == bf16.weights_bytes + shape.vocab * shape.hidden * 4
    vllm32 = plan_engine(shape, H100, WORK, engine="vllm", device="cuda", dtype="float32")
    assert vllm32.weights_bytes == shape.parameters() * 4 == 2 * plan_engine(shape, H100, WORK, engine="vllm", device="cuda").weights_bytes


def test_too_small_refuses_naming_the_smallest_machine():
    no = plan_engine(SHAPES["qwen2.5-32b"], RTX4090, WORK, engine="vllm", device="cuda")
    assert not no.fits and no.max_batch == 0 and re.search(r"needs 6\d\.\d\d GiB", no.reason) and "RTX 4090" in no.reason
    assert smallest_machine(SHAPES["qwen2.5-32b"], WORK).startswith("a GPU with 80 GiB free (A100 80 GB, H100)")
    assert smallest_machine(SHAPES["qwen2.5-7b"], WORK).startswith("a GPU with 24 GiB free")
    assert "a CPU-only machine with" in smallest_machine(SHAPES["qwen2.5-0.5b"], WORK)
    cpu = plan_engine(SHAPES["qwen2.5-0.5b"], LAPTOP, WORK)
    assert cpu.fits and cpu.device == "cpu" and cpu.memory_share is None and 1 <= cpu.max_batch <= 32
    assert not plan_engine(SHAPES["qwen2.5-7b"], LAPTOP, WORK).fits
    long = Workload(8, 30_000, 4_000)
    assert "exceed the model's 32,768 positions" in plan_engine(SHAPES["qwen2.5-0.5b"], H100, long, engine="vllm", device="cuda").reason
    with pytest.raises(ValueError):
        plan_engine(SHAPES["qwen2.5-0.5b"], LAPTOP, WORK, device="cuda")


def _embedded_worker(tmp_path: Path):
    from node.coordinator.base import EMBEDDED_BASE_DIR
    from node.worker.role import Worker, WorkerOptions
    from protocol.identity import NodeKey
    from protocol.models import load_tokenizer
    from protocol.runspec import RunInfo, RunSpec, sign_run_spec

    key = NodeKey.generate()
    signed = sign_run_spec(RunSpec(run=RunInfo(coordinator=key.peer_id)), key)
    worker = Worker(signed, key, WorkerOptions(data_dir=tmp_path, gossip=None, http_port=None))
    worker.tokenizer = load_tokenizer(EMBEDDED_BASE_DIR)
    return worker, EMBEDDED_BASE_DIR


@pytest.mark.slow  # imports the worker role (torch, transformers, libp2p): seconds on a loaded machine
def test_worker_sizes_itself_or_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    import node.machine
    from node.worker.role import MachineTooSmall

    worker, base = _embedded_worker(tmp_path)
    monkeypatch.setattr(node.machine, "probe_machine", lambda **kw: Machine(host_available_bytes=8 * GiB))
    plan = worker._fit(base)
    assert plan.fits and plan.device == "cpu" and plan.max_batch == 16  # the default spec: 2 tasks × group 8
    assert "worker fits the machine: engine transformers on cpu: batch 16 sequences" in capsys.readouterr().out
    monkeypatch.setattr(node.machine, "probe_machine", lambda **kw: Machine(host_available_bytes=64 << 20))
    with pytest.raises(MachineTooSmall) as e:
        worker._fit(base)
    assert "\n" not in str(e.value) and "the smallest machine that can: a GPU with 8 GiB free" in str(e.value)


def test_doctor_fit_table(tmp_path):
    from node.commands.doctor_fit import check_fit
    from protocol.identity import NodeKey
    from protocol.runspec import RunInfo, RunSpec

    spec = RunSpec(run=RunInfo(coordinator=NodeKey.generate().peer_id))
    check, table = check_fit(spec, tmp_path, RTX4090)
    assert check.status == "PASS" and check.detail.startswith("embedded: engine transformers on cuda")
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert "GPU RTX 4090 (23.00 GiB free), vLLM" in table.splitlines()[1] and "CPU-only (30.00 GiB available)" in table.splitlines()[1]
    assert "yes: share" in rows["qwen2.5-7b"] and "no: needs" in rows["qwen2.5-32b"] and rows["embedded"].count("yes") == 2
    _, cpu_only = check_fit(spec, tmp_path, LAPTOP)
    assert "GPU (none found)" in cpu_only and "no GPU" in cpu_only
    # a remote run's model is unknown until its step 0 is held; then the fetched config.json is read
    remote = spec.model_copy(update={"model": spec.model.model_copy(update={"base": "/nowhere"})})
    assert check_fit(remote, tmp_path, LAPTOP)[0].status == "WARN"
    step = tmp_path / "checkpoints" / "step-0"
    step.mkdir(parents=True)
    big = {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
           "vocab_size": 152064, "tie_word_embeddings": False}
    (step / "config.json").write_text(json.dumps(big))
    fail = check_fit(remote, tmp_path, LAPTOP)[0]
    assert fail.status == "FAIL" and "the smallest machine that can: a GPU with 80 GiB free" in fail.fix
