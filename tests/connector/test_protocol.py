"""The worker → scheduler report, as vLLM's KVOutputAggregator merges it across TP ranks."""

import pickle

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvtrace.connector.protocol import WorkerReport


def test_ranks_merge_a_request_is_ready_when_its_last_rank_is():
    rank0 = WorkerReport(ready_ns={"a": 100, "b": 50}, loop_ns={"a": 7}, expired={"x"})
    rank1 = WorkerReport(ready_ns={"a": 180}, loop_ns={"a": 3, "c": 1}, expired={"y"})
    merged = pickle.loads(pickle.dumps(rank0)).aggregate(pickle.loads(pickle.dumps(rank1)))
    assert merged.ready_ns == {"a": 180, "b": 50}
    assert merged.loop_ns == {"a": 10, "c": 1}
    assert merged.expired == {"x", "y"}
    assert not WorkerReport() and merged


def test_vllms_aggregator_delivers_the_merged_report():
    aggregator = KVOutputAggregator(expected_finished_count=2)
    outputs = []
    for rank, ready in enumerate((100, 180)):
        output = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        output.kv_connector_output = KVConnectorOutput(
            finished_recving={"a"}, kv_connector_worker_meta=WorkerReport(ready_ns={"a": ready}))
        outputs.append(output)
    merged = aggregator.aggregate(outputs).kv_connector_output
    assert merged.finished_recving == {"a"}  # both ranks reported
    assert merged.kv_connector_worker_meta.ready_ns == {"a": 180}
