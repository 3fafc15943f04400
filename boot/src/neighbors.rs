//! Which MAC holds a client address, and on what evidence. TFTP and HTTP requests carry no MAC:
//! their boot steps are attributed, and ramdisk tokens and bootstrap data handed out, by the
//! address they come from. So identity comes only from what siteboot can stand behind:
//!
//! - when siteboot hands out the addresses (full mode), the lease it ACKed, and for an address
//!   of the served subnet (an on-link client) a complete ARP entry naming the same MAC: positive
//!   evidence, since a machine that forged the lessee's `chaddr` still sends from its own
//!   Ethernet address, and a missing, incomplete, failed or all-zero entry names no one (an
//!   attacker can put the table in any of those states). A relayed client (an address of a
//!   relay's subnet) is off-link and has no entry: the lease alone counts, unless an entry
//!   contradicts it, and only where the operator opted in (`dhcp.trust_relayed_leases`:
//!   a machine behind the same relay can forge the lessee's MAC), and for a host pinned to
//!   its relay port ([`Inventory::relay_pin`]) only a lease granted through a relay that said
//!   what the pin names;
//! - when another server hands them out (proxy mode, DHCP off), a complete ARP entry alone;
//! - never a DHCP packet's `chaddr` by itself, whatever the port.
//!
//! A table entry can be planted or stale, so where a token is minted or secrets leave, an
//! on-link (or proxy-mode) holder is [confirmed](Neighbors::confirm) by the appliance's own ARP
//! probe as well ([`crate::arp_probe`]).

use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::MacAddr;
use crate::arp_probe::{self, ArpProbe, Unconfirmed};
use crate::dhcp::leases::{Lease, SharedLeases, UnixTime, unix_now};
use crate::inventory::{BoxFuture, Confirm, Inventory};
use crate::rate::{Rate, RateLimiter};

/// One warning per address a minute about a lease its ARP entry does not back: the segment
/// decides how often that is asked (every connection and request from the address).
const WARNING_RATE: Rate = Rate { burst: 1, every: Duration::from_secs(60) };
/// How many addresses' warnings are tracked (the limiter forgets refilled ones first).
const WARNED_ADDRESSES: usize = 1024;

/// Why siteboot believes a MAC holds an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evidence {
    /// A lease siteboot ACKed, and the ARP table names the same MAC.
    LeaseAndArp,
    /// A lease siteboot ACKed for an address behind a relay, and no ARP entry against it.
    Lease,
    /// The ARP entry alone (another server hands out the addresses).
    Arp,
}

/// Who holds an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub mac: MacAddr,
    pub evidence: Evidence,
}

/// The kernel's neighbour table, or a stand-in for tests.
pub trait ArpTable: Send + Sync {
    /// The MAC of a complete entry for `addr`, if there is one; never all zeros.
    fn lookup(&self, addr: Ipv4Addr) -> Option<MacAddr>;
}

/// The kernel's ARP entries on the interface siteboot serves, in the network namespace it runs
/// in, asked for one address at a time (`SIOCGARP`): constant work per request, where reading
/// `/proc/net/arp` formats the whole table (a line per host of the site) for every boot step.
/// Only that interface: an on-link client is on the segment siteboot serves; a relayed one has
/// no entry anywhere.
pub struct KernelArp {
    /// Any socket of the namespace carries the ioctl.
    socket: std::os::fd::OwnedFd,
    interface: [libc::c_char; libc::IFNAMSIZ],
}

impl KernelArp {
    pub fn new(interface: &str) -> std::io::Result<Self> {
        let mut name = [0 as libc::c_char; libc::IFNAMSIZ];
        if interface.is_empty() || interface.len() >= name.len() || interface.contains('\0') {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{interface:?} is not an interface name"),
            ));
        }
        for (to, from) in name.iter_mut().zip(interface.bytes()) {
            *to = from as libc::c_char;
        }
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
        Ok(Self { socket: socket.into(), interface: name })
    }
}

