"""One role per host (docs/multi_host.md): the address a prefill side channel on every
interface advertises, and ``serve-pd --role``'s plans, allow-lists and secrets.

The namespace run, which starts these plans on two hosts, is tests/test_multi_host_serving.py.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from kvshare_connector.backends.options import ConnectorOptions, OptionError
from kvshare_connector.toolkit import cli, roles
from kvshare_connector.toolkit.checks import UsageError
from kvshare_connector.toolkit.launcher import ServeConfig, pd_deployment, plan_pd
from kvshare_connector.transfer.wire import addresses
from kvshare_connector.transfer.wire.addresses import AdvertiseError, advertised_host
from kvshare_connector.transfer.wire.side_channel import (
    SECRET_ENV,
    SideChannelRefused,
    SideChannelServer,
)
from kvshare_connector.transfer.wire.side_channel_client import ask

SECRET = b"the deployment's secret"
ENGINE = "prefill-7"


def _routable() -> str:
    try:
        return addresses.routable_address().host
    except AdvertiseError as exc:
        pytest.skip(f"this host has no single routable IPv4 address: {exc}")


def _kv(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in (SECRET_ENV, roles.HOST_ENV, addresses.ADVERTISE_ENV):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text("0123abcd" * 8 + "\n")
    path.chmod(0o600)
    return path


# ---- the advertised address -----------------------------------------------------------------


def test_a_side_channel_on_every_interface_answers_to_its_routable_address():
    """Bound to 0.0.0.0, it is addressed by the host's routable address (what its
    kv_transfer_params name); a request signed for another of its addresses is refused as
    misaddressed (the negative control: the listener reaches it, the MAC names another
    destination), as a relayed one would be."""
    host = _routable()
    server = SideChannelServer("0.0.0.0", 0, lambda p: b"ok " + p, SECRET, ENGINE, advertise=host)
    try:
        assert server.host == host and server.bind_host == "0.0.0.0"
        assert server.destination == f"{ENGINE}@{host}:{server.port}"
        assert ask(host, server.port, b"hello", 3.0, SECRET, ENGINE) == b"ok hello"
        with pytest.raises(SideChannelRefused, match="misaddressed"):
            ask("127.0.0.1", server.port, b"hello", 3.0, SECRET, ENGINE)
        assert server.refused == {"misaddressed": 1}
    finally:
        server.close()


def test_what_a_side_channel_advertises():
    assert advertised_host("10.0.0.5").host == "10.0.0.5"  # one host: itself
    assert advertised_host("localhost").host == "localhost"  # vLLM's default, as before
    named = advertised_host("0.0.0.0", "prefill-a.example")
    assert (named.host, named.why) == ("prefill-a.example", "advertise_host")
    assert advertised_host("0.0.0.0").host == addresses.routable_address().host
    route = addresses.default_route(socket.AF_INET)
    if route is not None:  # the kernel's source address toward the default gateway
        assert "default route's interface" in advertised_host("0.0.0.0").why
    with pytest.raises(AdvertiseError, match="advertise_host '0.0.0.0' is the unspecified"):
        advertised_host("0.0.0.0", "0.0.0.0")


def test_without_a_default_route_the_only_address_or_a_named_error(monkeypatch):
    monkeypatch.setattr(addresses, "default_route", lambda family: None)
    monkeypatch.setattr(addresses, "interface_addresses", lambda f: {"veth0": ["10.77.3.1"]})
    only = advertised_host("0.0.0.0")
    assert only.host == "10.77.3.1" and "only IPv4 address (veth0" in only.why
    two = {"eth0": ["10.0.0.5"], "eth1": ["10.1.0.5"]}
    monkeypatch.setattr(addresses, "interface_addresses", lambda family: two)
    with pytest.raises(AdvertiseError) as err:
        advertised_host("0.0.0.0")
    text = str(err.value)
    assert "10.0.0.5 (eth0), 10.1.0.5 (eth1)" in text and "advertise_host" in text
    assert addresses.ADVERTISE_ENV in text


def test_the_advertise_host_option_and_its_variable():
    o = ConnectorOptions.parse({}, environ={addresses.ADVERTISE_ENV: "10.0.0.7"})
    assert o.advertise_host == "10.0.0.7"
    for bad in ("0.0.0.0", "::", "a host", 7):
        with pytest.raises(OptionError, match="advertise_host must be one host's name"):
            ConnectorOptions.parse({"advertise_host": bad}, environ={})


# ---- serve-pd --role ---------------------------------------------------------------------------


def test_a_prefill_host_runs_prefills_alone_on_every_interface(secret_file):
    host = _routable()
    cfg = ServeConfig(
        model="m", role="prefill", host="0.0.0.0", num_prefill=2, secret_file=secret_file
    )
    engines = plan_pd(cfg)
    assert [e.name for e in engines] == ["prefill0", "prefill1"]
    for e in engines:
        assert e.env[roles.HOST_ENV] == "0.0.0.0"  # the side channel on every interface
        assert e.env[SECRET_ENV] == "0123abcd" * 8  # the file's line, in the environment
        assert "0123abcd" not in " ".join(e.argv)  # never on the command line
        assert "allowed_prefills" not in _kv(e.argv).get("kv_connector_extra_config", {})
    deployment = pd_deployment(cfg)
    assert not deployment.with_proxy  # the front runs elsewhere
    info = deployment.describe()
    assert info["endpoint"] is None and info["role"] == "prefill"
    assert info["side_channels"] == [f"{host}:5600", f"{host}:5616"]
    line = roles.ready_line(deployment)
    assert f"--allowed-prefills {host}:5600 {host}:5616" in line
    assert f"kvshare proxy --prefill http://{host}:8100 http://{host}:8101" in line


def test_a_decode_host_admits_the_prefills_it_is_given(secret_file):
    cfg = ServeConfig(
        model="m", role="decode", allowed_prefills=["10.0.0.5:5600", "10.0.0.6:5600-5601"],
        secret_file=secret_file,
    )  # fmt: skip
    (decode,) = plan_pd(cfg)
    extra = _kv(decode.argv)["kv_connector_extra_config"]
    assert extra["allowed_prefills"] == ["10.0.0.5:5600", "10.0.0.6:5600-5601"]
    assert _kv(decode.argv)["kv_role"] == "kv_consumer"
    assert pd_deployment(cfg).describe()["side_channels"] == []
    with pytest.raises(UsageError, match="--role decode needs --allowed-prefills HOST:PORT"):
        ServeConfig(model="m", role="decode", secret_file=secret_file)
    with pytest.raises(UsageError, match="'10.0.0.5' names no port: write 10.0.0.5:PORT"):
        ServeConfig(model="m", role="decode", allowed_prefills=["10.0.0.5"])
    with pytest.raises(UsageError, match="host '0.0.0.0': the unspecified address"):
        ServeConfig(model="m", role="decode", allowed_prefills=["0.0.0.0:5600"])


def test_a_role_needs_the_shared_secret_from_a_file_or_the_environment(
    monkeypatch, tmp_path, secret_file
):
    cfg = ServeConfig(model="m", role="prefill", host="10.0.0.5")
    with pytest.raises(UsageError, match="--secret-file PATH .* or KVSHARE_SIDE_CHANNEL_SECRET"):
        plan_pd(cfg)
    monkeypatch.setenv(SECRET_ENV, "exported")
    assert SECRET_ENV not in plan_pd(cfg)[0].env  # the engine inherits serve-pd's
    for text in ("", "\n\n", "two\nlines\n"):
        (tmp_path / "bad").write_text(text)
        bad = ServeConfig(model="m", role="prefill", secret_file=tmp_path / "bad")
        with pytest.raises(UsageError, match="must hold one non-empty line"):
            plan_pd(bad)
    missing = ServeConfig(model="m", role="prefill", secret_file=tmp_path / "none")
    with pytest.raises(UsageError, match="--secret-file .*none"):
        plan_pd(missing)


def test_the_one_host_form_lists_its_prefills_host_port(secret_file):
    """Both roles on one host: decode admits each prefill's host:port (never a host alone,
    which admits every port), at the address a prefill on every interface advertises."""
    *_, d = plan_pd(ServeConfig(model="m", num_prefill=2, side_channel_port=7000))
    assert _kv(d.argv)["kv_connector_extra_config"]["allowed_prefills"] == [
        "localhost:7000", "localhost:7016"
    ]  # fmt: skip
    host = _routable()
    cfg = ServeConfig(model="m", side_channel_host="0.0.0.0")
    prefill, decode = plan_pd(cfg)
    assert prefill.env[roles.HOST_ENV] == "0.0.0.0"
    assert _kv(decode.argv)["kv_connector_extra_config"]["allowed_prefills"] == [f"{host}:5600"]
    cfg = ServeConfig(model="m", side_channel_host="0.0.0.0", advertise_host="pf.example")
    prefill, decode = plan_pd(cfg)
    assert _kv(prefill.argv)["kv_connector_extra_config"]["advertise_host"] == "pf.example"
    assert _kv(decode.argv)["kv_connector_extra_config"]["allowed_prefills"] == ["pf.example:5600"]
    assert "advertise_host" not in _kv(decode.argv)["kv_connector_extra_config"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--env", f"{SECRET_ENV}=x"], "puts the secret on serve-pd's command line"),
        (["--kv-extra-config", '{"side_channel_secret": "x"}'], "on the engines' command lines"),
        (["--role", "decode"], "--role decode needs --allowed-prefills"),
        (["--role", "decode", "--allowed-prefills", "10.0.0.5"], "names no port"),
        (["--role", "prefill"], "--role prefill needs the deployment's side-channel secret"),
    ],
)
def test_serve_pd_refuses_before_starting(args, message, capsys):
    assert cli.main(["serve-pd", "m", "--server-cmd", "true {model}", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvshare serve-pd: error: ") and message in err, err


# ---- the connector, one host ---------------------------------------------------------------------


def test_a_prefill_on_every_interface_names_its_routable_address_and_serves_it(monkeypatch):
    """vLLM's Scheduler and the connector (``engine_sim``), prefill's side channel on
    0.0.0.0: its kv_transfer_params name the host's routable address, decode dials that and
    loads byte for byte. Negative control: the same params naming 127.0.0.1, which reaches
    the same listener (and decode admits), are refused as misaddressed and computed locally."""
    from kvshare_connector.toolkit.procs import pick_free_port
    from lab.tools.engine_sim import (
        READY,
        RESULT,
        Engine,
        decode_requests,
        start_prefill,
    )

    host = _routable()
    monkeypatch.setenv(roles.HOST_ENV, "0.0.0.0")
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    port = pick_free_port()
    child = start_prefill(port, 200, 2, "--lease-s", "30", cwd=str(Path(__file__).parents[1]))
    decode = None
    try:
        requests = child.wait_json(READY, 180)["requests"]
        assert {r["kv_transfer_params"]["remote_host"] for r in requests.values()} == {host}
        allowed = [f"{host}:{port}", f"127.0.0.1:{port}"]
        decode = Engine(
            "g4tiny", "per_layer", "kv_consumer", pick_free_port(),
            {"allowed_prefills": allowed, "handshake_timeout_s": 5}, failure_policy="recompute",
        )  # fmt: skip
        relayed = dict(requests["p1"])
        relayed["kv_transfer_params"] = {
            **relayed["kv_transfer_params"],
            "remote_host": "127.0.0.1",
        }
        refused = decode_requests(decode, {"p1": relayed}, 200)["d1"]
        assert "misaddressed" in refused["kv_transfer_params"]["kv_load_error"], refused
        assert decode.loaded.pop("d1", ["not loaded"])  # nothing of prefill's KV in place
        decode.outputs.pop("d1")
        report = decode_requests(decode, requests, 200)
        assert decode.loaded == {"d0": [], "d1": []}  # every layer-block prefill's
        assert all(r["kv_transfer_params"] is None for r in report.values())
        assert child.wait_json(RESULT, 60)["held"] == []
    finally:
        if decode is not None:
            decode.close()
        child.kill()


def test_the_parser_names_the_variables_the_connector_reads():
    """``roles`` names them itself, so that building kvshare's parser imports no transfer
    code: they must be the connector's."""
    assert roles.SECRET_ENV == SECRET_ENV
    assert roles.ADVERTISE_ENV == addresses.ADVERTISE_ENV
