//! The DHCP socket loop: receive a batch of datagrams, handle each, send the replies that
//! announce no lease change, make the batch's lease changes durable with one sync (group
//! commit), then send the replies that announce them.
//!
//! No reply leaves before the lease it announces is on disk (and, with several replicas, in the
//! site's [checkpoint](super::checkpoint)), so a crash at any moment loses no lease a client was
//! told about. With leader election, nothing is answered outside this replica's term, and a
//! standby reads the checkpoint every [`STANDBY_REFRESH`]: its boot plane (HTTP, TFTP) knows the
//! leader's clients by their addresses, and so does it the moment it takes over.
//!
//! The loop has a thread and a single-threaded runtime of its own, and syncs the lease file on
//! that thread: it waits for each sync anyway, and on the shared runtime every batch cost a trip
//! to the blocking pool and back plus wake-ups of idle workers, which was most of its CPU.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::checkpoint::LeaseCheckpoint;
use super::journal::Journal;
use super::leases::{LeaseRecord, unix_now};
use super::server::{DhcpServer, Outcome, Port};
use crate::leadership::{LeadershipWatch, leading_now};

/// Datagrams handled per batch (and per sync).
const MAX_BATCH: usize = 256;
/// Large enough for any DHCP message (RFC 2131's minimum is 576; jumbo frames fit too).
const MAX_DATAGRAM: usize = 9000;
/// Bytes of requests a DHCP socket may hold unread.
const RECEIVE_QUEUE: usize = 4 << 20;
/// How often a standby reads the site's lease checkpoint. A read is one GET of the ConfigMap
/// (up to 1 MiB at ten thousand leases).
pub const STANDBY_REFRESH: Duration = Duration::from_secs(5);

/// Why the site's checkpoint is read now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CheckpointRead {
    /// The first read of this replica's term (or the first after a failed save): nothing is
    /// answered until it succeeds, since another replica may have led meanwhile.
    ForTerm,
    /// A standby's refresh, so that its boot plane knows the leader's clients.
    Refresh,
}

/// Whether to read the checkpoint `now`: a leader whose term has not read it yet, a standby
/// that has not read it for [`STANDBY_REFRESH`] (`refreshed`: when it last tried).
fn checkpoint_read_due(
    leading: bool,
    read_for_term: bool,
    refreshed: Option<Instant>,
    now: Instant,
) -> Option<CheckpointRead> {
    if leading {
        return (!read_for_term).then_some(CheckpointRead::ForTerm);
    }
    let due = refreshed.is_none_or(|at| now.duration_since(at) >= STANDBY_REFRESH);
    due.then_some(CheckpointRead::Refresh)
}

/// A UDP socket on `port` of all addresses, bound to `interface`: it sees broadcasts and sends
/// them out of that interface only. Non-blocking, for [`DhcpService::run`].
pub fn bind_socket(interface: &str, port: u16) -> io::Result<std::net::UdpSocket> {
    let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    socket.set_reuse_address(true)?;
    socket.set_broadcast(true)?;
    socket
        .bind_device(Some(interface.as_bytes()))
        .map_err(|e| io::Error::new(e.kind(), format!("binding to interface {interface}: {e}")))?;
    socket.set_nonblocking(true)?;
    // Requests queue here while the loop syncs the lease file, and a rack powered on at once
    // sends hundreds together: room for thousands rather than the default ~200 KiB's few hundred.
    // The forced size passes net.core.rmem_max (root); otherwise the kernel caps the plain one.
    if rustix::net::sockopt::set_socket_recv_buffer_size_force(&socket, RECEIVE_QUEUE).is_err() {
        socket.set_recv_buffer_size(RECEIVE_QUEUE)?;
    }
    socket.bind(&SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port).into()).map_err(|e| {
        io::Error::new(e.kind(), format!("binding UDP port {port} on {interface}: {e}"))
    })?;
    Ok(socket.into())
}

/// Sends each outcome's reply, if it has one, from the socket of the port it came in on.
async fn send_replies(dhcp: &UdpSocket, pxe: &UdpSocket, outcomes: Vec<(Port, Outcome)>) {
    for (port, outcome) in outcomes {
        let Some(reply) = outcome.reply else { continue };
        let socket = if port == Port::Pxe { pxe } else { dhcp };
        if let Err(e) = socket.send_to(&reply.bytes, reply.to).await {
            tracing::warn!(to = %reply.to, error = %e, "cannot send DHCP reply");
        }
    }
}

