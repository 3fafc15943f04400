//! TFTP sockets: one listening socket for requests, and a fresh socket (a new transfer ID) per
//! transfer, as RFC 1350 requires; each transfer is a task driving a [`Transfer`].

use std::collections::HashSet;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use siteboot_ipxe::IpxeBinaries;
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::packet::{self, ErrorCode, Packet};
use super::transfer::{self, Limits, Send, Transfer};
use crate::admission::{Caps, CapsError, Refusal, Slots, Standing};
use crate::backoff::Backoff;
use crate::files::{FileError, FileRoot};
use crate::inventory::Inventory;
use crate::metrics::Metrics;
use crate::neighbors::Neighbors;
use crate::timeline::{Stage, Timeline};

/// The `tftp:` section of the configuration. A field left out takes its value from
/// [`TftpSettings::default`], the one place the defaults are written (`examples/standalone.yaml`
/// shows each, checked by a test).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TftpSettings {
    /// Directory of the iPXE binaries handed to firmware (default: Debian's `ipxe` package).
    pub ipxe_dir: PathBuf,
    /// Optional directory of further files served read-only.
    pub root: Option<PathBuf>,
    /// Transfers in progress at once; further requests are refused until one ends. Each takes
    /// two file descriptors (its socket and the file). The default lets a few racks' firmware
    /// fetch iPXE at once (a refused one depends on its firmware retrying).
    pub max_transfers: usize,
    /// Transfers one client address may have in progress at once (a booting host needs one).
    pub max_transfers_per_address: usize,
    /// Largest block size a client may negotiate (RFC 2348).
    pub max_block_size: u16,
    /// Largest window a client may negotiate (RFC 7440).
    pub max_window_size: u16,
    /// Retransmission timeout when the client does not negotiate one.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Longest retransmission timeout a client may negotiate (RFC 2349). A client asking for
    /// more does not get the option acknowledged and runs with `timeout`: with `retries`, this
    /// bounds how long an abandoned transfer holds its slot. Whole seconds, 1s-255s.
    #[serde(with = "humantime_serde")]
    pub max_timeout: Duration,
    /// Retransmissions before a transfer is abandoned.
    pub retries: u32,
}

impl Default for TftpSettings {
    fn default() -> Self {
        Self {
            ipxe_dir: PathBuf::from("/usr/lib/ipxe"),
            root: None,
            max_transfers: 256,
            max_transfers_per_address: 8,
            max_block_size: 1468,
            max_window_size: 64,
            timeout: Duration::from_secs(1),
            max_timeout: Duration::from_secs(10),
            retries: 5,
        }
    }
}

impl TftpSettings {
    pub fn limits(&self) -> Limits {
        Limits {
            max_block_size: self.max_block_size,
            max_window_size: self.max_window_size,
            default_timeout: self.timeout,
            max_timeout: self.max_timeout,
            max_retries: self.retries,
        }
    }

    /// The transfer caps; an error names what is wrong with which field.
    pub fn caps(&self) -> Result<Caps, CapsError> {
        Caps::new(self.max_transfers, self.max_transfers_per_address, 0)
    }
}

