# Names vulture (tests/test_dead_code.py) cannot see used: each is called by a framework by name,
# or is part of an interface kvtrace mirrors or publishes. Never imported; vulture reads it.
# ruff: noqa
_ = object()

# http.server's handler protocol (collectors/httpserver.py)
_.daemon_threads, protocol_version, disable_nagle_algorithm, _.log_message, _.do_GET, _.do_POST
_.close_connection

# html.parser's callbacks (the KPI tiles' reader in tests/dashboard/test_app.py)
_.handle_starttag, _.handle_endtag, _.handle_data

# Wrappers installed by name: ``_wrap<method>`` wraps the vLLM worker's or scheduler's ``<method>``
# (``getattr(self, f"_wrap{name}")`` in connector/worker_tracing.py; push_rendezvous.py is its mixin)
_._wrap_send_registration_to_p, _._wrap_do_send_reg_notif, _._wrap_handle_push_reg_notif
_._wrap_pop_matching_finished_blocks, _._wrap_pop_matching_registration
_._wrap_read_blocks_for_req, _._wrap_do_start_push_kv, _._wrap_xfer_blocks_for_req
_._wrap_ensure_handshake, _._wrap_reap_expired_send_leases

# vLLM's KVConnectorBase_V1 hook (connector/traced.py)
_.build_prom_metrics

# The in-process stand-ins keep the signatures and fields of the NIXL agent and vLLM objects they
# replace (kvtrace/testbed/inproc.py)
local_ids, remote_ids, backends, _.send_notif, _.remove_remote_agent, _.deregister_memory, descs
_.kv_cache_layout, _.transfer_topo, remote_tp_size, remote_block_size

# tokenizers' and transformers' fields, set for the files they save (kvtrace/testbed/recipes.py)
_.pre_tokenizer, _.decoder, _.chat_template

# The published contract (docs/CONTRACT.md): names senders may use that kvtrace itself does not read
ATTR_REMOTE_ENGINE_ID, RETRIED

# pytest hooks and autouse fixtures, fixtures asked for by name (request.getfixturevalue: started only for
# the parameters that need them); fields of vLLM objects the tests fake
_reset_process_recorder, pytest_runtest_logreport, pytest_sessionfinish, tp_size, clickhouse_cluster
_.reqs_in_batch, _.reqs_to_send, _.push_finished_blocks, _.num_computed_tokens, _._push_registration_timeout

# Breakdown fields the store reads by name (collectors/store.py NUMBER_COLUMNS, read by _otlp.number_columns)
_.engine_loop_ns, _.transfer_descriptors, _.transfer_post_us, _.transfer_xfer_us, _.e2e_ns, _.block_count
_.kv_hold_ns
