//! Who gets a connection or transfer slot: a global cap, a per-address cap, a reserve that
//! only short, boot-critical requests may use, and precedence for the site's own hosts. Every
//! machine on the provisioning segment is untrusted, so no one address may take every slot;
//! and many addresses together may take them all, so a connection from an address held by a
//! host the site knows ([`Standing::Known`]) is never turned away for theirs: once every slot
//! is taken it takes the slot of the oldest connection of an unknown address, which is closed.
//!
//! [`Admission`] is the bookkeeping and the decision, with no I/O and no clock; [`Slots`]
//! shares it between tasks and hands out [`Ticket`]s that give their slot back when dropped
//! and tell their holder when they were evicted.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use crate::MacAddr;

/// The caps, checked: `1 <= per_address`, `reserved < total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    total: usize,
    per_address: usize,
    reserved: usize,
}

/// Why a set of caps is not usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CapsError {
    #[error("must be at least 1")]
    ZeroTotal,
    #[error("must be at least 1")]
    ZeroPerAddress,
    #[error("must be less than the total ({total}), or nothing is left for other requests")]
    ReserveNotBelowTotal { total: usize },
}

impl Caps {
    /// `total` slots, at most `per_address` held by one address, and `reserved` of the total
    /// kept for [`Slot::Reserved`] use once the others are taken.
    pub fn new(total: usize, per_address: usize, reserved: usize) -> Result<Self, CapsError> {
        if total == 0 {
            return Err(CapsError::ZeroTotal);
        }
        if per_address == 0 {
            return Err(CapsError::ZeroPerAddress);
        }
        if reserved >= total {
            return Err(CapsError::ReserveNotBelowTotal { total });
        }
        Ok(Self { total, per_address, reserved })
    }
}

/// What siteboot can stand behind about a peer address when it connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// A host of the site holds the address (its holder is a MAC the inventory knows), or the
    /// address is the appliance's own (its health probes).
    Known,
    /// Anyone else on the segment.
    Unknown,
}

impl Standing {
    /// The standing of a peer: `own` when the address is the appliance's, else by whether
    /// the MAC holding it (as [`crate::neighbors::Neighbors`] proves it) is one `knows` knows.
    pub fn of(own: bool, holder: Option<MacAddr>, knows: impl FnOnce(MacAddr) -> bool) -> Self {
        match holder {
            _ if own => Self::Known,
            Some(mac) if knows(mac) => Self::Known,
            _ => Self::Unknown,
        }
    }
}

/// The kind of slot a connection got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Any request may use it.
    General,
    /// The general slots were taken when an unknown address connected: only what the reserve
    /// is for may use it.
    Reserved,
}

/// Why a slot was not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("this address already holds {0} slots")]
    PerAddress(usize),
    #[error("all {0} slots are taken")]
    Full(usize),
    #[error("all {0} slots are taken by known hosts")]
    FullOfKnownHosts(usize),
}

/// One admission, named by when it was made: a lower id is an older connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AdmissionId(u64);

/// A slot given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    pub id: AdmissionId,
    pub slot: Slot,
    /// The connection whose slot this one took: its holder must close it.
    pub evicted: Option<AdmissionId>,
}

#[derive(Debug)]
struct Held {
    addr: IpAddr,
    standing: Standing,
}

/// Slots in use, by admission and by address.
#[derive(Debug)]
pub struct Admission {
    caps: Caps,
    /// Every slot in use, oldest first.
    held: BTreeMap<AdmissionId, Held>,
    next: u64,
    /// Only addresses holding at least one slot: the map is bounded by `caps.total`.
    by_address: HashMap<IpAddr, usize>,
}

impl Admission {
    pub fn new(caps: Caps) -> Self {
        Self { caps, held: BTreeMap::new(), next: 0, by_address: HashMap::new() }
    }

    /// Gives `addr` a slot, or says why not. An unknown address gets a general slot while
    /// there is one, then a reserved one. A known one gets a general slot while any slot is
    /// free, and when none is, the slot of the oldest connection of an unknown address
    /// (idle, slow, or simply first: nothing on the segment may keep the site's hosts out).
    pub fn admit(&mut self, addr: IpAddr, standing: Standing) -> Result<Admitted, Refusal> {
        let held = self.by_address.get(&addr).copied().unwrap_or(0);
        if held >= self.caps.per_address {
            return Err(Refusal::PerAddress(held));
        }
        let in_use = self.held.len();
        let (slot, evicted) = match standing {
            _ if in_use < self.caps.total - self.caps.reserved => (Slot::General, None),
            Standing::Unknown if in_use < self.caps.total => (Slot::Reserved, None),
            Standing::Unknown => return Err(Refusal::Full(self.caps.total)),
            Standing::Known if in_use < self.caps.total => (Slot::General, None),
            Standing::Known => {
                let oldest_unknown = self
                    .held
                    .iter()
                    .find(|(_, h)| h.standing == Standing::Unknown)
                    .map(|(id, _)| *id)
                    .ok_or(Refusal::FullOfKnownHosts(self.caps.total))?;
                self.release(oldest_unknown);
                (Slot::General, Some(oldest_unknown))
            }
        };
        let id = AdmissionId(self.next);
        self.next += 1;
        self.held.insert(id, Held { addr, standing });
        *self.by_address.entry(addr).or_default() += 1;
        Ok(Admitted { id, slot, evicted })
    }

