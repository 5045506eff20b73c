//! Glue between the listeners and the protocol adapters: each function turns the
//! broker-wide [`ConnContext`] into its adapter's context and serves one connection.

use std::borrow::Cow;
use std::net::SocketAddr;

use tokio::net::TcpStream;

use crate::listener::{ConnContext, ConnResult};

/// Serves one AMQP 0-9-1 connection.
pub async fn amqp(stream: TcpStream, peer: SocketAddr, ctx: ConnContext) -> ConnResult {
    let limits = &ctx.config.limits;
    let config = triad_amqp::AmqpConfig {
        frame_max: u32::try_from(limits.frame_max.bytes()).unwrap_or(u32::MAX),
        channel_max: limits.channel_max,
        heartbeat: limits.heartbeat.get(),
        max_message_size: limits.max_message_size.bytes(),
        handshake_timeout: limits.handshake_timeout.get(),
        ..triad_amqp::AmqpConfig::default()
    };
    let actx = triad_amqp::AmqpContext {
        broker: ctx.broker.clone(),
        config,
        shutdown: ctx.shutdown.clone(),
    };
    triad_amqp::serve(stream, peer, actx)
        .await
        .map(|()| Cow::Borrowed("closed"))
        .map_err(|e| e.into())
}
