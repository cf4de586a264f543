"""`pdserve edge --metrics-port`: /metrics moves to a port of its own (the one a
NetworkPolicy opens to the monitoring namespace alone) and leaves the API's port."""
from __future__ import annotations

import urllib.request

from support import Proc, free_port, http_status, pdserve_cmd, wait_http


def test_metrics_port_serves_metrics_alone_and_the_api_port_no_longer_does(model_dir):
    port, metrics_port = free_port(), free_port()
    # No router answers there: the edge serves its API and metrics all the same.
    edge = Proc(pdserve_cmd("edge", "--port", str(port), "--grpc-port", str(free_port()),
                            "--metrics-port", str(metrics_port), "--router",
                            f"127.0.0.1:{free_port()}", "--model", str(model_dir)), name="edge")
    try:
        scrape = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_http(scrape, edge, 60)
        with urllib.request.urlopen(scrape, timeout=5) as r:
            body = r.read().decode()
        assert "pdserve:num_requests_running" in body
        assert http_status(f"http://127.0.0.1:{port}/v1/models") == 200
        assert http_status(f"http://127.0.0.1:{port}/metrics") == 404
        assert http_status(f"http://127.0.0.1:{metrics_port}/v1/models") == 404
    finally:
        edge.stop(timeout=20)
