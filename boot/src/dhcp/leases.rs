//! The lease table: which address belongs to which MAC. Pure (the time is passed in), so the
//! allocation rules are unit-tested; the [journal](super::journal) makes it durable.
//!
//! Invariants: an address has at most one lease and at most one pending offer, both for the same
//! MAC unless the lease has expired; a MAC has at most one lease and one offer; `free` holds
//! exactly the pool addresses with no lease, no offer, no quarantine and no reservation. Every
//! operation is O(log n) in the pool size, except reclaiming an expired lease, which skips the
//! expired addresses currently offered.
//!
//! Quarantine (DECLINE) is bounded: at most half of a subnet's pool is ever quarantined by
//! [`decline`](LeaseTable::decline), so DECLINEs alone never empty a pool (see the server's
//! `decline` for the rest of the rule).

use std::collections::{BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::relay_agent::RelayAgentInfo;
use super::settings::NetworkPlan;
use crate::MacAddr;

/// At most 1/this of a subnet's pool is quarantined by DECLINEs (half): the other half always
/// stays for clients, whoever sends DECLINEs.
pub const MAX_QUARANTINED_SHARE: usize = 2;

/// Seconds since the Unix epoch: leases must mean the same after a restart.
pub type UnixTime = u64;

pub fn unix_now() -> UnixTime {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The lease table, shared by the DHCP server (which changes it) and the
/// [neighbour view](crate::neighbors) (which asks who holds an address).
pub type SharedLeases = Arc<Mutex<LeaseTable>>;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub addr: Ipv4Addr,
    pub mac: MacAddr,
    pub expires: UnixTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Granted through a relay to a pinned host (`Inventory::relay_pin`): what the relay said,
    /// of the sub-options pinned then; empty otherwise. Only the operator's values, never more
    /// of what a relay sent. A relayed lease of a pinned host is identity only while the pin
    /// admits this ([`RelayPin::admits`](super::relay_agent::RelayPin::admits)): not a lease
    /// granted before the host was pinned, or pinned elsewhere.
    #[serde(default, skip_serializing_if = "RelayAgentInfo::is_empty")]
    pub relay_agent: RelayAgentInfo,
}

/// A change to the durable lease state: what the journal stores.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseRecord {
    /// `mac` holds `addr` until `expires`. A release is a lease that expires now: the address is
    /// free again, but the same MAC gets it back first.
    Lease(Lease),
    /// `addr` was declined (a client found it in use) and stays out of the pool until `until`.
    Declined { addr: Ipv4Addr, until: UnixTime },
}

#[derive(Debug, Default)]
struct SubnetState {
    free: BTreeSet<u32>,
    /// Every lease in this subnet, by expiry: the oldest expired one is reclaimed first.
    by_expiry: BTreeSet<(UnixTime, u32)>,
    /// Pool addresses that are not reserved: what the pool can hand out.
    pool_size: usize,
    /// Addresses of this subnet in quarantine.
    quarantined: usize,
}

/// Why [`LeaseTable::decline`] quarantined nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeclineRefused {
    /// The MAC holds no lease or offer of the address: nothing to decline.
    NotHeld,
    /// The address is reserved: quarantining it would leave its host without one.
    Reserved,
    /// Half of the subnet's pool is quarantined already: the other half stays for clients.
    ReserveReached,
}

#[derive(Debug)]
pub struct LeaseTable {
    plan: Arc<NetworkPlan>,
    subnets: Vec<SubnetState>,
    leases: HashMap<Ipv4Addr, Lease>,
    lease_of: HashMap<MacAddr, Ipv4Addr>,
    offers: HashMap<Ipv4Addr, (MacAddr, UnixTime)>,
    offer_of: HashMap<MacAddr, Ipv4Addr>,
    offer_expiry: BTreeSet<(UnixTime, u32)>,
    declined: HashMap<Ipv4Addr, UnixTime>,
    decline_expiry: BTreeSet<(UnixTime, u32)>,
    reserved: HashMap<Ipv4Addr, MacAddr>,
}