/// Why the TFTP server cannot start.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("opening a file root: {0}")]
    Root(#[from] std::io::Error),
    #[error("tftp transfer caps: {0}")]
    Caps(#[from] CapsError),
}

pub struct TftpServer {
    address: Ipv4Addr,
    binaries: Arc<IpxeBinaries>,
    ipxe_root: FileRoot,
    root: Option<FileRoot>,
    limits: Limits,
    slots: Arc<Slots>,
    /// Clients with a transfer running: a retransmitted request must not start a second one.
    active: Arc<Mutex<HashSet<SocketAddrV4>>>,
    /// The transfers under way, for shutdown to wait for.
    transfers: TaskTracker,
    timeline: Arc<Timeline>,
    metrics: Arc<Metrics>,
    neighbors: Arc<Neighbors>,
    /// Which MACs are the site's hosts: their transfers go first once every slot is taken.
    inventory: Arc<dyn Inventory>,
}

/// The largest request we read: RFC 2347 limits a request to 512 bytes.
const MAX_REQUEST: usize = 512;

impl TftpServer {
    pub fn new(
        address: Ipv4Addr,
        settings: &TftpSettings,
        binaries: Arc<IpxeBinaries>,
        timeline: Arc<Timeline>,
        metrics: Arc<Metrics>,
        neighbors: Arc<Neighbors>,
        inventory: Arc<dyn Inventory>,
    ) -> Result<Self, SetupError> {
        let ipxe_root = FileRoot::open(binaries.dir())?;
        let root = settings.root.as_deref().map(FileRoot::open).transpose()?;
        Ok(Self {
            address,
            binaries,
            ipxe_root,
            root,
            limits: settings.limits(),
            slots: Slots::new(settings.caps()?),
            active: Arc::default(),
            transfers: TaskTracker::new(),
            timeline,
            metrics,
            neighbors,
            inventory,
        })
    }

    /// Serves requests arriving on `socket` (bound to port 69) until `shutdown`; then it takes
    /// no new transfer and waits up to `drain` for those under way. Receive errors are logged
    /// and retried after a backoff, never fatal.
    pub async fn run(self, socket: UdpSocket, shutdown: CancellationToken, drain: Duration) {
        let mut buf = vec![0u8; MAX_REQUEST + 1];
        let mut backoff = Backoff::default();
        loop {
            let received = tokio::select! {
                received = socket.recv_from(&mut buf) => received,
                _ = shutdown.cancelled() => break,
            };
            let (len, from) = match received {
                Ok(received) => {
                    backoff.succeeded();
                    received
                }
                Err(e) => {
                    let wait = backoff.failed();
                    tracing::warn!(error = %e, retry_in = ?wait, "TFTP receive error");
                    tokio::time::sleep(wait).await;
                    continue;
                }
            };
            let SocketAddr::V4(from) = from else { continue };
            if len > MAX_REQUEST {
                self.refuse(&socket, from, ErrorCode::IllegalOperation, "request too long").await;
                continue;
            }
            self.request(&socket, &buf[..len], from).await;
        }
        self.transfers.close();
        let running = self.transfers.len();
        if running > 0 {
            tracing::info!(transfers = running, deadline = ?drain, "TFTP: finishing the transfers under way");
        }
        if tokio::time::timeout(drain, self.transfers.wait()).await.is_err() {
            tracing::warn!(
                transfers = self.transfers.len(),
                "TFTP: transfers still running at the drain deadline are cut off"
            );
        }
    }

    async fn request(&self, listener: &UdpSocket, bytes: &[u8], from: SocketAddrV4) {
        let req = match packet::parse(bytes) {
            Ok(Packet::Request(req)) => req,
            Ok(_) => return, // stray DATA/ACK to the listening port: not a transfer of ours
            Err(e) => {
                tracing::debug!(%from, error = %e, "malformed TFTP request");
                return self
                    .refuse(listener, from, ErrorCode::IllegalOperation, &e.to_string())
                    .await;
            }
        };
        if req.write {
            tracing::info!(%from, file = req.filename, "refusing a TFTP write request");
            return self
                .refuse(listener, from, ErrorCode::AccessViolation, "read-only server")
                .await;
        }
        let (file, size) = match self.open(req.filename) {
            Ok(found) => found,
            Err(e) => {
                tracing::info!(%from, file = req.filename, error = %e, "TFTP file not served");
                let code = match e {
                    FileError::NotFound | FileError::NotAFile => ErrorCode::FileNotFound,
                    _ => ErrorCode::AccessViolation,
                };
                return self.refuse(listener, from, code, &e.to_string()).await;
            }
        };
        if !self.active.lock().expect("active lock").insert(from) {
            return; // a retransmitted request for a transfer already running
        }
        let addr = IpAddr::V4(*from.ip());
        let admitted = match self.slots.admit(addr, Standing::Unknown) {
            // Every slot is taken: a host of the site takes the oldest unknown transfer's (many
            // addresses together must not keep its firmware from iPXE). Its standing is looked
            // up only now: it may read the ARP table, which most requests must not cost.
            Err(Refusal::Full(_)) => {
                let holder = self.neighbors.mac_of(*from.ip());
                let standing = Standing::of(false, holder, |mac| self.inventory.knows(mac));
                self.slots.admit(addr, standing)
            }
            other => other,
        };
        let slot = match admitted {
            Ok(slot) => slot,
            Err(refusal) => {
                self.active.lock().expect("active lock").remove(&from);
                tracing::info!(%from, %refusal, "refusing a TFTP transfer");
                let message = match refusal {
                    Refusal::PerAddress(_) => "too many transfers from this address",
                    Refusal::Full(_) | Refusal::FullOfKnownHosts(_) => "server busy, try again",
                };
                return self.refuse(listener, from, ErrorCode::NotDefined, message).await;
            }
        };
        // Looked up only now: it may read the ARP table, which refused requests must not cost.
        let mac = self.neighbors.mac_of(*from.ip());
        let negotiated = transfer::negotiate(&req.options, size, &self.limits);
        let name = req.filename.to_owned();
        if let Some(mac) = mac {
            self.timeline.record(
                mac,
                Stage::TftpStart,
                format!(
                    "{name} ({size} bytes, blksize {}, windowsize {})",
                    negotiated.block_size, negotiated.window_size
                ),
            );
        }
        let socket = match transfer_socket(self.address, from).await {
            Ok(s) => s,
            Err(e) => {
                self.active.lock().expect("active lock").remove(&from);
                tracing::error!(%from, error = %e, "cannot open a TFTP transfer socket");
                return;
            }
        };
        Metrics::add(&self.metrics.tftp_started, 1);
        Metrics::add(&self.metrics.tftp_active, 1);
        let (metrics, timeline, active, limits) =
            (self.metrics.clone(), self.timeline.clone(), self.active.clone(), self.limits);
        self.transfers.spawn(async move {
            let sent = send_file(&socket, &file, size, &negotiated, &limits, &metrics);
            let result = tokio::select! {
                result = sent => result,
                () = slot.evicted().cancelled() => {
                    Metrics::add(&metrics.tftp_evicted, 1);
                    let busy = packet::error(ErrorCode::NotDefined, "server busy, try again");
                    let _ = socket.send(&busy).await;
                    Err(TransferError::Evicted)
                }
            };
            active.lock().expect("active lock").remove(&from);
            metrics.tftp_active.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            match (&result, mac) {
                (Ok(()), Some(mac)) => timeline.record(mac, Stage::TftpDone, name.clone()),
                (Err(e), Some(mac)) => {
                    timeline.record(mac, Stage::TftpFailed, format!("{name}: {e}"))
                }
                _ => {}
            }
            match result {
                Ok(()) => Metrics::add(&metrics.tftp_completed, 1),
                Err(e) => {
                    Metrics::add(&metrics.tftp_failed, 1);
                    tracing::info!(%from, file = %name, error = %e, "TFTP transfer failed");
                }
            }
            drop(slot);
        });
    }

    /// The iPXE binaries come from their directory; anything else from the optional root.
    fn open(&self, name: &str) -> Result<(File, u64), FileError> {
        let trimmed = name.trim_start_matches('/');
        if self.binaries.is_binary(trimmed) {
            return self.ipxe_root.open_file(trimmed);
        }
        match &self.root {
            Some(root) => root.open_file(name),
            None => Err(FileError::NotFound),
        }
    }

    async fn refuse(&self, socket: &UdpSocket, to: SocketAddrV4, code: ErrorCode, message: &str) {
        Metrics::add(&self.metrics.tftp_refused, 1);
        let _ = socket.send_to(&packet::error(code, message), to).await;
    }
}

/// A new socket on the server address and an ephemeral port, connected to the client: the
/// kernel then delivers only that client's packets to this transfer.
async fn transfer_socket(address: Ipv4Addr, client: SocketAddrV4) -> std::io::Result<UdpSocket> {
    let socket = UdpSocket::bind(SocketAddrV4::new(address, 0)).await?;
    socket.connect(client).await?;
    Ok(socket)
}

#[derive(Debug, thiserror::Error)]
enum TransferError {
    #[error("no ACK after {0} retransmissions")]
    Timeout(u32),
    #[error("its slot went to a host of the site (every transfer slot was taken)")]
    Evicted,
    #[error("client sent error {code}: {message}")]
    Client { code: u16, message: String },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

async fn send_file(
    socket: &UdpSocket,
    file: &File,
    size: u64,
    negotiated: &transfer::Negotiated,
    limits: &Limits,
    metrics: &Metrics,
) -> Result<(), TransferError> {
    let mut transfer = Transfer::new(size, negotiated, limits);
    let mut packet = vec![0u8; 4 + negotiated.block_size as usize];
    let mut ack_buf = [0u8; 516];
    let mut highest_sent = 0u64;
    let mut send = transfer.start();
    // The retransmission deadline moves only when we send: stale ACKs cannot keep a stalled
    // transfer alive.
    let mut deadline = tokio::time::Instant::now();
    loop {
        match send {
            Send::Done => return Ok(()),
            Send::GiveUp => return Err(TransferError::Timeout(limits.max_retries)),
            Send::Oack => {
                socket.send(&packet::oack(&negotiated.oack)).await?;
            }
            Send::Blocks { first, last } => {
                for block in first..=last {
                    let (offset, len) = transfer.block_range(block, size);
                    packet::data_header(&mut packet, Transfer::wire_block(block));
                    // Boot files are small and hot in the page cache: a positional read is
                    // cheaper here than a trip through the blocking pool.
                    file.read_exact_at(&mut packet[4..4 + len], offset)?;
                    socket.send(&packet[..4 + len]).await?;
                    if block > highest_sent {
                        highest_sent = block;
                        Metrics::add(&metrics.tftp_bytes, len as u64);
                    }
                }
            }
            Send::Nothing => {}
        }
        if send != Send::Nothing {
            deadline = tokio::time::Instant::now() + negotiated.timeout;
        }
        send = match tokio::time::timeout_at(deadline, socket.recv(&mut ack_buf)).await {
            Err(_elapsed) => transfer.on_timeout(),
            Ok(Err(e)) => return Err(e.into()),
            Ok(Ok(n)) => match packet::parse(&ack_buf[..n]) {
                Ok(Packet::Ack { block }) => transfer.on_ack(block),
                Ok(Packet::Error { code, message }) => {
                    return Err(TransferError::Client { code, message: message.to_owned() });
                }
                _ => Send::Nothing,
            },
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MacAddr;
    use crate::inventory::{BootAction, BootRequest, BoxFuture};

    const BLOCK: usize = 512;

    /// An inventory that knows one MAC, or none.
    struct Knows(Option<MacAddr>);

    impl Inventory for Knows {
        fn boots(&self, mac: MacAddr) -> bool {
            self.0 == Some(mac)
        }

        fn boot_action(&self, _: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
            Box::pin(async { None })
        }
    }

    fn rrq(name: &str) -> Vec<u8> {
        [&[0, 1][..], name.as_bytes(), &[0], b"octet", &[0]].concat()
    }

    fn ack(block: u16) -> Vec<u8> {
        [&[0, 4][..], &block.to_be_bytes()].concat()
    }

    /// Receives one DATA packet: (block, payload length, the transfer's address).
    async fn data(client: &UdpSocket) -> (u16, usize, SocketAddr) {
        let mut buf = [0u8; 4 + BLOCK];
        let (n, from) = tokio::time::timeout(Duration::from_secs(5), client.recv_from(&mut buf))
            .await
            .expect("a DATA packet in time")
            .unwrap();
        assert_eq!(&buf[..2], &[0, 3], "a DATA packet");
        (u16::from_be_bytes([buf[2], buf[3]]), n - 4, from)
    }

    #[tokio::test]
    async fn shutdown_takes_no_new_transfer_and_finishes_the_ones_under_way() {
        let dir = tempfile::tempdir().unwrap();
        // Three and a bit blocks: the transfer needs four ACKs.
        std::fs::write(dir.path().join("undionly.kpxe"), vec![7u8; 3 * BLOCK + 10]).unwrap();
        let settings = TftpSettings { ipxe_dir: dir.path().to_owned(), ..TftpSettings::default() };
        let server = TftpServer::new(
            Ipv4Addr::LOCALHOST,
            &settings,
            Arc::new(IpxeBinaries::discover(dir.path())),
            Arc::new(Timeline::new()),
            Arc::new(Metrics::new()),
            Arc::new(Neighbors::from_arp(Vec::<(Ipv4Addr, MacAddr)>::new())),
            Arc::new(Knows(None)),
        )
        .unwrap();
        let listener = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(server.run(listener, shutdown.clone(), Duration::from_secs(10)));

        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.send_to(&rrq("undionly.kpxe"), port).await.unwrap();
        let (block, len, transfer) = data(&client).await;
        assert_eq!((block, len), (1, BLOCK));

        shutdown.cancel();
        // A new client is not served any more...
        let late = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        late.send_to(&rrq("undionly.kpxe"), port).await.unwrap();
        let mut buf = [0u8; 600];
        let answer = tokio::time::timeout(Duration::from_millis(500), late.recv_from(&mut buf));
        assert!(answer.await.is_err(), "a transfer started after shutdown");
        // ... while the transfer under way runs to its end, and then the server returns.
        let mut received = len;
        let mut last = block;
        while more_follows(received) {
            client.send_to(&ack(last), transfer).await.unwrap();
            let (block, len, _) = data(&client).await;
            assert_eq!(block, last + 1);
            received += len;
            last = block;
        }
        client.send_to(&ack(last), transfer).await.unwrap();
        assert_eq!(received, 3 * BLOCK + 10);
        tokio::time::timeout(Duration::from_secs(5), running)
            .await
            .expect("the server returns once the transfer is done")
            .unwrap();
    }

    /// Every slot held by transfers nobody acknowledges, from two addresses: a third unknown
    /// address is refused, a host of the site takes the oldest one's slot (its client is told
    /// so), and gets its file.
    #[tokio::test]
    async fn a_known_host_takes_the_slot_of_the_oldest_unknown_transfer_when_all_are_taken() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("undionly.kpxe"), vec![7u8; 100]).unwrap();
        let settings = TftpSettings {
            ipxe_dir: dir.path().to_owned(),
            max_transfers: 2,
            max_transfers_per_address: 1,
            ..TftpSettings::default()
        };
        let known: MacAddr = "52:54:00:00:00:01".parse().unwrap();
        let host = Ipv4Addr::new(127, 0, 0, 9);
        let metrics = Arc::new(Metrics::new());
        let server = TftpServer::new(
            Ipv4Addr::LOCALHOST,
            &settings,
            Arc::new(IpxeBinaries::discover(dir.path())),
            Arc::new(Timeline::new()),
            metrics.clone(),
            Arc::new(Neighbors::from_arp(vec![(host, known)])),
            Arc::new(Knows(Some(known))),
        )
        .unwrap();
        let listener = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        tokio::spawn(server.run(listener, shutdown.clone(), Duration::from_secs(1)));

        let mut holders = Vec::new();
        for last in [2, 3] {
            let holder = UdpSocket::bind((Ipv4Addr::new(127, 0, 0, last), 0)).await.unwrap();
            holder.send_to(&rrq("undionly.kpxe"), port).await.unwrap();
            assert_eq!(data(&holder).await.0, 1, "127.0.0.{last} holds a slot");
            holders.push(holder);
        }
        let stranger = UdpSocket::bind("127.0.0.4:0").await.unwrap();
        stranger.send_to(&rrq("undionly.kpxe"), port).await.unwrap();
        assert_eq!(first_packet(&stranger).await[..2], [0, 5], "an unknown third is refused");

        let client = UdpSocket::bind((host, 0)).await.unwrap();
        client.send_to(&rrq("undionly.kpxe"), port).await.unwrap();
        let (block, len, transfer) = data(&client).await;
        assert_eq!((block, len), (1, 100));
        client.send_to(&ack(1), transfer).await.unwrap();
        // The oldest holder's transfer ended, with an error saying why; the other's runs on.
        let ended = loop {
            let packet = first_packet(&holders[0]).await;
            if packet[..2] == [0, 5] {
                break packet;
            }
        };
        assert!(String::from_utf8_lossy(&ended).contains("server busy"));
        assert_eq!(metrics.tftp_evicted.load(std::sync::atomic::Ordering::Relaxed), 1);
        shutdown.cancel();
    }

    async fn first_packet(socket: &UdpSocket) -> Vec<u8> {
        let mut buf = [0u8; 600];
        let n = tokio::time::timeout(Duration::from_secs(5), socket.recv(&mut buf))
            .await
            .expect("a packet in time")
            .unwrap();
        buf[..n].to_vec()
    }

    /// Whether more DATA follows after `received` bytes (the last block is short).
    fn more_follows(received: usize) -> bool {
        received.is_multiple_of(BLOCK)
    }
}
