//! Serving a file with HEAD, ETag/If-None-Match, Last-Modified and single byte ranges. The body
//! leaves by sendfile ([`super::sendfile`]): a multi-gigabyte image never passes through memory.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body_util::BodyExt;

use super::sendfile::{FileBody, FileChunks};
use super::{Body, empty, full};
use crate::metrics::Metrics;
use std::sync::Arc;

/// A byte range request, resolved against the file length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeRequest {
    /// No (usable) Range header: send the whole file.
    Full,
    /// Bytes `start..=end`.
    Partial { start: u64, end: u64 },
    /// A range outside the file: 416.
    Unsatisfiable,
}

/// Parses a `Range` header for a file of `len` bytes. Multiple ranges are answered with the
/// whole file, which RFC 9110 allows.
pub fn parse_range(value: &str, len: u64) -> RangeRequest {
    let Some(spec) = value.trim().strip_prefix("bytes=") else {
        return RangeRequest::Full;
    };
    if spec.contains(',') {
        return RangeRequest::Full;
    }
    let Some((start, end)) = spec.trim().split_once('-') else {
        return RangeRequest::Full;
    };
    let parse = |s: &str| s.trim().parse::<u64>().ok();
    match (start.trim().is_empty(), end.trim().is_empty()) {
        // "-N": the last N bytes.
        (true, false) => match parse(end) {
            Some(0) | None => RangeRequest::Unsatisfiable,
            Some(_) if len == 0 => RangeRequest::Unsatisfiable,
            Some(n) => RangeRequest::Partial { start: len.saturating_sub(n), end: len - 1 },
        },
        (false, _) => {
            let Some(start) = parse(start) else {
                return RangeRequest::Full;
            };
            let end = if end.trim().is_empty() { Some(u64::MAX) } else { parse(end) };
            match end {
                None => RangeRequest::Full,
                Some(end) if end < start => RangeRequest::Full,
                Some(_) if start >= len => RangeRequest::Unsatisfiable,
                Some(end) => RangeRequest::Partial { start, end: end.min(len - 1) },
            }
        }
        (true, true) => RangeRequest::Full,
    }
}

/// The response for `file` given the request's method and headers.
pub fn respond(
    file: File,
    len: u64,
    request_headers: &HeaderMap,
    head: bool,
    chunks: Arc<FileChunks>,
    metrics: Arc<Metrics>,
) -> std::io::Result<Response<Body>> {
    let meta = file.metadata()?;
    let etag = format!("\"{:x}-{:x}-{:x}.{:x}\"", meta.ino(), len, meta.mtime(), meta.mtime_nsec());
    let modified = UNIX_EPOCH + Duration::from_secs(meta.mtime().max(0) as u64);

    let header_str = |name| request_headers.get(name).and_then(|v: &HeaderValue| v.to_str().ok());
    let builder = Response::builder()
        .header(header::ETAG, &etag)
        .header(header::LAST_MODIFIED, httpdate::fmt_http_date(modified))
        .header(header::ACCEPT_RANGES, "bytes");

    if let Some(inm) = header_str(header::IF_NONE_MATCH)
        && inm.split(',').any(|t| t.trim() == etag || t.trim() == "*")
    {
        return Ok(builder.status(StatusCode::NOT_MODIFIED).body(empty()).expect("valid response"));
    }
    // If-Range with a stale validator means "send everything".
    let if_range_ok = header_str(header::IF_RANGE).is_none_or(|v| v.trim() == etag);
    let range = match header_str(header::RANGE) {
        Some(v) if if_range_ok => parse_range(v, len),
        _ => RangeRequest::Full,
    };
    let (builder, Selected { start, count }) = match select(range, len, builder) {
        Ok(selected) => selected,
        Err(unsatisfiable) => return Ok(*unsatisfiable),
    };
    let builder = builder.header(header::CONTENT_TYPE, "application/octet-stream");
    if head {
        return Ok(builder.body(empty()).expect("valid response"));
    }
    let body = FileBody::new(file, start, count, chunks, metrics);
    Ok(builder.body(body.boxed()).expect("valid response"))
}

/// The bytes of a body that a response sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Selected {
    pub start: u64,
    pub count: u64,
}

/// What `range` selects of a `len`-byte body: `builder` with the status, `Content-Length` and,
/// for a part, `Content-Range`, and the bytes to send; or the 416 answer.
pub(super) fn select(
    range: RangeRequest,
    len: u64,
    builder: http::response::Builder,
) -> Result<(http::response::Builder, Selected), Box<Response<Body>>> {
    let (builder, selected) = match range {
        RangeRequest::Full => (builder.status(StatusCode::OK), Selected { start: 0, count: len }),
        RangeRequest::Partial { start, end } => (
            builder
                .status(StatusCode::PARTIAL_CONTENT)
                .header(header::CONTENT_RANGE, format!("bytes {start}-{end}/{len}")),
            Selected { start, count: end - start + 1 },
        ),
        RangeRequest::Unsatisfiable => {
            return Err(Box::new(
                builder
                    .status(StatusCode::RANGE_NOT_SATISFIABLE)
                    .header(header::CONTENT_RANGE, format!("bytes */{len}"))
                    .header(header::CONTENT_TYPE, "text/plain")
                    .body(full("range not satisfiable\n"))
                    .expect("valid response"),
            ));
        }
    };
    Ok((builder.header(header::CONTENT_LENGTH, selected.count), selected))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_forms() {
        use RangeRequest::*;
        assert_eq!(parse_range("bytes=0-99", 1000), Partial { start: 0, end: 99 });
        assert_eq!(parse_range("bytes=900-", 1000), Partial { start: 900, end: 999 });
        assert_eq!(parse_range("bytes=-100", 1000), Partial { start: 900, end: 999 });
        assert_eq!(parse_range("bytes=-5000", 1000), Partial { start: 0, end: 999 });
        assert_eq!(parse_range("bytes=990-2000", 1000), Partial { start: 990, end: 999 });
        assert_eq!(parse_range("bytes=1000-", 1000), Unsatisfiable);
        assert_eq!(parse_range("bytes=-0", 1000), Unsatisfiable);
        assert_eq!(parse_range("bytes=0-", 0), Unsatisfiable);
        assert_eq!(parse_range("bytes=5-1", 1000), Full, "invalid: ignored");
        assert_eq!(parse_range("bytes=0-1,5-6", 1000), Full);
        assert_eq!(parse_range("items=0-1", 1000), Full);
        assert_eq!(parse_range("bytes=x-1", 1000), Full);
        assert_eq!(parse_range("bytes=18446744073709551615-", 10), Unsatisfiable);
    }
}
