"""rabbitmqadmin (shipped with RabbitMQ, Debian package rabbitmq-server) against Triad's
management API: list, show, declare, publish, get, purge, delete, close, export and import
definitions, unchanged from how it is used against RabbitMQ."""

import json
import os
import shutil
import subprocess

import pika
import pytest

pytestmark = pytest.mark.skipif(
    not shutil.which("rabbitmqadmin"),
    reason="rabbitmqadmin not installed (Debian package rabbitmq-server; run.sh installs it "
    "when run as root)",
)


def admin(broker, *args, user="guest", password="guest", check=True):
    host, port = broker.host_port("http")
    out = subprocess.run(
        ["rabbitmqadmin", "-H", host, "-P", str(port), "-u", user, "-p", password, *args],
        capture_output=True, text=True, timeout=30,
    )
    if check:
        assert out.returncode == 0, f"rabbitmqadmin {args}: {out.stdout}{out.stderr}"
    return out


def listing(broker, *args, **kw):
    return json.loads(admin(broker, "-f", "raw_json", "list", *args, **kw).stdout)


def test_declare_publish_get_purge_delete(broker, uid):
    q, x = f"q-{uid}", f"x-{uid}"
    admin(broker, "declare", "queue", f"name={q}", "durable=true",
          'arguments={"x-max-length": 100}')
    admin(broker, "declare", "exchange", f"name={x}", "type=topic")
    admin(broker, "declare", "binding", f"source={x}", f"destination={q}", "routing_key=a.*")
    assert any(b["source"] == x and b["destination"] == q and b["routing_key"] == "a.*"
               for b in listing(broker, "bindings"))
    for i in range(3):
        admin(broker, "publish", f"exchange={x}", "routing_key=a.b", f"payload=hello {i}",
              'properties={"delivery_mode": 2, "content_type": "text/plain"}')
    queues = {r["name"]: r for r in listing(broker, "queues")}
    assert queues[q]["messages"] == 3
    assert queues[q]["durable"] is True
    assert queues[q]["arguments"] == {"x-max-length": 100}

    got = json.loads(admin(broker, "-f", "raw_json", "get", f"queue={q}",
                           "ackmode=ack_requeue_false").stdout)
    assert got[0]["payload"] == "hello 0"
    assert got[0]["properties"]["content_type"] == "text/plain"
    # a table, as people read it
    table = admin(broker, "get", f"queue={q}", "count=2").stdout
    assert "hello 1" in table and "hello 2" in table
    assert {r["name"]: r for r in listing(broker, "queues")}[q]["messages"] == 2

    admin(broker, "purge", "queue", f"name={q}")
    assert {r["name"]: r for r in listing(broker, "queues")}[q]["messages"] == 0
    admin(broker, "delete", "binding", f"source={x}", "destination_type=queue",
          f"destination={q}", "properties_key=a.*")
    admin(broker, "delete", "exchange", f"name={x}")
    admin(broker, "delete", "queue", f"name={q}")
    assert q not in {r["name"] for r in listing(broker, "queues")}
    assert x not in {r["name"] for r in listing(broker, "exchanges")}


def test_lists_and_shows_what_tables_expect(broker):
    overview = json.loads(admin(broker, "-f", "raw_json", "show", "overview").stdout)[0]
    assert overview["product_name"] == "Triad"
    assert "queues" in overview["object_totals"]
    names = {v["name"] for v in listing(broker, "vhosts")}
    assert "/" in names
    users = listing(broker, "users")
    guest = [u for u in users if u["name"] == "guest"][0]
    assert guest["tags"] == ["administrator"]
    assert guest["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    assert listing(broker, "nodes")[0]["name"].startswith("triad@")
    # the default table output (columns name, type) works too
    out = admin(broker, "list", "exchanges").stdout
    assert "amq.topic" in out and "topic" in out


def test_connections_are_listed_and_closed(broker, uid):
    host, port = broker.host_port("amqp")
    conn = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=port))
    try:
        ours = [c for c in listing(broker, "connections")
                if c["protocol"] == "AMQP 0-9-1" and c["vhost"] == "/"]
        assert ours, listing(broker, "connections")
        for c in ours:
            admin(broker, "close", "connection", f"name={c['name']}")
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            for _ in range(50):
                conn.process_data_events(time_limit=0.1)
    finally:
        if conn.is_open:
            conn.close()


