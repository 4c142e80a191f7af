#!/usr/bin/env bash
# Install intellect-node with its test extra into ./.venv and run the test suite.
# torch is pinned first: 2.13.0 is the local CPU wheel; an unpinned torch would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e '.[test]'
# System packages some tests need, installed with apt when missing (root only; README § Set up):
#   chromium, chromium-driver: headless Chromium + WebDriver for the run page's browser tests;
#   bubblewrap: the sandbox code rewards run in (nodes refuse code tasks without it).
# Without them those tests skip, each naming what to install.
NEED=()
{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || NEED+=(chromium chromium-driver)
command -v bwrap >/dev/null || NEED+=(bubblewrap)
if [ "${#NEED[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get update -qq && apt-get install -y -qq "${NEED[@]}"; } || echo "apt-get could not install ${NEED[*]}: the tests that need them will skip"
    else
        echo "not installing ${NEED[*]} (needs root and apt): run 'sudo apt-get install ${NEED[*]}' first; until then the run page's browser tests and the code-sandbox tests skip, naming it"
    fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two pytest workers (pytest-xdist), each test module on one worker (its module fixtures built once):
# most of the slow tests wait on child processes, so two run side by side even on 2 cores
# (≈ 610 tests on the idle 2-core machine: 5 min 17 s to 6 min 31 s, against 9 min 0 s serially).
# Modules are handed out in tests/conftest.py's order, the longest first (--no-loadscope-reorder:
# xdist's own order, most tests first, ran the one-test devnet modules last, one at a time).
# TEST_WORKERS=0 runs them serially in this process.
WORKERS=${TEST_WORKERS:-2}
XDIST=()
[ "$WORKERS" != 0 ] && XDIST=(-n "$WORKERS" --dist loadscope --no-loadscope-reorder)
# Every run leaves its per-test durations: the 25 slowest printed, all of them in test-durations/ (git ignores it):
# <UTC time>.tsv per test (setup/call/teardown seconds, outcome, worker, start), .modules.tsv per module.
DURATIONS="test-durations/$(date -u +%Y%m%dT%H%M%SZ).tsv"
set +e
python -m pytest -q ${XDIST[@]+"${XDIST[@]}"} --durations=25 --durations-file "$DURATIONS" "$@"
rc=$?
set -e
echo "per-test durations: $DURATIONS (per module: ${DURATIONS%.tsv}.modules.tsv)"
# pytest exits 5 when no test ran: that is a failure here, never a silent pass.
[ "$rc" = 5 ] && { echo "no tests ran: failing"; exit 1; }
exit "$rc"