pub struct DhcpService {
    server: DhcpServer,
    /// `None` in proxy mode: nothing to persist.
    journal: Option<Journal>,
    /// When set, datagrams are answered only during this replica's term as the site's leader.
    leadership: Option<LeadershipWatch>,
    /// With several replicas: where their leases meet.
    checkpoint: Option<Arc<dyn LeaseCheckpoint>>,
    /// The checkpoint was loaded in this replica's current term, and no save failed since.
    checkpoint_loaded: bool,
    /// When this replica, as a standby, last tried to read the checkpoint.
    refreshed: Option<Instant>,
}

impl DhcpService {
    pub fn new(server: DhcpServer, journal: Option<Journal>) -> Self {
        Self {
            server,
            journal,
            leadership: None,
            checkpoint: None,
            checkpoint_loaded: false,
            refreshed: None,
        }
    }

    /// Answers only during this replica's terms as leader: with several appliances at a site,
    /// only the leader hands out addresses, and it shares them through `checkpoint`.
    pub fn led_by(
        mut self,
        leadership: LeadershipWatch,
        checkpoint: Option<Arc<dyn LeaseCheckpoint>>,
    ) -> Self {
        self.leadership = Some(leadership);
        self.checkpoint = checkpoint;
        self
    }

    fn is_leading(&self) -> bool {
        self.leadership.as_ref().is_none_or(leading_now)
    }

    /// Serves `dhcp` (port 67) and `pxe` (port 4011), both from [`bind_socket`], on a thread
    /// of its own until an I/O error, or until `shutdown`: then it finishes the batch in hand,
    /// writes the lease file compactly, and returns.
    pub async fn run(
        self,
        dhcp: std::net::UdpSocket,
        pxe: std::net::UdpSocket,
        shutdown: CancellationToken,
    ) -> io::Result<()> {
        let (done, finished) = tokio::sync::oneshot::channel();
        std::thread::Builder::new().name("siteboot-dhcp".to_owned()).spawn(move || {
            let served = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .and_then(|runtime| {
                    runtime.block_on(async {
                        let dhcp = UdpSocket::from_std(dhcp)?;
                        let pxe = UdpSocket::from_std(pxe)?;
                        self.serve(dhcp, pxe, shutdown).await
                    })
                });
            let _ = done.send(served);
        })?;
        finished.await.unwrap_or_else(|_| Err(io::Error::other("the DHCP thread panicked")))
    }

