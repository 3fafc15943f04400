//! Serving the boot media ([`crate::media`]) over HTTPS: the ISO with one request's parameters
//! written over its region, whole or as a single byte range, read and sent in chunks (a BMC
//! reads a 100 MB ISO; no request holds more than a chunk or two of it in memory). Under TLS
//! the bytes pass through user space anyway, so there is no sendfile here.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderMap, Response, header};
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};
use tokio::task::JoinHandle;

use super::static_files::{RangeRequest, Selected, parse_range, select};
use super::{Body, empty};
use crate::media::{BootMedia, MediaParams};
use crate::metrics::Metrics;

/// The most read from the file and handed to TLS at once.
const CHUNK: usize = 256 * 1024;

/// The response to a `GET` (or `HEAD`) of `media` patched with `params`, and the range it
/// answers (for the log).
pub(super) fn respond(
    media: Arc<BootMedia>,
    params: MediaParams,
    request_headers: &HeaderMap,
    head: bool,
    metrics: Arc<Metrics>,
) -> (Response<Body>, RangeRequest) {
    let len = media.file_len();
    let builder = Response::builder()
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::CACHE_CONTROL, "no-store");
    // A response has no validator (every key's bytes differ, and none is cached), so an
    // If-Range never matches: the whole file, as RFC 9110 says.
    let range = match request_headers.get(header::RANGE).and_then(|v| v.to_str().ok()) {
        Some(range) if !request_headers.contains_key(header::IF_RANGE) => parse_range(range, len),
        _ => RangeRequest::Full,
    };
    let (builder, Selected { start, count }) = match select(range, len, builder) {
        Ok(selected) => selected,
        Err(unsatisfiable) => return (*unsatisfiable, range),
    };
    let builder = builder.header(header::CONTENT_TYPE, "application/octet-stream");
    if head {
        return (builder.body(empty()).expect("valid response"), range);
    }
    let body = PatchedBody {
        media,
        params: Arc::new(params),
        next: start,
        left: count,
        reading: None,
        metrics,
    };
    (builder.body(body.boxed()).expect("valid response"), range)
}

/// `left` bytes of the patched file from `next`, read a chunk at a time on the blocking pool.
struct PatchedBody {
    media: Arc<BootMedia>,
    params: Arc<MediaParams>,
    next: u64,
    left: u64,
    /// The chunk being read, if one is.
    reading: Option<JoinHandle<io::Result<Vec<u8>>>>,
    metrics: Arc<Metrics>,
}

impl hyper::body::Body for PatchedBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<io::Result<Frame<Bytes>>>> {
        let this = &mut *self;
        if this.left == 0 {
            return Poll::Ready(None);
        }
        let reading = this.reading.get_or_insert_with(|| {
            let (media, params, at) = (this.media.clone(), this.params.clone(), this.next);
            let len = this.left.min(CHUNK as u64) as usize;
            tokio::task::spawn_blocking(move || media.read_patched(&params, at, len))
        });
        let read = ready!(Pin::new(reading).poll(cx));
        this.reading = None;
        let chunk = match read {
            Ok(Ok(chunk)) => chunk,
            Ok(Err(e)) => return Poll::Ready(Some(Err(e))),
            Err(e) => return Poll::Ready(Some(Err(io::Error::other(e)))),
        };
        this.next += chunk.len() as u64;
        this.left -= chunk.len() as u64;
        Metrics::add(&this.metrics.http_bytes, chunk.len() as u64);
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(chunk)))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}