impl ArpTable for KernelArp {
    fn lookup(&self, addr: Ipv4Addr) -> Option<MacAddr> {
        use std::os::fd::AsRawFd;
        // SAFETY: all-zero bytes are a valid `arpreq` (plain integers and arrays).
        let mut request: libc::arpreq = unsafe { std::mem::zeroed() };
        // `arp_pa` as the `sockaddr_in` its family says it is: port 0, then the address.
        request.arp_pa.sa_family = libc::AF_INET as libc::sa_family_t;
        for (byte, octet) in request.arp_pa.sa_data[2..6].iter_mut().zip(addr.octets()) {
            *byte = octet as libc::c_char;
        }
        request.arp_dev = self.interface;
        // SAFETY: SIOCGARP reads and writes one `arpreq`, which `request` is, for the call only.
        let result = unsafe { libc::ioctl(self.socket.as_raw_fd(), libc::SIOCGARP, &mut request) };
        if result != 0 {
            let error = std::io::Error::last_os_error();
            // ENXIO: no entry for the address.
            if error.raw_os_error() != Some(libc::ENXIO) {
                tracing::warn!(%addr, %error, "cannot read the ARP table");
            }
            return None;
        }
        let hardware = &request.arp_ha.sa_data[..6];
        entry_mac(request.arp_flags as u32, std::array::from_fn(|i| hardware[i] as u8))
    }
}

/// What a kernel entry (`SIOCGARP`'s flags and hardware address) proves: a MAC only when it is
/// complete (`ATF_COM`: NUD_VALID, so REACHABLE, STALE, DELAY, PROBE or PERMANENT) and not all
/// zeros. INCOMPLETE and FAILED entries lack `ATF_COM`; an all-zero address is what a forged
/// ARP packet or a NOARP entry leaves, and names no machine.
fn entry_mac(flags: u32, hardware: [u8; 6]) -> Option<MacAddr> {
    let mac = MacAddr::new(hardware);
    (flags & ARP_COMPLETE != 0 && hardware != [0; 6]).then_some(mac)
}

pub struct Neighbors {
    /// The lease table when siteboot hands out the addresses; `None` when another server does.
    leases: Option<SharedLeases>,
    /// With the leases: the hosts' relay agent pins, which a relayed lease must match.
    pins: Option<Arc<dyn Inventory>>,
    arp: Box<dyn ArpTable>,
    /// How [`confirm`](Self::confirm) asks the segment; without one, nothing on-link is confirmed.
    probe: Option<Box<dyn ArpProbe>>,
    warnings: Mutex<RateLimiter<Ipv4Addr>>,
}

impl Neighbors {
    /// Full mode: the leases siteboot ACKs, checked against `arp`, and relayed ones against
    /// the `inventory`'s [relay pins](Inventory::relay_pin).
    pub fn from_leases(
        leases: SharedLeases,
        inventory: Arc<dyn Inventory>,
        arp: impl ArpTable + 'static,
    ) -> Self {
        Self {
            leases: Some(leases),
            pins: Some(inventory),
            arp: Box::new(arp),
            probe: None,
            warnings: warnings(),
        }
    }

    /// Proxy mode and DHCP off: the addresses are another server's, only `arp` knows.
    pub fn from_arp(arp: impl ArpTable + 'static) -> Self {
        Self { leases: None, pins: None, arp: Box::new(arp), probe: None, warnings: warnings() }
    }

    /// Confirms holders with `probe`.
    pub fn probing(mut self, probe: impl ArpProbe + 'static) -> Self {
        self.probe = Some(Box::new(probe));
        self
    }

    /// Whether `addr` is `mac`'s now, with positive evidence from the segment: the tables'
    /// [`holder`](Self::holder), and for an on-link or proxy-mode holder an ARP probe answered
    /// by `mac` alone ([`arp_probe::judge`]). A relayed holder is off-link: no ARP reaches it,
    /// and its lease is all there is.
    pub async fn confirm(&self, addr: Ipv4Addr, mac: MacAddr) -> Result<Evidence, Unconfirmed> {
        self.confirm_at(addr, mac, unix_now()).await
    }