def test_users_vhosts_permissions(broker, uid):
    user, vhost = f"u-{uid}", f"v-{uid}"
    admin(broker, "declare", "vhost", f"name={vhost}")
    admin(broker, "declare", "user", f"name={user}", "password=pw", "tags=management")
    admin(broker, "declare", "permission", f"vhost={vhost}", f"user={user}",
          "configure=.*", "write=.*", "read=.*")
    # the new user uses rabbitmqadmin itself, and sees only its vhost
    mine = {v["name"] for v in listing(broker, "vhosts", user=user, password="pw")}
    assert mine == {vhost}
    refused = admin(broker, "list", "users", user=user, password="pw", check=False)
    assert refused.returncode != 0 and "Access refused" in refused.stdout + refused.stderr
    admin(broker, "delete", "permission", f"vhost={vhost}", f"user={user}")
    admin(broker, "delete", "user", f"name={user}")
    admin(broker, "delete", "vhost", f"name={vhost}")
    assert vhost not in {v["name"] for v in listing(broker, "vhosts")}


def test_export_and_import_definitions(broker, configured_broker, uid, tmp_path):
    q, x, user = f"dq-{uid}", f"dx-{uid}", f"du-{uid}"
    admin(broker, "declare", "queue", f"name={q}", "durable=true")
    admin(broker, "declare", "exchange", f"name={x}", "type=fanout")
    admin(broker, "declare", "binding", f"source={x}", f"destination={q}")
    admin(broker, "declare", "user", f"name={user}", "password=moved", "tags=management")
    admin(broker, "declare", "permission", "vhost=/", f"user={user}",
          "configure=.*", "write=.*", "read=.*")
    path = os.path.join(tmp_path, "defs.json")
    admin(broker, "export", path)
    with open(path) as f:
        defs = json.load(f)
    assert q in {d["name"] for d in defs["queues"]}

    fresh = configured_broker("")
    admin(fresh, "import", path)
    assert q in {r["name"] for r in listing(fresh, "queues")}
    assert any(b["source"] == x and b["destination"] == q for b in listing(fresh, "bindings"))
    # the password hash moved with the user: it logs in on the new broker
    host, port = fresh.host_port("amqp")
    creds = pika.PlainCredentials(user, "moved")
    conn = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=port, credentials=creds))
    conn.close()


def test_policies_declared_listed_and_deleted(broker, uid):
    q, p = f"pol-{uid}", f"p-{uid}"
    admin(broker, "declare", "queue", f"name={q}", "durable=true")
    for i in range(4):
        admin(broker, "publish", "exchange=amq.default", f"routing_key={q}", f"payload=m{i}")
    admin(broker, "declare", "policy", f"name={p}", f"pattern=^{q}$",
          'definition={"max-length": 2}', "priority=1", "apply-to=queues")
    pols = {r["name"]: r for r in listing(broker, "policies")}
    assert pols[p]["definition"] == {"max-length": 2}
    assert pols[p]["apply-to"] == "queues" and pols[p]["priority"] == 1
    # applied to the existing queue without a redeclare
    queues = {r["name"]: r for r in listing(broker, "queues")}
    assert queues[q]["policy"] == p and queues[q]["messages"] == 2
    # a key Triad does not implement is refused, naming it
    out = admin(broker, "declare", "policy", f"name={p}-bad", "pattern=.*",
                'definition={"ha-mode": "all"}', check=False)
    assert out.returncode != 0 and "ha-mode" in (out.stdout + out.stderr)
    admin(broker, "delete", "policy", f"name={p}")
    assert p not in {r["name"] for r in listing(broker, "policies")}
    admin(broker, "delete", "queue", f"name={q}")
