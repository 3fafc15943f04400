//! Which MAC is behind a client address. TFTP and HTTP requests carry no MAC, but their boot
//! steps belong on the host's timeline: the DHCP server records the addresses it hands out, and
//! the kernel's neighbour (ARP) table covers clients whose address came from another server
//! (proxy mode).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Mutex;

use crate::MacAddr;

/// Learned entries kept at most; older ones are dropped wholesale (the ARP table still answers).
const MAX_LEARNED: usize = 65_536;

#[derive(Default)]
pub struct Neighbors {
    learned: Mutex<HashMap<Ipv4Addr, MacAddr>>,
}

impl Neighbors {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn learn(&self, addr: Ipv4Addr, mac: MacAddr) {
        let mut learned = self.learned.lock().expect("neighbors lock");
        if learned.len() >= MAX_LEARNED && !learned.contains_key(&addr) {
            learned.clear();
        }
        learned.insert(addr, mac);
    }

    pub fn mac_of(&self, addr: Ipv4Addr) -> Option<MacAddr> {
        if let Some(mac) = self.learned.lock().expect("neighbors lock").get(&addr) {
            return Some(*mac);
        }
        let table = std::fs::read_to_string("/proc/net/arp").ok()?;
        arp_lookup(&table, addr)
    }
}

/// Finds `addr` in the text of `/proc/net/arp`.
fn arp_lookup(table: &str, addr: Ipv4Addr) -> Option<MacAddr> {
    table.lines().skip(1).find_map(|line| {
        let mut cols = line.split_whitespace();
        let ip: Ipv4Addr = cols.next()?.parse().ok()?;
        let mac = cols.nth(2)?.parse().ok()?;
        (ip == addr && mac != MacAddr::new([0; 6])).then_some(mac)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_arp_table() {
        let table = "IP address       HW type     Flags       HW address            Mask     Device\n\
                     10.99.0.100      0x1         0x2         52:54:00:12:34:56     *        br0\n\
                     10.99.0.101      0x1         0x0         00:00:00:00:00:00     *        br0\n";
        assert_eq!(
            arp_lookup(table, "10.99.0.100".parse().unwrap()),
            Some("52:54:00:12:34:56".parse().unwrap())
        );
        assert_eq!(arp_lookup(table, "10.99.0.101".parse().unwrap()), None, "incomplete entry");
        assert_eq!(arp_lookup(table, "10.99.0.102".parse().unwrap()), None);
    }

    #[test]
    fn learned_entries_win() {
        let n = Neighbors::new();
        let mac: MacAddr = "52:54:00:00:00:09".parse().unwrap();
        n.learn("192.0.2.1".parse().unwrap(), mac);
        assert_eq!(n.mac_of("192.0.2.1".parse().unwrap()), Some(mac));
    }
}
