"""What decode's ``allowed_prefills`` admits (issue 46, item 10): a ``host:port`` entry
admits that prefill's side channels, its TP ranks' included; ``host:first-last`` exactly
those ports; ``host`` every port. Hosts are compared as written, never resolved.

A TP prefill of base port P serves rank r on P + r, and decode learns prefill's TP size
from the request's kv_transfer_params alone (up to 64 ranks), so ``host:P`` admits P to
P + 63: what the params could name for that prefill anyway. Through the connector, a
TP2 prefill admitted by ``127.0.0.1:P`` is read in ``test_ucx_reach.py``.
"""

from __future__ import annotations

import pytest

from kvshare_connector.transfer.wire import settings as engine_settings
from kvshare_connector.transfer.wire.settings import EngineSettings


def allows(entries: list[str], host: str, port: int) -> bool:
    return EngineSettings("decode", allowed_prefills=frozenset(entries)).allows(host, port)


def test_host_and_port_admits_that_prefill_and_its_tp_ranks_only():
    """On ff795fd, ``10.0.0.5:5600`` refused rank 1 of a TP2 prefill (5601)."""
    entry = ["10.0.0.5:5600"]
    assert allows(entry, "10.0.0.5", 5600) and allows(entry, "10.0.0.5", 5601)
    assert allows(entry, "10.0.0.5", 5663)  # rank 63, the last kv_transfer_params may state
    assert not allows(entry, "10.0.0.5", 5664) and not allows(entry, "10.0.0.5", 5599)
    assert not allows(entry, "10.0.0.6", 5600)
    assert engine_settings.AllowedPrefill.parse("h:65500").ports == (
        65500,
        65535,
    )  # clipped at the last port


def test_a_port_span_admits_exactly_its_ports():
    entry = ["127.0.0.1:5600-5601"]
    assert allows(entry, "127.0.0.1", 5600) and allows(entry, "127.0.0.1", 5601)
    assert not allows(entry, "127.0.0.1", 5602)
    assert allows(["127.0.0.1:5600-5600"], "127.0.0.1", 5600)
    assert not allows(["127.0.0.1:5600-5600"], "127.0.0.1", 5601)


def test_a_host_alone_admits_every_port_of_it():
    """Kept (``kvshare serve-pd`` and existing configs write it), warned about at start
    (``test_options.py``)."""
    assert allows(["10.0.0.5"], "10.0.0.5", 1) and allows(["10.0.0.5"], "10.0.0.5", 65535)
    assert not allows(["10.0.0.5"], "10.0.0.50", 5600)
    assert engine_settings.AllowedPrefill.parse("10.0.0.5").every_port


def test_hosts_are_compared_as_written_never_resolved():
    """``localhost`` does not admit ``127.0.0.1`` (nor the reverse): a name resolved at the
    check and again at the connection could point elsewhere the second time. Names compare
    without case or a final dot; addresses in canonical form, IPv6 with or without
    brackets."""
    assert not allows(["localhost:5600"], "127.0.0.1", 5600)
    assert not allows(["127.0.0.1:5600"], "localhost", 5600)
    assert allows(["LocalHost.:5600"], "localhost", 5600)
    assert allows(["prefill-0.pd.svc:5600"], "PREFILL-0.pd.svc.", 5600)
    assert allows(["[0:0:0:0:0:0:0:1]:5600"], "::1", 5600)
    assert allows(["::1"], "0::1", 7) and allows(["[::1]"], "::1", 7)
    assert not allows(["::1"], "::ffff:127.0.0.1", 7)  # another address, though loopback


def test_no_allow_list_admits_any_and_a_bad_entry_never_admits_silently():
    assert EngineSettings("decode").allows("192.0.2.9", 1)
    assert EngineSettings("decode").allowed_hosts() is None
    settings = EngineSettings("decode", allowed_prefills=frozenset({"b:1", "a", "B:2"}))
    assert settings.allowed_hosts() == ("a", "b")  # what UCX's reach is judged by
    with pytest.raises(ValueError, match="'10.0.0.9:5600\\\\n': empty, or holds spaces"):
        EngineSettings("decode", allowed_prefills=frozenset({"10.0.0.9:5600\n"}))
