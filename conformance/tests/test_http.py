"""The HTTP listener answers health probes the way monitoring tools expect."""

import json
import urllib.error
import urllib.request


def test_health_is_ok(broker):
    host, port = broker.host_port("http")
    with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/json")
        assert json.loads(r.read()) == {"status": "ok"}


def test_unknown_path_is_404(broker):
    host, port = broker.host_port("http")
    try:
        urllib.request.urlopen(f"http://{host}:{port}/nope", timeout=5)
    except urllib.error.HTTPError as e:
        assert e.code == 404
    else:
        raise AssertionError("expected 404")
