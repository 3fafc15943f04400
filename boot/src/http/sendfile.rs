//! Zero-copy file bodies on plain HTTP: the bytes of a file go from the page cache to the socket
//! with sendfile(2), never through user space, as nginx sends them.
//!
//! hyper owns the framing (status line, headers, Content-Length, keep-alive) and only writes
//! buffers it is given, so a file body is given to it as placeholders: slices of one static
//! region, [`PLACEHOLDER`], whose contents are never sent. Each placeholder chunk's file range
//! waits in the connection's [`FileChunks`] queue, in body order. [`SendfileStream`], the
//! connection's socket, writes every other buffer as it is, and a placeholder by sendfile from
//! the file range at the head of the queue. hyper hands body buffers to the socket unchanged
//! (and in order) when the socket says it writes vectored, which this one does; hyper's
//! "flatten" strategy, which would copy the placeholder's zeros, is used only for sockets that
//! do not (or with `writev(false)`, which this server never sets).
//!
//! The stall deadline still applies: [`super::deadline::WriteDeadline`] wraps this socket, and a
//! sendfile that cannot proceed returns `Pending` like any other write.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

use crate::metrics::Metrics;

/// The largest placeholder, so the most one sendfile call is asked to send: big enough that
/// hyper asks for the next chunk rarely, and only address space (never touched, so no RSS).
const CHUNK: usize = 1 << 20;
static PLACEHOLDER: [u8; CHUNK] = [0; CHUNK];

fn placeholder_offset(buf: &[u8]) -> Option<usize> {
    let offset = (buf.as_ptr() as usize).checked_sub(PLACEHOLDER.as_ptr() as usize)?;
    (offset < CHUNK && !buf.is_empty()).then_some(offset)
}

/// One placeholder's file range.
struct Chunk {
    file: Arc<File>,
    offset: u64,
    len: usize,
    /// The body ends with this chunk: the socket is uncorked when it has been sent.
    last: bool,
}

/// The file ranges of the placeholders one connection has handed to hyper and not yet sent.
#[derive(Default)]
pub struct FileChunks {
    queue: Mutex<VecDeque<Chunk>>,
}

/// A response body of `count` bytes of `file` from `start`, sent by sendfile through `chunks`
/// (the queue of the connection it is written to).
pub struct FileBody {
    file: Arc<File>,
    next: u64,
    left: u64,
    chunks: Arc<FileChunks>,
    metrics: Arc<Metrics>,
}

impl FileBody {
    pub fn new(
        file: File,
        start: u64,
        count: u64,
        chunks: Arc<FileChunks>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self { file: Arc::new(file), next: start, left: count, chunks, metrics }
    }
}

impl hyper::body::Body for FileBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<io::Result<Frame<Bytes>>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let len = self.left.min(CHUNK as u64) as usize;
        self.left -= len as u64;
        let chunk = Chunk { file: self.file.clone(), offset: self.next, len, last: self.left == 0 };
        self.chunks.queue.lock().expect("file chunk queue lock").push_back(chunk);
        self.next += len as u64;
        Metrics::add(&self.metrics.http_bytes, len as u64);
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(&PLACEHOLDER[..len])))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}

/// A plain-HTTP connection's socket: placeholders go out by sendfile from `chunks`.
pub struct SendfileStream {
    stream: TcpStream,
    chunks: Arc<FileChunks>,
    /// TCP_CORK is on from a file body's first chunk to the end of its last (the socket has
    /// TCP_NODELAY, for short answers): sendfile then leaves in full segments, as with nginx's
    /// `tcp_nopush`. Uncorking once per body, not per chunk, saves two setsockopt calls and a
    /// partial segment per chunk; hyper asks for the next chunk as soon as one is sent, so the
    /// cork never holds data while the connection waits for anything else.
    corked: bool,
}

impl SendfileStream {
    pub fn new(stream: TcpStream, chunks: Arc<FileChunks>) -> Self {
        Self { stream, chunks, corked: false }
    }

    /// Sends (part of) the placeholder `buf`, which starts `offset` bytes into its chunk.
    fn poll_sendfile(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
        offset: usize,
    ) -> Poll<io::Result<usize>> {
        let mut queue = self.chunks.queue.lock().expect("file chunk queue lock");
        let Some(chunk) = queue.front() else {
            return Poll::Ready(Err(io::Error::other("a file body chunk without its file")));
        };
        if !self.corked {
            rustix::net::sockopt::set_tcp_cork(&self.stream, true)?;
            self.corked = true;
        }
        let mut position = chunk.offset + offset as u64;
        let want = buf.len().min(chunk.len.saturating_sub(offset));
        loop {
            ready!(self.stream.poll_write_ready(cx))?;
            let sent = self.stream.try_io(Interest::WRITABLE, || {
                rustix::fs::sendfile(&self.stream, &*chunk.file, Some(&mut position), want)
                    .map_err(io::Error::from)
            });
            match sent {
                // The file is shorter than the Content-Length promised: end the connection.
                Ok(0) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the file shrank while it was being sent",
                    )));
                }
                Ok(n) => {
                    if offset + n >= chunk.len && queue.pop_front().is_some_and(|c| c.last) {
                        // Uncorking sends the body's last partial segment now.
                        rustix::net::sockopt::set_tcp_cork(&self.stream, false)?;
                        self.corked = false;
                    }
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncRead for SendfileStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for SendfileStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match placeholder_offset(buf) {
            Some(offset) => self.poll_sendfile(cx, buf, offset),
            None => Pin::new(&mut self.stream).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // Ordinary buffers up to the first placeholder in one writev; a placeholder alone.
        match bufs.iter().position(|b| placeholder_offset(b).is_some()) {
            Some(0) => {
                let offset = placeholder_offset(&bufs[0]).expect("a placeholder");
                self.poll_sendfile(cx, &bufs[0], offset)
            }
            Some(first) => Pin::new(&mut self.stream).poll_write_vectored(cx, &bufs[..first]),
            None => Pin::new(&mut self.stream).poll_write_vectored(cx, bufs),
        }
    }

    /// Must stay true: hyper flattens (copies) body buffers for a socket that is not.
    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
