//! The appliance's own ARP probe: positive evidence, at the moment a ramdisk token is minted and
//! when secrets leave, that an on-link address is its lessee's. The kernel's ARP entry is not
//! enough there: any machine can plant one naming the lessee (a gratuitous ARP "X is-at
//! <victim's MAC>" from its own Ethernet address), or it can be stale, and on a segment that
//! floods unknown unicast the planter reads what is sent to the victim's MAC.
//!
//! So the appliance broadcasts "who-has X, tell <its own address>" and listens for
//! [`PROBE_DEADLINE`]; [`judge`] decides from every ARP packet about X seen meanwhile. A
//! machine that does not forge its Ethernet source cannot answer as the lessee, and a second
//! machine claiming X is a conflict. One that forges the lessee's MAC as its Ethernet source
//! too is not stopped here (switch port security is).

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::MacAddr;
use crate::inventory::BoxFuture;

/// How long the probe's answers are collected: a machine on the segment answers ARP within
/// milliseconds; a conflicting claim must have the same chance to arrive.
pub const PROBE_DEADLINE: Duration = Duration::from_millis(300);

/// One ARP packet whose sender protocol address is the probed address: someone says it is
/// theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArpClaim {
    /// The frame's Ethernet source.
    pub ethernet_source: MacAddr,
    /// The ARP sender hardware address.
    pub sender: MacAddr,
    /// A reply (op 2); else a request (op 1), e.g. a gratuitous ARP.
    pub is_reply: bool,
}

/// Why the segment did not confirm that an address is a MAC's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unconfirmed {
    #[error("the address is not this MAC's by the lease and ARP tables")]
    NotHolder,
    #[error("no ARP reply from the MAC itself within {PROBE_DEADLINE:?}")]
    NoAnswer,
    #[error(
        "an ARP packet for the address names {other} (a second machine claims it, or a forged entry)"
    )]
    Conflict { other: MacAddr },
    #[error("the appliance cannot send ARP probes on its interface (CAP_NET_RAW?)")]
    NoProbe,
    #[error("the ARP probe failed")]
    ProbeFailed,
}

/// Positive evidence that `mac` holds the probed address, from every claim seen: at least one
/// reply whose Ethernet source and ARP sender are both `mac`, and no claim naming any other MAC
/// in either place.
pub fn judge(mac: MacAddr, claims: &[ArpClaim]) -> Result<(), Unconfirmed> {
    let other =
        claims.iter().flat_map(|c| [c.ethernet_source, c.sender]).find(|named| *named != mac);
    if let Some(other) = other {
        return Err(Unconfirmed::Conflict { other });
    }
    if claims.iter().any(|c| c.is_reply) { Ok(()) } else { Err(Unconfirmed::NoAnswer) }
}

/// Sends the probe and collects the claims, or a stand-in for tests.
pub trait ArpProbe: Send + Sync {
    /// Broadcasts who-has `addr` and returns every claim to `addr` seen within
    /// [`PROBE_DEADLINE`].
    fn probe(&self, addr: Ipv4Addr) -> BoxFuture<'_, std::io::Result<Vec<ArpClaim>>>;
}

const ETH_P_ARP: u16 = libc::ETH_P_ARP as u16;
const ETHERNET_HEADER: usize = 14;
const ARP_FRAME: usize = ETHERNET_HEADER + 28;
const BROADCAST: [u8; 6] = [0xff; 6];

/// Probes on the served interface through a packet socket (AF_PACKET, CAP_NET_RAW), one socket
/// per probe so concurrent probes each see every answer.
pub struct PacketProbe {
    interface: String,
    ifindex: i32,
    /// The interface's address: the probe's sender, where the answers come.
    own_addr: Ipv4Addr,
}

