"""vLLM general-plugin hook: makes ``"kv_connector": "KVShareConnector"`` resolvable by name."""

from kvshare_connector import CONNECTOR_NAME


def register() -> None:
    """Register the connector with vLLM's factory (idempotent: vLLM may load plugins twice)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "kvshare_connector.connector", CONNECTOR_NAME
    )
