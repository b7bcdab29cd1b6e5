"""Decode's claims: ask prefill to keep a request's blocks for this one reader, and read
its answer as a ``Grant``, a retry ("not held yet") or the error that ends the read.

A step's reads from one prefill are claimed in one message (``reads.claim_batches``): with
one ask per request they queued on the prefill's two ask threads, and the last of sixteen
concurrent requests waited for fifteen round trips before its READ. The message goes over
the peer's ``Pipe`` from the engine thread and its answer is picked up at the next step
boundary: through a helper thread, a claim waited for the GIL at every hop.
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError, Future

from kvshare_connector.layout.verification import VerificationError, remote_ids_of
from kvshare_connector.transfer.decode.peers import HandshakeError, Peers
from kvshare_connector.transfer.decode.reads import Grant, Read, ReadOrder, claim_batches
from kvshare_connector.transfer.device.nixl import TransportError
from kvshare_connector.transfer.wire import kv_params, protocol
from kvshare_connector.transfer.wire.settings import EngineSettings
from kvshare_connector.transfer.wire.side_channel import SideChannelError
from kvshare_connector.transfer.wire.side_channel_client import retryable

NOT_HELD_RETRY_S = 0.01  # "not held yet": ask again this much later


class PeerDown(HandshakeError):
    """Prefill did not answer a claim (dead, or unreachable)."""


class ClaimRefused(HandshakeError):
    """Prefill refused this decode's claim (another reader, or blocks it does not hold)."""


class Claims:
    """Collects the reads that need a claim during one ``KVSink.advance``, asks for them
    (``send``), and turns each answer into the read's ``Grant`` (``grant``)."""

    def __init__(self, peers: Peers, settings: EngineSettings, packed: bool):
        self.peers = peers
        self.settings = settings
        self.packed = packed  # this reader can take packed requests
        self._due: list[Read] = []
        groups = peers.topology.groups
        self._owners = [  # owner layers per group: each has a digest per block in a reply
            sum(1 for o in peers.topology.owners.values() if o.group == g)
            for g in range(len(groups))
        ]

    def grant(self, read: Read) -> Grant | None:
        """Prefill's grant once it confirmed it holds the blocks for this reader (and
        extended their lease); None while the answer is not in (or not asked yet).

        Prefill's scheduler hands a finished request to its worker one step after it
        returned the request's kv_transfer_params, so "not held yet" is retried until the
        handshake bound; "gone" (read or lease expired) fails the request before any read.
        """
        p = read.order.params
        if read.claim is None:
            if time.monotonic() >= read.next_claim:
                self._due.append(read)  # asked with the step's other claims (``send``)
            return None
        if not read.claim.done():
            return None
        future, read.claim = read.claim, None
        try:
            reply = future.result()
        except CancelledError:
            raise HandshakeError(
                f"prefill {p.remote_engine_id} was evicted before the claim of request "
                f"{p.remote_request_id} was answered"
            ) from None
        except PeerDown as exc:
            if not (retryable(exc.__cause__) and self._in_time(read)):
                raise
            read.next_claim = time.monotonic() + NOT_HELD_RETRY_S  # alive: ask again
            return None
        rid = p.remote_request_id
        if rid in reply.refused:
            raise ClaimRefused(
                f"prefill {p.remote_engine_id} refused the claim of request {rid}: "
                f"{reply.refused[rid]}"
            )
        if rid in reply.held:
            if read.plan is not None and read.plan.verify:
                _check_digested(p, reply.digests.get(rid))
            return Grant(reply.packed.get(rid), reply.digests.get(rid), reply.held_s.get(rid),
                         reply.answer_s)  # fmt: skip
        if rid in reply.gone:
            raise TransportError(
                f"prefill {p.remote_engine_id} no longer holds request {rid}'s blocks (read "
                "already, or its lease expired)"
            )
        if not self._in_time(read):
            raise HandshakeError(
                f"prefill {p.remote_engine_id} never held request {rid} within "
                f"{self.settings.handshake_timeout_s:g} s"
            )
        read.next_claim = time.monotonic() + NOT_HELD_RETRY_S
        return None

    def _in_time(self, read: Read) -> bool:
        return time.monotonic() - read.created <= self.settings.handshake_timeout_s

    def send(self) -> dict[str, Exception]:
        """Ask each prefill once for every read that became due since the last call;
        returns the reads whose claim could not even be sent (e.g. the peer was evicted)."""
        due, self._due = self._due, []
        failed: dict[str, Exception] = {}
        for batch in claim_batches(due):
            p = batch[0].order.params
            key = (p.remote_host, p.remote_port)
            pipe = self.peers.pipe(key)
            if pipe is None:
                exc = HandshakeError(f"prefill at {key[0]}:{key[1]} is not connected")
                failed.update((r.request_id, exc) for r in batch)
                continue
            verify = batch[0].plan is not None and batch[0].plan.verify
            claim = self._claim([r.order for r in batch], verify)
            for read in batch:  # before it leaves: the answer may be in before send returns
                read.claims += 1
                if "asked" not in read.marks:
                    read.mark("asked")
            bound = reply_bound([r.order for r in batch], self._owners, verify)
            future = _answer(pipe.send(protocol.encode(claim), bound), key, claim.request_ids)
            for read in batch:
                read.claim = future
        return failed

    def _claim(self, orders: list[ReadOrder], verify: bool) -> protocol.Claim:
        """One claim naming every order; ``verify``: ask for prefill's digests of them."""
        return protocol.Claim(
            protocol.PROTOCOL_VERSION,
            self.settings.engine_id,
            [o.params.remote_request_id for o in orders],
            self.settings.transfer_timeout_s + 5,
            tokens={o.params.remote_request_id: o.token for o in orders},
            block_ids={  # all that prefill holds for each, in the request's order
                o.params.remote_request_id: [
                    protocol.pack_ids(b) for b in o.params.remote_block_ids
                ]
                for o in orders
            },
            packed=self.packed,
            verify=verify,
            readers=orders[0].readers,
        )


