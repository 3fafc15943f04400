//! Which MAC holds a client address, and on what evidence. TFTP and HTTP requests carry no MAC:
//! their boot steps are attributed, and ramdisk tokens and bootstrap data handed out, by the
//! address they come from. So identity comes only from what siteboot can stand behind:
//!
//! - when siteboot hands out the addresses (full mode), the lease it ACKed; and when the
//!   kernel's ARP table has a complete entry for the address, that entry must name the same MAC
//!   (a machine that forged the lessee's `chaddr` still sends from its own Ethernet address). A
//!   relayed client is off-link and has no entry: the lease alone counts;
//! - when another server hands them out (proxy mode, DHCP off), the ARP entry alone;
//! - never a DHCP packet's `chaddr` by itself, whatever the port.

use std::net::Ipv4Addr;

use crate::MacAddr;
use crate::dhcp::leases::{SharedLeases, UnixTime, unix_now};

/// Why siteboot believes a MAC holds an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evidence {
    /// A lease siteboot ACKed, and the ARP table names the same MAC.
    LeaseAndArp,
    /// A lease siteboot ACKed, and no ARP entry (a client behind a relay).
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
    /// The MAC of a complete entry for `addr`, if there is one.
    fn lookup(&self, addr: Ipv4Addr) -> Option<MacAddr>;
}

/// `/proc/net/arp` of the network namespace siteboot runs in.
pub struct KernelArp;

impl ArpTable for KernelArp {
    fn lookup(&self, addr: Ipv4Addr) -> Option<MacAddr> {
        match std::fs::read_to_string("/proc/net/arp") {
            Ok(table) => arp_lookup(&table, addr),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read /proc/net/arp");
                None
            }
        }
    }
}

pub struct Neighbors {
    /// The lease table when siteboot hands out the addresses; `None` when another server does.
    leases: Option<SharedLeases>,
    arp: Box<dyn ArpTable>,
}

impl Neighbors {
    /// Full mode: the leases siteboot ACKs, checked against `arp`.
    pub fn from_leases(leases: SharedLeases, arp: impl ArpTable + 'static) -> Self {
        Self { leases: Some(leases), arp: Box::new(arp) }
    }

    /// Proxy mode and DHCP off: the addresses are another server's, only `arp` knows.
    pub fn from_arp(arp: impl ArpTable + 'static) -> Self {
        Self { leases: None, arp: Box::new(arp) }
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
            Some(table) => match table.lock().expect("lease table lock").lease(addr) {
                Some(lease) if lease.expires > now => Leased::To(lease.mac),
                _ => Leased::No,
            },
        };
        let arp = self.arp.lookup(addr);
        let holder = identify(leased, arp);
        if let (None, Leased::To(lessee), Some(seen)) = (holder, leased, arp) {
            tracing::warn!(%addr, %lessee, arp = %seen, "the ARP table contradicts the lease (a forged MAC?); no identity for this address");
        }
        holder
    }
}

/// What siteboot's own DHCP says about an address.
#[derive(Debug, Clone, Copy)]
enum Leased {
    /// siteboot hands out no addresses here.
    NotOurs,
    /// No current lease.
    No,
    To(MacAddr),
}

/// The rule in the module documentation.
fn identify(leased: Leased, arp: Option<MacAddr>) -> Option<Holder> {
    let holder = |mac, evidence| Some(Holder { mac, evidence });
    match (leased, arp) {
        (Leased::NotOurs, Some(mac)) => holder(mac, Evidence::Arp),
        (Leased::To(mac), None) => holder(mac, Evidence::Lease),
        (Leased::To(mac), Some(seen)) if seen == mac => holder(mac, Evidence::LeaseAndArp),
        _ => None,
    }
}

/// ATF_COM: the entry is complete (it has a hardware address).
const ARP_COMPLETE: u32 = 0x2;

