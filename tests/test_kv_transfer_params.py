"""``kv_transfer_params`` as decode parses them: every malformed field is named."""

import pytest

from kvshare_connector.transfer.wire import kv_params

# ---- kv_transfer_params ---------------------------------------------------------------

DELETE = object()
GOOD_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2], [3]],
    "remote_engine_id": "prefill-0",
    "remote_request_id": "req-0",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "remote_num_tokens": 20,
}


def test_good_kv_transfer_params_parse():
    parsed = kv_params.remote_prefill_params(dict(GOOD_PARAMS, extra_field_of_a_proxy="ignored"))
    assert parsed.remote_block_ids == [[1, 2], [3]]
    assert parsed.remote_port == 5600
    for host in ("localhost", "prefill-0.pd.svc.cluster.local", "10.1.2.3", "::1", "fe80::1"):
        assert kv_params.remote_prefill_params(dict(GOOD_PARAMS, remote_host=host))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"remote_block_ids": None}, "remote_block_ids"),
        ({"remote_block_ids": [1, 2]}, "$.remote_block_ids[0]"),
        ({"remote_block_ids": [[1, "2"]]}, "$.remote_block_ids[0][1]"),
        ({"remote_block_ids": [[1, -2]]}, "remote_block_ids"),
        ({"remote_port": "5600"}, "$.remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_engine_id": None}, "$.remote_engine_id"),
        ({"do_remote_prefill": "yes"}, "$.do_remote_prefill"),
        ({"tp_size": 0}, "tp_size"),  # TP > 1 is served (issue 16); 0 is not a TP size
        ({"remote_host": DELETE}, "remote_host"),
        # What decode would otherwise connect to, or trip over later (issue 22).
        ({"remote_host": " "}, "$.remote_host"),
        ({"remote_host": "*"}, "$.remote_host"),
        ({"remote_host": "tcp://10.0.0.1:5600"}, "$.remote_host"),
        ({"remote_host": "host\nname"}, "$.remote_host"),
        ({"remote_host": "a" * 100_000}, "$.remote_host"),
        ({"remote_engine_id": "x" * (1 << 20)}, "$.remote_engine_id"),
        ({"remote_request_id": ""}, "$.remote_request_id"),
        ({"remote_request_id": "req 0\r\n"}, "$.remote_request_id"),
        ({"remote_num_tokens": -5}, "$.remote_num_tokens"),
        ({"remote_prompt_tokens": 1 << 40}, "$.remote_prompt_tokens"),
        ({"remote_prompt_digest": "not-hex"}, "$.remote_prompt_digest"),
        ({"remote_block_ids": [list(range(1, 140_000))]}, "$.remote_block_ids"),
    ],
)
def test_malformed_kv_transfer_params_name_the_field(change, field):
    params = dict(GOOD_PARAMS)
    for key, value in change.items():
        if value is DELETE:
            del params[key]
        else:
            params[key] = value
    with pytest.raises(kv_params.KVTransferParamsError) as caught:
        kv_params.remote_prefill_params(params)
    assert field in str(caught.value)


# Issue 46 item 10: each of these passed the check on ff795fd.
@pytest.mark.parametrize(
    ("change", "field", "why"),
    [
        # ``$`` matched before a final newline
        ({"remote_host": "10.0.0.9\n"}, "$.remote_host", "control characters"),
        ({"remote_host": "prefill-0\n"}, "$.remote_host", "control characters"),
        ({"remote_engine_id": "prefill-0\n"}, "$.remote_engine_id", "control characters"),
        ({"remote_request_id": "req-0\n"}, "$.remote_request_id", "control characters"),
        ({"remote_prompt_digest": "ab" * 32 + "\n"}, "$.remote_prompt_digest", "SHA-256"),
        # not one host
        ({"remote_host": "0.0.0.0"}, "$.remote_host", "unspecified address"),
        ({"remote_host": "::"}, "$.remote_host", "unspecified address"),
        ({"remote_host": "224.0.0.1"}, "$.remote_host", "multicast"),
        ({"remote_host": "fe80::1%eth0\n"}, "$.remote_host", "control characters"),
        ({"remote_host": "fe80::1%eth0"}, "$.remote_host", "scoped IPv6"),
        # neither an address nor a host name, yet numbers to a resolver
        ({"remote_host": "256.1.1.1"}, "$.remote_host", "last label is never all digits"),
        ({"remote_host": "999999"}, "$.remote_host", "resolvers read it as 0.15.66.63"),
        ({"remote_host": "0x7f000001"}, "$.remote_host", "resolvers read it as 127.0.0.1"),
        ({"remote_host": "010.0.0.1"}, "$.remote_host", "resolvers read it as 8.0.0.1"),
        # beyond vLLM's int32 block tables
        ({"remote_block_ids": [[1], [2, 1 << 64]]}, "$.remote_block_ids[1]", "int32"),
        ({"remote_block_ids": [[1 << 31]]}, "$.remote_block_ids[0]", "int32"),
    ],
)
def test_what_ff795fd_accepted_is_refused_by_name(change, field, why):
    with pytest.raises(kv_params.KVTransferParamsError) as caught:
        kv_params.remote_prefill_params(dict(GOOD_PARAMS, **change))
    assert field in str(caught.value) and why in str(caught.value)


def test_the_edges_of_what_is_accepted():
    """The largest int32 block id, a name with a final dot, a name that starts with a
    digit, and an IPv6 address in full form are a prefill's own (not refused)."""
    assert kv_params.remote_prefill_params(dict(GOOD_PARAMS, remote_block_ids=[[(1 << 31) - 1]]))
    for host in ("prefill-0.", "1prefill", "0:0:0:0:0:0:0:1", "a1.example.com"):
        assert kv_params.remote_prefill_params(dict(GOOD_PARAMS, remote_host=host))


def test_kv_transfer_params_that_are_not_an_object():
    with pytest.raises(kv_params.KVTransferParamsError, match="must be an object, got list"):
        kv_params.remote_prefill_params([GOOD_PARAMS])
