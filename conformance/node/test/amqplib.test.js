// amqplib (promise API) against Triad's AMQP listener. Run by tests/test_node.py with
// TRIAD_AMQP_URL set; every wait is bounded.
'use strict';
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const amqp = require('amqplib');

const URL = process.env.TRIAD_AMQP_URL;
const uid = (p) => `${p}-${crypto.randomBytes(4).toString('hex')}`;
const within = (ms, what, promise) =>
  Promise.race([
    promise,
    new Promise((_, rej) => setTimeout(() => rej(new Error(`timed out: ${what}`)), ms).unref()),
  ]);

let conn;
before(async () => { conn = await amqp.connect(URL, { timeout: 5000 }); });
after(async () => { await conn.close(); });

function collect(ch, queue, n, { ack = true } = {}) {
  return new Promise((resolve, reject) => {
    const got = [];
    ch.consume(queue, (msg) => {
      got.push(msg);
      if (ack) ch.ack(msg);
      if (got.length === n) resolve(got);
    }).catch(reject);
  });
}

test('confirm channel: persistent publish to a durable queue, manual-ack consume', async () => {
  const ch = await conn.createConfirmChannel();
  const ex = uid('ex'); const q = uid('q');
  await ch.assertExchange(ex, 'topic', { durable: true });
  const ok = await ch.assertQueue(q, { durable: true });
  assert.equal(ok.queue, q);
  await ch.bindQueue(q, ex, 'orders.#');
  for (let i = 0; i < 20; i++) {
    ch.publish(ex, `orders.eu.${i}`, Buffer.from(`o${i}`), {
      persistent: true, contentType: 'text/plain', headers: { i }, messageId: `m${i}`,
    });
  }
  await within(5000, 'confirms', ch.waitForConfirms());
  const got = await within(5000, 'deliveries', collect(ch, q, 20));
  assert.deepEqual(got.map((m) => m.content.toString()), [...Array(20).keys()].map((i) => `o${i}`));
  assert.equal(got[3].properties.headers.i, 3);
  assert.equal(got[3].properties.deliveryMode, 2);
  assert.equal(got[3].properties.messageId, 'm3');
  assert.equal(got[3].fields.routingKey, 'orders.eu.3');
  await ch.close();
});

test('prefetch caps unacked deliveries; nack requeues with redelivered', async () => {
  const ch = await conn.createChannel();
  const q = uid('q');
  await ch.assertQueue(q, { exclusive: true });
  for (let i = 0; i < 5; i++) ch.sendToQueue(q, Buffer.from(`m${i}`));
  await ch.prefetch(2);
  const got = [];
  await ch.consume(q, (msg) => got.push(msg));
  await new Promise((r) => setTimeout(r, 500));
  assert.equal(got.length, 2);
  ch.nack(got[0], false, true);
  await new Promise((r) => setTimeout(r, 300));
  const redelivered = got.filter((m) => m.fields.redelivered);
  assert.equal(redelivered.length, 1);
  assert.equal(redelivered[0].content.toString(), 'm0');
  await ch.close();
});

test('get, purge and checkQueue', async () => {
  const ch = await conn.createChannel();
  const q = uid('q');
  await ch.assertQueue(q, { exclusive: true });
  assert.equal(await ch.get(q), false);
  ch.sendToQueue(q, Buffer.from('a'));
  ch.sendToQueue(q, Buffer.from('b'));
  ch.sendToQueue(q, Buffer.from('c'));
  const m = await within(2000, 'get', (async () => {
    for (;;) { const x = await ch.get(q, { noAck: true }); if (x) return x; }
  })());
  assert.equal(m.content.toString(), 'a');
  assert.equal(m.fields.messageCount, 2);
  assert.equal((await ch.checkQueue(q)).messageCount, 2);
  assert.equal((await ch.purgeQueue(q)).messageCount, 2);
  await ch.close();
});

test('checkQueue of a missing queue rejects with 404 and the connection lives on', async () => {
  const ch = await conn.createChannel();
  ch.on('error', () => {});
  await assert.rejects(ch.checkQueue(uid('missing')), (e) => e.code === 404);
  const ch2 = await conn.createChannel();
  const q = uid('q');
  await ch2.assertQueue(q, { exclusive: true });
  ch2.sendToQueue(q, Buffer.from('fine'));
  const [msg] = await within(3000, 'delivery', collect(ch2, q, 1));
  assert.equal(msg.content.toString(), 'fine');
  await ch2.close();
});

test('dead-lettering with x-death via assertQueue options', async () => {
  const ch = await conn.createChannel();
  const dlx = uid('dlx'); const dlq = uid('dlq'); const q = uid('q');
  await ch.assertExchange(dlx, 'fanout', { autoDelete: true });
  await ch.assertQueue(dlq, { exclusive: true });
  await ch.bindQueue(dlq, dlx, '');
  await ch.assertQueue(q, { exclusive: true, deadLetterExchange: dlx, messageTtl: 100 });
  ch.sendToQueue(q, Buffer.from('expire me'));
  const [msg] = await within(5000, 'dead letter', collect(ch, dlq, 1));
  assert.equal(msg.content.toString(), 'expire me');
  const death = msg.properties.headers['x-death'][0];
  assert.equal(death.reason, 'expired');
  assert.equal(death.queue, q);
  await ch.close();
});