    /// Gives back the slot of `id`; nothing if it was evicted already.
    pub fn release(&mut self, id: AdmissionId) {
        let Some(held) = self.held.remove(&id) else { return };
        let count = self.by_address.get_mut(&held.addr).expect("an address holding a slot");
        *count -= 1;
        if *count == 0 {
            self.by_address.remove(&held.addr);
        }
    }

    pub fn in_use(&self) -> usize {
        self.held.len()
    }
}

/// An [`Admission`] shared between tasks, with a way to tell an evicted ticket's holder.
#[derive(Debug)]
pub struct Slots {
    inner: Mutex<Shared>,
}

#[derive(Debug)]
struct Shared {
    admission: Admission,
    /// Cancelled when the admission is evicted; one per slot in use.
    evictions: HashMap<AdmissionId, CancellationToken>,
}

impl Slots {
    pub fn new(caps: Caps) -> Arc<Self> {
        let admission = Admission::new(caps);
        Arc::new(Self { inner: Mutex::new(Shared { admission, evictions: HashMap::new() }) })
    }

    /// A slot for `addr`, held until the ticket is dropped or evicted (see
    /// [`Ticket::evicted`]). Only a [`Standing::Known`] address evicts, so a holder that
    /// admits only unknown ones (the status page's streams) never has to watch for it.
    pub fn admit(self: &Arc<Self>, addr: IpAddr, standing: Standing) -> Result<Ticket, Refusal> {
        let mut shared = self.inner.lock().expect("admission lock");
        let admitted = shared.admission.admit(addr, standing)?;
        if let Some(token) = admitted.evicted.and_then(|id| shared.evictions.remove(&id)) {
            token.cancel();
        }
        let evicted = CancellationToken::new();
        shared.evictions.insert(admitted.id, evicted.clone());
        Ok(Ticket { slots: self.clone(), id: admitted.id, slot: admitted.slot, evicted })
    }
}

/// A slot; given back when dropped.
#[derive(Debug)]
pub struct Ticket {
    slots: Arc<Slots>,
    id: AdmissionId,
    slot: Slot,
    evicted: CancellationToken,
}

impl Ticket {
    pub fn slot(&self) -> Slot {
        self.slot
    }

