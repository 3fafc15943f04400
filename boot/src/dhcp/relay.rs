//! Refused relayed messages logged once, not at every message: each untrusted relay, and each
//! pinned MAC whose relayed messages carry relay agent information its pin does not name.

use std::collections::HashSet;
use std::hash::Hash;
use std::net::Ipv4Addr;

use crate::MacAddr;

/// What was refused so far, remembered so that each is logged once. The attacker chooses what
/// is refused (the addresses of a forged relay, and which pinned host's MAC it forges), so at
/// most `bound` are remembered; past that none is logged (the counter still counts).
#[derive(Debug)]
pub struct Refusals<K> {
    seen: HashSet<K>,
    bound: usize,
    /// Whether the line saying that no more are logged was logged.
    full: bool,
}

/// Relays (a `giaddr` and the source it came from) refused so far.
pub type RefusedRelays = Refusals<(Ipv4Addr, Ipv4Addr)>;
/// Pinned MACs whose relayed messages were refused for what their relay agent information says.
pub type RefusedPins = Refusals<MacAddr>;

/// Refused relays remembered: far more than a site has relays.
const MAX_RELAYS_LOGGED: usize = 64;
/// Pinned MACs remembered: only a host with a pin can be refused for it, so these are the
/// site's own hosts, and a relay or pin misconfigured for a whole rack logs each of them.
const MAX_PINS_LOGGED: usize = 1024;

/// Whether a refusal is logged, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalLog {
    /// The first refusal of this one: log it.
    First,
    /// The first refusal past the bound: say that no more are logged.
    LastLogged,
    /// Logged already, or past the bound.
    Quiet,
}

impl RefusedRelays {
    pub fn new() -> Self {
        Refusals::bounded(MAX_RELAYS_LOGGED)
    }
}

impl RefusedPins {
    pub fn new() -> Self {
        Refusals::bounded(MAX_PINS_LOGGED)
    }
}

impl<K: Hash + Eq> Refusals<K> {
    fn bounded(bound: usize) -> Self {
        Self { seen: HashSet::new(), bound, full: false }
    }

    /// Notes a refused message of `key` (for a relay: its `giaddr` and the source it came from).
    pub fn refused(&mut self, key: K) -> RefusalLog {
        if self.seen.contains(&key) {
            RefusalLog::Quiet
        } else if self.seen.len() < self.bound {
            self.seen.insert(key);
            RefusalLog::First
        } else if !self.full {
            self.full = true;
            RefusalLog::LastLogged
        } else {
            RefusalLog::Quiet
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refused_relay_is_logged_once_and_memory_is_bounded() {
        let mut refused = RefusedRelays::new();
        let relay = Ipv4Addr::new(10, 0, 5, 2);
        assert_eq!(refused.refused((relay, relay)), RefusalLog::First);
        assert_eq!(refused.refused((relay, relay)), RefusalLog::Quiet);
        // The same giaddr from another source is another sender.
        assert_eq!(refused.refused((relay, Ipv4Addr::new(10, 0, 0, 77))), RefusalLog::First);
        // A flood of made-up relays: logged up to the bound, then one last line, then nothing.
        let made_up = (1..=1000u32).map(|n| Ipv4Addr::from(0x0a63_0000 + n));
        let logs: Vec<RefusalLog> = made_up.map(|a| refused.refused((a, a))).collect();
        assert_eq!(logs.iter().filter(|l| **l == RefusalLog::First).count(), MAX_RELAYS_LOGGED - 2);
        assert_eq!(logs.iter().filter(|l| **l == RefusalLog::LastLogged).count(), 1);
        assert_eq!(refused.seen.len(), MAX_RELAYS_LOGGED);
        assert_eq!(refused.refused((relay, relay)), RefusalLog::Quiet);
    }

    #[test]
    fn each_refused_pinned_mac_is_logged_once_and_memory_is_bounded() {
        let mut refused = RefusedPins::new();
        let mac = |n: u32| {
            let [a, b, c, d] = n.to_be_bytes();
            MacAddr::new([0x52, 0x54, a, b, c, d])
        };
        assert_eq!(refused.refused(mac(1)), RefusalLog::First);
        assert_eq!(refused.refused(mac(1)), RefusalLog::Quiet);
        let logs: Vec<RefusalLog> = (2..=5000).map(|n| refused.refused(mac(n))).collect();
        assert_eq!(logs.iter().filter(|l| **l == RefusalLog::First).count(), MAX_PINS_LOGGED - 1);
        assert_eq!(logs.iter().filter(|l| **l == RefusalLog::LastLogged).count(), 1);
        assert_eq!(refused.seen.len(), MAX_PINS_LOGGED);
        assert_eq!(refused.refused(mac(1)), RefusalLog::Quiet);
    }
}
