"""Run inside a private network namespace (``unshare --net``, loopback up): Phoenix, whose gRPC
port binds every interface, and a kvtrace collector forwarding to it. Sends contract traces
to the collector, reads the spans back from Phoenix's REST API (the engines' spans and the
collector's ``kvtrace.breakdown`` span per trace), prints one JSON line with the store's
breakdown rows beside them.

Usage: python phoenix_roundtrip.py PHOENIX_PYTHON WORK_DIR
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtrace.collectors.model import SpanBatch  # noqa: E402
from kvtrace.collectors.config import CollectorConfig  # noqa: E402
from kvtrace.collectors.service import Collector  # noqa: E402
from tests.collectors.forwarding import store_breakdowns  # noqa: E402
from tests.collectors.traces import build  # noqa: E402

HTTP_PORT, GRPC_PORT = 6006, 4317


def main() -> int:
    phoenix_python, work = sys.argv[1], Path(sys.argv[2])
    env = {**os.environ, "PHOENIX_PORT": str(HTTP_PORT), "PHOENIX_GRPC_PORT": str(GRPC_PORT),
           "PHOENIX_HOST": "127.0.0.1", "PHOENIX_WORKING_DIR": str(work / "phoenix"),
           "PHOENIX_TELEMETRY_ENABLED": "false", "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false"}
    log = open(work / "phoenix.log", "wb")
    phoenix = subprocess.Popen([phoenix_python, "-m", "phoenix.server.main", "serve"], env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    collector = None
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{HTTP_PORT}/healthz", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if phoenix.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("phoenix did not start: " + (work / "phoenix.log").read_text()[-3000:])
            time.sleep(0.5)

        collector = Collector(CollectorConfig(db_path=str(work / "kv.duckdb"), grpc_port=0, http_port=0,
                                              decision_wait_s=0.2, forward=[f"grpc://127.0.0.1:{GRPC_PORT}"]))
        collector.start()
        builts = [build("push", "registration_first"), build("push", "kv_first"), build("pull")]
        sent = {}
        for built in builts:
            for request in built.requests:
                collector.consume(SpanBatch.of(request))
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            attrs = {a.key: a.value.WhichOneof("value") and getattr(a.value, a.value.WhichOneof("value"))
                                     for a in span.attributes}
                            sent[span.span_id.hex()] = {
                                "trace_id": span.trace_id.hex(), "name": span.name,
                                "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                                "parent": span.parent_span_id.hex(), "attributes": attrs}
        received = {}
        deadline = time.monotonic() + 60
        wanted = len(sent) + len(builts)  # and one breakdown span per trace
        while time.monotonic() < deadline and len(received) < wanted:
            time.sleep(1)
            response = requests.get(f"http://127.0.0.1:{HTTP_PORT}/v1/projects/default/spans/otlpv1",
                                    params={"limit": 1000}, timeout=10)
            if response.status_code != 200:
                continue
            for span in response.json().get("data", []):
                attrs = {}
                for a in span.get("attributes") or []:
                    kind, raw = next(((k, v) for k, v in a["value"].items() if v is not None), (None, None))
                    attrs[a["key"]] = int(raw) if kind == "int_value" else float(raw) if kind == "double_value" else raw
                received[span["span_id"]] = {
                    "trace_id": span["trace_id"], "name": span["name"],
                    "start": int(span["start_time_unix_nano"]), "end": int(span["end_time_unix_nano"]),
                    "parent": span.get("parent_span_id") or "", "attributes": attrs}
        forwarded = collector.upstreams[0].stats.forwarded_spans
        collector.store.flush()
        store = store_breakdowns(collector.store.query)
        print(json.dumps({"sent": sent, "received": received, "forwarded": forwarded, "store": store}))
        return 0
    finally:
        if collector is not None:
            collector.shutdown()
        os.killpg(phoenix.pid, signal.SIGTERM)
        try:
            phoenix.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(phoenix.pid, signal.SIGKILL)


if __name__ == "__main__":
    raise SystemExit(main())