impl LeaseTable {
    pub fn new(plan: Arc<NetworkPlan>) -> Self {
        let reserved: HashMap<Ipv4Addr, MacAddr> =
            plan.reservations.iter().map(|r| (r.address, r.mac)).collect();
        let subnets = plan
            .subnets
            .iter()
            .map(|s| {
                let free: BTreeSet<u32> = s
                    .pools
                    .iter()
                    .flat_map(|p| p.iter())
                    .filter(|a| !reserved.contains_key(a))
                    .map(u32::from)
                    .collect();
                SubnetState {
                    pool_size: free.len(),
                    free,
                    by_expiry: BTreeSet::new(),
                    quarantined: 0,
                }
            })
            .collect();
        Self {
            plan,
            subnets,
            leases: HashMap::new(),
            lease_of: HashMap::new(),
            offers: HashMap::new(),
            offer_of: HashMap::new(),
            offer_expiry: BTreeSet::new(),
            declined: HashMap::new(),
            decline_expiry: BTreeSet::new(),
            reserved,
        }
    }

    pub fn plan(&self) -> &NetworkPlan {
        &self.plan
    }

    fn subnet_of(&self, addr: Ipv4Addr) -> Option<usize> {
        self.plan.subnets.iter().position(|s| s.subnet.contains(addr))
    }

    /// Takes `addr` out of its subnet's free set.
    fn occupy(&mut self, addr: Ipv4Addr) {
        if let Some(s) = self.subnet_of(addr) {
            self.subnets[s].free.remove(&u32::from(addr));
        }
    }

    /// Puts `addr` back into its free set if nothing holds it.
    fn release_if_unused(&mut self, addr: Ipv4Addr) {
        let Some(s) = self.subnet_of(addr) else {
            return;
        };
        let unused = self.plan.subnets[s].in_pool(addr)
            && !self.reserved.contains_key(&addr)
            && !self.leases.contains_key(&addr)
            && !self.offers.contains_key(&addr)
            && !self.declined.contains_key(&addr);
        if unused {
            self.subnets[s].free.insert(u32::from(addr));
        }
    }

    fn remove_lease(&mut self, addr: Ipv4Addr) -> Option<Lease> {
        let lease = self.leases.remove(&addr)?;
        if self.lease_of.get(&lease.mac) == Some(&addr) {
            self.lease_of.remove(&lease.mac);
        }
        if let Some(s) = self.subnet_of(addr) {
            self.subnets[s].by_expiry.remove(&(lease.expires, u32::from(addr)));
        }
        Some(lease)
    }

    /// Ends `addr`'s quarantine, if it has one (the caller puts it back in the free set).
    fn unquarantine(&mut self, addr: Ipv4Addr) {
        if let Some(until) = self.declined.remove(&addr) {
            self.decline_expiry.remove(&(until, u32::from(addr)));
            if let Some(s) = self.subnet_of(addr) {
                self.subnets[s].quarantined -= 1;
            }
        }
    }

    fn remove_offer(&mut self, addr: Ipv4Addr) {
        if let Some((mac, until)) = self.offers.remove(&addr) {
            self.offer_expiry.remove(&(until, u32::from(addr)));
            if self.offer_of.get(&mac) == Some(&addr) {
                self.offer_of.remove(&mac);
            }
        }
    }

    /// Applies a durable record: used for replay at start-up and by every change.
    pub fn apply(&mut self, record: &LeaseRecord) {
        match record {
            LeaseRecord::Lease(lease) => {
                let addr = lease.addr;
                if self.subnet_of(addr).is_none() {
                    tracing::warn!(%addr, mac = %lease.mac, "dropping a stored lease outside every configured subnet");
                    return;
                }
                if self.reserved.get(&addr).is_some_and(|owner| *owner != lease.mac) {
                    tracing::warn!(%addr, mac = %lease.mac, "dropping a stored lease on an address now reserved for another MAC");
                    return;
                }
                self.remove_offer(addr);
                self.remove_lease(addr);
                self.unquarantine(addr);
                // A MAC holds one address: its previous one goes back to the pool.
                if let Some(previous) = self.lease_of.get(&lease.mac).copied()
                    && previous != addr
                {
                    self.remove_lease(previous);
                    self.release_if_unused(previous);
                }
                if let Some(offered) = self.offer_of.get(&lease.mac).copied() {
                    self.remove_offer(offered);
                    self.release_if_unused(offered);
                }
                self.occupy(addr);
                let s = self.subnet_of(addr).expect("checked above");
                self.subnets[s].by_expiry.insert((lease.expires, u32::from(addr)));
                self.lease_of.insert(lease.mac, addr);
                self.leases.insert(addr, lease.clone());
            }
            LeaseRecord::Declined { addr, until } => {
                let addr = *addr;
                self.remove_offer(addr);
                self.remove_lease(addr);
                match self.declined.insert(addr, *until) {
                    Some(old) => {
                        self.decline_expiry.remove(&(old, u32::from(addr)));
                    }
                    None => {
                        if let Some(s) = self.subnet_of(addr) {
                            self.subnets[s].quarantined += 1;
                        }
                    }
                }
                self.decline_expiry.insert((*until, u32::from(addr)));
                self.occupy(addr);
            }
        }
    }

