//! How many addresses one client may put in quarantine, and how often a refused DECLINE or
//! RELEASE is logged. Not durable: a restart only gives each client a fresh budget, while the
//! quarantines themselves (journaled) and the table's reserve (half the pool) stay.
//!
//! A DECLINE comes from 0.0.0.0:68 (RFC 2131 4.4.4: the client has no address), so its source
//! tells clients apart no better than `chaddr`; relayed ones come from the relay. The budget is
//! therefore per MAC only, and the table's reserve bounds what many MACs can do together.

use std::collections::{HashMap, VecDeque};

use super::leases::UnixTime;
use crate::MacAddr;

/// Addresses one MAC may have quarantined per window (the quarantine's length): a client that
/// really finds its address taken declines once, and rarely twice, before it gets a good one.
pub const DECLINES_PER_CLIENT: u32 = 2;

/// MACs tracked at once. A client that would need a new entry past this is refused (and not
/// logged): only a flood of made-up MACs gets there, and the reserve caps it anyway.
const MAX_TRACKED: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct Client {
    /// When this client's window began.
    since: UnixTime,
    /// Addresses it had quarantined in the window.
    quarantined: u32,
    /// A refusal of this client was logged in the window.
    logged: bool,
}

/// Per-MAC windows of `window` seconds, opened by a MAC's first DECLINE or refusal.
#[derive(Debug, Default)]
pub struct DeclineBudget {
    clients: HashMap<MacAddr, Client>,
    /// Windows by start: since every window lasts as long, also by end.
    opened: VecDeque<(UnixTime, MacAddr)>,
}

impl DeclineBudget {
    pub fn new() -> Self {
        Self::default()
    }

    /// `mac`'s window now, opened if it has none; `None` when no more MACs can be tracked.
    fn client(&mut self, mac: MacAddr, now: UnixTime, window: u64) -> Option<&mut Client> {
        while let Some(&(since, old)) = self.opened.front() {
            if since.saturating_add(window) > now {
                break;
            }
            self.opened.pop_front();
            if self.clients.get(&old).is_some_and(|c| c.since == since) {
                self.clients.remove(&old);
            }
        }
        if !self.clients.contains_key(&mac) {
            if self.clients.len() >= MAX_TRACKED {
                return None;
            }
            self.clients.insert(mac, Client { since: now, quarantined: 0, logged: false });
            self.opened.push_back((now, mac));
        }
        self.clients.get_mut(&mac)
    }

    /// Whether `mac` may have one more address quarantined now.
    pub fn allows(&mut self, mac: MacAddr, now: UnixTime, window: u64) -> bool {
        self.client(mac, now, window).is_some_and(|c| c.quarantined < DECLINES_PER_CLIENT)
    }

    /// `mac` had an address quarantined (after [`allows`](Self::allows) said it may).
    pub fn spend(&mut self, mac: MacAddr, now: UnixTime, window: u64) {
        if let Some(c) = self.client(mac, now, window) {
            c.quarantined += 1;
        }
    }

    /// Whether a refusal of `mac` is to be logged: the first in its window.
    pub fn log_refusal(&mut self, mac: MacAddr, now: UnixTime, window: u64) -> bool {
        self.client(mac, now, window).is_some_and(|c| !std::mem::replace(&mut c.logged, true))
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.clients.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: UnixTime = 1_000_000;
    const WINDOW: u64 = 600;

    fn mac(n: u16) -> MacAddr {
        let [a, b] = n.to_be_bytes();
        MacAddr::new([2, 0, 0, 0, a, b])
    }

    #[test]
    fn each_mac_spends_its_budget_once_per_window() {
        let mut b = DeclineBudget::new();
        for _ in 0..DECLINES_PER_CLIENT {
            assert!(b.allows(mac(1), NOW, WINDOW));
            b.spend(mac(1), NOW, WINDOW);
        }
        assert!(!b.allows(mac(1), NOW + 1, WINDOW));
        assert!(b.allows(mac(2), NOW + 1, WINDOW), "another MAC has its own");
        assert!(b.log_refusal(mac(1), NOW + 1, WINDOW));
        assert!(!b.log_refusal(mac(1), NOW + 2, WINDOW), "one line per window");
        // The window opened at NOW ends at NOW + WINDOW: a new budget, a new log line.
        assert!(b.allows(mac(1), NOW + WINDOW, WINDOW));
        assert!(b.log_refusal(mac(1), NOW + WINDOW, WINDOW));
        assert_eq!(b.tracked(), 2, "mac 2's window, opened at NOW + 1, still runs");
        assert!(b.allows(mac(3), NOW + WINDOW + 1, WINDOW));
        assert_eq!(b.tracked(), 2, "mac 2's has ended");
    }

    #[test]
    fn tracking_is_bounded_and_refuses_past_the_bound() {
        let mut b = DeclineBudget::new();
        for n in 0..MAX_TRACKED as u16 {
            assert!(b.allows(mac(n), NOW, WINDOW));
        }
        assert!(!b.allows(mac(u16::MAX), NOW, WINDOW), "full: refused");
        assert!(!b.log_refusal(mac(u16::MAX), NOW, WINDOW), "and not logged");
        assert!(b.allows(mac(0), NOW, WINDOW), "a tracked MAC keeps its budget");
        assert_eq!(b.tracked(), MAX_TRACKED);
        assert!(b.allows(mac(u16::MAX), NOW + WINDOW, WINDOW), "room again");
        assert_eq!(b.tracked(), 1);
    }
}
