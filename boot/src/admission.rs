//! Who gets a connection or transfer slot: a global cap, a per-address cap, and a reserve that
//! only short, boot-critical requests may use. Every machine on the provisioning segment is
//! untrusted, so no one address may take every slot.
//!
//! [`Admission`] is the bookkeeping, with no I/O and no clock; [`Slots`] shares it between
//! tasks and hands out [`Ticket`]s that give their slot back when dropped.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

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

/// The kind of slot a connection got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Any request may use it.
    General,
    /// The general slots were taken: only what the reserve is for may use it.
    Reserved,
}

/// Why a slot was not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("this address already holds {0} slots")]
    PerAddress(usize),
    #[error("all {0} slots are taken")]
    Full(usize),
}

/// Slots in use, by kind and by address.
#[derive(Debug)]
pub struct Admission {
    caps: Caps,
    general: usize,
    reserved: usize,
    /// Only addresses holding at least one slot: the map is bounded by `caps.total`.
    by_address: HashMap<IpAddr, usize>,
}

impl Admission {
    pub fn new(caps: Caps) -> Self {
        Self { caps, general: 0, reserved: 0, by_address: HashMap::new() }
    }

    /// Gives `addr` a slot, general first, or says why not.
    pub fn admit(&mut self, addr: IpAddr) -> Result<Slot, Refusal> {
        let held = self.by_address.get(&addr).copied().unwrap_or(0);
        if held >= self.caps.per_address {
            return Err(Refusal::PerAddress(held));
        }
        let slot = if self.general < self.caps.total - self.caps.reserved {
            self.general += 1;
            Slot::General
        } else if self.reserved < self.caps.reserved {
            self.reserved += 1;
            Slot::Reserved
        } else {
            return Err(Refusal::Full(self.caps.total));
        };
        *self.by_address.entry(addr).or_default() += 1;
        Ok(slot)
    }

    /// Gives back a slot [`admit`](Self::admit) gave `addr`.
    pub fn release(&mut self, addr: IpAddr, slot: Slot) {
        match slot {
            Slot::General => self.general -= 1,
            Slot::Reserved => self.reserved -= 1,
        }
        let held = self.by_address.get_mut(&addr).expect("released by an address holding a slot");
        *held -= 1;
        if *held == 0 {
            self.by_address.remove(&addr);
        }
    }

    /// Whether some address could be admitted now.
    pub fn has_room(&self) -> bool {
        self.in_use() < self.caps.total
    }

    pub fn in_use(&self) -> usize {
        self.general + self.reserved
    }
}

/// An [`Admission`] shared between tasks.
#[derive(Debug)]
pub struct Slots {
    admission: Mutex<Admission>,
    freed: Notify,
}

impl Slots {
    pub fn new(caps: Caps) -> Arc<Self> {
        Arc::new(Self { admission: Mutex::new(Admission::new(caps)), freed: Notify::new() })
    }

    /// A slot for `addr`, held until the ticket is dropped.
    pub fn admit(self: &Arc<Self>, addr: IpAddr) -> Result<Ticket, Refusal> {
        let slot = self.admission.lock().expect("admission lock").admit(addr)?;
        Ok(Ticket { slots: self.clone(), addr, slot })
    }

    /// Returns once some slot is free (at once if one is).
    pub async fn room(&self) {
        loop {
            // Registered before the check, so a release in between is not missed.
            let freed = self.freed.notified();
            if self.admission.lock().expect("admission lock").has_room() {
                return;
            }
            freed.await;
        }
    }
}

/// A slot; given back when dropped.
#[derive(Debug)]
pub struct Ticket {
    slots: Arc<Slots>,
    addr: IpAddr,
    slot: Slot,
}

impl Ticket {
    pub fn slot(&self) -> Slot {
        self.slot
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.slots.admission.lock().expect("admission lock").release(self.addr, self.slot);
        self.slots.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 99, 0, last])
    }

    #[test]
    fn caps_are_checked() {
        assert_eq!(Caps::new(0, 1, 0), Err(CapsError::ZeroTotal));
        assert_eq!(Caps::new(4, 0, 0), Err(CapsError::ZeroPerAddress));
        assert_eq!(Caps::new(4, 1, 4), Err(CapsError::ReserveNotBelowTotal { total: 4 }));
        assert!(Caps::new(4, 1, 3).is_ok());
    }

    #[test]
    fn one_address_cannot_take_every_slot() {
        let mut a = Admission::new(Caps::new(8, 3, 0).unwrap());
        for _ in 0..3 {
            assert_eq!(a.admit(ip(1)), Ok(Slot::General));
        }
        assert_eq!(a.admit(ip(1)), Err(Refusal::PerAddress(3)));
        assert_eq!(a.admit(ip(2)), Ok(Slot::General), "others still get in");
        a.release(ip(1), Slot::General);
        assert_eq!(a.admit(ip(1)), Ok(Slot::General), "a released slot can be used again");
        assert_eq!(a.in_use(), 4);
    }

    #[test]
    fn the_reserve_is_used_only_once_the_general_slots_are_taken() {
        let mut a = Admission::new(Caps::new(4, 4, 2).unwrap());
        assert_eq!(a.admit(ip(1)), Ok(Slot::General));
        assert_eq!(a.admit(ip(2)), Ok(Slot::General));
        assert_eq!(a.admit(ip(3)), Ok(Slot::Reserved));
        assert_eq!(a.admit(ip(4)), Ok(Slot::Reserved));
        assert!(!a.has_room());
        assert_eq!(a.admit(ip(5)), Err(Refusal::Full(4)));
        a.release(ip(3), Slot::Reserved);
        assert!(a.has_room());
        assert_eq!(a.admit(ip(5)), Ok(Slot::Reserved), "the general slots are still taken");
        a.release(ip(1), Slot::General);
        assert_eq!(a.admit(ip(6)), Ok(Slot::General));
    }

    #[test]
    fn released_addresses_are_forgotten() {
        let mut a = Admission::new(Caps::new(4, 1, 0).unwrap());
        for last in 0..=255 {
            let slot = a.admit(ip(last)).unwrap();
            a.release(ip(last), slot);
        }
        assert_eq!((a.in_use(), a.by_address.len()), (0, 0));
    }

    #[tokio::test]
    async fn tickets_give_their_slot_back_and_wake_a_waiter() {
        let slots = Slots::new(Caps::new(1, 1, 0).unwrap());
        let ticket = slots.admit(ip(1)).unwrap();
        assert_eq!(ticket.slot(), Slot::General);
        assert_eq!(slots.admit(ip(2)).unwrap_err(), Refusal::Full(1));
        let waiter = tokio::spawn({
            let slots = slots.clone();
            async move { slots.room().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(ticket);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter).await.unwrap().unwrap();
        assert_eq!(slots.admission.lock().unwrap().in_use(), 0);
    }
}
