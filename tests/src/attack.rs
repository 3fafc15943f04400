//! Hostile clients for the denial-of-service tests: idle connections, stalled request bodies,
//! responses nobody reads, floods from many source addresses ([`Flood`]), and helpers to squeeze a process's file-descriptor limit. Sockets
//! are made inside a namespace ([`Netns::enter`]) and watched from the test thread.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::netns::Netns;

/// How long one connect may take (SYNs are retried if the server's backlog is full).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// What is kept of each connection's answer, for messages.
const KEEP: usize = 200;

/// Raises this process's RLIMIT_NOFILE (soft, and hard if need be) to at least `min`.
pub fn raise_fd_limit(min: u64) -> Result<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read or write the struct they are given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        bail!("getrlimit: {}", std::io::Error::last_os_error());
    }
    if limit.rlim_cur >= min {
        return Ok(limit.rlim_cur);
    }
    limit.rlim_cur = min;
    limit.rlim_max = limit.rlim_max.max(min);
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        bail!("raising RLIMIT_NOFILE to {min}: {}", std::io::Error::last_os_error());
    }
    Ok(min)
}

/// Sets another process's RLIMIT_NOFILE (soft and hard) to `limit`, as `prlimit --nofile`.
pub fn set_fd_limit(pid: u32, limit: u64) -> Result<()> {
    let new = libc::rlimit { rlim_cur: limit, rlim_max: limit };
    // SAFETY: prlimit reads `new` and writes nothing (old limit pointer is null).
    if unsafe { libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) }
        != 0
    {
        bail!("prlimit({pid}, NOFILE, {limit}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// File descriptors `pid` has open.
pub fn open_fds(pid: u32) -> Result<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("listing /proc/{pid}/fd"))?
        .count())
}

/// One connection as the client sees it.
struct Conn {
    stream: TcpStream,
    /// The first bytes received.
    head: Vec<u8>,
    bytes: u64,
    /// When EOF or a reset was seen.
    closed: Option<Instant>,
}

impl Conn {
    /// Reads what is there without blocking; notes EOF or a reset.
    fn poll(&mut self) {
        let mut buf = [0u8; 64 * 1024];
        while self.closed.is_none() {
            match self.stream.read(&mut buf) {
                Ok(0) => self.closed = Some(Instant::now()),
                Ok(n) => {
                    self.bytes += n as u64;
                    let room = KEEP.saturating_sub(self.head.len()).min(n);
                    self.head.extend_from_slice(&buf[..room]);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => self.closed = Some(Instant::now()),
            }
        }
    }
}

/// Connections a client opened, sent something (or nothing) on, and then stopped using.
pub struct Stalled {
    what: String,
    conns: Vec<Conn>,
    /// When the last one was opened and had its request sent.
    pub opened: Instant,
    /// Connects that failed, with why.
    pub failed: Vec<String>,
}

impl Stalled {
    /// `count` connections from inside `ns` to `server`, each sending `request` (maybe empty)
    /// and then nothing more.
    pub fn open(
        what: &str,
        ns: &Netns,
        server: SocketAddrV4,
        count: usize,
        request: &[u8],
    ) -> Result<Self> {
        let request = request.to_vec();
        let (streams, failed) = ns.enter(move || {
            let (mut streams, mut failed) = (Vec::new(), Vec::new());
            for _ in 0..count {
                let opened = TcpStream::connect_timeout(&SocketAddr::V4(server), CONNECT_TIMEOUT)
                    .and_then(|mut s| s.write_all(&request).map(|()| s));
                match opened {
                    Ok(s) => streams.push(s),
                    Err(e) => failed.push(e.to_string()),
                }
            }
            Ok((streams, failed))
        })?;
        let conns = streams
            .into_iter()
            .map(|stream| {
                stream.set_nonblocking(true)?;
                Ok(Conn { stream, head: Vec::new(), bytes: 0, closed: None })
            })
            .collect::<Result<_>>()?;
        Ok(Self { what: what.to_owned(), conns, opened: Instant::now(), failed })
    }

