//! An MQTT connection: the CONNECT phase ([`crate::connect`]), then the [`Session`]
//! under the core's one connection driver ([`triad_core::driver`]), then the session's
//! end (unacked messages given back, the will).

use std::net::SocketAddr;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use triad_core::driver::{drive, End, Stop};

use crate::connect::{accept, Ctx, Hello};
use crate::session::Closed;
use crate::{MqttContext, MqttError};

/// Serves one MQTT connection until it closes. Errors are what the peer did wrong or
/// I/O failures; log them at `debug`. The client id, user and vhost are recorded as
/// `client`, `user` and `vhost` in the current span (the listener's `conn` span, which
/// exists at `debug` only): a span of its own would cost each idle connection a second
/// registry slot.
// Not an `async fn` on purpose (see the comment inside).
#[allow(clippy::manual_async_fn)]
pub fn serve<S>(
    mut stream: S,
    peer: SocketAddr,
    ctx: MqttContext,
) -> impl std::future::Future<Output = Result<(), MqttError>> + Send
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    // The login settings go with the CONNECT phase (boxed, freed once it is done): the
    // connection keeps only what it needs afterwards, for as long as it lives.
    let MqttContext {
        broker,
        state,
        anonymous_user,
        limits,
        shutdown,
        login,
    } = ctx;
    let ctx = Ctx {
        broker,
        state,
        limits,
        shutdown,
    };
    let hello = Box::new(Hello {
        anonymous_user,
        login,
    });
    // An async block using its captures in place: an async fn would keep its arguments
    // twice (as captured and as locals) for as long as the connection lives.
    async move { run(&mut stream, peer, &ctx, hello).await }
}

async fn run<S>(
    stream: &mut S,
    peer: SocketAddr,
    ctx: &Ctx,
    hello: Box<Hello>,
) -> Result<(), MqttError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut rbuf = BytesMut::new();
    // Boxed: the CONNECT phase's state (the packet, login, takeover wait, refusals) is
    // larger than what a connected client keeps, and the task would be sized for it.
    let Some(mut k) = Box::pin(accept(stream, &mut rbuf, peer, ctx, hello)).await? else {
        return Ok(());
    };
    // `k` is used in place (moving its fields out would keep them twice in this future)
    let stop = Stop {
        shutdown: &ctx.shutdown,
        kick: None,
    };
    let ended = drive(stream, &mut k.session, &mut rbuf, stop, ctx.broker.alarms()).await;
    // a takeover cancels the connection's shutdown token: it ends as a shutdown would,
    // but the will goes out
    let shutdown = if k.registration.taken_over() {
        Ending::Abnormal
    } else {
        Ending::Shutdown
    };
    let end = match ended {
        Ok(End::Closed) => match k.session.take_closed() {
            Some(Closed::Error(e)) => Err(e),
            Some(Closed::Shutdown) => Ok(shutdown),
            Some(Closed::Disconnect) | None => Ok(Ending::Disconnect),
        },
        Ok(End::PeerClosed) => Ok(Ending::Abnormal),
        Ok(End::Kicked) => Ok(Ending::Abnormal),
        Ok(End::Silent) => Err(MqttError::Timeout("keep alive")),
        Ok(End::Shutdown) => Ok(shutdown),
        Ok(End::WriteStalled) => Ok(Ending::Abnormal),
        Err(e) => Err(e),
    };
    // the will goes out unless the client said DISCONNECT [MQTT-3.1.2-8], [MQTT-3.1.2-10]
    let abnormal = matches!(end, Ok(Ending::Abnormal) | Err(_));
    k.session.finish(abnormal, k.will.take());
    match end {
        Err(e) => {
            tracing::debug!(error = %e, "MQTT connection closed");
            Err(e)
        }
        Ok(_) => Ok(()),
    }
}

/// How a connected session ended, for its will.
enum Ending {
    /// DISCONNECT: no will.
    Disconnect,
    /// Broker shutdown: no will.
    Shutdown,
    /// The peer left, was taken over, or stopped reading: the will goes out.
    Abnormal,
}
