//! Glue between the listeners and the protocol adapters: each function turns the
//! broker-wide [`ConnContext`] into its adapter's context and serves one connection,
//! over any [`Stream`]: plain TCP or TLS. The unit types [`Amqp`], [`Stomp`] and
//! [`Mqtt`] are the same functions as [`Service`]s, for the TLS listeners.
//!
//! Each stream is [`Counted`] (the connection's bytes, for `/api/connections`).
//!
//! `ctx.shutdown` is the connection's own shutdown token (the listener registered the
//! connection, see [`crate::listener`]): cancelling it is how the management API closes
//! one connection, and the adapter closes it as it does at broker shutdown.

use std::borrow::Cow;
use std::future::Future;
use std::net::SocketAddr;

use futures_util::FutureExt;

use crate::counted::Counted;
use crate::listener::{ConnContext, ConnResult, Service, Stream};

/// [`amqp`] as a [`Service`].
#[derive(Clone, Copy, Debug)]
pub struct Amqp;
/// [`stomp`] as a [`Service`].
#[derive(Clone, Copy, Debug)]
pub struct Stomp;
/// [`mqtt`] as a [`Service`].
#[derive(Clone, Copy, Debug)]
pub struct Mqtt;

impl Service for Amqp {
    fn serve<S: Stream>(
        &self,
        stream: S,
        peer: SocketAddr,
        ctx: ConnContext,
    ) -> impl Future<Output = ConnResult> + Send + 'static + use<S> {
        amqp(stream, peer, ctx)
    }
}

impl Service for Stomp {
    fn serve<S: Stream>(
        &self,
        stream: S,
        peer: SocketAddr,
        ctx: ConnContext,
    ) -> impl Future<Output = ConnResult> + Send + 'static + use<S> {
        stomp(stream, peer, ctx)
    }
}

impl Service for Mqtt {
    fn serve<S: Stream>(
        &self,
        stream: S,
        peer: SocketAddr,
        ctx: ConnContext,
    ) -> impl Future<Output = ConnResult> + Send + 'static + use<S> {
        mqtt(stream, peer, ctx)
    }
}

/// The future of a connection's task is as large as its largest state, for as long as
/// the connection lives (idle or not), and an `async fn`'s arguments keep a slot of their
/// own beside what it awaits. These functions are therefore plain functions: they build
/// the adapter's context from the [`ConnContext`] (dropped here) and return the adapter's
/// future with only its result mapped.
fn closed<E: Into<crate::listener::BoxError>>(
    serve: impl Future<Output = Result<(), E>> + Send + 'static,
) -> impl Future<Output = ConnResult> + Send + 'static {
    // `map`, not an async block: awaiting a captured future moves it into a second slot
    serve.map(|r| r.map(|()| Cow::Borrowed("closed")).map_err(|e| e.into()))
}

/// Serves one AMQP 0-9-1 connection.
pub fn amqp<S: Stream>(
    stream: S,
    peer: SocketAddr,
    ctx: ConnContext,
) -> impl Future<Output = ConnResult> + Send + 'static {
    let limits = &ctx.config.limits;
    let config = triad_amqp::AmqpConfig {
        frame_max: u32::try_from(limits.frame_max.bytes()).unwrap_or(u32::MAX),
        channel_max: limits.channel_max,
        heartbeat: limits.heartbeat.get(),
        max_message_size: limits.max_message_size.bytes(),
        handshake_timeout: limits.handshake_timeout.get(),
        failed_login_delay: ctx.config.auth.failed_login_delay.get(),
        peer_cert_cn: ctx.peer_cert_cn.clone(),
        ..triad_amqp::AmqpConfig::default()
    };
    let actx = triad_amqp::AmqpContext {
        broker: ctx.broker.clone(),
        config,
        shutdown: ctx.shutdown.clone(),
    };
    closed(triad_amqp::serve(
        Counted::new(stream, ctx.conn.clone()),
        peer,
        actx,
    ))
}

