"""kvferry inside vLLM: `KvferryConnector`, a V1 KV connector (docs/vllm.md).

Load it with ``--kv-transfer-config '{"kv_connector": "KvferryConnector",
"kv_connector_module_path": "kvferry.vllm", "kv_role": "kv_producer"}'`` (``kv_consumer`` on
the decode server), or by name once the ``vllm.general_plugins`` entry point registered it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvferryConnector", "register"]


def _need_vllm() -> None:
    """The one line a missing vLLM gets. The connector's worker data path (the prefill and
    decode workers, the rendezvous, the scheduler half's logic) imports without vLLM, so it
    can be driven where vLLM cannot be installed; the connector itself cannot."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ImportError(f"kvferry.vllm needs vLLM: pip install 'kvferry[vllm]' ({err})") from None


def __getattr__(name: str) -> Any:
    # Lazy: vLLM loads the plugin entry point (`register`) early in every process, before it
    # is ready for a connector module to import its kv_transfer internals.
    if name == "KvferryConnector":
        _need_vllm()
        from kvferry.vllm.connector import KvferryConnector

        return KvferryConnector
    raise AttributeError(f"module 'kvferry.vllm' has no attribute {name!r}")


CONNECTOR_NAME = "KvferryConnector"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the connector by name. vLLM's
    factory raises on a duplicate name, and plugins load once per process and again in
    each worker, so a name already taken is left as it is."""
    _need_vllm()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvferry.vllm.connector", "KvferryConnector")