    /// Cancelled when a known host's connection took this slot: close the connection.
    pub fn evicted(&self) -> &CancellationToken {
        &self.evicted
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut shared = self.slots.inner.lock().expect("admission lock");
        shared.admission.release(self.id);
        shared.evictions.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 99, 0, last])
    }

    fn mac(last: u8) -> MacAddr {
        MacAddr::new([0x52, 0x54, 0, 0, 0, last])
    }

    #[test]
    fn caps_are_checked() {
        assert_eq!(Caps::new(0, 1, 0), Err(CapsError::ZeroTotal));
        assert_eq!(Caps::new(4, 0, 0), Err(CapsError::ZeroPerAddress));
        assert_eq!(Caps::new(4, 1, 4), Err(CapsError::ReserveNotBelowTotal { total: 4 }));
        assert!(Caps::new(4, 1, 3).is_ok());
    }

    /// Known means positive evidence: the appliance's own address, or an address whose proven
    /// holder is a MAC of the inventory. No holder, or a holder the inventory does not know,
    /// is anyone.
    #[test]
    fn the_standing_matrix() {
        let knows = |m: MacAddr| m == mac(1);
        let cases = [
            (true, None, Standing::Known),
            (true, Some(mac(9)), Standing::Known),
            (false, Some(mac(1)), Standing::Known),
            (false, Some(mac(9)), Standing::Unknown),
            (false, None, Standing::Unknown),
        ];
        for (own, holder, expected) in cases {
            assert_eq!(Standing::of(own, holder, knows), expected, "own {own}, holder {holder:?}");
        }
    }

    /// Every kind of pool against both standings: what the next connection gets. The pool
    /// has 4 slots, 1 of them reserved; `held` are its connections, oldest first, each from
    /// its own address.
    #[test]
    fn the_admission_matrix() {
        use Standing::{Known as K, Unknown as U};
        let general = |evicted: Option<u64>| Ok((Slot::General, evicted));
        /// What the arrival gets: its slot and whose slot it took (by age), or why not.
        type Outcome = Result<(Slot, Option<u64>), Refusal>;
        let cases: [(&str, &[Standing], Standing, Outcome); 12] = [
            ("empty", &[], U, general(None)),
            ("empty", &[], K, general(None)),
            ("general slots taken", &[U, U, U], U, Ok((Slot::Reserved, None))),
            ("general slots taken", &[U, U, U], K, general(None)),
            ("general slots taken by known hosts", &[K, K, K], U, Ok((Slot::Reserved, None))),
            ("full of unknown", &[U, U, U, U], U, Err(Refusal::Full(4))),
            ("full of unknown", &[U, U, U, U], K, general(Some(0))),
            ("full, the oldest known", &[K, U, U, K], K, general(Some(1))),
            ("full, the oldest known", &[K, U, U, K], U, Err(Refusal::Full(4))),
            ("full, one unknown, newest", &[K, K, K, U], K, general(Some(3))),
            ("full of known", &[K, K, K, K], K, Err(Refusal::FullOfKnownHosts(4))),
            ("full of known", &[K, K, K, K], U, Err(Refusal::Full(4))),
        ];
        for (pool, held, arriving, expected) in cases {
            let mut a = Admission::new(Caps::new(4, 4, 1).unwrap());
            for (i, standing) in held.iter().enumerate() {
                a.admit(ip(i as u8), *standing).unwrap();
            }
            let got = a
                .admit(ip(100), arriving)
                .map(|admitted| (admitted.slot, admitted.evicted.map(|AdmissionId(id)| id)));
            assert_eq!(got, expected, "{pool}, {arriving:?} arrives");
            assert!(a.in_use() <= 4, "{pool}: never more than the cap");
        }
    }

    #[test]
    fn one_address_cannot_take_every_slot_known_or_not() {
        for standing in [Standing::Unknown, Standing::Known] {
            let mut a = Admission::new(Caps::new(8, 3, 0).unwrap());
            let ids: Vec<_> = (0..3).map(|_| a.admit(ip(1), standing).unwrap().id).collect();
            assert_eq!(a.admit(ip(1), standing), Err(Refusal::PerAddress(3)), "{standing:?}");
            assert!(a.admit(ip(2), standing).is_ok(), "others still get in");
            a.release(ids[0]);
            assert!(a.admit(ip(1), standing).is_ok(), "a released slot can be used again");
            assert_eq!(a.in_use(), 4);
        }
    }

    /// The attack of issue 22 item 11 in miniature: many unknown addresses take every slot;
    /// the site's hosts still get in, one connection of the flood at a time, oldest first.
    #[test]
    fn a_flood_from_many_addresses_yields_to_known_hosts_oldest_first() {
        let mut a = Admission::new(Caps::new(16, 2, 2).unwrap());
        let flood: Vec<_> = (0..8)
            .flat_map(|n| [ip(n), ip(n)])
            .map(|addr| a.admit(addr, Standing::Unknown))
            .collect();
        let flood: Vec<AdmissionId> = flood.into_iter().map(|f| f.unwrap().id).collect();
        assert_eq!(a.admit(ip(50), Standing::Unknown), Err(Refusal::Full(16)));
        let first = a.admit(ip(200), Standing::Known).unwrap();
        let second = a.admit(ip(201), Standing::Known).unwrap();
        assert_eq!((first.evicted, second.evicted), (Some(flood[0]), Some(flood[1])));
        assert_eq!(a.in_use(), 16);
        // The evicted connections close later; their release gives nothing back twice.
        a.release(flood[0]);
        a.release(flood[1]);
        assert_eq!(a.in_use(), 16);
        assert_eq!(
            a.admit(ip(0), Standing::Unknown),
            Err(Refusal::Full(16)),
            "ip(0) holds none now"
        );
        a.release(first.id);
        assert_eq!(a.admit(ip(0), Standing::Unknown).map(|x| x.slot), Ok(Slot::Reserved));
    }

    #[test]
    fn released_addresses_are_forgotten() {
        let mut a = Admission::new(Caps::new(4, 1, 0).unwrap());
        for last in 0..=255 {
            let admitted = a.admit(ip(last), Standing::Unknown).unwrap();
            a.release(admitted.id);
        }
        assert_eq!((a.in_use(), a.by_address.len()), (0, 0));
    }

    #[test]
    fn tickets_give_their_slot_back_and_learn_of_their_eviction() {
        let slots = Slots::new(Caps::new(1, 1, 0).unwrap());
        let unknown = slots.admit(ip(1), Standing::Unknown).unwrap();
        assert_eq!(unknown.slot(), Slot::General);
        assert_eq!(slots.admit(ip(2), Standing::Unknown).unwrap_err(), Refusal::Full(1));
        let known = slots.admit(ip(3), Standing::Known).unwrap();
        assert!(unknown.evicted().is_cancelled(), "the unknown connection is told to close");
        assert!(!known.evicted().is_cancelled());
        drop(unknown);
        assert_eq!(
            slots.inner.lock().unwrap().admission.in_use(),
            1,
            "the known host's slot stays"
        );
        drop(known);
        assert_eq!(slots.admit(ip(2), Standing::Unknown).map(|t| t.slot()), Ok(Slot::General));
        let shared = slots.inner.lock().unwrap();
        assert_eq!((shared.admission.in_use(), shared.evictions.len()), (0, 0));
    }
}
