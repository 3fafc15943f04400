//! The DHCP socket loop: receive a batch of datagrams, handle each, make the batch's lease
//! changes durable with one sync (group commit), then send the replies.
//!
//! No reply leaves before the lease it announces is on disk, so a crash at any moment loses no
//! lease a client was told about.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;
use tokio::sync::watch;

use super::journal::Journal;
use super::leases::unix_now;
use super::server::{DhcpServer, Outcome, Port};

/// Datagrams handled per batch (and per sync).
const MAX_BATCH: usize = 256;
/// Large enough for any DHCP message (RFC 2131's minimum is 576; jumbo frames fit too).
const MAX_DATAGRAM: usize = 9000;

/// A UDP socket on `port` of all addresses, bound to `interface`: it sees broadcasts and sends
/// them out of that interface only.
pub fn bind_socket(interface: &str, port: u16) -> io::Result<UdpSocket> {
    let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    socket.set_reuse_address(true)?;
    socket.set_broadcast(true)?;
    socket
        .bind_device(Some(interface.as_bytes()))
        .map_err(|e| io::Error::new(e.kind(), format!("binding to interface {interface}: {e}")))?;
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port).into()).map_err(|e| {
        io::Error::new(e.kind(), format!("binding UDP port {port} on {interface}: {e}"))
    })?;
    UdpSocket::from_std(socket.into())
}

pub struct DhcpService {
    server: DhcpServer,
    /// `None` in proxy mode: nothing to persist.
    journal: Option<Journal>,
    /// When set, datagrams are answered only while it reads true (the site's leader).
    active: Option<watch::Receiver<bool>>,
}

impl DhcpService {
    pub fn new(server: DhcpServer, journal: Option<Journal>) -> Self {
        Self { server, journal, active: None }
    }

    /// Answers only while `active` is true: with several appliances at a site, only the
    /// leader hands out addresses.
    pub fn gated_by(mut self, active: watch::Receiver<bool>) -> Self {
        self.active = Some(active);
        self
    }

    fn is_active(&self) -> bool {
        self.active.as_ref().is_none_or(|a| *a.borrow())
    }

    /// Serves `dhcp` (port 67) and `pxe` (port 4011) until an I/O error.
    pub async fn run(mut self, dhcp: UdpSocket, pxe: UdpSocket) -> io::Result<()> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        // The lease gauge changes with time as well as with traffic: refresh it on a tick.
        let mut gauge = tokio::time::interval(Duration::from_secs(1));
        loop {
            let mut outcomes: Vec<(Port, Outcome)> = Vec::new();
            tokio::select! {
                r = dhcp.readable() => r?,
                r = pxe.readable() => r?,
                _ = gauge.tick() => {
                    self.server.refresh_lease_gauge(unix_now());
                    continue;
                }
            }
            // Take whatever is queued on both ports, so one sync covers many leases under load.
            for (socket, port) in [(&pxe, Port::Pxe), (&dhcp, Port::Dhcp)] {
                while outcomes.len() < MAX_BATCH {
                    match socket.try_recv_from(&mut buf) {
                        Ok((n, from)) => self.handle(&buf[..n], from, port, &mut outcomes),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        // An ICMP error queued on the socket (a client went away): not fatal.
                        Err(e) => {
                            tracing::debug!(error = %e, "DHCP socket receive error");
                            break;
                        }
                    }
                }
            }
            let durable = self.commit(&outcomes).await;
            for (port, outcome) in outcomes {
                let Some(reply) = outcome.reply else { continue };
                if outcome.record.is_some() && !durable {
                    continue; // never announce a lease that is not on disk
                }
                let socket = if port == Port::Pxe { &pxe } else { &dhcp };
                if let Err(e) = socket.send_to(&reply.bytes, reply.to).await {
                    tracing::warn!(to = %reply.to, error = %e, "cannot send DHCP reply");
                }
            }
        }
    }

    fn handle(
        &mut self,
        bytes: &[u8],
        from: SocketAddr,
        port: Port,
        out: &mut Vec<(Port, Outcome)>,
    ) {
        let SocketAddr::V4(from) = from else { return };
        if !self.is_active() {
            return; // not the leader: another appliance answers
        }
        out.push((port, self.server.handle(bytes, from, port, unix_now())));
    }

    /// Appends the batch's records and syncs them. `false` if that failed (the replies that
    /// depend on them are then not sent; the clients retry).
    async fn commit(&mut self, outcomes: &[(Port, Outcome)]) -> bool {
        let records: Vec<_> = outcomes.iter().filter_map(|(_, o)| o.record.clone()).collect();
        if records.is_empty() {
            return true;
        }
        let Some(mut journal) = self.journal.take() else {
            return true;
        };
        let live = self.server.table().durable_count();
        let snapshot =
            journal.should_compact(live + records.len()).then(|| self.server.table().records());
        let (journal, result) = tokio::task::spawn_blocking(move || {
            let mut result = journal.append(&records);
            if result.is_ok()
                && let Some(live) = snapshot
            {
                result = journal.compact(&live);
            }
            (journal, result)
        })
        .await
        .expect("journal task does not panic");
        self.journal = Some(journal);
        match result {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "cannot write the lease file; withholding the replies that depend on it");
                false
            }
        }
    }
}
