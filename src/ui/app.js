// Triad's web dashboard: vanilla JS over the management API (/api), basic auth.
// Every value from the broker is put in the page as text (textContent), never as HTML.
"use strict";

const state = { auth: sessionStorage.getItem("triad-auth"), timer: null, rates: [] };

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}

async function api(method, path, body) {
  const r = await fetch("/api" + path, {
    method,
    headers: { "Authorization": "Basic " + state.auth, "Content-Type": "application/json", "X-Requested-With": "XMLHttpRequest" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 401 && path === "/whoami") throw new Error("Login failed");
  const text = await r.text();
  const data = text ? JSON.parse(text) : null;
  if (!r.ok) throw new Error((data && data.reason) || ("HTTP " + r.status));
  return data;
}

const enc = encodeURIComponent;

function get(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

// A table of `rows` with columns [[title, path or function]], `id` for tests.
function table(id, rows, cols) {
  const head = el("tr", {}, ...cols.map(([t]) => el("th", {}, t)));
  const body = rows.map((r) => el("tr", { "data-name": r.name == null ? "" : r.name },
    ...cols.map(([, f]) => {
      const v = typeof f === "function" ? f(r) : get(r, f);
      const td = el("td", typeof v === "number" ? { class: "num" } : {});
      if (v instanceof Node) td.append(v);
      else td.textContent = v == null ? "" : (typeof v === "object" ? JSON.stringify(v) : String(v));
      return td;
    })));
  return el("table", { id }, el("thead", {}, head), el("tbody", {}, ...body));
}

function status(msg) { $("status").textContent = msg || ""; }

async function act(what, f) {
  try { await f(); status(""); await render(); } catch (e) { status(what + ": " + e.message); }
}

function rate(r, k) {
  const v = get(r, "message_stats." + k + "_details.rate");
  return v == null ? "" : Number(v).toFixed(1);
}

function chart(samples) {
  const c = el("canvas", { id: "rate-chart", width: 600, height: 150 });
  const g = c.getContext("2d");
  const max = Math.max(1, ...samples.map((s) => Math.max(s.publish, s.deliver)));
  const line = (key, color) => {
    g.strokeStyle = color; g.beginPath();
    samples.forEach((s, i) => {
      const x = samples.length < 2 ? 0 : (i * 599) / (samples.length - 1);
      const y = 149 - (s[key] / max) * 140;
      if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
    });
    g.stroke();
  };
  line("publish", "#1f77b4");
  line("deliver", "#2ca02c");
  return el("div", {}, el("h2", {}, "Message rates (msg/s): publish (blue), deliver/get (green), max " + max.toFixed(1)), c);
}

const pages = {
  async overview() {
    const o = await api("GET", "/overview");
    const s = o.message_stats || {};
    state.rates.push({
      publish: get(s, "publish_details.rate") || 0,
      deliver: get(s, "deliver_get_details.rate") || 0,
    });
    if (state.rates.length > 60) state.rates.shift();
    const t = o.object_totals, q = o.queue_totals;
    return [
      el("h1", {}, "Overview"),
      el("p", { class: "totals", id: "totals" },
        el("span", {}, "Node: " + o.node),
        el("span", {}, "Connections: " + t.connections),
        el("span", {}, "Queues: " + t.queues),
        el("span", {}, "Consumers: " + t.consumers),
        el("span", { id: "total-messages" }, "Messages: " + q.messages)),
      table("rates", [s], [["publish", "publish"], ["publish/s", (r) => rate({ message_stats: r }, "publish")],
        ["deliver/get", "deliver_get"], ["deliver/get/s", (r) => rate({ message_stats: r }, "deliver_get")],
        ["ack", "ack"], ["ack/s", (r) => rate({ message_stats: r }, "ack")], ["redeliver", "redeliver"]]),
      chart(state.rates),
    ];
  },
  async queues() {
    const qs = await api("GET", "/queues");
    return [el("h1", {}, "Queues"), table("queues", qs, [
      ["vhost", "vhost"],
      ["name", (r) => el("a", { href: "#queue/" + enc(r.vhost) + "/" + enc(r.name) }, r.name)],
      ["messages", "messages"], ["ready", "messages_ready"], ["unacked", "messages_unacknowledged"],
      ["consumers", "consumers"], ["policy", "policy"],
      ["publish/s", (r) => rate(r, "publish")], ["deliver/get/s", (r) => rate(r, "deliver_get")],
      ["", (r) => el("button", { type: "button", class: "purge", onclick: () => act("purge", () => api("DELETE", "/queues/" + enc(r.vhost) + "/" + enc(r.name) + "/contents")) }, "Purge")],
    ])];
  },
  async queue(vhost, name) {
    const path = "/queues/" + enc(vhost) + "/" + enc(name);
    const q = await api("GET", path);
    const out = [el("h1", {}, "Queue " + name + " in " + vhost),
      table("queue", [q], [["messages", "messages"], ["ready", "messages_ready"], ["unacked", "messages_unacknowledged"],
        ["consumers", "consumers"], ["durable", "durable"], ["arguments", "arguments"], ["policy", "policy"],
        ["effective policy", "effective_policy_definition"]]),
      el("button", { type: "button", id: "peek", onclick: async () => {
        try {
          const got = await api("POST", path + "/get", { count: 5, ackmode: "ack_requeue_true", encoding: "auto", truncate: 500 });
          $("peeked").replaceChildren(table("peeked-table", got, [["routing key", "routing_key"], ["redelivered", "redelivered"], ["bytes", "payload_bytes"], ["payload", "payload"], ["properties", "properties"]]));
        } catch (e) { status("peek: " + e.message); }
      } }, "Peek 5 (requeued)"),
      " ",
      el("button", { type: "button", id: "purge", onclick: () => act("purge", () => api("DELETE", path + "/contents")) }, "Purge"),
      " ",
      el("button", { type: "button", id: "delete", onclick: () => act("delete", async () => { await api("DELETE", path); location.hash = "#queues"; }) }, "Delete"),
      el("div", { id: "peeked" })];
    return out;
  },
  async connections() {
    const cs = await api("GET", "/connections");
    return [el("h1", {}, "Connections"), table("connections", cs, [
      ["name", "name"], ["protocol", "protocol"], ["user", "user"], ["vhost", "vhost"], ["TLS", "ssl"],
      ["", (r) => el("button", { type: "button", onclick: () => act("close", () => api("DELETE", "/connections/" + enc(r.name))) }, "Close")],
    ])];
  },
  async exchanges() {
    const xs = await api("GET", "/exchanges");
    return [el("h1", {}, "Exchanges"), table("exchanges", xs, [["vhost", "vhost"], ["name", "name"], ["type", "type"], ["durable", "durable"], ["internal", "internal"]])];
  },
  async bindings() {
    const bs = await api("GET", "/bindings");
    return [el("h1", {}, "Bindings"), table("bindings", bs, [["vhost", "vhost"], ["source", "source"], ["destination", "destination"], ["type", "destination_type"], ["routing key", "routing_key"]])];
  },
  async users() {
    const us = await api("GET", "/users");
    return [el("h1", {}, "Users"), table("users", us, [["name", "name"], ["tags", "tags"]])];
  },
  async permissions() {
    const ps = await api("GET", "/permissions");
    return [el("h1", {}, "Permissions"), table("permissions", ps, [["user", "user"], ["vhost", "vhost"], ["configure", "configure"], ["write", "write"], ["read", "read"]])];
  },
  async policies() {
    const ps = await api("GET", "/policies");
    return [el("h1", {}, "Policies"), table("policies", ps, [["vhost", "vhost"], ["name", "name"], ["pattern", "pattern"], ["apply-to", "apply-to"], ["priority", "priority"], ["definition", "definition"]])];
  },
  async messages() {
    const out = el("div", { id: "found" });
    const show = (found) => out.replaceChildren(table("found-table", found, [["stored", (r) => new Date(r.store_time).toISOString()], ["bytes", "payload_bytes"], ["routing key", "routing_key"], ["payload", "payload"], ["queues", "queues"]]));
    const input = el("input", { id: "msg-id", placeholder: "message-id" });
    const form = el("form", { id: "by-id", onsubmit: async (ev) => {
      ev.preventDefault();
      try { show(await api("GET", "/messages/by-id/" + enc(input.value))); } catch (e) { status("query: " + e.message); }
    } }, input, " ", el("button", { type: "submit" }, "Find"));
    // MQTT publishes by topic and store time (local time in the inputs, ms to the API)
    const vhost = el("input", { id: "msg-vhost", value: "/", size: "8" });
    const topic = el("input", { id: "msg-topic", placeholder: "MQTT topic, e.g. sensors/1/temp" });
    const from = el("input", { id: "msg-from", type: "datetime-local", step: "1" });
    const to = el("input", { id: "msg-to", type: "datetime-local", step: "1" });
    const byTopic = el("form", { id: "by-topic", onsubmit: async (ev) => {
      ev.preventDefault();
      const q = ["topic=" + enc(topic.value)];
      if (from.value) q.push("from=" + new Date(from.value).getTime());
      if (to.value) q.push("to=" + new Date(to.value).getTime());
      try { show(await api("GET", "/messages/by-topic/" + enc(vhost.value) + "?" + q.join("&"))); } catch (e) { status("query: " + e.message); }
    } }, "vhost ", vhost, " topic ", topic, " from ", from, " to ", to, " ", el("button", { type: "submit" }, "Find"));
    return [el("h1", {}, "Message query"), el("h2", {}, "By message-id"), form, el("h2", {}, "By MQTT topic and time"), byTopic, out];
  },
};

async function render() {
  clearTimeout(state.timer);
  if (!state.auth) {
    $("login").hidden = false; $("nav").hidden = true; $("page").replaceChildren();
    return;
  }
  $("login").hidden = true; $("nav").hidden = false;
  const [name, ...args] = (location.hash.slice(1) || "overview").split("/").map(decodeURIComponent);
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.getAttribute("href") === "#" + name);
  const page = pages[name] || pages.overview;
  try {
    const nodes = await page(...args);
    $("page").replaceChildren(...nodes);
    $("page").setAttribute("data-page", name);
  } catch (e) {
    status(e.message);
  }
  // live pages refresh every 5 s (not while reading a peek or a query)
  if (["overview", "queues", "connections"].includes(name)) state.timer = setTimeout(render, 5000);
}

$("login").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  state.auth = btoa(unescape(encodeURIComponent($("user").value + ":" + $("password").value)));
  try {
    const me = await api("GET", "/whoami");
    sessionStorage.setItem("triad-auth", state.auth);
    $("who").textContent = me.name;
    $("login-error").textContent = "";
    await render();
  } catch (e) {
    state.auth = null;
    $("login-error").textContent = e.message;
  }
});

$("logout").addEventListener("click", () => { sessionStorage.removeItem("triad-auth"); state.auth = null; render(); });
window.addEventListener("hashchange", render);
render();
