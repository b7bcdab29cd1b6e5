"""``kv_connector_extra_config`` parsed once into ``ConnectorOptions``: defaults, environment
variables, strict types naming the option, unknown keys warned about."""

from __future__ import annotations

import dataclasses
import logging
import sys

import pytest

from kvshare_connector.backends.options import ConnectorOptions, OptionError


def test_defaults():
    o = ConnectorOptions.parse(None, environ={})
    assert o.backend == "nixl" and o.kv_lease_duration == 30.0 and o.verify_kv is None
    assert o.verifies  # verify_kv is on unless turned off
    assert o.staging_bytes == 512 << 20 and o.lane_probe_bytes == 8 << 20
    assert o.secret is None and o.allowed_prefills is None and o.ucx_lane == "auto"
    assert o.nixl_progress_thread is True and o.cross_layer_blocks is None
    assert o.nixl_progress_poll_ms == 1.0  # the thread sleeps on UCX's events


def test_every_option_is_read_from_the_extra_config():
    extra = {
        "backend": "lmcache", "kv_lease_duration": "12.5", "handshake_timeout_s": 3,
        "transfer_timeout_s": 9, "cross_layer_blocks": "false", "staging_mib": 0,
        "verify_kv": True, "side_channel_secret": "s3cret", "side_channel_insecure": "1",
        "allowed_prefills": ["10.0.0.1", "10.0.0.2:5600"], "ucx_lane": "off",
        "lane_probe_mib": 0.5, "nixl_progress_thread": False, "read_log": "/tmp/reads.jsonl",
        "lmcache": {"remote_url": "lm://h:1"}, "switch_interval_ms": "0.5",
        "layer_nudge_ms": 0, "nixl_progress_poll_ms": "0", "advertise_host": "10.0.0.9",
    }  # fmt: skip
    o = ConnectorOptions.parse(extra, environ={})
    assert o.switch_interval_ms == 0.5 and o.layer_nudge_ms == 0
    assert o.nixl_progress_poll_ms == 0.0 and o.advertise_host == "10.0.0.9"
    assert set(extra) == {f.name for f in dataclasses.fields(ConnectorOptions)}
    assert o.kv_lease_duration == 12.5 and o.cross_layer_blocks is False
    assert o.staging_bytes == 0 and o.verify_kv and o.secret == b"s3cret"
    assert o.side_channel_insecure and o.allowed_prefills == ("10.0.0.1", "10.0.0.2:5600")
    assert o.ucx_lane == "off" and o.lane_probe_bytes == 1 << 19
    assert not o.nixl_progress_thread and o.read_log == "/tmp/reads.jsonl"
    assert o.lmcache == {"remote_url": "lm://h:1"} and o.backend == "lmcache"


def test_environment_variables_and_the_extra_config_wins():
    environ = {
        "KVSHARE_SIDE_CHANNEL_SECRET": "from-env", "KVSHARE_SIDE_CHANNEL_INSECURE": "1",
        "KVSHARE_NIXL_PROGRESS_THREAD": "0", "KVSHARE_UCX_LANE": "off",
        "KVSHARE_NIXL_PROGRESS_POLL_MS": "5",
    }  # fmt: skip
    o = ConnectorOptions.parse({}, environ=environ)
    assert o.secret == b"from-env" and o.side_channel_insecure
    assert o.nixl_progress_poll_ms == 5.0
    assert not o.nixl_progress_thread and o.ucx_lane == "off"
    o = ConnectorOptions.parse({"side_channel_secret": "mine", "ucx_lane": "auto"}, environ)
    assert o.secret == b"mine" and o.ucx_lane == "auto"


