"""mosquitto_pub / mosquitto_sub (Debian's mosquitto-clients) against Triad's MQTT
listener: the command-line tools people script with."""

import shutil
import subprocess
import time

import pytest

pytestmark = pytest.mark.skipif(
    not (shutil.which("mosquitto_pub") and shutil.which("mosquitto_sub")),
    reason="mosquitto_pub/mosquitto_sub not installed (Debian package mosquitto-clients; "
    "run.sh installs it when run as root)",
)

def auth(broker):
    host, port = broker.host_port("mqtt")
    return ["-h", host, "-p", str(port), "-V", "mqttv311", "-u", "guest", "-P", "guest"]

def pub(broker, *args):
    subprocess.run(["mosquitto_pub", *auth(broker), *args], check=True, timeout=15,
                   capture_output=True)

def test_sub_receives_retained_qos1_publish(broker, uid):
    pub(broker, "-t", f"t/{uid}/cfg", "-m", "retained hello", "-q", "1", "-r")
    out = subprocess.run(
        ["mosquitto_sub", *auth(broker), "-C", "1", "-W", "10", "-t", f"t/{uid}/#", "-q", "1", "-v"],
        capture_output=True, text=True, timeout=20,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"t/{uid}/cfg retained hello"
    # clear it, so the topic is left as found
    pub(broker, "-t", f"t/{uid}/cfg", "-n", "-q", "1", "-r")
    out = subprocess.run(
        ["mosquitto_sub", *auth(broker), "-C", "1", "-W", "2", "-t", f"t/{uid}/#", "-q", "1"],
        capture_output=True, text=True, timeout=20,
    )
    assert out.stdout == "", "the retained message must be gone after an empty retained publish"
    assert out.returncode != 0  # -W timed out with nothing received

def test_sub_receives_live_messages(broker, uid):
    sub = subprocess.Popen(
        ["mosquitto_sub", *auth(broker), "-C", "3", "-W", "15", "-t", f"live/{uid}/+", "-q", "2",
         "-F", "%t|%q|%r|%p"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(0.5)  # let the subscription land
        for q in (0, 1, 2):
            pub(broker, "-t", f"live/{uid}/q{q}", "-m", f"m{q}", "-q", str(q))
        out, err = sub.communicate(timeout=20)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    assert sub.returncode == 0, err
    lines = out.strip().splitlines()
    assert lines == [f"live/{uid}/q{q}|{q}|0|m{q}" for q in (0, 1, 2)]

def test_pub_with_bad_password_fails(broker, uid):
    host, port = broker.host_port("mqtt")
    r = subprocess.run(
        ["mosquitto_pub", "-h", host, "-p", str(port), "-V", "mqttv311", "-u", "guest", "-P", "nope",
         "-t", f"x/{uid}", "-m", "x"],
        capture_output=True, text=True, timeout=15,
    )
    assert r.returncode != 0
    assert "not authorised" in r.stderr.lower() or "bad user" in r.stderr.lower() or "refused" in r.stderr.lower(), r.stderr
