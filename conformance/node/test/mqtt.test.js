// mqtt.js (MQTT 3.1.1) against Triad's MQTT listener. Run by tests/test_node.py with
// TRIAD_MQTT_URL set; every wait is bounded.
'use strict';
const { test } = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const mqtt = require('mqtt');

const URL = process.env.TRIAD_MQTT_URL;
const uid = (p) => `${p}-${crypto.randomBytes(4).toString('hex')}`;
const within = (ms, what, promise) =>
  Promise.race([
    promise,
    new Promise((_, rej) => setTimeout(() => rej(new Error(`timed out: ${what}`)), ms).unref()),
  ]);

async function client(opts = {}) {
  const c = await within(5000, 'connect', mqtt.connectAsync(URL, {
    protocolVersion: 4, username: 'guest', password: 'guest', reconnectPeriod: 0,
    connectTimeout: 5000, ...opts,
  }));
  return c;
}

function nextMessage(c, ms = 5000) {
  return within(ms, 'message', new Promise((resolve) => {
    c.once('message', (topic, payload, packet) => resolve({ topic, payload, packet }));
  }));
}

test('QoS 1 and 2 round trips with a wildcard subscription', async () => {
  const sub = await client(); const pub = await client();
  const base = uid('js');
  const granted = await sub.subscribeAsync(`${base}/+/v`, { qos: 2 });
  assert.equal(granted[0].qos, 2);
  for (const qos of [1, 2]) {
    const next = nextMessage(sub);
    await within(5000, 'publish', pub.publishAsync(`${base}/q${qos}/v`, `qos${qos}`, { qos }));
    const m = await next;
    assert.equal(m.topic, `${base}/q${qos}/v`);
    assert.equal(m.payload.toString(), `qos${qos}`);
    assert.equal(m.packet.qos, qos);
  }
  await sub.endAsync(); await pub.endAsync();
});

test('retained message on subscribe, cleared by an empty retained publish', async () => {
  const pub = await client();
  const topic = `${uid('jsret')}/state`;
  await pub.publishAsync(topic, 'kept', { qos: 1, retain: true });
  const late = await client();
  const next = nextMessage(late);
  await late.subscribeAsync(topic, { qos: 1 });
  const m = await next;
  assert.equal(m.payload.toString(), 'kept');
  assert.equal(m.packet.retain, true);
  await pub.publishAsync(topic, '', { qos: 1, retain: true });
  const later = await client();
  await later.subscribeAsync(topic, { qos: 1 });
  await assert.rejects(nextMessage(later, 700));
  await Promise.all([pub.endAsync(), late.endAsync(), later.endAsync()]);
});

test('last will on a dropped connection', async () => {
  const watcher = await client();
  const topic = uid('jswill');
  await watcher.subscribeAsync(topic, { qos: 1 });
  const doomed = await client({ clientId: uid('doomed'), will: { topic, payload: Buffer.from('bye'), qos: 1 } });
  const next = nextMessage(watcher);
  doomed.stream.destroy();
  const m = await next;
  assert.equal(m.payload.toString(), 'bye');
  doomed.end(true);
  await watcher.endAsync();
});

test('persistent session receives what was published while offline', async () => {
  const clientId = uid('jspersist');
  const topic = uid('jsps');
  const a = await client({ clientId, clean: false });
  await a.subscribeAsync(topic, { qos: 1 });
  await a.endAsync();
  const pub = await client();
  await pub.publishAsync(topic, 'while away', { qos: 1 });
  const b = mqtt.connect(URL, { protocolVersion: 4, username: 'guest', password: 'guest',
    clientId, clean: false, reconnectPeriod: 0 });
  const m = await nextMessage(b);
  assert.equal(m.payload.toString(), 'while away');
  await b.endAsync(); await pub.endAsync();
  const c = await client({ clientId, clean: true });
  await c.endAsync();
});

test('shared subscription: the members of a group take turns', async () => {
  const base = uid('jsshare');
  const a = await client(); const b = await client(); const pub = await client();
  for (const c of [a, b]) {
    const granted = await c.subscribeAsync(`$share/g/${base}/#`, { qos: 1 });
    assert.equal(granted[0].qos, 1);
  }
  const got = { a: [], b: [] };
  const all = within(5000, '4 messages', new Promise((resolve) => {
    const on = (k) => (topic, payload) => {
      got[k].push(payload.toString());
      if (got.a.length + got.b.length === 4) resolve();
    };
    a.on('message', on('a')); b.on('message', on('b'));
  }));
  for (let i = 0; i < 4; i++) await pub.publishAsync(`${base}/x`, `${i}`, { qos: 1 });
  await all;
  assert.equal(got.a.length, 2, JSON.stringify(got));
  assert.equal(got.b.length, 2, JSON.stringify(got));
  await Promise.all([a.endAsync(), b.endAsync(), pub.endAsync()]);
});