    pub fn len(&self) -> usize {
        self.conns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Reads what each has received; returns how many are still open.
    pub fn poll(&mut self) -> usize {
        self.conns.iter_mut().for_each(Conn::poll);
        self.conns.iter().filter(|c| c.closed.is_none()).count()
    }

    /// Polls until every connection was closed by the server, or `within` after
    /// [`opened`](Self::opened); the error says how many stayed open and what they got.
    pub fn wait_closed(&mut self, within: Duration) -> Result<Duration> {
        let deadline = self.opened + within;
        loop {
            let open = self.poll();
            if open == 0 {
                let last = self.conns.iter().filter_map(|c| c.closed).max();
                return Ok(last.map(|t| t.duration_since(self.opened)).unwrap_or_default());
            }
            if Instant::now() >= deadline {
                bail!(
                    "{}: {open} of {} connections still open {within:?} after they were opened \
                     (first answer: {:?})",
                    self.what,
                    self.conns.len(),
                    self.first_answer()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Reads everything there is (until EOF, a reset, or 1 s without data) and returns the
    /// total bytes received by each connection and whether the server had closed it.
    pub fn drain(&mut self) -> Vec<(u64, bool)> {
        let mut quiet_since = Instant::now();
        let mut total = self.total_bytes();
        while self.poll() > 0 && quiet_since.elapsed() < Duration::from_secs(1) {
            if self.total_bytes() != total {
                total = self.total_bytes();
                quiet_since = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.conns.iter().map(|c| (c.bytes, c.closed.is_some())).collect()
    }

    fn total_bytes(&self) -> u64 {
        self.conns.iter().map(|c| c.bytes).sum()
    }

    /// The start of what the first connection that got an answer received.
    pub fn first_answer(&self) -> String {
        self.conns
            .iter()
            .find(|c| !c.head.is_empty())
            .map(|c| String::from_utf8_lossy(&c.head).lines().next().unwrap_or("").to_owned())
            .unwrap_or_else(|| "none".to_owned())
    }
}

/// One HTTP/1.1 request from inside `ns`; returns the status code. The answer must come within
/// 5 s.
pub fn http_status(ns: &Netns, server: SocketAddrV4, method: &str, path: &str) -> Result<u16> {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {server}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let answer = ns.enter(move || {
        let mut stream = TcpStream::connect_timeout(&SocketAddr::V4(server), CONNECT_TIMEOUT)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(request.as_bytes())?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer)?;
        Ok(answer)
    })?;
    let text = String::from_utf8_lossy(&answer);
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no HTTP status in {text:?}"))
}

/// Many source addresses holding connections to one server, as an attacker with a block of
/// addresses does: slow readers (a tiny receive window, a little read each round, so the
/// server's write deadline never fires) and idle connections that send nothing. Whatever the
/// server closes is opened again at once, so the flood lasts until it is dropped. It runs on
/// its own thread inside the namespace.
pub struct Flood {
    open: Arc<AtomicUsize>,
    reopened: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What a [`Flood`] opens from each of its source addresses.
pub struct FloodPlan {
    pub sources: Vec<Ipv4Addr>,
    pub server: SocketAddrV4,
    /// Slow readers of `request`'s answer, from the sources in turn, connected one after the
    /// other before [`Flood::start`] returns.
    pub readers: usize,
    pub request: Vec<u8>,
    /// Idle connections per source, all started at once after the readers: a connect burst.
    pub idle: usize,
}

/// Bytes a slow reader reads per round.
const SLOW_READ: usize = 256;
const FLOOD_ROUND: Duration = Duration::from_millis(250);

/// One flood connection, from the client's side.
struct FloodConn {
    socket: socket2::Socket,
    source: Ipv4Addr,
    reader: bool,
    state: FloodState,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FloodState {
    Connecting,
    Open,
    Closed,
}

impl FloodConn {
    /// A socket from `source` with a receive window of a few hundred bytes; `blocking`
    /// connects within [`CONNECT_TIMEOUT`], else the SYN is sent and the connect goes on alone.
    fn connect(plan: &FloodPlan, source: Ipv4Addr, reader: bool, blocking: bool) -> Result<Self> {
        use socket2::{Domain, Socket, Type};
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        socket.set_recv_buffer_size(1024)?;
        socket.bind(&SocketAddr::V4(SocketAddrV4::new(source, 0)).into())?;
        let server = SocketAddr::V4(plan.server).into();
        let mut conn = Self { socket, source, reader, state: FloodState::Connecting };
        if blocking {
            conn.socket.connect_timeout(&server, CONNECT_TIMEOUT)?;
            conn.socket.set_nonblocking(true)?;
            conn.opened(plan);
        } else {
            conn.socket.set_nonblocking(true)?;
            match conn.socket.connect(&server) {
                Ok(()) => conn.opened(plan),
                Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(conn)
    }

    fn opened(&mut self, plan: &FloodPlan) {
        self.state = FloodState::Open;
        if self.reader && (&self.socket).write_all(&plan.request).is_err() {
            self.state = FloodState::Closed;
        }
    }

    /// One round: finish a connect, read a little, notice a close.
    fn poll(&mut self, plan: &FloodPlan) {
        match self.state {
            FloodState::Closed => {}
            FloodState::Connecting => match self.socket.take_error() {
                Ok(None) if self.socket.peer_addr().is_ok() => self.opened(plan),
                Ok(None) => {}
                Ok(Some(_)) | Err(_) => self.state = FloodState::Closed,
            },
            FloodState::Open => {
                let mut buf = [0u8; SLOW_READ];
                let want = if self.reader { SLOW_READ } else { 1 };
                match (&self.socket).read(&mut buf[..want]) {
                    Ok(0) => self.state = FloodState::Closed,
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(_) => self.state = FloodState::Closed,
                }
            }
        }
    }
}

impl Flood {
    /// Opens the readers (failing if one cannot connect), starts the idle burst, and keeps
    /// them all going on a thread inside `ns`.
    pub fn start(ns: &Netns, plan: FloodPlan) -> Result<Self> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        let open = Arc::new(AtomicUsize::new(0));
        let reopened = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let ns = ns.name().to_owned();
        let thread = std::thread::spawn({
            let (open, reopened, stop) = (open.clone(), reopened.clone(), stop.clone());
            move || {
                let started = (|| {
                    crate::netns::setns_current_thread(&ns)?;
                    let mut conns = Vec::new();
                    for &source in plan.sources.iter().cycle().take(plan.readers) {
                        conns.push(FloodConn::connect(&plan, source, true, true).with_context(
                            || format!("a slow reader from {source} cannot connect"),
                        )?);
                    }
                    for &source in &plan.sources {
                        for _ in 0..plan.idle {
                            conns.push(FloodConn::connect(&plan, source, false, false)?);
                        }
                    }
                    Ok(conns)
                })();
                let mut conns = match started {
                    Ok(conns) => {
                        let _ = ready_tx.send(Ok(()));
                        conns
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while !stop.load(Ordering::Relaxed) {
                    for conn in &mut conns {
                        conn.poll(&plan);
                        if conn.state != FloodState::Closed {
                            continue;
                        }
                        if let Ok(again) =
                            FloodConn::connect(&plan, conn.source, conn.reader, false)
                        {
                            *conn = again;
                            reopened.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    let now_open = conns.iter().filter(|c| c.state == FloodState::Open).count();
                    open.store(now_open, Ordering::Relaxed);
                    std::thread::sleep(FLOOD_ROUND);
                }
            }
        });
        ready_rx.recv().context("the flood thread ended before it started")??;
        Ok(Self { open, reopened, stop, thread: Some(thread) })
    }

    /// Connections open (the handshake done, no close seen) at the last round.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections opened again after the server closed them.
    pub fn reopened(&self) -> usize {
        self.reopened.load(Ordering::Relaxed)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