def test_prefill_shortens_the_switch_interval_but_never_lengthens_it(monkeypatch):
    """The nixl backend's ``switch_interval_ms`` (bench_claim_latency: a claim's hops wait
    up to Python's 5 ms each for the GIL behind a busy engine thread)."""
    from kvshare_connector.backends.nixl import _shorten_switch_interval

    monkeypatch.setattr(sys, "setswitchinterval", lambda s: set_to.append(s))
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)
    set_to: list[float] = []
    _shorten_switch_interval(1.0)
    _shorten_switch_interval(0.0)  # 0: Python's, left
    _shorten_switch_interval(20.0)  # longer than it is: left
    assert set_to == [0.001]
    assert ConnectorOptions.parse({}, environ={}).switch_interval_ms == 1.0
    with pytest.raises(OptionError, match="switch_interval_ms must be 0 or more"):
        ConnectorOptions.parse({"switch_interval_ms": -1}, environ={})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"verify_kv": "yes please"}, "kv_connector_extra_config.verify_kv must be true or false"),
        ({"kv_lease_duration": 0}, "kv_lease_duration must be greater than 0"),
        ({"handshake_timeout_s": "soon"}, "handshake_timeout_s must be a number"),
        ({"staging_mib": -1}, "staging_mib must be 0 or more"),
        ({"transfer_timeout_s": float("nan")}, "transfer_timeout_s must be greater than 0"),
        ({"ucx_lane": "fast"}, "ucx_lane must be one of ('auto', 'off')"),
        ({"allowed_prefills": [""]}, "allowed_prefills.0. '': empty"),
        ({"allowed_prefills": 5}, "allowed_prefills must be a list"),
        ({"lmcache": "lm://h:1"}, "lmcache must be an object"),
        ({"read_log": 3}, "read_log must be a string"),
        ({"backend": 1}, "backend must be a backend name"),
        ({"nixl_progress_poll_ms": -2}, "nixl_progress_poll_ms must be 0 or more"),
    ],
)
def test_a_wrong_value_names_the_option(extra, message):
    with pytest.raises(OptionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConnectorOptions.parse(extra, environ={})


def test_a_wrong_environment_value_names_the_variable():
    with pytest.raises(OptionError, match="KVSHARE_NIXL_PROGRESS_THREAD must be true or false"):
        ConnectorOptions.parse({}, environ={"KVSHARE_NIXL_PROGRESS_THREAD": "maybe"})


def test_an_unknown_key_is_warned_about_with_a_guess(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvshare"):
        o = ConnectorOptions.parse({"verify_kvv": True, "backends": ["UCX"]}, environ={})
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "unknown option 'verify_kvv' ignored (did you mean 'verify_kv'?)" in text
    assert "unknown option 'backends' ignored (did you mean 'backend'?)" in text
    assert o == ConnectorOptions()


def test_the_option_table_covers_every_field():
    rows = ConnectorOptions().table()
    assert [r[0] for r in rows] == [f.name for f in dataclasses.fields(ConnectorOptions)]
    assert all(help_text for *_, help_text in rows)
    assert ("kv_lease_duration", "30", "", rows[1][3]) == rows[1]
    assert rows[[r[0] for r in rows].index("side_channel_secret")][2] == (
        "KVSHARE_SIDE_CHANNEL_SECRET"
    )


# Issue 46 item 10: on ff795fd each of these was accepted (stripped, or kept as a string
# that never matches), or, for ``[]``, taken for "no allow-list": every prefill allowed.
@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["10.0.0.9\n"], "allowed_prefills[0] '10.0.0.9\\n': empty, or holds spaces or control"),
        (["ok:5600", " 10.0.0.9"], "allowed_prefills[1] ' 10.0.0.9': empty, or holds spaces"),
        (["10.0.0.9:5600\n"], "allowed_prefills[0] '10.0.0.9:5600\\n': empty, or holds"),
        (["0.0.0.0"], "'0.0.0.0': host '0.0.0.0': the unspecified address"),
        (["[::]:5600"], "'[::]:5600': host '::': the unspecified address"),
        (["256.1.1.1:5600"], "host '256.1.1.1': not an IP address, and a host name's last"),
        (["999999"], "host '999999': not an IP address, yet resolvers read it as 0.15.66.63"),
        (["0x7f000001:5600"], "host '0x7f000001': not an IP address, yet resolvers read it as"),
        (["*"], "host '*': not a host name or IP address"),
        (["10.0.0.9:99999"], "'10.0.0.9:99999': port 99999 not in [1, 65535]"),
        (["10.0.0.9:0"], "'10.0.0.9:0': port 0 not in [1, 65535]"),
        (["10.0.0.9:5601-5600"], "ports 5601-5600 not a span within [1, 65535]"),
        (["10.0.0.9:http"], "port 'http' is not a number or first-last"),
        (["tcp://10.0.0.9:5600"], "allowed_prefills[0] 'tcp://10.0.0.9:5600'"),
        (["[prefill]:5600"], "brackets hold an IPv6 address only"),
        ([], "allowed_prefills must be a list of host:port, host:first-last or host strings"),
        ([5600], "allowed_prefills[0] 5600: not a string"),
    ],
)
def test_an_allow_list_entry_that_is_not_one_is_refused_by_name(entries, message):
    with pytest.raises(OptionError) as caught:
        ConnectorOptions.parse({"allowed_prefills": entries}, environ={})
    assert message in str(caught.value)
    assert str(caught.value).startswith("kv_connector_extra_config.allowed_prefills")


def test_allow_list_entries_are_kept_as_written():
    entries = ["prefill-0.pd.svc:5600", "[::1]:5600-5601", "::1", "127.0.0.1:5600", "LocalHost"]
    o = ConnectorOptions.parse({"allowed_prefills": entries}, environ={})
    assert o.allowed_prefills == tuple(entries)


def test_an_entry_without_a_port_is_warned_about_once(caplog, monkeypatch):
    from kvshare_connector.backends import options

    monkeypatch.setattr(options, "_WARNED_EVERY_PORT", set())
    with caplog.at_level(logging.WARNING, logger="vllm.kvshare"):
        for _ in range(2):
            ConnectorOptions.parse({"allowed_prefills": ["10.9.8.7", "10.9.8.6:5600"]}, {})
    (record,) = [r for r in caplog.records if "allowed_prefills" in r.getMessage()]
    text = record.getMessage()
    assert "allowed_prefills[0] '10.9.8.7' has no port: decode may connect to every port" in text
    assert "write 10.9.8.7:PORT (that port and the 63 after it" in text
