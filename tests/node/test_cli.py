"""The CLI as a user runs it: real subprocesses of the installed entry point."""

import os
import re
import stat
import subprocess
import sys

import pytest

PEER_ID = re.compile(r"12D3KooW[1-9A-HJ-NP-Za-km-z]{44}")


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=120, env=env, check=False)


def test_help_lists_commands_and_is_fast():
    r = cli("--help")
    assert r.returncode == 0
    for name in ("keygen", "id", "spec"):
        assert name in r.stdout


@pytest.mark.slow
def test_keygen_id_agree_mode_and_no_overwrite(tmp_path):
    key = tmp_path / "k"
    a = cli("keygen", "--key", str(key))
    b = cli("id", "--key", str(key))
    assert a.returncode == 0 and b.returncode == 0
    assert PEER_ID.search(a.stdout).group() == PEER_ID.search(b.stdout).group()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    c = cli("keygen", "--key", str(key))
    assert c.returncode == 2 and "refusing to overwrite" in c.stderr
    assert PEER_ID.search(cli("id", "--key", str(key)).stdout).group() == PEER_ID.search(a.stdout).group()


def test_default_key_location(tmp_path):
    env = dict(os.environ, INTELLECT_NODE_HOME=str(tmp_path / "home"))
    a = cli("keygen", env=env)
    assert a.returncode == 0 and (tmp_path / "home" / "node.key").exists()
    assert PEER_ID.search(cli("id", env=env).stdout).group() == PEER_ID.search(a.stdout).group()


def test_id_without_key_is_a_clear_error(tmp_path):
    r = cli("id", "--key", str(tmp_path / "nope"))
    assert r.returncode == 2 and "keygen" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_spec_init_show_and_tamper(tmp_path):
    key = tmp_path / "coord"
    cli("keygen", "--key", str(key))
    v = tmp_path / "val"
    vid = PEER_ID.search(cli("keygen", "--key", str(v)).stdout).group()
    run = tmp_path / "run.toml"
    r = cli("spec", "init", "--coordinator-key", str(key), "--out", str(run), "--validator", vid, "--async-level", "1")
    assert r.returncode == 0, r.stderr
    show = cli("spec", "show", str(run))
    assert show.returncode == 0 and "signature: valid" in show.stdout and vid in show.stdout
    assert "keep_steps = 2" in show.stdout
    assert cli("spec", "init", "--coordinator-key", str(key), "--out", str(run)).returncode == 2  # no silent overwrite
    text = run.read_text()
    run.write_text(text.replace("async_level = 1", "async_level = 0"))
    bad = cli("spec", "show", str(run))
    assert bad.returncode == 2 and "modified after signing" in bad.stderr


@pytest.mark.parametrize("opt", [["--async-level", "-3"], ["--piece-size", "10"]])
def test_spec_init_rejects_bad_options(tmp_path, opt):
    key = tmp_path / "coord"
    cli("keygen", "--key", str(key))
    r = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "r.toml"), *opt)
    assert r.returncode == 2 and "invalid option" in r.stderr


@pytest.mark.slow
def test_spec_init_logprob_tolerances(tmp_path):
    """--logprob-max-abs / --logprob-mean-abs / --replay-eps / --max-near-tie-fraction set the run spec's toploc
    tolerances; bad values are refused in one line."""
    key = tmp_path / "coord"
    cli("keygen", "--key", str(key))
    run = tmp_path / "run.toml"
    r = cli("spec", "init", "--coordinator-key", str(key), "--out", str(run), "--logprob-max-abs", "0.5", "--logprob-mean-abs", "0.05",
            "--replay-eps", "0.05", "--max-near-tie-fraction", "0.5", "--eos-prob-slack", "0.02")
    assert r.returncode == 0, r.stderr
    show = cli("spec", "show", str(run))
    assert show.returncode == 0 and "logprob_max_abs = 0.5" in show.stdout and "logprob_mean_abs = 0.05" in show.stdout
    assert "replay_eps = 0.05" in show.stdout and "max_near_tie_fraction = 0.5" in show.stdout and "eos_prob_slack = 0.02" in show.stdout
    for opt in (["--logprob-max-abs", "nan"], ["--logprob-max-abs", "0"], ["--logprob-mean-abs", "0.02"], ["--replay-eps", "0"],
                ["--max-near-tie-fraction", "2"], ["--replay-logit-bound", "-1"]):
        bad = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "bad.toml"), *opt)
        assert bad.returncode == 2 and "invalid option" in bad.stderr and opt[0][2:].replace("-", "_") in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_spec_init_audit_writes_eprocess_v2_unless_told(tmp_path):
    """``--audit`` writes the twin-testing rule ``eprocess-v2`` with ``--min-calibration-decisive``;
    ``--audit-rule eprocess-v1`` keeps the rate test alone, and refuses the twin option in one line."""
    key = tmp_path / "coord"
    cli("keygen", "--key", str(key))
    v2 = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "v2.toml"), "--audit", "--min-calibration-decisive", "128",
             "--twin-share", "0.25")
    assert v2.returncode == 0, v2.stderr
    show = cli("spec", "show", str(tmp_path / "v2.toml")).stdout
    assert 'rule = "eprocess-v2"' in show and "min_calibration_decisive = 128" in show and "twin_share = 0.25" in show
    assert re.search(r"calibration_batches = \[\s*1,\s*8,\s*64,?\s*\]", show), show  # new runs calibrate batch 1, 8 and 64 (issue #33)
    v1 = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "v1.toml"), "--audit", "--audit-rule", "eprocess-v1")
    assert v1.returncode == 0 and 'rule = "eprocess-v1"' in cli("spec", "show", str(tmp_path / "v1.toml")).stdout
    for opt in (["--audit", "--audit-rule", "eprocess-v1", "--min-calibration-decisive", "5"], ["--audit-rule", "eprocess-v2"],
                ["--audit", "--twin-share", "0"], ["--audit", "--calibration-batches", "8,1"], ["--audit", "--calibration-batches", "x"],
                ["--calibration-batches", "8"]):
        bad = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "bad.toml"), *opt)
        assert bad.returncode != 0 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        if opt[-1] == "8,1":
            assert "audit.calibration_batches" in bad.stderr, bad.stderr