    /// The loop itself, on the DHCP thread: blocking there (the lease file's sync) holds up
    /// DHCP only, which waits for it in any case.
    async fn serve(
        mut self,
        dhcp: UdpSocket,
        pxe: UdpSocket,
        shutdown: CancellationToken,
    ) -> io::Result<()> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        // The lease gauge changes with time as well as with traffic, and a standby reads the
        // checkpoint (a new leader too, without waiting for a client): both on a tick.
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            let mut outcomes: Vec<(Port, Outcome)> = Vec::new();
            tokio::select! {
                r = dhcp.readable() => r?,
                r = pxe.readable() => r?,
                _ = tick.tick() => {
                    self.server.refresh_lease_gauge(unix_now());
                    let leading = self.is_leading();
                    self.read_checkpoint(leading).await;
                    continue;
                }
                _ = shutdown.cancelled() => break,
            }
            let leading = self.is_leading();
            let leading = self.read_checkpoint(leading).await && leading;
            // Take whatever is queued on both ports, so one sync covers many leases under load.
            for (socket, port) in [(&pxe, Port::Pxe), (&dhcp, Port::Dhcp)] {
                while outcomes.len() < MAX_BATCH {
                    match socket.try_recv_from(&mut buf) {
                        // Not leading: another appliance answers; the datagram is dropped.
                        Ok((n, SocketAddr::V4(from))) if leading => outcomes
                            .push((port, self.server.handle(&buf[..n], from, port, unix_now()))),
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        // An ICMP error queued on the socket (a client went away): not fatal.
                        Err(e) => {
                            tracing::debug!(error = %e, "DHCP socket receive error");
                            break;
                        }
                    }
                }
            }
            // A reply that announces no lease change (an OFFER, a NAK, a proxy answer) waits
            // for no sync: it leaves at once, while the batch's leases are being written.
            let (changes, answers): (Vec<_>, Vec<_>) =
                outcomes.into_iter().partition(|(_, outcome)| outcome.record.is_some());
            send_replies(&dhcp, &pxe, answers).await;
            let durable = self.commit(&changes).await;
            // The term may have ended while the leases were written: a deposed leader is silent.
            if !self.is_leading() {
                if !changes.is_empty() {
                    tracing::warn!(
                        replies = changes.len(),
                        "no longer leading: withholding this batch's DHCP replies"
                    );
                }
                continue;
            }
            // Never announce a lease that is not durable.
            if durable {
                send_replies(&dhcp, &pxe, changes).await;
            }
        }
        self.compact_on_shutdown();
        Ok(())
    }

    /// Reads the site's checkpoint into the table and the journal when it is due
    /// ([`checkpoint_read_due`]), merging by expiry. `false` while this replica leads and its
    /// term's read has not succeeded: nothing is answered then.
    async fn read_checkpoint(&mut self, leading: bool) -> bool {
        let Some(checkpoint) = self.checkpoint.clone() else {
            return true;
        };
        // A new term reads the checkpoint first: another replica may have led meanwhile.
        if !leading {
            self.checkpoint_loaded = false;
        }
        let now = Instant::now();
        let read = checkpoint_read_due(leading, self.checkpoint_loaded, self.refreshed, now);
        let Some(read) = read else {
            return true;
        };
        if read == CheckpointRead::Refresh {
            self.refreshed = Some(now);
        }
        let leases = match checkpoint.load().await {
            Ok(leases) => leases,
            Err(e) if read == CheckpointRead::ForTerm => {
                tracing::error!(error = %e, "cannot read the site's lease checkpoint; not answering DHCP until it can be read");
                return false;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the site's lease checkpoint; this standby's boot plane may not know the leader's newest clients");
                return true;
            }
        };
        let merged: Vec<LeaseRecord> = {
            let mut table = self.server.table();
            table.merge_all(&leases)
        };
        if read == CheckpointRead::ForTerm || !merged.is_empty() {
            tracing::info!(
                leases = leases.len(),
                merged = merged.len(),
                leading,
                "read the site's lease checkpoint"
            );
        }
        let journaled = self.append(merged);
        match read {
            CheckpointRead::ForTerm => {
                self.checkpoint_loaded = journaled;
                journaled
            }
            CheckpointRead::Refresh => true,
        }
    }

    /// Makes the batch's lease changes durable: the lease file, then the checkpoint. `false` if
    /// that failed (the replies that depend on them are then not sent; the clients retry).
    async fn commit(&mut self, outcomes: &[(Port, Outcome)]) -> bool {
        let records: Vec<_> = outcomes.iter().filter_map(|(_, o)| o.record.clone()).collect();
        if records.is_empty() {
            return true;
        }
        let leases: Vec<_> = records
            .iter()
            .filter_map(|r| match r {
                LeaseRecord::Lease(lease) => Some(lease.clone()),
                LeaseRecord::Declined { .. } => None,
            })
            .collect();
        if !self.append(records) {
            return false;
        }
        let Some(checkpoint) = self.checkpoint.clone() else {
            return true;
        };
        if leases.is_empty() {
            return true;
        }
        match checkpoint.save(leases).await {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "cannot save leases to the site's checkpoint; withholding the replies that depend on them and reading it again");
                self.checkpoint_loaded = false;
                false
            }
        }
    }

    /// Appends `records` to the lease file and syncs it, compacting the file when it has grown.
    /// Blocks the DHCP thread (see [`serve`](Self::serve)).
    fn append(&mut self, records: Vec<LeaseRecord>) -> bool {
        if records.is_empty() {
            return true;
        }
        let Some(journal) = self.journal.as_mut() else {
            return true;
        };
        let live = self.server.table().durable_count();
        let mut result = journal.append(&records);
        if result.is_ok() && journal.should_compact(live + records.len()) {
            result = journal.compact(&self.server.table().records());
        }
        match result {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "cannot write the lease file; withholding the replies that depend on it");
                false
            }
        }
    }

    /// Rewrites the lease file with the live leases only, so the next start replays little.
    fn compact_on_shutdown(&mut self) {
        let Some(journal) = self.journal.as_mut() else {
            return;
        };
        match journal.compact(&self.server.table().records()) {
            Ok(()) => tracing::info!("lease file written"),
            Err(e) => {
                tracing::error!(error = %e, "cannot compact the lease file at shutdown (its records stay valid)")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_reads_the_checkpoint_once_per_term_and_a_standby_every_refresh() {
        let t0 = Instant::now();
        let later = |d: Duration| t0 + d;
        // A term reads it before anything else, whenever the standby last did.
        assert_eq!(checkpoint_read_due(true, false, Some(t0), t0), Some(CheckpointRead::ForTerm));
        assert_eq!(checkpoint_read_due(true, true, None, later(STANDBY_REFRESH * 9)), None);
        // A standby at once, then every STANDBY_REFRESH.
        assert_eq!(checkpoint_read_due(false, false, None, t0), Some(CheckpointRead::Refresh));
        let soon = later(STANDBY_REFRESH - Duration::from_millis(1));
        assert_eq!(checkpoint_read_due(false, false, Some(t0), soon), None);
        assert_eq!(
            checkpoint_read_due(false, false, Some(t0), later(STANDBY_REFRESH)),
            Some(CheckpointRead::Refresh)
        );
    }
}
