//! A deadline on every write: a client that stops reading (its TCP window stays shut) loses its
//! connection after `timeout` without progress. The deadline restarts with every write that
//! goes through, so a multi-gigabyte image still downloads as long as the reader keeps reading.
//!
//! Reads need no such wrapper: hyper's header timeout covers the request head (also between
//! keep-alive requests), and the one body siteboot reads, the agent API's, has its own deadline.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// `io` with a deadline on each write, flush and shutdown that has to wait for the peer.
pub struct WriteDeadline<T> {
    io: T,
    timeout: Duration,
    /// Armed when a write first has to wait; disarmed when one completes.
    deadline: Pin<Box<Sleep>>,
    waiting: bool,
}

impl<T> WriteDeadline<T> {
    pub fn new(io: T, timeout: Duration) -> Self {
        Self { io, timeout, deadline: Box::pin(tokio::time::sleep(timeout)), waiting: false }
    }

    fn watch<R>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if poll.is_ready() {
            self.waiting = false;
            return poll;
        }
        if !self.waiting {
            self.waiting = true;
            self.deadline.as_mut().reset(Instant::now() + self.timeout);
        }
        ready!(self.deadline.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client read nothing for {:?}", self.timeout),
        )))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, poll)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const TIMEOUT: Duration = Duration::from_millis(200);

    #[tokio::test]
    async fn a_reader_that_stops_is_dropped() {
        let (near, _far) = tokio::io::duplex(64);
        let mut io = WriteDeadline::new(near, TIMEOUT);
        let started = std::time::Instant::now();
        let err = io.write_all(&[0; 4096]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= TIMEOUT);
    }

    #[tokio::test]
    async fn a_slow_but_live_reader_gets_everything() {
        let (near, mut far) = tokio::io::duplex(64);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut chunk = [0; 64];
            loop {
                tokio::time::sleep(TIMEOUT / 4).await;
                match far.read(&mut chunk).await.unwrap() {
                    0 => return got,
                    n => got.extend_from_slice(&chunk[..n]),
                }
            }
        });
        // Ten times the deadline in total, never that long without progress.
        let data: Vec<u8> = (0..64 * 40).map(|i| i as u8).collect();
        let mut io = WriteDeadline::new(near, TIMEOUT);
        io.write_all(&data).await.unwrap();
        io.shutdown().await.unwrap();
        drop(io);
        assert_eq!(reader.await.unwrap(), data);
    }
}