@pytest.mark.slow
def test_bad_gossip_flags_are_one_line_errors_in_every_role(tmp_path):
    """``join``, ``validate`` and ``intellect-train`` read the gossip flags the same way (node.cli.gossip_config)."""
    key = tmp_path / "coord"
    cli("keygen", "--key", str(key))
    run = tmp_path / "run.toml"
    assert cli("spec", "init", "--coordinator-key", str(key), "--out", str(run), "--validator",
               PEER_ID.search(cli("id", "--key", str(key)).stdout).group()).returncode == 0
    common = ["--run", str(run), "--data-dir", str(tmp_path / "data"), "--p2p-port", "70000"]
    roles = (["-m", "node", "join", "--role", "worker", *common], ["-m", "node", "join", "--role", "relay", *common],
             ["-m", "node", "validate", "--key", str(key), *common], ["-m", "node.train_cli", "--key", str(key), *common])
    # the four start side by side (each mostly imports): one after another they were ≈ 50 s of the suite
    procs = [(args, subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for args in roles]
    try:
        for args, p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 2 and err.strip().splitlines() == ["error: invalid --p2p-port: Input should be less than or equal to 65535"], (args, err)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_spec_init_gumbel_v2_needs_a_logit_replay_rule(tmp_path):
    """``--sampling-rule gumbel-v2`` is replayed under a logit bound: without one the spec is refused in one line naming
    ``toploc.replay_rule`` and the flags that set it; with them, or with ``--measure-precision`` (which writes
    ``logit-bound-v3`` and δ), it is written."""
    key = tmp_path / "coord"
    cli("keygen", "--key", str(key))
    for opt in ([], ["--replay-rule", "eps-v1"]):
        bad = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "bad.toml"), "--sampling-rule", "gumbel-v2", *opt)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and "Traceback" not in bad.stderr, bad.stderr
        assert "toploc.replay_rule" in lines[0] and "--replay-rule logit-bound-v" in lines[0] and "--measure-precision" in lines[0], lines
        assert not (tmp_path / "bad.toml").exists()
    ok = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "g.toml"), "--sampling-rule", "gumbel-v2",
             "--replay-rule", "logit-bound-v2", "--replay-logit-bound", "0.7", "--worker-dtype", "bfloat16")
    assert ok.returncode == 0, ok.stderr
    show = cli("spec", "show", str(tmp_path / "g.toml")).stdout
    assert 'rule = "gumbel-v2"' in show and 'replay_rule = "logit-bound-v2"' in show and "replay_logit_bound = 0.7" in show, show
    measured = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "m.toml"), "--sampling-rule", "gumbel-v2",
                   "--measure-precision", "bfloat16", "--fp32-logits", "--measure-submissions", "1")
    assert measured.returncode == 0, measured.stderr
    show = cli("spec", "show", str(tmp_path / "m.toml")).stdout
    assert 'rule = "gumbel-v2"' in show and 'replay_rule = "logit-bound-v3"' in show and 'worker_dtype = "bfloat16"' in show, show


def test_spec_errors_carry_no_pydantic_prefix(tmp_path):
    """A spec's own refusal reads as its message, without pydantic's ``Value error,`` prefix."""
    key = tmp_path / "coord"
    cli("keygen", "--key", str(key))
    bad = cli("spec", "init", "--coordinator-key", str(key), "--out", str(tmp_path / "bad.toml"), "--replay-rule", "logit-bound-v2")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: invalid option: toploc.replay_rule logit-bound-v2 needs toploc.replay_logit_bound > 0 (nats)"], bad.stderr