    /// Ends offers and quarantines whose time is up.
    pub fn sweep(&mut self, now: UnixTime) {
        while let Some(&(until, addr)) = self.offer_expiry.first() {
            if until > now {
                break;
            }
            let addr = Ipv4Addr::from(addr);
            self.remove_offer(addr);
            self.release_if_unused(addr);
        }
        while let Some(&(until, addr)) = self.decline_expiry.first() {
            if until > now {
                break;
            }
            let addr = Ipv4Addr::from(addr);
            self.unquarantine(addr);
            self.release_if_unused(addr);
        }
    }

    /// Whether `mac` may be given `addr` now (ignoring pools: reservations may be outside them).
    pub fn available_to(&self, addr: Ipv4Addr, mac: MacAddr, now: UnixTime) -> bool {
        if self.reserved.get(&addr).is_some_and(|owner| *owner != mac) {
            return false;
        }
        if self.declined.contains_key(&addr) {
            return false;
        }
        if self.offers.get(&addr).is_some_and(|(other, until)| *other != mac && *until > now) {
            return false;
        }
        match self.leases.get(&addr) {
            Some(lease) => lease.mac == mac || lease.expires <= now,
            None => true,
        }
    }

    /// The address to offer `mac` in subnet `subnet`, in order of preference: its reservation,
    /// its pending offer, its (possibly expired) lease, the address it asks for, a never-used
    /// address, the address whose lease expired longest ago.
    pub fn choose(
        &self,
        mac: MacAddr,
        subnet: usize,
        requested: Option<Ipv4Addr>,
        now: UnixTime,
    ) -> Option<Ipv4Addr> {
        let plan = &self.plan.subnets[subnet];
        if let Some(r) = self.plan.reservation_for(mac)
            && plan.subnet.contains(r.address)
        {
            return self.available_to(r.address, mac, now).then_some(r.address);
        }
        let candidates =
            [self.offer_of.get(&mac).copied(), self.lease_of.get(&mac).copied(), requested];
        for addr in candidates.into_iter().flatten() {
            if plan.in_pool(addr) && self.available_to(addr, mac, now) {
                return Some(addr);
            }
        }
        if let Some(&free) = self.subnets[subnet].free.first() {
            return Some(Ipv4Addr::from(free));
        }
        self.subnets[subnet]
            .by_expiry
            .iter()
            .take_while(|(expires, _)| *expires <= now)
            .map(|(_, addr)| Ipv4Addr::from(*addr))
            .find(|addr| self.available_to(*addr, mac, now))
    }

    /// Holds `addr` for `mac` until `until` (not durable: an offer promises nothing yet).
    pub fn offer(&mut self, mac: MacAddr, addr: Ipv4Addr, until: UnixTime) {
        if let Some(previous) = self.offer_of.get(&mac).copied() {
            self.remove_offer(previous);
            if previous != addr {
                self.release_if_unused(previous);
            }
        }
        self.remove_offer(addr);
        self.occupy(addr);
        self.offers.insert(addr, (mac, until));
        self.offer_of.insert(mac, addr);
        self.offer_expiry.insert((until, u32::from(addr)));
    }

    /// The client chose another server: forget what we offered it.
    pub fn cancel_offer(&mut self, mac: MacAddr) {
        if let Some(addr) = self.offer_of.get(&mac).copied() {
            self.remove_offer(addr);
            self.release_if_unused(addr);
        }
    }

    pub fn lease(&self, addr: Ipv4Addr) -> Option<&Lease> {
        self.leases.get(&addr)
    }

