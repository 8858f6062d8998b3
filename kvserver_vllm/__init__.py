"""kvserver for vLLM: the ``KVServerConnector`` plug-in (``kvserver_vllm.connector``).

Runs inside vLLM's scheduler and worker processes; the only part of the project that imports
vLLM, which stays an optional dependency (docs/vllm.md: install and command line).
"""

#: the value of ``kv_connector_module_path`` in vLLM's ``--kv-transfer-config``.
CONNECTOR_MODULE = "kvserver_vllm.connector"
CONNECTOR_NAME = "KVServerConnector"