    async fn confirm_at(
        &self,
        addr: Ipv4Addr,
        mac: MacAddr,
        now: UnixTime,
    ) -> Result<Evidence, Unconfirmed> {
        let holder =
            self.holder_at(addr, now).filter(|h| h.mac == mac).ok_or(Unconfirmed::NotHolder)?;
        if holder.evidence == Evidence::Lease {
            return Ok(holder.evidence);
        }
        let probe = self.probe.as_ref().ok_or(Unconfirmed::NoProbe)?;
        let claims = probe.probe(addr).await.map_err(|error| {
            tracing::error!(%addr, %error, "cannot probe ARP");
            Unconfirmed::ProbeFailed
        })?;
        arp_probe::judge(mac, &claims).map(|()| holder.evidence).inspect_err(|why| {
            tracing::warn!(%addr, %mac, %why, ?claims, "the ARP probe does not confirm the address's holder; no identity");
        })
    }

    /// Who holds `addr` now.
    pub fn holder(&self, addr: Ipv4Addr) -> Option<Holder> {
        self.holder_at(addr, unix_now())
    }

    /// The MAC of [`holder`](Self::holder), whatever the evidence: every kind is enough.
    pub fn mac_of(&self, addr: Ipv4Addr) -> Option<MacAddr> {
        self.holder(addr).map(|h| h.mac)
    }

    /// The address siteboot's DHCP leases to `mac` now; `None` when another server hands out
    /// the addresses. For display only: identity is [`holder`](Self::holder)'s.
    pub fn leased_address(&self, mac: MacAddr) -> Option<Ipv4Addr> {
        self.leased_address_at(mac, unix_now())
    }

    fn leased_address_at(&self, mac: MacAddr, now: UnixTime) -> Option<Ipv4Addr> {
        let table = self.leases.as_ref()?.lock().expect("lease table lock");
        table.lease_of(mac).filter(|lease| lease.expires > now).map(|lease| lease.addr)
    }

    pub(crate) fn holder_at(&self, addr: Ipv4Addr, now: UnixTime) -> Option<Holder> {
        let leased = match &self.leases {
            None => Leased::NotOurs,
            Some(table) => {
                let table = table.lock().expect("lease table lock");
                match table.lease(addr) {
                    Some(lease) if lease.expires > now && table.plan().on_link(addr) => {
                        Leased::OnLink(lease.mac)
                    }
                    Some(lease)
                        if lease.expires > now
                            && table.plan().trust_relayed_leases
                            && self.pin_admits(lease) =>
                    {
                        Leased::Relayed(lease.mac)
                    }
                    Some(lease) if lease.expires > now => Leased::RelayedNotTrusted(lease.mac),
                    _ => Leased::No,
                }
            }
        };
        let arp = self.arp.lookup(addr);
        let holder = identify(leased, arp);
        match (holder, leased, arp) {
            (None, Leased::OnLink(_) | Leased::Relayed(_), _) if !self.may_warn(addr) => {}
            (None, Leased::OnLink(lessee) | Leased::Relayed(lessee), Some(seen)) => {
                tracing::warn!(%addr, %lessee, arp = %seen, "the ARP table contradicts the lease (a forged MAC?); no identity for this address");
            }
            (None, Leased::RelayedNotTrusted(lessee), _) => {
                tracing::debug!(%addr, %lessee, "a relayed lease is no identity: dhcp.trust_relayed_leases is off, or its host's relay agent pin does not admit it");
            }
            (None, Leased::OnLink(lessee), None) => {
                tracing::warn!(%addr, %lessee, "no complete ARP entry for an on-link lease (missing, incomplete, failed or all zeros); no identity for this address");
            }
            _ => {}
        }
        holder
    }
}