REPLY_BASE_BYTES = 64 << 10  # a claim reply's framing and fields, beside its requests'
REPLY_REQUEST_BYTES = 4 << 10  # a request's id in the reply's lists, its refusal text
REPLY_LAYER_BYTES = 1 << 10  # a layer's name and framing in a request's digests


def reply_bound(orders: list[ReadOrder], owners: list[int], verify: bool) -> int:
    """The longest answer prefill can give a claim of ``orders``: what decode reads of one
    at most, so a peer announcing more is refused before any of it is read."""
    total = REPLY_BASE_BYTES
    for order in orders:
        total += REPLY_REQUEST_BYTES
        if verify:
            for group, ids in enumerate(order.params.remote_block_ids):
                n = sum(1 for b in ids if b)  # ids as msgpack ints (<= 9 B), digests 8 B each
                layers = owners[group] if group < len(owners) else max(owners, default=0)
                total += n * (9 + 8 * layers) + layers * REPLY_LAYER_BYTES
    return total


def _check_digested(p: kv_params.RemotePrefillParams, digests: protocol.KVDigests | None) -> None:
    """Prefill digested the blocks decode was told, in that order (``VerificationError``
    if not): a prefill that granted a reordered list has bypassed its own check."""
    rid = p.remote_request_id
    if digests is None:
        raise VerificationError(
            f"prefill {p.remote_engine_id} sent no KV digests for request {rid}: "
            "verify_kv must be on for prefill too"
        )
    told = [remote_ids_of(p.remote_block_ids, g) for g in range(len(p.remote_block_ids))]
    try:
        digested = [protocol.unpack_ids(ids).tolist() for ids in digests.block_ids]
    except protocol.ProtocolError:
        digested = []
    if digested != told:
        raise VerificationError(
            f"prefill {p.remote_engine_id} digested other blocks, or the same in another "
            f"order, than kv_transfer_params name for request {rid} (a reordered list?)"
        )


def _answer(
    raw: Future[bytes], key: tuple[str, int], ids: list[str]
) -> Future[protocol.ClaimReply]:
    """The claim's reply, decoded once for all the reads it names (settled by the pipe, on
    the engine thread)."""
    out: Future[protocol.ClaimReply] = Future()

    def settle(done: Future[bytes]) -> None:
        if done.cancelled():
            out.cancel()
            return
        try:
            out.set_result(_decode(done.result(), key, ids))
        except SideChannelError as exc:  # unanswered; ``__cause__`` says if worth a retry
            what = ids[0] if len(ids) == 1 else f"{len(ids)} requests ({ids[0]}, ...)"
            down = PeerDown(f"claiming {what} at {key[0]}:{key[1]}: {exc}")
            down.__cause__ = exc
            out.set_exception(down)
        except ClaimRefused as exc:
            out.set_exception(exc)

    raw.add_done_callback(settle)
    return out


def _decode(raw: bytes, key: tuple[str, int], ids: list[str]) -> protocol.ClaimReply:
    host, port = key
    try:
        reply = protocol.decode(raw)
    except protocol.ProtocolError as exc:
        raise ClaimRefused(
            f"prefill at {host}:{port} answered a claim with garbage: {exc}"
        ) from exc
    if isinstance(reply, protocol.ErrorReply):
        raise ClaimRefused(f"prefill at {host}:{port} refused the claim: {reply.message}")
    if not isinstance(reply, protocol.ClaimReply):
        raise ClaimRefused(f"prefill at {host}:{port} answered a claim with {reply}")
    return reply
