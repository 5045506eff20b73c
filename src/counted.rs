//! A connection's stream with its bytes counted: RabbitMQ's `recv_oct` / `recv_cnt` /
//! `send_oct` / `send_cnt` on `/api/connections`. Each read or write call that moved
//! bytes adds to the connection's registry entry ([`ConnInfo::note_recv`],
//! [`ConnInfo::note_send`]: plain stores on the connection's own entry, no lock): one
//! per read or write system call, not per message. Over TLS the figures are the
//! protocol's bytes (inside the records); over a WebSocket, the protocol's bytes inside
//! the frames.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use triad_core::conns::ConnInfo;

/// `S` with its bytes counted into `info` (when the connection is registered).
pub struct Counted<S> {
    inner: S,
    info: Option<Arc<ConnInfo>>,
}

impl<S> Counted<S> {
    pub fn new(inner: S, info: Option<Arc<ConnInfo>>) -> Counted<S> {
        Counted { inner, info }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let me = &mut *self;
        let r = Pin::new(&mut me.inner).poll_read(cx, buf);
        if let (Poll::Ready(Ok(())), Some(info)) = (&r, &me.info) {
            let n = buf.filled().len().saturating_sub(before);
            if n > 0 {
                info.note_recv(n);
            }
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        let r = Pin::new(&mut me.inner).poll_write(cx, buf);
        if let (Poll::Ready(Ok(n)), Some(info)) = (&r, &me.info) {
            if *n > 0 {
                info.note_send(*n);
            }
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = &mut *self;
        let r = Pin::new(&mut me.inner).poll_write_vectored(cx, bufs);
        if let (Poll::Ready(Ok(n)), Some(info)) = (&r, &me.info) {
            if *n > 0 {
                info.note_send(*n);
            }
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
