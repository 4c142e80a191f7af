#!/usr/bin/env bash
# One prepared check for a CUDA machine with this repository and network access to PyPI.
#
#   scripts/gpu_check.sh [VENV_DIR]        (default VENV_DIR: .venv-gpu; ≈ 5-10 min, mostly the install)
#
# 1. Installs intellect-node with the `gpu` extra (vLLM, which brings its own CUDA torch) and the
#    `test` extra into VENV_DIR — never into the CPU venv .venv.
# 2. Sampling CPU vs GPU: tests/protocol/test_sampling.py, including the CUDA-only
#    test_rule_bits_identical_on_gpu (Philox words, uniforms, tokens, log-probs and the replay's
#    verdicts equal on both devices at vocabulary 151,936) and
#    test_sampler_never_syncs_with_the_host (torch.cuda.set_sync_debug_mode("error") around
#    sampling.sample: no host synchronisation inside the rule, with and without top-p / EOS gate);
#    the same for gumbel-v2 in tests/protocol/test_sampling_gumbel.py.
# 3. The vLLM engine on CUDA: tests/node/test_vllm_engine.py (float32 model; every token must
#    replay exactly, log-probs, EOS gate, TOPLOC proofs of the captured rows, hot weight swap).
# 4. The transformers engine's static decode on CUDA (tests/node/test_engine.py -k cuda): no host
#    synchronisation in a decode step; its tokens and rows pass a CPU validator's replay and TOPLOC.
# 5. The qwen2.5-0.5b devnet profile across devices (scripts/gpu_profile_check.py; needs the public
#    task text, default ../shared/data, or DATA_ROOT=…): its worker on vLLM in bfloat16 on CUDA and
#    the transformers worker on the CPU, each submission checked by a CPU validator and by a validator
#    prefilling on CUDA (float32, as `validate --device cuda` loads it); a rejection prints its
#    evidence (the check, the measured figure, the threshold) so a threshold that must move is named
#    with the number. Builds the 24-layer model once (cached, ≈ 1 min).
# 6. The verification benchmarks on the GPU (the CPU runs are in docs/toploc.md §9-10):
#    benchmarks/validator_bench.py at the qwen2.5-0.5b profile, worker and validator on CUDA (goal
#    validator / worker ≤ 1/20; also sampling check / prefill ≤ 1/4, validator / prefill ≤ 1.25),
#    and benchmarks/false_rejections.py with honest workers decoding on CUDA in float32 and bfloat16
#    against a float32 CUDA validator (goal: 0 false rejections; prints every threshold's margin).
#    Their result lines are printed under the step; a step fails only if the script fails.
# Prints versions and a PASS/FAIL line per step; exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-gpu}
PY=${PYTHON:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || exit 1
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -U pip || exit 1
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[gpu,test]' || exit 1
"$VENV/bin/python" - <<'EOF' || exit 1
import torch, transformers, vllm
assert torch.cuda.is_available(), "torch in this venv sees no CUDA device"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name()}")
EOF
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} INTELLECT_VLLM_DEVICE=cuda
fail=0
step() {
    local name=$1; shift
    local t0=$SECONDS
    if "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider "$@"; then
        echo "PASS  $name ($((SECONDS - t0)) s)"
    else
        echo "FAIL  $name ($((SECONDS - t0)) s)"; fail=1
    fi
}
bench() {
    local name=$1; shift
    local t0=$SECONDS out
    out=$(mktemp)
    if "$VENV/bin/python" "$@" >"$out" 2>&1; then
        grep -E "^(ratio|floor|honest|model|load|submission|threshold|TOPLOC|replay|log-prob|cheating|  )" "$out" | grep -v "^  batch" | head -60
        echo "PASS  $name ($((SECONDS - t0)) s)"
    else
        tail -20 "$out"; echo "FAIL  $name ($((SECONDS - t0)) s)"; fail=1
    fi
    rm -f "$out"
}
step "sampling CPU vs GPU, no host sync (both rules)" tests/protocol/test_sampling.py tests/protocol/test_sampling_gumbel.py
step "vLLM engine on CUDA" tests/node/test_vllm_engine.py
step "transformers engine's static decode on CUDA" tests/node/test_engine.py -k cuda
t0=$SECONDS
if "$VENV/bin/python" scripts/gpu_profile_check.py --data-root "${DATA_ROOT:-../shared/data}"; then
    echo "PASS  qwen2.5-0.5b profile: vLLM bf16 worker and CPU worker vs CPU and GPU validators ($((SECONDS - t0)) s)"
else
    echo "FAIL  qwen2.5-0.5b profile: vLLM bf16 worker and CPU worker vs CPU and GPU validators ($((SECONDS - t0)) s)"; fail=1
fi
bench "validator / worker at the qwen2.5-0.5b profile on CUDA" benchmarks/validator_bench.py --device cuda --profile qwen2.5-0.5b \
    --tasks 2 --group 4 --max-tokens 256 --repeats 2 --peaked 12
bench "honest false rejections, workers on CUDA (fp32 and bf16)" benchmarks/false_rejections.py --device cuda --submissions 4
exit "$fail"