impl PacketProbe {
    /// Fails now, not at the first probe, when the interface is unknown or packet sockets are
    /// not allowed.
    pub fn new(interface: &str, own_addr: Ipv4Addr) -> std::io::Result<Self> {
        let name = std::ffi::CString::new(interface)?;
        // SAFETY: reads the NUL-terminated name, which outlives the call.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(std::io::Error::last_os_error());
        }
        hardware_address(interface)?;
        let probe = Self { interface: interface.to_owned(), ifindex: ifindex as i32, own_addr };
        probe.socket()?;
        Ok(probe)
    }

    /// A non-blocking packet socket that receives the interface's ARP frames.
    fn socket(&self) -> std::io::Result<OwnedFd> {
        // Protocol 0 until bound: no frame of another interface is queued before.
        // SAFETY: socket(2) with constant arguments; the descriptor is owned at once.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket(2) and is owned by no one else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let at = self.link_address(&[0; 6]);
        // SAFETY: bind(2) reads `at`, a `sockaddr_ll` of the size given, for the call only.
        let bound = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&at as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if bound != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(fd)
    }

    fn link_address(&self, to: &[u8; 6]) -> libc::sockaddr_ll {
        // SAFETY: all-zero bytes are a valid `sockaddr_ll` (plain integers and arrays).
        let mut at: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        at.sll_family = libc::AF_PACKET as u16;
        at.sll_protocol = ETH_P_ARP.to_be();
        at.sll_ifindex = self.ifindex;
        at.sll_halen = 6;
        at.sll_addr[..6].copy_from_slice(to);
        at
    }

    async fn run(&self, addr: Ipv4Addr) -> std::io::Result<Vec<ArpClaim>> {
        // SAFETY: an `OwnedFd` is open and is the same descriptor until the `AsyncFd` drops it.
        let socket =
            unsafe { AsyncFd::register_with_interest(self.socket()?, Interest::READABLE) }?;
        // Read at each probe: a bridge's MAC changes as ports come and go, and the answers go
        // to the MAC the request names.
        let own_mac = hardware_address(&self.interface)?;
        let frame = request_frame(own_mac, self.own_addr, addr);
        let to = self.link_address(&BROADCAST);
        // SAFETY: sendto(2) reads `frame` and `to`, both alive for the call.
        let sent = unsafe {
            libc::sendto(
                socket.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&to as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if sent != frame.len() as isize {
            return Err(std::io::Error::last_os_error());
        }
        let mut claims = Vec::new();
        let collect = async {
            let mut buf = [0u8; 1514];
            loop {
                let mut ready = socket.readable().await?;
                // SAFETY: recv(2) writes at most `buf.len()` bytes into `buf`.
                let n = unsafe {
                    libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                };
                if n < 0 {
                    let error = std::io::Error::last_os_error();
                    if error.kind() != std::io::ErrorKind::WouldBlock {
                        return Err::<(), _>(error);
                    }
                    ready.clear_ready();
                    continue;
                }
                claims.extend(claim_in(&buf[..n as usize], addr));
            }
        };
        match tokio::time::timeout(PROBE_DEADLINE, collect).await {
            Ok(Err(error)) => Err(error),
            // The deadline: every claim that came in time.
            Ok(Ok(())) | Err(_) => Ok(claims),
        }
    }
}

impl ArpProbe for PacketProbe {
    fn probe(&self, addr: Ipv4Addr) -> BoxFuture<'_, std::io::Result<Vec<ArpClaim>>> {
        Box::pin(self.run(addr))
    }
}

/// The interface's MAC (`SIOCGIFHWADDR`).
fn hardware_address(interface: &str) -> std::io::Result<[u8; 6]> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
    // SAFETY: all-zero bytes are a valid `ifreq`.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (to, from) in request.ifr_name.iter_mut().zip(interface.bytes().take(libc::IFNAMSIZ - 1)) {
        *to = from as libc::c_char;
    }
    // SAFETY: SIOCGIFHWADDR reads the name and writes the address into `request`, for the call.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFHWADDR, &mut request) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFHWADDR filled the `ifru_hwaddr` member.
    let hardware = unsafe { request.ifr_ifru.ifru_hwaddr.sa_data };
    Ok(std::array::from_fn(|i| hardware[i] as u8))
}

/// A broadcast ARP request: who-has `target`, tell `own_addr` at `own_mac`.
fn request_frame(own_mac: [u8; 6], own_addr: Ipv4Addr, target: Ipv4Addr) -> [u8; ARP_FRAME] {
    let mut frame = [0u8; ARP_FRAME];
    frame[..6].copy_from_slice(&BROADCAST);
    frame[6..12].copy_from_slice(&own_mac);
    frame[12..14].copy_from_slice(&ETH_P_ARP.to_be_bytes());
    // Ethernet, IPv4, 6- and 4-byte addresses, a request.
    frame[14..22].copy_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    frame[22..28].copy_from_slice(&own_mac);
    frame[28..32].copy_from_slice(&own_addr.octets());
    // Target hardware address: unknown (zeros).
    frame[38..42].copy_from_slice(&target.octets());
    frame
}