/// The user a login without credentials from `peer` becomes (`auth.anonymous`); a
/// connection that came through the HTTP listener is a WebSocket one.
fn anonymous_user(ctx: &ConnContext, peer: SocketAddr) -> Option<String> {
    let websocket = ctx.proto.plain() == crate::listener::Proto::Http;
    ctx.config.auth.anonymous_login(peer.ip(), websocket)
}

/// Serves one STOMP 1.0-1.2 connection.
pub fn stomp<S: Stream>(
    stream: S,
    peer: SocketAddr,
    ctx: ConnContext,
) -> impl Future<Output = ConnResult> + Send + 'static {
    let mut sctx = triad_stomp::StompContext::new(ctx.broker.clone(), ctx.shutdown.clone());
    sctx.anonymous_user = anonymous_user(&ctx, peer);
    sctx.handshake_timeout = ctx.config.limits.handshake_timeout.get();
    sctx.limits.max_frame =
        usize::try_from(ctx.config.limits.stomp_frame_max()).unwrap_or(usize::MAX);
    sctx.failed_login_delay = ctx.config.auth.failed_login_delay.get();
    sctx.ssl_cert_login = ctx.config.auth.ssl_cert_login;
    sctx.peer_cert_cn = ctx.peer_cert_cn.clone();
    let st = &ctx.config.stomp;
    let n = |v: u32| usize::try_from(v).unwrap_or(usize::MAX);
    sctx.caps = triad_stomp::Caps {
        max_transactions: n(st.max_transactions),
        max_transaction_frames: n(st.max_transaction_frames),
        max_transaction_bytes: usize::try_from(st.max_transaction_bytes.bytes())
            .unwrap_or(usize::MAX),
        max_subscriptions: n(st.max_subscriptions),
        max_id_length: n(st.max_id_length),
    };
    closed(triad_stomp::serve(
        Counted::new(stream, ctx.conn.clone()),
        peer,
        sctx,
    ))
}

/// The port of the listener this connection came in on (the HTTP listener's for a
/// WebSocket).
fn local_port(ctx: &ConnContext) -> Option<u16> {
    ctx.http
        .bound
        .get()?
        .iter()
        .find(|(p, _)| *p == ctx.proto)
        .map(|(_, a)| a.port())
}

/// Serves one MQTT 3.1.1 connection.
pub fn mqtt<S: Stream>(
    stream: S,
    peer: SocketAddr,
    ctx: ConnContext,
) -> impl Future<Output = ConnResult> + Send + 'static {
    let mctx = triad_mqtt::MqttContext {
        broker: ctx.broker.clone(),
        state: ctx.mqtt.clone(),
        anonymous_user: anonymous_user(&ctx, peer),
        limits: triad_mqtt::MqttLimits {
            connect_timeout: ctx.config.limits.handshake_timeout.get(),
            max_packet_size: usize::try_from(ctx.config.limits.mqtt_packet_max())
                .unwrap_or(usize::MAX),
            max_subscriptions: usize::try_from(ctx.config.mqtt.max_subscriptions)
                .unwrap_or(usize::MAX),
            stream_max_age: ctx.config.mqtt.stream_max_age.get(),
            stream_max_bytes: ctx.config.mqtt.stream_max_bytes.0,
            index_topics: ctx.config.mqtt.index_topics,
            ..triad_mqtt::MqttLimits::default()
        },
        shutdown: ctx.shutdown.clone(),
        login: triad_mqtt::MqttLogin {
            failed_login_delay: ctx.config.auth.failed_login_delay.get(),
            ssl_cert_login: ctx.config.auth.ssl_cert_login,
            peer_cert_cn: ctx.peer_cert_cn.clone(),
            port_vhost: local_port(&ctx)
                .and_then(|p| ctx.config.mqtt.vhost_for_port(p))
                .map(str::to_string),
            vhost_in_username: !ctx.config.mqtt.ignore_colons_in_username,
        },
    };
    closed(triad_mqtt::serve(
        Counted::new(stream, ctx.conn.clone()),
        peer,
        mctx,
    ))
}