impl Neighbors {
    /// Whether a relayed `lease` was granted through a relay that said what its host's pin
    /// names now (the DHCP server's rule, [`RelayPin::admits`]); true for a host with no pin.
    /// A lease granted before the host was pinned, or pinned to another port, is not.
    ///
    /// [`RelayPin::admits`]: crate::dhcp::relay_agent::RelayPin::admits
    fn pin_admits(&self, lease: &Lease) -> bool {
        let Some(pin) = self.pins.as_ref().and_then(|pins| pins.relay_pin(lease.mac)) else {
            return true;
        };
        let admits = pin.admits(&lease.relay_agent);
        if !admits && self.may_warn(lease.addr) {
            tracing::warn!(addr = %lease.addr, lessee = %lease.mac, %pin, granted = %lease.relay_agent, "a relayed lease granted with other relay agent information than its host's pin names (granted before the pin was set or changed?) is no identity; the host's next relayed REQUEST through its pinned port renews it");
        }
        admits
    }

    /// Whether a warning about `addr` may be logged now (see [`WARNING_RATE`]).
    fn may_warn(&self, addr: Ipv4Addr) -> bool {
        self.warnings.lock().expect("warning limiter lock").allow(addr, Instant::now())
    }
}

fn warnings() -> Mutex<RateLimiter<Ipv4Addr>> {
    Mutex::new(RateLimiter::new(WARNING_RATE, WARNED_ADDRESSES))
}

impl Confirm for Neighbors {
    fn confirm(&self, addr: Ipv4Addr, mac: MacAddr) -> BoxFuture<'_, Result<(), Unconfirmed>> {
        Box::pin(async move { Neighbors::confirm(self, addr, mac).await.map(|_| ()) })
    }
}

/// What siteboot's own DHCP says about an address.
#[derive(Debug, Clone, Copy)]
enum Leased {
    /// siteboot hands out no addresses here.
    NotOurs,
    /// No current lease.
    No,
    /// Leased to a MAC, in the served subnet.
    OnLink(MacAddr),
    /// Leased to a MAC, in a relay's subnet, and identity: relayed leases are trusted, and the
    /// host's relay agent pin, if it has one, admits this one.
    Relayed(MacAddr),
    /// Leased to a MAC, in a relay's subnet, and not identity: relayed leases are not trusted,
    /// or the host's relay agent pin does not admit this one.
    RelayedNotTrusted(MacAddr),
}

/// The rule in the module documentation. `arp` is a complete, non-zero entry's MAC.
fn identify(leased: Leased, arp: Option<MacAddr>) -> Option<Holder> {
    let holder = |mac, evidence| Some(Holder { mac, evidence });
    match (leased, arp) {
        (Leased::NotOurs, Some(mac)) => holder(mac, Evidence::Arp),
        (Leased::Relayed(mac), None) => holder(mac, Evidence::Lease),
        (Leased::OnLink(mac) | Leased::Relayed(mac), Some(seen)) if seen == mac => {
            holder(mac, Evidence::LeaseAndArp)
        }
        _ => None,
    }
}

/// ATF_COM: the entry is complete (it has a hardware address).
const ARP_COMPLETE: u32 = 0x2;

