"""kvtrace.connector: traced drop-in versions of vLLM's NIXL push and pull connectors.

Not yet built (issue 3). Loading this module as ``kv_connector_module_path`` today fails
loudly at vLLM start-up ("Class NixlPushConnector not found in kvtrace.connector"), never
silently untraced.
"""
