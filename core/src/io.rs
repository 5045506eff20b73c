//! Socket helpers shared by the protocol drivers (the first piece of the one connection
//! driver the adapters are moving to).

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

/// Most bytes taken per read while the read buffer is let go (on the task's stack).
const STACK_READ: usize = 8 << 10;

/// Reads once into `buf`. An empty `buf` is let go first and the read goes through a
/// buffer on the stack, copied into a `buf` just big enough: a connection waiting for
/// its peer holds no read buffer (4–8 KiB had been most of an idle connection's memory).
/// The rest of a frame that arrives in pieces is read straight into `buf`, which grows by
/// `grow` bytes when less than 1 KiB is free.
/// Cancel-safe: bytes read are in `buf` before the future returns `Ready`.
pub async fn read_some<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut BytesMut,
    grow: usize,
) -> std::io::Result<usize> {
    if !buf.is_empty() {
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(grow);
        }
        return stream.read_buf(buf).await;
    }
    if buf.capacity() > 0 {
        *buf = BytesMut::new();
    }
    std::future::poll_fn(|cx| {
        let mut stack = [std::mem::MaybeUninit::<u8>::uninit(); STACK_READ];
        let mut rb = tokio::io::ReadBuf::uninit(&mut stack);
        std::task::ready!(std::pin::Pin::new(&mut *stream).poll_read(cx, &mut rb))?;
        buf.extend_from_slice(rb.filled());
        std::task::Poll::Ready(Ok(rb.filled().len()))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_empty_buffer_is_let_go_and_a_partial_frame_grows_it() {
        let (mut a, mut b) = tokio::io::duplex(64);
        let mut buf = BytesMut::with_capacity(4096);
        tokio::io::AsyncWriteExt::write_all(&mut a, b"hello")
            .await
            .unwrap();
        assert_eq!(read_some(&mut b, &mut buf, 4096).await.unwrap(), 5);
        assert_eq!(&buf[..], b"hello");
        assert!(
            buf.capacity() < 4096,
            "read through the stack, buffer just big enough"
        );
        tokio::io::AsyncWriteExt::write_all(&mut a, b" world")
            .await
            .unwrap();
        assert_eq!(read_some(&mut b, &mut buf, 4096).await.unwrap(), 6);
        assert_eq!(&buf[..], b"hello world");
        drop(a);
        buf.clear();
        assert_eq!(read_some(&mut b, &mut buf, 4096).await.unwrap(), 0);
        assert_eq!(buf.capacity(), 0);
    }
}
