"""Joining from a run address (node/bootstrap.py): the signed spec and the pinned task list are fetched and verified;
a tampered spec, artifact or address is refused with one line and nothing is written in the node's folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web
from localnet import serve_app

from node.bootstrap import JoinError, open_run, run_folder
from node.cli import main
from node.shardcast.publish import publish_artifact
from node.shardcast.server import ShardcastServer
from node.shardcast.store import ShardcastStore
from protocol.address import format_run_address, parse_run_address
from protocol.artifacts import TASKS_ARTIFACT
from protocol.dataset import TASKS_FILE, resolve_tasks, run_tasks, tasks_artifact_files, tasks_artifact_id
from protocol.errors import AddressError
from protocol.identity import NodeKey
from protocol.run_api import SPEC_ROUTE
from protocol.runspec import DataSpec, NetworkSpec, RunInfo, RunSpec, dump_run_spec, sign_run_spec
from protocol.shardcast import ROUTE_PREFIX
from protocol.tasks import math_task

KEY = NodeKey.generate()
OTHER = NodeKey.generate()


def write_tasks(path: Path, n: int = 120) -> Path:
    lines = [math_task(f"add/{i}", f"What is {i} + {i % 7}?", str(i + i % 7)).to_dict() for i in range(n)]
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def make_signed(tasks_file: Path, key: NodeKey = KEY, **net):
    train = resolve_tasks(str(tasks_file)).train
    spec = RunSpec(run=RunInfo(coordinator=key.peer_id), data=DataSpec(tasks=str(tasks_file), tasks_hash=resolve_tasks(str(tasks_file)).hash),
                   network=NetworkSpec(**net), artifacts={TASKS_ARTIFACT: tasks_artifact_id(train).hex()})
    return sign_run_spec(spec, key)


@pytest.fixture
def origin(tmp_path):
    """A coordinator-like origin: the signed spec and the tasks artifact on one port."""
    (tmp_path / "coord").mkdir()
    tasks = write_tasks(tmp_path / "coord" / "tasks.jsonl")
    signed = make_signed(tasks)
    store = ShardcastStore(tmp_path / "coord", run_id=signed.run_id, authorities=signed.spec.authorities, keep_steps=3, fsync=False)
    publish_artifact(store, TASKS_ARTIFACT, tasks_artifact_files(resolve_tasks(str(tasks)).train), expected_id=signed.spec.artifact_id("tasks"))
    server = ShardcastServer(store)
    server.run_spec = dump_run_spec(signed).encode()
    with serve_app(server.make_app) as url:
        yield signed, url, tasks


def empty(path: Path) -> bool:
    return not path.exists()


def test_address_grammar_round_trips_and_refuses_in_one_line():
    run_id = bytes(range(32))
    text = format_run_address(KEY.peer_id, run_id, ["http://203.0.113.5:8000/"], [f"/ip4/203.0.113.5/tcp/4001/p2p/{KEY.peer_id}",
                                                                                   f"/dns4/relay.example/tcp/4002/p2p/{OTHER.peer_id}"])
    assert text == (f"intellect1:{KEY.peer_id}/{run_id.hex()[:16]}@http://203.0.113.5:8000,/ip4/203.0.113.5/tcp/4001,"
                    f"/dns4/relay.example/tcp/4002/p2p/{OTHER.peer_id}")
    a = parse_run_address(text)
    assert a.coordinator == KEY.peer_id and a.run_id_prefix == run_id.hex()[:16] and a.http_urls == ("http://203.0.113.5:8000",)
    assert a.bootstrap == (f"/ip4/203.0.113.5/tcp/4001/p2p/{KEY.peer_id}", f"/dns4/relay.example/tcp/4002/p2p/{OTHER.peer_id}")
    assert a.matches_run(run_id) and not a.matches_run(bytes(32)) and str(a) == text
    for bad, why in [
        ("intellect2:x@http://h:1", "starts with"),
        (f"intellect1:{KEY.peer_id[:-1]}@http://h:1", "not a coordinator peer ID"),
        (f"intellect1:{KEY.peer_id}/XYZ@http://h:1", "run ID"),
        (f"intellect1:{KEY.peer_id}", "no '@'"),
        (f"intellect1:{KEY.peer_id}@ftp://h:1", "neither an http"),
        (f"intellect1:{KEY.peer_id}@http://u:p@h:1", "no user"),
        (f"intellect1:{KEY.peer_id}@/ip4/1.2.3.4/udp/5", "multiaddr"),
        (f"intellect1:{KEY.peer_id}@http://h:1,,http://g:2", "empty location"),
        (f"intellect1:{KEY.peer_id}@http://h:1 x", "whitespace"),
        (f"intellect1:{KEY.peer_id}@" + ",".join(f"http://h{i}:1" for i in range(17)), "more than 16"),
    ]:
        with pytest.raises(AddressError, match=why) as e:
            parse_run_address(bad)
        assert "\n" not in str(e.value)


def test_join_from_address_fetches_spec_and_tasks(origin, tmp_path):
    signed, url, tasks_file = origin
    node = tmp_path / "node"
    address = format_run_address(KEY.peer_id, signed.run_id, [url])
    joined = open_run(address, node, artifacts=[TASKS_ARTIFACT])
    assert joined.signed.run_id == signed.run_id and joined.spec_path == run_folder(node, signed.run_id) / "run.toml"
    assert joined.spec_path.read_text() == dump_run_spec(signed)
    folder = joined.artifacts[TASKS_ARTIFACT]
    got = run_tasks(signed.spec.data.tasks, None, signed.spec.data.tasks_hash, joined.artifacts)
    assert got.train == resolve_tasks(str(tasks_file)).train and got.heldout == []  # the held-out tasks never leave the coordinator
    assert (folder / TASKS_FILE).is_file()
    # again: nothing new to fetch; and with the coordinator gone, the stored spec stands in
    assert open_run(address, node, artifacts=[TASKS_ARTIFACT]).artifacts == joined.artifacts
    gone = format_run_address(KEY.peer_id, signed.run_id, ["http://127.0.0.1:9"])
    assert open_run(gone, node, artifacts=[TASKS_ARTIFACT]).signed.run_id == signed.run_id
    # the old file form keeps working, fetching the pinned tasks from the spec's origins
    spec_file = tmp_path / "run.toml"
    spec_file.write_text(dump_run_spec(signed))
    with pytest.raises(JoinError, match="names no origin URL"):
        open_run(str(spec_file), tmp_path / "other", artifacts=[TASKS_ARTIFACT])
    assert empty(tmp_path / "other")
    assert open_run(str(spec_file), tmp_path / "other").artifacts == {}


def test_tampered_address_spec_and_artifact_are_refused_and_write_nothing(origin, tmp_path):
    signed, url, tasks_file = origin
    node = tmp_path / "node"
    spec_text = dump_run_spec(signed)

    def refused(address: str, match: str) -> None:
        with pytest.raises(JoinError, match=match) as e:
            open_run(address, node, artifacts=[TASKS_ARTIFACT])
        assert "\n" not in str(e.value)
        assert empty(node), f"{address} wrote into the node's folder"

    # addresses: malformed, naming another coordinator, naming another run of this coordinator
    refused(f"intellect1:{KEY.peer_id}@{url}/,", "empty location")
    refused(format_run_address(OTHER.peer_id, None, [url]), f"served a run spec of coordinator {KEY.peer_id}, the address names {OTHER.peer_id}")
    refused(format_run_address(KEY.peer_id, bytes(32), [url]), "the address names run 0000000000000000")
    refused(format_run_address(KEY.peer_id, signed.run_id, ["http://127.0.0.1:9"]), "unreachable")

    # a server that alters the spec, and one that serves another run's spec signed by someone else
    tampered = spec_text.replace("tasks_per_submission = 2", "tasks_per_submission = 3")
    assert tampered != spec_text
    foreign = dump_run_spec(make_signed(tasks_file, OTHER))

    def spec_app(body: str):
        def factory() -> web.Application:
            app = web.Application()
            async def answer(request: web.Request) -> web.Response:
                return web.Response(text=body)

            app.router.add_get(SPEC_ROUTE, answer)
            return app
        return factory

    with serve_app(spec_app(tampered)) as bad:
        refused(format_run_address(KEY.peer_id, signed.run_id, [bad]), "modified after signing")
    with serve_app(spec_app(foreign)) as bad:
        refused(format_run_address(KEY.peer_id, None, [bad]), "served a run spec of coordinator")
    with serve_app(spec_app("x" * (2 << 20))) as bad:
        refused(format_run_address(KEY.peer_id, None, [bad]), "over the 1048576-byte limit")

    # the right spec, but its task list's manifest or pieces altered on the way
    def artifact_app(mode: str):
        import aiohttp

        async def forward(request: web.Request) -> web.Response:
            async with aiohttp.ClientSession() as s, s.get(url + request.path) as up:
                body = await up.read()
                status = up.status
            if "/artifacts/" in request.path and mode == "manifest":
                body = body[:-1] + bytes([body[-1] ^ 1])
            if "/pieces/" in request.path and mode == "piece":
                body = body[:10] + bytes([body[10] ^ 1]) + body[11:]
            return web.Response(body=body, status=status)

        def factory() -> web.Application:
            app = web.Application()
            app.router.add_get("/{tail:.*}", forward)
            return app
        return factory

    for mode, why in (("manifest", "rejected its artifact manifest"), ("piece", "cannot fetch the run's tasks artifact")):
        with serve_app(artifact_app(mode)) as bad:
            refused(format_run_address(KEY.peer_id, signed.run_id, [bad]), why)

    # the real origin still works after all that
    assert open_run(format_run_address(KEY.peer_id, signed.run_id, [url]), node, artifacts=[TASKS_ARTIFACT]).artifacts


def test_cli_refuses_a_tampered_address_in_one_line(origin, tmp_path, capsys):
    _, url, _ = origin
    home = tmp_path / "home"
    rc = main(["join", "--role", "worker", format_run_address(OTHER.peer_id, None, [url]), "--data-dir", str(home)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("error: ") and "the address names" in err
    assert empty(home), "no key, spec or artifact written"
    NodeKey.generate().save(tmp_path / "k")
    rc = main(["validate", "intellect1:nonsense@http://x:1", "--data-dir", str(home), "--key", str(tmp_path / "k")])
    assert rc == 2 and "not a coordinator peer ID" in capsys.readouterr().err
    rc = main(["join", "--role", "relay", "--data-dir", str(home)])
    assert rc == 2 and "name the run once" in capsys.readouterr().err
    assert empty(home)


def test_spec_route_and_artifact_route(origin):
    import json
    import urllib.request

    signed, url, _ = origin
    with urllib.request.urlopen(url + SPEC_ROUTE, timeout=5) as r:
        assert r.read().decode() == dump_run_spec(signed) and r.headers["Content-Type"].startswith("application/toml")
    with urllib.request.urlopen(f"{url}{ROUTE_PREFIX}/held", timeout=5) as r:
        assert json.loads(r.read())["artifacts"] == [signed.spec.artifacts["tasks"]]


def test_join_waits_for_a_coordinator_still_starting_but_not_after_a_refusal(origin, tmp_path, monkeypatch):
    from node import bootstrap

    signed, url, _ = origin
    real = bootstrap.fetch_spec
    calls: list[int] = []

    async def not_yet(address, **kw):
        calls.append(1)
        if len(calls) < 3:
            raise bootstrap.LocationsUnavailable(f"{url}: unreachable (starting)")
        return await real(address, **kw)

    monkeypatch.setattr(bootstrap, "fetch_spec", not_yet)
    monkeypatch.setattr(bootstrap, "SPEC_RETRY_MAX_S", 0.05)
    address = format_run_address(KEY.peer_id, signed.run_id, [url])
    assert open_run(address, tmp_path / "a", wait_s=30).signed.run_id == signed.run_id and len(calls) == 3
    calls.clear()
    with pytest.raises(bootstrap.LocationsUnavailable):
        open_run(address, tmp_path / "b", wait_s=0)  # no wait asked: the first failure ends it
    assert empty(tmp_path / "b")

    async def refused(address, **kw):
        calls.append(1)
        raise JoinError(f"{url}: refused the run spec it served: modified after signing")

    calls.clear()
    monkeypatch.setattr(bootstrap, "fetch_spec", refused)
    with pytest.raises(JoinError, match="modified after signing"):
        open_run(address, tmp_path / "c", wait_s=30)
    assert calls == [1], "a refusal is not retried"
