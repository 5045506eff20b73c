// Browser-style clients over WebSocket on Triad's HTTP listener: @stomp/stompjs on /ws
// (STOMP 1.2) and mqtt.js on /mqtt. Run by tests/test_node.py with TRIAD_HTTP_URL set;
// every wait is bounded.
'use strict';
const { test } = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const { Client } = require('@stomp/stompjs');
const WebSocket = require('ws');
const mqtt = require('mqtt');

const HTTP = process.env.TRIAD_HTTP_URL; // http://host:port
const WS = HTTP.replace(/^http/, 'ws');
const uid = (p) => `${p}-${crypto.randomBytes(4).toString('hex')}`;
const within = (ms, what, promise) =>
  Promise.race([
    promise,
    new Promise((_, rej) => setTimeout(() => rej(new Error(`timed out: ${what}`)), ms).unref()),
  ]);

function stompClient() {
  return new Promise((resolve, reject) => {
    const c = new Client({
      webSocketFactory: () => new WebSocket(`${WS}/ws`, ['v12.stomp', 'v11.stomp', 'v10.stomp']),
      connectHeaders: { login: 'guest', passcode: 'guest' },
      reconnectDelay: 0,
      heartbeatIncoming: 0,
      heartbeatOutgoing: 0,
      onConnect: () => resolve(c),
      onStompError: (f) => reject(new Error(f.headers.message)),
      onWebSocketError: (e) => reject(e),
    });
    c.activate();
  });
}

test('stompjs over WebSocket: subscribe, publish with receipt, client ack', async () => {
  const c = await within(5000, 'stomp connect', stompClient());
  try {
    const q = `/queue/${uid('ws')}`;
    const got = new Promise((resolve) => {
      c.subscribe(q, (m) => { m.ack(); resolve(m); }, { ack: 'client-individual' });
    });
    const receipt = uid('r');
    const receipted = new Promise((resolve) => c.watchForReceipt(receipt, resolve));
    c.publish({ destination: q, body: 'hello from stompjs', headers: { receipt, persistent: 'true' } });
    await within(5000, 'receipt', receipted);
    const m = await within(5000, 'message', got);
    assert.equal(m.body, 'hello from stompjs');
    assert.equal(m.headers.destination, q);
  } finally {
    await c.deactivate();
  }
});

test('mqtt.js over WebSocket: QoS 1 round trip', async () => {
  const c = await within(5000, 'mqtt ws connect', mqtt.connectAsync(`${WS}/mqtt`, {
    protocolVersion: 4, username: 'guest', password: 'guest', reconnectPeriod: 0, connectTimeout: 5000,
  }));
  try {
    const topic = `${uid('ws')}/t`;
    await c.subscribeAsync(topic, { qos: 1 });
    const got = within(5000, 'message', new Promise((resolve) => c.once('message', (t, p) => resolve([t, p.toString()]))));
    await c.publishAsync(topic, 'over websocket', { qos: 1 });
    assert.deepEqual(await got, [topic, 'over websocket']);
  } finally {
    await c.endAsync();
  }
});

// Issue 14 item 8: the `ws` client with a foreign page's Origin (as a browser sends it)
// is refused with 403; with the broker's own origin it is accepted. stompjs without
// credentials over WebSocket is refused: anonymous login is off there by default.
function upgradeStatus(origin) {
  return new Promise((resolve) => {
    const ws = new WebSocket(`${WS}/ws`, ['v12.stomp'], origin ? { origin } : {});
    ws.on('unexpected-response', (_req, res) => { resolve(res.statusCode); ws.terminate(); });
    ws.on('open', () => { resolve(101); ws.terminate(); });
    ws.on('error', () => {});
  });
}

test('ws: a page from another origin cannot open a WebSocket', async () => {
  assert.equal(await within(5000, 'foreign origin', upgradeStatus('http://evil.example')), 403);
  assert.equal(await within(5000, 'own origin', upgradeStatus(HTTP)), 101);
});

test('stompjs over WebSocket without credentials is refused', async () => {
  const err = await within(5000, 'anonymous stomp', new Promise((resolve) => {
    const c = new Client({
      webSocketFactory: () => new WebSocket(`${WS}/ws`, ['v12.stomp']),
      reconnectDelay: 0,
      heartbeatIncoming: 0,
      heartbeatOutgoing: 0,
      onConnect: () => { resolve(null); c.deactivate(); },
      onStompError: (f) => { resolve(f.headers.message); c.deactivate(); },
    });
    c.activate();
  }));
  assert.equal(err, 'Bad CONNECT');
});