/// Finds a complete entry for `addr` in the text of `/proc/net/arp`.
fn arp_lookup(table: &str, addr: Ipv4Addr) -> Option<MacAddr> {
    table.lines().skip(1).find_map(|line| {
        let mut cols = line.split_whitespace();
        let ip: Ipv4Addr = cols.next()?.parse().ok()?;
        let flags = u32::from_str_radix(cols.nth(1)?.strip_prefix("0x")?, 16).ok()?;
        let mac = cols.next()?.parse().ok()?;
        (ip == addr && flags & ARP_COMPLETE != 0 && mac != MacAddr::new([0; 6])).then_some(mac)
    })
}

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
    use crate::dhcp::leases::{Lease, LeaseTable};
    use crate::dhcp::settings::{NetworkPlan, Settings, SubnetSettings};

    const NOW: UnixTime = 2_000_000;

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn mac(n: u8) -> MacAddr {
        MacAddr::new([0x52, 0x54, 0, 0, 0, n])
    }

    #[test]
    fn reads_the_arp_table() {
        let table = "IP address       HW type     Flags       HW address            Mask     Device\n\
                     10.99.0.100      0x1         0x2         52:54:00:12:34:56     *        br0\n\
                     10.99.0.101      0x1         0x0         00:00:00:00:00:00     *        br0\n\
                     10.99.0.102      0x1         0x0         52:54:00:12:34:57     *        br0\n\
                     10.99.0.103      0x1         0x6         52:54:00:12:34:58     *        br0\n";
        assert_eq!(
            arp_lookup(table, ip("10.99.0.100")),
            Some("52:54:00:12:34:56".parse().unwrap())
        );
        assert_eq!(arp_lookup(table, ip("10.99.0.101")), None, "incomplete entry");
        assert_eq!(arp_lookup(table, ip("10.99.0.102")), None, "not marked complete");
        assert_eq!(
            arp_lookup(table, ip("10.99.0.103")),
            Some("52:54:00:12:34:58".parse().unwrap()),
            "permanent entry"
        );
        assert_eq!(arp_lookup(table, ip("10.99.0.104")), None);
    }

    /// A lease table on 10.0.0.0/24 where mac(1) holds 10.0.0.100 (and held .101 until NOW).
    fn leases() -> SharedLeases {
        let settings = Settings {
            subnets: vec![SubnetSettings {
                subnet: "10.0.0.0/24".parse().unwrap(),
                pools: vec!["10.0.0.100-10.0.0.120".parse().unwrap()],
                router: None,
                dns: vec![],
                domain: None,
                lease_time: None,
            }],
            ..Settings::default()
        };
        let plan = NetworkPlan::new(&settings, ip("10.0.0.1"), "dhcp").unwrap();
        let mut table = LeaseTable::new(Arc::new(plan));
        table.bind(Lease { addr: ip("10.0.0.101"), mac: mac(2), expires: NOW, hostname: None });
        table.bind(Lease {
            addr: ip("10.0.0.100"),
            mac: mac(1),
            expires: NOW + 60,
            hostname: None,
        });
        Arc::new(Mutex::new(table))
    }

    #[test]
    fn full_mode_a_lease_and_an_agreeing_arp_entry() {
        let n = Neighbors::from_leases(leases(), vec![(ip("10.0.0.100"), mac(1))]);
        assert_eq!(
            n.holder_at(ip("10.0.0.100"), NOW),
            Some(Holder { mac: mac(1), evidence: Evidence::LeaseAndArp })
        );
    }

    #[test]
    fn leased_addresses_are_current_leases_only() {
        let n = Neighbors::from_leases(leases(), vec![]);
        assert_eq!(n.leased_address_at(mac(1), NOW), Some(ip("10.0.0.100")));
        assert_eq!(n.leased_address_at(mac(2), NOW), None, "the lease ended");
        assert_eq!(n.leased_address_at(mac(3), NOW), None, "never leased");
        let proxy = Neighbors::from_arp(vec![(ip("10.0.0.150"), mac(1))]);
        assert_eq!(proxy.leased_address_at(mac(1), NOW), None, "not our addresses");
    }

    #[test]
    fn full_mode_an_arp_entry_that_contradicts_the_lease_gives_no_identity() {
        let n = Neighbors::from_leases(leases(), vec![(ip("10.0.0.100"), mac(9))]);
        assert_eq!(n.holder_at(ip("10.0.0.100"), NOW), None);
    }

    #[test]
    fn full_mode_a_lease_alone_is_a_relayed_client() {
        let n = Neighbors::from_leases(leases(), vec![]);
        assert_eq!(
            n.holder_at(ip("10.0.0.100"), NOW),
            Some(Holder { mac: mac(1), evidence: Evidence::Lease })
        );
    }

    #[test]
    fn full_mode_no_lease_no_identity_whatever_the_arp_table_says() {
        let arp = vec![(ip("10.0.0.101"), mac(2)), (ip("10.0.0.102"), mac(3))];
        let n = Neighbors::from_leases(leases(), arp);
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
