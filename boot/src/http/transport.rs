//! The transport: the accept loops (never paused; a flood waits in no backlog), admission of
//! each connection to a slot ([`crate::admission`]), TLS on the HTTPS port, and the deadlines
//! on every read and write; each request then goes to [`HttpServer::route`].

use super::*;

impl HttpServer {
    /// Accepts and serves connections on both ports until `shutdown` is cancelled; then closes
    /// both listeners (new connections are refused), lets the requests in flight finish for
    /// up to `drain`, and returns.
    pub async fn run(self, listeners: Listeners, shutdown: CancellationToken, drain: Duration) {
        let server = Arc::new(self);
        let connections = TaskTracker::new();
        tokio::join!(
            server.clone().accept(listeners.http, Port::Http, &connections, &shutdown),
            server.clone().accept(listeners.https, Port::Https, &connections, &shutdown),
        );
        // Event streams never end by themselves: end them, or they would hold the drain.
        if let Some(page) = &server.status {
            page.close();
        }
        connections.close();
        let open = connections.len();
        if tokio::time::timeout(drain, connections.wait()).await.is_err() {
            tracing::warn!(
                left = connections.len(),
                deadline = ?drain,
                "HTTP connections still open after the drain deadline; leaving them"
            );
        } else {
            tracing::info!(drained = open, "HTTP server stopped");
        }
    }

    /// One port's accept loop, until `shutdown`. Accept errors (out of file descriptors, ...)
    /// are logged and retried after a backoff: they must not take the appliance down.
    pub(super) async fn accept(
        self: Arc<Self>,
        listener: TcpListener,
        port: Port,
        connections: &TaskTracker,
        shutdown: &CancellationToken,
    ) {
        let mut backoff = Backoff::default();
        loop {
            // Never paused for want of a slot: a known host's connect must not wait in the
            // backlog behind a flood, so every connection is accepted and admitted or closed.
            let accepted = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let (stream, remote) = match accepted {
                Ok(accepted) => {
                    backoff.succeeded();
                    accepted
                }
                // The client gave up before we accepted: nothing to wait for.
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    Metrics::add(&self.plane.metrics.http_accept_errors, 1);
                    let wait = backoff.failed();
                    tracing::warn!(error = %e, ?port, retry_in = ?wait, "cannot accept an HTTP connection");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            match self.slots.admit(remote.ip(), self.standing(remote)) {
                Ok(ticket) => {
                    let connection =
                        self.clone().connection(stream, remote, port, ticket, shutdown.clone());
                    connections.spawn(connection);
                }
                Err(refusal) => {
                    // Dropping the stream closes it. Debug level: a flood would fill the log.
                    Metrics::add(&self.plane.metrics.http_connections_refused, 1);
                    tracing::debug!(%remote, ?port, %refusal, "closing an HTTP connection on arrival");
                }
            }
        }
    }

    pub(super) async fn connection(
        self: Arc<Self>,
        stream: TcpStream,
        remote: SocketAddr,
        port: Port,
        ticket: Ticket,
        shutdown: CancellationToken,
    ) {
        let _ = stream.set_nodelay(true);
        let metrics = self.plane.metrics.clone();
        Metrics::add(&metrics.http_connections_active, 1);
        let evicted = ticket.evicted().clone();
        let slot = ticket.slot();
        let serve = async move {
            match port {
                Port::Http => {
                    // Files leave by sendfile, so only plain HTTP connections get a chunk queue.
                    let chunks = Arc::new(FileChunks::default());
                    let io = WriteDeadline::new(
                        SendfileStream::new(stream, chunks.clone()),
                        self.stall_timeout,
                    );
                    self.serve_http(io, remote, port, Some(chunks), slot, &shutdown).await
                }
                Port::Https => {
                    // Under TLS, so the stall deadline sees the client's real progress.
                    let io = WriteDeadline::new(stream, self.stall_timeout);
                    match tokio::time::timeout(self.handshake_timeout, self.tls.accept(io)).await {
                        Ok(Ok(tls)) => {
                            self.serve_http(tls, remote, port, None, slot, &shutdown).await
                        }
                        Ok(Err(e)) => tracing::debug!(%remote, error = %e, "TLS handshake failed"),
                        Err(_elapsed) => {
                            Metrics::add(&self.plane.metrics.http_timeouts, 1);
                            tracing::debug!(%remote, "TLS handshake not finished in time");
                        }
                    }
                }
            }
        };
        tokio::select! {
            () = serve => {}
            // A known host needed the slot: dropping the connection closes it, mid-request or not.
            () = evicted.cancelled() => {
                Metrics::add(&metrics.http_connections_evicted, 1);
                tracing::debug!(%remote, ?port, "closed a connection to give its slot to a known host");
            }
        }
        metrics.http_connections_active.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        drop(ticket);
    }

    /// HTTP/1.1 on `io` until the client closes, a deadline passes, or `shutdown` (then the
    /// request in flight is finished and the connection closed).
    pub(super) async fn serve_http<I>(
        self: Arc<Self>,
        io: I,
        remote: SocketAddr,
        port: Port,
        chunks: Option<Arc<FileChunks>>,
        slot: Slot,
        shutdown: &CancellationToken,
    ) where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let server = self.clone();
        let service = service_fn(move |req| {
            let (server, chunks) = (server.clone(), chunks.clone());
            async move { Ok::<_, Infallible>(server.route(req, remote, port, chunks, slot).await) }
        });
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_timeout)
            .serve_connection(TokioIo::new(io), service);
        let mut connection = std::pin::pin!(connection);
        let result = tokio::select! {
            result = connection.as_mut() => result,
            () = shutdown.cancelled() => {
                connection.as_mut().graceful_shutdown();
                connection.await
            }
        };
        if let Err(e) = result {
            if is_timeout(&e) {
                Metrics::add(&self.plane.metrics.http_timeouts, 1);
            }
            tracing::debug!(%remote, error = %e, "HTTP connection ended with an error");
        }
    }
}

/// The listen backlog asked for. The kernel caps it at `net.core.somaxconn` (per network
/// namespace; 4096 by default since Linux 5.4), and tokio's own `bind` asks for 128. The
/// accept loops never pause, so the queue fills only in a burst of connects faster than they
/// run; a SYN that finds it full is dropped (the client sends it again after 1 s, 3 s, ...),
/// SYN cookies (`net.ipv4.tcp_syncookies`, on by default) or not: cookies stand in only for
/// the queue of half-open connections (`tcp_max_syn_backlog`), against a SYN flood.
const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `addr` with [`LISTEN_BACKLOG`].
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    // As tokio's `bind` does: a restarted appliance binds again at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Errors of one connection that came and went before `accept()`: no reason to back off.
pub(super) fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset)
}

/// Whether a connection ended on a deadline: hyper's header timeout or a [`WriteDeadline`].
pub(super) fn is_timeout(e: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        source = s.source();
    }
    e.is_timeout()
}
