"""A Celery application for the conformance suite: the worker runs it as a subprocess
(`celery -A apps.celery_app worker`) against Triad's AMQP listener."""

import os

from celery import Celery

app = Celery(
    "triad_conformance",
    broker=os.environ.get("CELERY_BROKER_URL", "pyamqp://guest:guest@127.0.0.1:5672//"),
    backend="rpc://",
)
app.conf.update(
    task_default_queue=os.environ.get("CONFORMANCE_CELERY_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=3,
    result_expires=60,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
)


@app.task
def add(x, y):
    return x + y


@app.task
def write_file(path, content):
    with open(path, "w") as f:
        f.write(content)
    return len(content)


@app.task(bind=True, max_retries=2, default_retry_delay=0.2)
def flaky(self, path):
    """Fails on its first two runs (counting in a file), succeeds on the third."""
    n = int(open(path).read()) if os.path.exists(path) else 0
    with open(path, "w") as f:
        f.write(str(n + 1))
    if n < 2:
        raise self.retry(exc=RuntimeError(f"attempt {n}"))
    return n + 1


@app.task
def boom():
    raise ValueError("expected failure")