    pub fn lease_of(&self, mac: MacAddr) -> Option<&Lease> {
        self.lease_of.get(&mac).and_then(|a| self.leases.get(a))
    }

    /// Binds `addr` to `mac`. The caller checked [`available_to`](Self::available_to); the
    /// returned record must be made durable before the client is told.
    pub fn bind(&mut self, lease: Lease) -> LeaseRecord {
        let record = LeaseRecord::Lease(lease);
        self.apply(&record);
        record
    }

    /// Takes in a lease another replica granted (read from the [checkpoint](super::checkpoint)),
    /// unless this table knows a lease of the same address or the same MAC that lasts at least
    /// as long. Keeping the longer lease errs on the safe side: at worst an address stays taken
    /// after a release this replica missed, and is reclaimed when that lease runs out. Returns
    /// the record to journal if the table changed.
    pub fn merge(&mut self, lease: &Lease) -> Option<LeaseRecord> {
        let outlasts = |known: Option<&Lease>| known.is_none_or(|k| k.expires < lease.expires);
        if !outlasts(self.leases.get(&lease.addr)) || !outlasts(self.lease_of(lease.mac)) {
            return None;
        }
        Some(self.bind(lease.clone()))
    }

    /// [`merge`](Self::merge)s every lease of a checkpoint read: a new term's first read, and a
    /// standby's refresh. Returns the records to journal.
    pub fn merge_all(&mut self, leases: &[Lease]) -> Vec<LeaseRecord> {
        leases.iter().filter_map(|lease| self.merge(lease)).collect()
    }

    /// `mac` gives `addr` back. `None` if it does not hold it.
    pub fn release(&mut self, mac: MacAddr, addr: Ipv4Addr, now: UnixTime) -> Option<LeaseRecord> {
        let lease = self.leases.get(&addr).filter(|l| l.mac == mac && l.expires > now)?;
        Some(self.bind(Lease { expires: now, ..lease.clone() }))
    }

    /// Whether `mac` holds `addr`: a lease (expired or not) or a pending offer.
    pub fn holds(&self, mac: MacAddr, addr: Ipv4Addr) -> bool {
        self.leases.get(&addr).is_some_and(|l| l.mac == mac)
            || self.offers.get(&addr).is_some_and(|(m, _)| *m == mac)
    }

    /// Whether `addr` is reserved (for any MAC).
    pub fn is_reserved(&self, addr: Ipv4Addr) -> bool {
        self.reserved.contains_key(&addr)
    }

    /// `mac` found `addr` in use: quarantines it until `until`, unless `mac` does not hold it,
    /// it is reserved, or half of its subnet's pool is quarantined already.
    pub fn decline(
        &mut self,
        mac: MacAddr,
        addr: Ipv4Addr,
        until: UnixTime,
    ) -> Result<LeaseRecord, DeclineRefused> {
        if !self.holds(mac, addr) {
            return Err(DeclineRefused::NotHeld);
        }
        if self.is_reserved(addr) {
            return Err(DeclineRefused::Reserved);
        }
        if let Some(s) = self.subnet_of(addr) {
            let subnet = &self.subnets[s];
            if subnet.quarantined + 1 > subnet.pool_size / MAX_QUARANTINED_SHARE {
                return Err(DeclineRefused::ReserveReached);
            }
        }
        let record = LeaseRecord::Declined { addr, until };
        self.apply(&record);
        Ok(record)
    }

    /// Addresses of `subnet` in quarantine.
    pub fn quarantined(&self, subnet: usize) -> usize {
        self.subnets[subnet].quarantined
    }

    /// Every durable fact, for compacting the journal.
    pub fn records(&self) -> Vec<LeaseRecord> {
        let leases = self.leases.values().cloned().map(LeaseRecord::Lease);
        let declined = self
            .declined
            .iter()
            .map(|(addr, until)| LeaseRecord::Declined { addr: *addr, until: *until });
        leases.chain(declined).collect()
    }

    /// How many records [`records`](Self::records) would return.
    pub fn durable_count(&self) -> usize {
        self.leases.len() + self.declined.len()
    }

    /// Leases that have not expired.
    pub fn active(&self, now: UnixTime) -> usize {
        self.leases.values().filter(|l| l.expires > now).count()
    }