test('mandatory publish to nowhere is returned', async () => {
  const ch = await conn.createChannel();
  const returned = new Promise((resolve) => ch.on('return', resolve));
  ch.publish('amq.direct', uid('nobody'), Buffer.from('back to sender'), { mandatory: true });
  const msg = await within(5000, 'basic.return', returned);
  assert.equal(msg.content.toString(), 'back to sender');
  assert.equal(msg.fields.replyCode, 312);
  await ch.close();
});

// Issue 14 item 13: a retry loop that republishes a dead-lettered message with the
// x-death header it received (a common amqplib pattern) is not mistaken for a
// dead-letter cycle: the broker ignores client-supplied x-death, as RabbitMQ 4 does,
// and writes its own record.
test('republished x-death is not taken for a dead-letter cycle', async () => {
  const ch = await conn.createConfirmChannel();
  const q = uid('work'); const dlq = uid('dlq');
  await ch.assertQueue(dlq, { durable: false });
  await ch.assertQueue(q, {
    durable: false,
    arguments: { 'x-dead-letter-exchange': '', 'x-dead-letter-routing-key': dlq },
  });
  ch.publish('', q, Buffer.from('job'));
  await ch.waitForConfirms();
  for (let round = 1; round <= 2; round++) {
    const m = await within(5000, `get ${round}`, (async () => {
      for (;;) {
        const got = await ch.get(q, { noAck: false });
        if (got) return got;
      }
    })());
    ch.reject(m, false); // dead-lettered to dlq with reason rejected
    const dead = await within(5000, `dead ${round}`, (async () => {
      for (;;) {
        const got = await ch.get(dlq, { noAck: true });
        if (got) return got;
        await new Promise((r) => setTimeout(r, 20));
      }
    })());
    const deaths = dead.properties.headers['x-death'];
    assert.equal(deaths.length, 1);
    assert.equal(deaths[0].queue, q);
    assert.equal(deaths[0].count, 1, 'a republished x-death is not counted');
    // republish with the headers as received
    ch.publish('', q, dead.content, { headers: dead.properties.headers });
    await ch.waitForConfirms();
  }
  await ch.close();
});

test('a burst of sendToQueue then connection.close() closes cleanly', async () => {
  // amqplib writes connection.close ahead of the publishes still in its buffers; the
  // broker answers close-ok and drops what follows until the client closes (RabbitMQ
  // does). Closing the socket at once made amqplib fail with EPIPE / ECONNRESET.
  const body = Buffer.alloc(1000, 'x');
  for (let round = 0; round < 3; round++) {
    const c = await amqp.connect(URL, { timeout: 5000 });
    const errors = [];
    c.on('error', (e) => errors.push(e));
    const ch = await c.createChannel();
    ch.on('error', (e) => errors.push(e));
    const q = uid('burst');
    await ch.assertQueue(q, { autoDelete: false });
    for (let i = 0; i < 5000; i++) ch.sendToQueue(q, body);
    const closed = new Promise((resolve) => c.once('close', resolve));
    await within(10000, `close() of round ${round}`, c.close());
    const why = await within(10000, `close event of round ${round}`, closed);
    assert.equal(why, undefined, `close event carries an error: ${why}`);
    assert.deepEqual(errors.map(String), []);
    const ch2 = await conn.createChannel();
    await ch2.deleteQueue(q);
    await ch2.close();
  }
});

test('direct reply-to: an RPC round trip through amq.rabbitmq.reply-to', async () => {
  const client = await conn.createChannel();
  const server = await conn.createChannel();
  const svc = uid('rpc');
  await server.assertQueue(svc, { exclusive: true });
  await server.consume(svc, (msg) => {
    server.sendToQueue(msg.properties.replyTo, Buffer.from(`${Number(msg.content) * 2}`), {
      correlationId: msg.properties.correlationId,
    });
  }, { noAck: true });
  let gotReply;
  const reply = new Promise((resolve) => { gotReply = resolve; });
  await client.consume('amq.rabbitmq.reply-to', (msg) => gotReply(msg), { noAck: true });
  client.sendToQueue(svc, Buffer.from('21'), {
    replyTo: 'amq.rabbitmq.reply-to', correlationId: 'c-1',
  });
  const m = await within(5000, 'reply', reply);
  assert.equal(m.content.toString(), '42');
  assert.equal(m.properties.correlationId, 'c-1');
  assert.match(m.fields.routingKey, /^amq\.rabbitmq\.reply-to\./);
  await client.close();
  await server.close();
});
