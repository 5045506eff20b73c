"""Message queries by MQTT topic and time: paho-mqtt publishes, the management API
(`GET /api/messages/by-topic/{vhost}?topic=T&from=MS&to=MS`) finds the stored
messages through the store's IndexFile, newest first, in the time range. Triad only
(RocketMQ's queryMsgByKey); the broker is started with `mqtt.index_topics = true`."""

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from helpers import Mqtt


def query(broker, topic, **params):
    host, port = broker.host_port("http")
    q = urllib.parse.urlencode({"topic": topic, **params})
    req = urllib.request.Request(
        f"http://{host}:{port}/api/messages/by-topic/%2F?{q}",
        headers={"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def test_paho_publishes_are_found_by_topic_and_time(configured_broker, uid):
    # indexing MQTT publishes by topic is off by default (its cost per message)
    broker = configured_broker("[mqtt]\nindex_topics = true\n")
    sub = Mqtt(broker, client_id=f"qs-{uid}")
    pub = Mqtt(broker, client_id=f"qp-{uid}")
    try:
        # a subscriber: the publishes are routed, so stored
        sub.subscribe(f"meter/{uid}/#", qos=1)
        pub.publish(f"meter/{uid}/a", b"a-1", qos=1)
        pub.publish(f"meter/{uid}/b", b"b-1", qos=1)
        mark = int(time.time() * 1000)
        while int(time.time() * 1000) <= mark:
            time.sleep(0.001)
        pub.publish(f"meter/{uid}/a", b"a-2", qos=1)
        assert len(sub.take(3)) == 3
        found = query(broker, f"meter/{uid}/a")
        assert [m["payload"] for m in found] == ["a-2", "a-1"]
        assert found[0]["exchange"] == "amq.topic"
        assert found[0]["routing_key"] == f"meter.{uid}.a"
        assert [m["payload"] for m in query(broker, f"meter/{uid}/a", to=mark)] == ["a-1"]
        assert [m["payload"] for m in query(broker, f"meter/{uid}/a", **{"from": mark + 1})] == ["a-2"]
        assert [m["payload"] for m in query(broker, f"meter/{uid}/b")] == ["b-1"]
        assert query(broker, f"meter/{uid}/c") == []
        with pytest.raises(urllib.error.HTTPError) as e:
            query(broker, f"meter/{uid}/+")
        assert e.value.code == 400
    finally:
        pub.close()
        sub.close()