    /// Addresses still free in `subnet` (never used, released-and-reclaimed, or quarantine over).
    pub fn free_count(&self, subnet: usize) -> usize {
        self.subnets[subnet].free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dhcp::settings::{Reservation, Settings, SubnetSettings};

    const NOW: UnixTime = 1_000_000;

    fn mac(n: u8) -> MacAddr {
        MacAddr::new([0x52, 0x54, 0, 0, 0, n])
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn table(pool: &str, reservations: Vec<Reservation>) -> LeaseTable {
        let settings = Settings {
            subnets: vec![SubnetSettings {
                subnet: "10.0.0.0/24".parse().unwrap(),
                pools: vec![pool.parse().unwrap()],
                router: None,
                dns: vec![],
                domain: None,
                lease_time: None,
            }],
            reservations,
            ..Settings::default()
        };
        LeaseTable::new(Arc::new(NetworkPlan::new(&settings, ip("10.0.0.1"), "dhcp").unwrap()))
    }

    fn lease(t: &mut LeaseTable, m: MacAddr, expires: UnixTime) -> Ipv4Addr {
        let addr = t.choose(m, 0, None, NOW).expect("an address");
        t.offer(m, addr, NOW + 30);
        t.bind(Lease { addr, mac: m, expires, hostname: None, relay_agent: Default::default() });
        addr
    }

    #[test]
    fn merging_keeps_the_longer_lease_of_an_address_and_of_a_mac() {
        let mut t = table("10.0.0.10-10.0.0.12", vec![]);
        let a = lease(&mut t, mac(1), NOW + 100);
        let other = |addr, m, expires| Lease {
            addr,
            mac: m,
            expires,
            hostname: None,
            relay_agent: Default::default(),
        };
        // Another replica gave the same address to another MAC, for less time: ours stands.
        assert_eq!(t.merge(&other(a, mac(2), NOW + 50)), None);
        assert_eq!(t.lease(a).unwrap().mac, mac(1));
        // ... for longer (it reclaimed ours after it expired): theirs wins, and mac 1 has none.
        assert!(t.merge(&other(a, mac(2), NOW + 200)).is_some());
        assert_eq!(t.lease(a).unwrap().mac, mac(2));
        assert!(t.lease_of(mac(1)).is_none());
        // A lease we have not seen on a free address is taken in, and that address is not
        // offered to anyone else while it lasts.
        let b = ip("10.0.0.11");
        assert!(t.merge(&other(b, mac(3), NOW + 100)).is_some());
        assert!(!t.available_to(b, mac(4), NOW));
        assert_eq!(t.choose(mac(4), 0, None, NOW), Some(ip("10.0.0.12")));
        // The same lease again changes nothing; a MAC's older lease elsewhere is ignored.
        assert_eq!(t.merge(&other(b, mac(3), NOW + 100)), None);
        assert_eq!(t.merge(&other(ip("10.0.0.12"), mac(3), NOW + 10)), None);
        assert_eq!(t.lease_of(mac(3)).unwrap().addr, b);
    }

    #[test]
    fn a_standby_refresh_follows_the_leader_and_keeps_its_own_longer_leases() {
        let mut standby = table("10.0.0.10-10.0.0.20", vec![]);
        // From when this replica led: its renewal of mac 1 outlasts the checkpoint's copy.
        let a = lease(&mut standby, mac(1), NOW + 200);
        let (b, c) = (ip("10.0.0.15"), ip("10.0.0.16"));
        let at = |addr, m, expires| Lease {
            addr,
            mac: m,
            expires,
            hostname: None,
            relay_agent: Default::default(),
        };
        let first = [at(a, mac(1), NOW + 100), at(b, mac(2), NOW + 100)];
        assert_eq!(standby.merge_all(&first), vec![LeaseRecord::Lease(first[1].clone())]);
        assert_eq!(standby.lease(a).unwrap().expires, NOW + 200, "the longer local lease stays");
        // The leader renewed mac 2 and leased c to mac 3: the next read takes both, once.
        let second = [first[0].clone(), at(b, mac(2), NOW + 300), at(c, mac(3), NOW + 300)];
        let merged = standby.merge_all(&second);
        assert_eq!(merged.len(), 2, "{merged:?}");
        assert!(standby.merge_all(&second).is_empty(), "reading it again changes nothing");
        for (m, addr, expires) in [(1, a, NOW + 200), (2, b, NOW + 300), (3, c, NOW + 300)] {
            assert_eq!(standby.lease_of(mac(m)), Some(&at(addr, mac(m), expires)));
        }
        // Taking over, it offers none of them to another MAC.
        assert!([a, b, c].iter().all(|addr| !standby.available_to(*addr, mac(4), NOW)));
        assert_eq!(standby.choose(mac(4), 0, None, NOW), Some(ip("10.0.0.11")));
    }

    #[test]
    fn allocates_distinct_addresses_until_exhausted() {
        let mut t = table("10.0.0.10-10.0.0.12", vec![]);
        let a = lease(&mut t, mac(1), NOW + 3600);
        let b = lease(&mut t, mac(2), NOW + 3600);
        let c = lease(&mut t, mac(3), NOW + 3600);
        assert_eq!([a, b, c], [ip("10.0.0.10"), ip("10.0.0.11"), ip("10.0.0.12")]);
        assert_eq!(t.choose(mac(4), 0, None, NOW), None, "pool exhausted");
        assert_eq!(t.choose(mac(2), 0, None, NOW), Some(b), "a MAC keeps its address");
    }

    #[test]
    fn expired_and_released_addresses_prefer_their_mac_then_are_reclaimed_oldest_first() {
        let mut t = table("10.0.0.10-10.0.0.11", vec![]);
        let a = lease(&mut t, mac(1), NOW + 10);
        let b = lease(&mut t, mac(2), NOW + 3600);
        t.release(mac(2), b, NOW).unwrap();
        assert_eq!(
            t.choose(mac(2), 0, None, NOW + 1),
            Some(b),
            "released MAC gets its address back"
        );
        assert_eq!(t.choose(mac(3), 0, None, NOW + 1), Some(b), "released address is reclaimable");
        assert_eq!(
            t.choose(mac(3), 0, None, NOW + 11),
            Some(b),
            "oldest expiry (the release) first"
        );
        assert_eq!(t.choose(mac(1), 0, None, NOW + 11), Some(a));
    }

    #[test]
    fn offers_hold_addresses_until_they_lapse() {
        let mut t = table("10.0.0.10-10.0.0.10", vec![]);
        t.offer(mac(1), ip("10.0.0.10"), NOW + 30);
        assert_eq!(t.choose(mac(2), 0, None, NOW), None);
        assert!(!t.available_to(ip("10.0.0.10"), mac(2), NOW));
        t.sweep(NOW + 30);
        assert_eq!(t.choose(mac(2), 0, None, NOW + 30), Some(ip("10.0.0.10")));
        t.offer(mac(2), ip("10.0.0.10"), NOW + 60);
        t.cancel_offer(mac(2));
        assert_eq!(t.free_count(0), 1);
    }

    #[test]
    fn requested_address_is_honoured_when_free() {
        let t = table("10.0.0.10-10.0.0.20", vec![]);
        assert_eq!(t.choose(mac(1), 0, Some(ip("10.0.0.15")), NOW), Some(ip("10.0.0.15")));
        assert_eq!(
            t.choose(mac(1), 0, Some(ip("10.0.0.99")), NOW),
            Some(ip("10.0.0.10")),
            "outside the pool"
        );
    }

    #[test]
    fn reservations_are_kept_for_their_mac() {
        let r = Reservation { mac: mac(9), address: ip("10.0.0.10"), hostname: None };
        let mut t = table("10.0.0.10-10.0.0.11", vec![r]);
        assert_eq!(t.choose(mac(1), 0, Some(ip("10.0.0.10")), NOW), Some(ip("10.0.0.11")));
        assert_eq!(lease(&mut t, mac(1), NOW + 60), ip("10.0.0.11"));
        assert_eq!(t.choose(mac(2), 0, None, NOW), None, "the reserved address is not in the pool");
        assert_eq!(t.choose(mac(9), 0, None, NOW), Some(ip("10.0.0.10")));
    }

    #[test]
    fn declined_addresses_are_quarantined() {
        let mut t = table("10.0.0.10-10.0.0.11", vec![]);
        let a = lease(&mut t, mac(1), NOW + 3600);
        assert_eq!(
            t.decline(mac(2), a, NOW + 600),
            Err(DeclineRefused::NotHeld),
            "only the holder can decline"
        );
        assert!(t.decline(mac(1), a, NOW + 600).is_ok());
        assert!(t.lease_of(mac(1)).is_none());
        assert_eq!(t.choose(mac(1), 0, None, NOW), Some(ip("10.0.0.11")));
        assert!(!t.available_to(a, mac(1), NOW));
        t.sweep(NOW + 600);
        assert!(t.available_to(a, mac(3), NOW + 600));
        assert_eq!(t.free_count(0), 2);
        assert_eq!(t.quarantined(0), 0);
    }

    #[test]
    fn at_most_half_the_pool_is_quarantined_and_never_a_reservation() {
        let r = Reservation { mac: mac(9), address: ip("10.0.0.20"), hostname: None };
        let mut t = table("10.0.0.10-10.0.0.14", vec![r]);
        let mut declined = 0;
        for n in 1..=5 {
            let a = lease(&mut t, mac(n), NOW + 3600);
            match t.decline(mac(n), a, NOW + 600) {
                Ok(_) => declined += 1,
                Err(why) => assert_eq!(why, DeclineRefused::ReserveReached),
            }
        }
        assert_eq!((declined, t.quarantined(0)), (2, 2), "half of 5, rounded down");
        let a = ip("10.0.0.20");
        t.offer(mac(9), a, NOW + 30);
        t.bind(Lease {
            addr: a,
            mac: mac(9),
            expires: NOW + 3600,
            hostname: None,
            relay_agent: Default::default(),
        });
        assert_eq!(t.decline(mac(9), a, NOW + 600), Err(DeclineRefused::Reserved));
        // A quarantine that ends makes room for another; a lease bound over a quarantined
        // address (replayed from another replica) ends its quarantine too.
        t.sweep(NOW + 600);
        assert_eq!(t.quarantined(0), 0);
        t.apply(&LeaseRecord::Declined { addr: ip("10.0.0.10"), until: NOW + 1200 });
        assert_eq!(t.quarantined(0), 1);
        t.bind(Lease {
            addr: ip("10.0.0.10"),
            mac: mac(1),
            expires: NOW + 3600,
            hostname: None,
            relay_agent: Default::default(),
        });
        assert_eq!(t.quarantined(0), 0);
        assert_eq!(t.records().len(), 5, "five leases (the reservation's too), no quarantine");
    }

    #[test]
    fn a_mac_moving_address_frees_the_old_one() {
        let mut t = table("10.0.0.10-10.0.0.11", vec![]);
        let a = lease(&mut t, mac(1), NOW + 3600);
        t.bind(Lease {
            addr: ip("10.0.0.11"),
            mac: mac(1),
            expires: NOW + 3600,
            hostname: None,
            relay_agent: Default::default(),
        });
        assert!(t.lease(a).is_none());
        assert_eq!(t.free_count(0), 1);
        assert_eq!(t.active(NOW), 1);
    }

    #[test]
    fn replaying_records_rebuilds_the_same_table() {
        let mut t = table("10.0.0.10-10.0.0.20", vec![]);
        let mut journal = Vec::new();
        for n in 1..=5 {
            let addr = t.choose(mac(n), 0, None, NOW).unwrap();
            journal.push(t.bind(Lease {
                addr,
                mac: mac(n),
                expires: NOW + 100,
                hostname: None,
                relay_agent: Default::default(),
            }));
        }
        journal.push(t.release(mac(2), ip("10.0.0.11"), NOW).unwrap());
        journal.push(t.decline(mac(3), ip("10.0.0.12"), NOW + 600).unwrap());
        assert_eq!(t.quarantined(0), 1);
        let mut replayed = table("10.0.0.10-10.0.0.20", vec![]);
        for r in &journal {
            replayed.apply(r);
        }
        let mut a = t.records();
        let mut b = replayed.records();
        a.sort_by_key(|r| format!("{r:?}"));
        b.sort_by_key(|r| format!("{r:?}"));
        assert_eq!(a, b);
        assert_eq!(replayed.free_count(0), t.free_count(0));
        assert_eq!(replayed.quarantined(0), t.quarantined(0));
    }
}