/// The claim in `frame` if it is an Ethernet/IPv4 ARP request or reply whose sender protocol
/// address is `addr`.
fn claim_in(frame: &[u8], addr: Ipv4Addr) -> Option<ArpClaim> {
    let frame = frame.get(..ARP_FRAME)?;
    let mac = |at: usize| MacAddr::from_chaddr(&frame[at..at + 6]);
    if frame[12..14] != ETH_P_ARP.to_be_bytes() || frame[14..20] != [0, 1, 0x08, 0x00, 6, 4] {
        return None;
    }
    let is_reply = match frame[20..22] {
        [0, 1] => false,
        [0, 2] => true,
        _ => return None,
    };
    if frame[28..32] != addr.octets() {
        return None;
    }
    Some(ArpClaim { ethernet_source: mac(6)?, sender: mac(22)?, is_reply })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac(n: u8) -> MacAddr {
        MacAddr::new([0x52, 0x54, 0, 0, 0, n])
    }

    const LESSEE: u8 = 1;
    const OTHER: u8 = 9;

    fn claim(ethernet_source: u8, sender: u8, is_reply: bool) -> ArpClaim {
        ArpClaim { ethernet_source: mac(ethernet_source), sender: mac(sender), is_reply }
    }

    /// What the probe's answers prove, for the lessee mac(1); mac(9) is anyone else.
    #[test]
    fn the_judgement_matrix() {
        let lessee_replies = claim(LESSEE, LESSEE, true);
        let cases: [(&str, Vec<ArpClaim>, Result<(), Unconfirmed>); 10] = [
            ("the lessee answers", vec![lessee_replies], Ok(())),
            ("the lessee answers twice", vec![lessee_replies, lessee_replies], Ok(())),
            (
                "the lessee answers and announces itself",
                vec![claim(LESSEE, LESSEE, false), lessee_replies],
                Ok(()),
            ),
            ("no answer", vec![], Err(Unconfirmed::NoAnswer)),
            (
                "only a gratuitous request from the lessee",
                vec![claim(LESSEE, LESSEE, false)],
                Err(Unconfirmed::NoAnswer),
            ),
            (
                "a planted reply: the lessee's MAC as sender, sent from another",
                vec![claim(OTHER, LESSEE, true)],
                Err(Unconfirmed::Conflict { other: mac(OTHER) }),
            ),
            (
                "the lessee's Ethernet source naming another sender",
                vec![claim(LESSEE, OTHER, true)],
                Err(Unconfirmed::Conflict { other: mac(OTHER) }),
            ),
            (
                "the lessee and another machine answer",
                vec![lessee_replies, claim(OTHER, OTHER, true)],
                Err(Unconfirmed::Conflict { other: mac(OTHER) }),
            ),
            (
                "the lessee answers while another announces the lessee's MAC",
                vec![lessee_replies, claim(OTHER, LESSEE, false)],
                Err(Unconfirmed::Conflict { other: mac(OTHER) }),
            ),
            (
                "another machine answers for itself",
                vec![claim(OTHER, OTHER, true)],
                Err(Unconfirmed::Conflict { other: mac(OTHER) }),
            ),
        ];
        for (case, claims, expected) in cases {
            assert_eq!(judge(mac(LESSEE), &claims), expected, "{case}");
        }
    }

    const APPLIANCE: [u8; 6] = [0x52, 0x54, 0, 0, 0, 0xaa];
    const APPLIANCE_ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const PROBED: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);

    /// An answer to the probe: `sender` at `PROBED`, from `source`.
    fn reply(source: u8, sender: u8) -> Vec<u8> {
        let mut frame = request_frame(mac(sender).octets(), PROBED, APPLIANCE_ADDR).to_vec();
        frame[..6].copy_from_slice(&APPLIANCE);
        frame[6..12].copy_from_slice(&mac(source).octets());
        frame[21] = 2;
        frame[32..38].copy_from_slice(&APPLIANCE);
        frame
    }

    #[test]
    fn the_probe_asks_everyone_who_has_the_address_telling_the_appliance() {
        let frame = request_frame(APPLIANCE, APPLIANCE_ADDR, PROBED);
        assert_eq!(&frame[..6], &[0xff; 6], "broadcast");
        assert_eq!(&frame[6..12], &APPLIANCE, "from the appliance's own MAC");
        assert_eq!(&frame[12..14], &[0x08, 0x06]);
        assert_eq!(&frame[20..22], &[0, 1], "a request");
        assert_eq!((&frame[22..28], &frame[28..32]), (&APPLIANCE[..], &[10, 0, 0, 1][..]));
        assert_eq!(&frame[38..42], &[10, 0, 0, 100]);
        // Its own request names the appliance's address, not the probed one: no claim.
        assert_eq!(claim_in(&frame, PROBED), None);
    }

    #[test]
    fn claims_are_arp_packets_whose_sender_is_the_probed_address() {
        assert_eq!(claim_in(&reply(LESSEE, LESSEE), PROBED), Some(claim(LESSEE, LESSEE, true)));
        assert_eq!(claim_in(&reply(OTHER, LESSEE), PROBED), Some(claim(OTHER, LESSEE, true)));
        let gratuitous = request_frame(mac(OTHER).octets(), PROBED, PROBED);
        assert_eq!(claim_in(&gratuitous, PROBED), Some(claim(OTHER, OTHER, false)));
        assert_eq!(claim_in(&reply(LESSEE, LESSEE), Ipv4Addr::new(10, 0, 0, 101)), None);
        let mut not_arp = reply(LESSEE, LESSEE);
        not_arp[12..14].copy_from_slice(&[0x08, 0x00]);
        assert_eq!(claim_in(&not_arp, PROBED), None);
        let mut unknown_op = reply(LESSEE, LESSEE);
        unknown_op[21] = 3;
        assert_eq!(claim_in(&unknown_op, PROBED), None);
        assert_eq!(claim_in(&reply(LESSEE, LESSEE)[..41], PROBED), None, "truncated");
    }
}