/// A fixed table: addresses and the MACs their complete entries name.
#[cfg(test)]
impl ArpTable for Vec<(Ipv4Addr, MacAddr)> {
    fn lookup(&self, addr: Ipv4Addr) -> Option<MacAddr> {
        self.iter().find(|(a, _)| *a == addr).map(|(_, mac)| *mac)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::arp_probe::ArpClaim;
    use crate::dhcp::leases::{Lease, LeaseTable};
    use crate::dhcp::relay_agent::RelayPin;
    use crate::dhcp::settings::{NetworkPlan, Settings, SubnetSettings, TrustedRelay};
    use crate::inventory::{BootAction, BootRequest};

    const NOW: UnixTime = 2_000_000;

    /// The hosts' relay agent pins, by MAC; boots nothing.
    struct Pins(Vec<(MacAddr, RelayPin)>);

    impl Inventory for Pins {
        fn boots(&self, _: MacAddr) -> bool {
            false
        }
        fn boot_action(&self, _: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
            Box::pin(async { None })
        }
        fn relay_pin(&self, mac: MacAddr) -> Option<RelayPin> {
            self.0.iter().find(|(m, _)| *m == mac).map(|(_, pin)| pin.clone())
        }
    }

    fn no_pins() -> Arc<dyn Inventory> {
        Arc::new(Pins(vec![]))
    }

    /// `mac` pinned to the relay port `circuit_id`.
    fn pinned(mac: MacAddr, circuit_id: &str) -> Arc<dyn Inventory> {
        Arc::new(Pins(vec![(mac, RelayPin::new(Some(circuit_id.parse().unwrap()), None).unwrap())]))
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn mac(n: u8) -> MacAddr {
        MacAddr::new([0x52, 0x54, 0, 0, 0, n])
    }

    /// The segment decides how often an address without ARP backing is asked about: the
    /// warning is logged once a minute per address, never once per question.
    #[test]
    fn an_unbacked_lease_is_warned_about_once_per_address() {
        let n = Neighbors::from_leases(leases(), no_pins(), vec![]);
        assert!(n.may_warn(ip("10.0.0.100")));
        assert!((0..100).all(|_| !n.may_warn(ip("10.0.0.100"))), "one warning a minute");
        assert!(n.may_warn(ip("10.0.0.101")), "addresses are counted apart");
        for _ in 0..10 {
            assert_eq!(n.holder_at(ip("10.0.0.100"), NOW), None, "still no identity");
        }
    }

    #[test]
    fn the_arp_interface_must_be_an_interface_name() {
        assert!(KernelArp::new("br0").is_ok());
        for bad in ["", "a-name-of-16-chr", "br\0x"] {
            assert!(KernelArp::new(bad).is_err(), "{bad:?}");
        }
    }

    /// A lease table where mac(1) holds 10.0.0.100 (and mac(2) held .101 until NOW) on the
    /// served subnet 10.0.0.0/24, and mac(4) holds 10.0.5.100 behind the relay 10.0.5.1.
    fn leases() -> SharedLeases {
        leases_with(true)
    }

    /// [`leases`], with relayed leases identity or not.
    fn leases_with(trust_relayed_leases: bool) -> SharedLeases {
        let subnet = |subnet: &str, pool: &str| SubnetSettings {
            subnet: subnet.parse().unwrap(),
            pools: vec![pool.parse().unwrap()],
            router: None,
            dns: vec![],
            domain: None,
            lease_time: None,
        };
        let settings = Settings {
            subnets: vec![
                subnet("10.0.0.0/24", "10.0.0.100-10.0.0.120"),
                subnet("10.0.5.0/24", "10.0.5.100-10.0.5.120"),
            ],
            trusted_relays: vec![TrustedRelay::at(ip("10.0.5.1"))],
            trust_relayed_leases,
            ..Settings::default()
        };
        let plan = NetworkPlan::new(&settings, ip("10.0.0.1"), "dhcp").unwrap();
        let mut table = LeaseTable::new(Arc::new(plan));
        table.bind(Lease {
            addr: ip("10.0.0.101"),
            mac: mac(2),
            expires: NOW,
            hostname: None,
            relay_agent: Default::default(),
        });
        table.bind(Lease {
            addr: ip("10.0.0.100"),
            mac: mac(1),
            expires: NOW + 60,
            hostname: None,
            relay_agent: Default::default(),
        });
        table.bind(Lease {
            addr: ip("10.0.5.100"),
            mac: mac(4),
            expires: NOW + 60,
            hostname: None,
            relay_agent: Default::default(),
        });
        Arc::new(Mutex::new(table))
    }

    #[test]
    fn full_mode_a_lease_and_an_agreeing_arp_entry() {
        let n = Neighbors::from_leases(leases(), no_pins(), vec![(ip("10.0.0.100"), mac(1))]);
        assert_eq!(
            n.holder_at(ip("10.0.0.100"), NOW),
            Some(Holder { mac: mac(1), evidence: Evidence::LeaseAndArp })
        );
    }

    #[test]
    fn leased_addresses_are_current_leases_only() {
        let n = Neighbors::from_leases(leases(), no_pins(), vec![]);
        assert_eq!(n.leased_address_at(mac(1), NOW), Some(ip("10.0.0.100")));
        assert_eq!(n.leased_address_at(mac(2), NOW), None, "the lease ended");
        assert_eq!(n.leased_address_at(mac(3), NOW), None, "never leased");
        let proxy = Neighbors::from_arp(vec![(ip("10.0.0.150"), mac(1))]);
        assert_eq!(proxy.leased_address_at(mac(1), NOW), None, "not our addresses");
    }

    #[test]
    fn full_mode_an_arp_entry_that_contradicts_the_lease_gives_no_identity() {
        let n = Neighbors::from_leases(leases(), no_pins(), vec![(ip("10.0.0.100"), mac(9))]);
        assert_eq!(n.holder_at(ip("10.0.0.100"), NOW), None);
    }

    /// The attack of issue 22: the intruder takes a lease for the victim's MAC with a forged
    /// REQUEST, then leaves the appliance no complete entry for the address (poisoned with a zero
    /// MAC, or ARP never answered). No entry names the lessee: no identity.
    #[test]
    fn full_mode_an_on_link_lease_needs_a_complete_arp_entry() {
        let n = Neighbors::from_leases(leases(), no_pins(), vec![]);
        assert_eq!(n.holder_at(ip("10.0.0.100"), NOW), None);
    }

    /// Issue 22, item 2: behind a relay, a machine that forges a host's MAC gets the host's
    /// lease. Unless the operator opted in, that lease is no identity.
    #[test]
    fn full_mode_a_relayed_lease_is_no_identity_unless_trusted() {
        let n = Neighbors::from_leases(leases_with(false), no_pins(), vec![]);
        assert_eq!(n.holder_at(ip("10.0.5.100"), NOW), None);
        let agreeing =
            Neighbors::from_leases(leases_with(false), no_pins(), vec![(ip("10.0.5.100"), mac(4))]);
        assert_eq!(agreeing.holder_at(ip("10.0.5.100"), NOW), None, "no ARP entry off-link");
        let on_link =
            Neighbors::from_leases(leases_with(false), no_pins(), vec![(ip("10.0.0.100"), mac(1))]);
        assert_eq!(
            on_link.holder_at(ip("10.0.0.100"), NOW),
            Some(Holder { mac: mac(1), evidence: Evidence::LeaseAndArp }),
            "on-link identity does not depend on it"
        );
    }

    #[test]
    fn full_mode_a_trusted_relayed_lease_alone_is_enough() {
        let n = Neighbors::from_leases(leases(), no_pins(), vec![]);
        assert_eq!(
            n.holder_at(ip("10.0.5.100"), NOW),
            Some(Holder { mac: mac(4), evidence: Evidence::Lease })
        );
        let contradicted =
            Neighbors::from_leases(leases(), no_pins(), vec![(ip("10.0.5.100"), mac(9))]);
        assert_eq!(contradicted.holder_at(ip("10.0.5.100"), NOW), None);
    }

    /// Issue 22, item 2: a relayed lease of a host pinned to its relay port counts only when
    /// it was granted through a relay that said what the pin names (the DHCP server keeps what
    /// the relay said in the lease). mac(4)'s lease in [`leases`] predates any pin.
    #[test]
    fn full_mode_a_pinned_host_s_relayed_lease_counts_only_if_granted_through_its_port() {
        let relayed = ip("10.0.5.100");
        let identity = Some(Holder { mac: mac(4), evidence: Evidence::Lease });
        let unpinned = Neighbors::from_leases(leases(), no_pins(), vec![]);
        assert_eq!(unpinned.holder_at(relayed, NOW), identity, "no pin: as before");
        let before_the_pin = Neighbors::from_leases(leases(), pinned(mac(4), "eth1/0/12"), vec![]);
        assert_eq!(before_the_pin.holder_at(relayed, NOW), None, "granted before the pin");

        let granted = |trust: bool, port: &str| {
            let leases = leases_with(trust);
            let pin = RelayPin::new(Some(port.parse().unwrap()), None).unwrap();
            leases.lock().unwrap().bind(Lease {
                addr: relayed,
                mac: mac(4),
                expires: NOW + 60,
                hostname: None,
                relay_agent: pin.as_info(),
            });
            leases
        };
        let through_its_port =
            Neighbors::from_leases(granted(true, "eth1/0/12"), pinned(mac(4), "eth1/0/12"), vec![]);
        assert_eq!(through_its_port.holder_at(relayed, NOW), identity);
        let pinned_elsewhere_since =
            Neighbors::from_leases(granted(true, "eth1/0/12"), pinned(mac(4), "eth1/0/13"), vec![]);
        assert_eq!(pinned_elsewhere_since.holder_at(relayed, NOW), None, "the pin changed");
        let untrusted = Neighbors::from_leases(
            granted(false, "eth1/0/12"),
            pinned(mac(4), "eth1/0/12"),
            vec![],
        );
        assert_eq!(untrusted.holder_at(relayed, NOW), None, "still opt-in");
        // On-link identity is the ARP table's, pin or not.
        let on_link = Neighbors::from_leases(
            leases(),
            pinned(mac(1), "eth1/0/12"),
            vec![(ip("10.0.0.100"), mac(1))],
        );
        assert_eq!(
            on_link.holder_at(ip("10.0.0.100"), NOW),
            Some(Holder { mac: mac(1), evidence: Evidence::LeaseAndArp })
        );
    }

    /// Evidence in, identity or refusal out: every lease kind against every kernel entry.
    #[test]
    fn the_decision_matrix() {
        const COMPLETE: u32 = ARP_COMPLETE;
        const PERMANENT: u32 = ARP_COMPLETE | 0x4; // ATF_PERM
        let (lessee, other, zero) = (mac(1).octets(), mac(9).octets(), [0u8; 6]);
        // (what the kernel says, the entry's MAC for the decision)
        let entries = [
            ("complete, agreeing", entry_mac(COMPLETE, lessee)),
            ("permanent, agreeing", entry_mac(PERMANENT, lessee)),
            ("complete, contradicting", entry_mac(COMPLETE, other)),
            ("incomplete or failed", entry_mac(0, lessee)),
            ("incomplete or failed, no address", entry_mac(0, zero)),
            ("complete, all zeros", entry_mac(COMPLETE, zero)),
            ("permanent, all zeros", entry_mac(PERMANENT, zero)),
            ("missing", None),
        ];
        let agreeing = |evidence| Some(Holder { mac: mac(1), evidence });
        for (entry, arp) in entries {
            let named = |evidence| if arp == Some(mac(1)) { agreeing(evidence) } else { None };
            let cases = [
                (Leased::OnLink(mac(1)), named(Evidence::LeaseAndArp)),
                (
                    Leased::Relayed(mac(1)),
                    match arp {
                        None => agreeing(Evidence::Lease),
                        Some(_) => named(Evidence::LeaseAndArp),
                    },
                ),
                (Leased::RelayedNotTrusted(mac(1)), None),
                (Leased::NotOurs, arp.map(|mac| Holder { mac, evidence: Evidence::Arp })),
                (Leased::No, None),
            ];
            for (leased, expected) in cases {
                assert_eq!(identify(leased, arp), expected, "{leased:?}, entry {entry}");
            }
        }
    }

    /// A probe that sees `claims`, whatever it asks; `None`: one that must not be asked.
    struct Sees(Option<Vec<ArpClaim>>);

    impl ArpProbe for Sees {
        fn probe(&self, _: Ipv4Addr) -> BoxFuture<'_, std::io::Result<Vec<ArpClaim>>> {
            let claims = self.0.clone().expect("no probe for this address");
            Box::pin(async move { Ok(claims) })
        }
    }

    fn claim(ethernet_source: MacAddr, sender: MacAddr) -> ArpClaim {
        ArpClaim { ethernet_source, sender, is_reply: true }
    }

    /// Where a token is minted or secrets leave: the tables' holder, and for an on-link or
    /// proxy-mode one the probe's judgement; a relayed holder is not probed (no ARP crosses
    /// the relay).
    #[tokio::test]
    async fn confirmation_asks_the_segment_for_on_link_and_proxy_holders() {
        let answered = Some(vec![claim(mac(1), mac(1))]);
        let planted = Some(vec![claim(mac(9), mac(1))]);
        let on_link = |seen| {
            Neighbors::from_leases(leases(), no_pins(), vec![(ip("10.0.0.100"), mac(1))])
                .probing(Sees(seen))
        };
        let at = |n: Neighbors, addr, who| async move { n.confirm_at(ip(addr), who, NOW).await };
        assert_eq!(
            at(on_link(answered.clone()), "10.0.0.100", mac(1)).await,
            Ok(Evidence::LeaseAndArp)
        );
        let conflict = Err(Unconfirmed::Conflict { other: mac(9) });
        assert_eq!(at(on_link(planted), "10.0.0.100", mac(1)).await, conflict, "a planted entry");
        assert_eq!(
            at(on_link(Some(vec![])), "10.0.0.100", mac(1)).await,
            Err(Unconfirmed::NoAnswer)
        );
        assert_eq!(at(on_link(None), "10.0.0.100", mac(2)).await, Err(Unconfirmed::NotHolder));
        let unprobed =
            Neighbors::from_leases(leases(), no_pins(), vec![(ip("10.0.0.100"), mac(1))]);
        assert_eq!(at(unprobed, "10.0.0.100", mac(1)).await, Err(Unconfirmed::NoProbe));
        let relayed = Neighbors::from_leases(leases(), no_pins(), vec![]).probing(Sees(None));
        assert_eq!(at(relayed, "10.0.5.100", mac(4)).await, Ok(Evidence::Lease));
        let proxy = Neighbors::from_arp(vec![(ip("10.0.0.150"), mac(1))]);
        assert_eq!(
            at(proxy.probing(Sees(answered)), "10.0.0.150", mac(1)).await,
            Ok(Evidence::Arp)
        );
    }

    #[test]
    fn full_mode_no_lease_no_identity_whatever_the_arp_table_says() {
        let arp = vec![(ip("10.0.0.101"), mac(2)), (ip("10.0.0.102"), mac(3))];
        let n = Neighbors::from_leases(leases(), no_pins(), arp);
        assert_eq!(n.holder_at(ip("10.0.0.101"), NOW), None, "the lease ended");
        assert_eq!(n.holder_at(ip("10.0.0.102"), NOW), None, "never leased");
        assert_eq!(n.holder_at(ip("10.0.0.100"), NOW + 60), None, "expired");
    }

    #[test]
    fn proxy_mode_the_arp_entry_alone() {
        let n = Neighbors::from_arp(vec![(ip("10.0.0.150"), mac(1))]);
        assert_eq!(
            n.holder_at(ip("10.0.0.150"), NOW),
            Some(Holder { mac: mac(1), evidence: Evidence::Arp })
        );
        assert_eq!(n.mac_of(ip("10.0.0.150")), Some(mac(1)));
        assert_eq!(n.holder_at(ip("10.0.0.151"), NOW), None, "nothing known");
    }
}
