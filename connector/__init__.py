"""kvtrace.connector: vLLM's NIXL push and pull connectors, traced per request.

Enable with one change to vLLM's ``--kv-transfer-config``::

    {"kv_connector": "NixlPushConnector", "kv_connector_module_path": "kvtrace.connector",
     "kv_role": "kv_producer", "kv_connector_extra_config": {"kvtrace": {...}}}

The classes keep vLLM's names (``NixlPushConnector``, ``NixlPullConnector``,
``NixlConnector``) so vLLM's name-based config checks still apply; ``Traced*`` aliases
exist for code that wants to be explicit. Importing this module checks that vLLM's
connector factory picks these classes over its own registry for that config, and says so
loudly if it would not.
"""

import logging
from types import SimpleNamespace

from .receipt import RequestReceipt
from .traced import (
    NixlConnector,
    NixlPullConnector,
    NixlPushConnector,
    TracedNixlConnector,
    TracedNixlPullConnector,
    TracedNixlPushConnector,
)

__all__ = [
    "NixlConnector", "NixlPullConnector", "NixlPushConnector",
    "TracedNixlConnector", "TracedNixlPullConnector", "TracedNixlPushConnector",
    "factory_picks_kvtrace", "RequestReceipt",
]

logger = logging.getLogger(__name__)


def factory_picks_kvtrace() -> bool:
    """Whether vLLM's factory loads our class for ``kv_connector_module_path=kvtrace.connector``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for cls in (NixlPushConnector, NixlPullConnector):
        config = SimpleNamespace(kv_connector=cls.__name__, kv_connector_module_path=__name__)
        if KVConnectorFactory.get_connector_class(config) is not cls:
            return False
    return True


if not factory_picks_kvtrace():
    logger.error(
        "kvtrace: this vLLM's connector factory prefers its own registry over "
        "kv_connector_module_path, so 'NixlPushConnector'/'NixlPullConnector' would load vLLM's "
        "untraced classes. Use kv_connector 'TracedNixlPushConnector'/'TracedNixlPullConnector'.")
