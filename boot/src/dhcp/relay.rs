//! Relays refused so far: an untrusted relay is logged once, not at every message.

use std::collections::HashSet;
use std::net::Ipv4Addr;

/// Relays (a `giaddr` and the source it came from) refused so far: an untrusted relay is
/// logged once, not at every message. The attacker chooses both addresses, so at most
/// [`MAX_LOGGED`] are remembered; past that none is logged (the counter still counts).
#[derive(Debug, Default)]
pub struct RefusedRelays {
    seen: HashSet<(Ipv4Addr, Ipv4Addr)>,
}

/// Refused relays remembered: far more than a site has relays.
const MAX_LOGGED: usize = 64;

/// Whether a refusal of a relay is logged, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalLog {
    /// The first refusal of this relay: log it.
    First,
    /// The first refusal past [`MAX_LOGGED`]: say that no more are logged.
    LastLogged,
    /// Logged already, or past the bound.
    Quiet,
}

impl RefusedRelays {
    pub fn new() -> Self {
        Self::default()
    }

    /// Notes a refused message that named `giaddr` and came from `source`.
    pub fn refused(&mut self, giaddr: Ipv4Addr, source: Ipv4Addr) -> RefusalLog {
        if self.seen.contains(&(giaddr, source)) {
            return RefusalLog::Quiet;
        }
        match self.seen.len() {
            n if n < MAX_LOGGED => {
                self.seen.insert((giaddr, source));
                RefusalLog::First
            }
            n if n == MAX_LOGGED => {
                // One more entry, an impossible pair, marks the bound as announced.
                self.seen.insert((Ipv4Addr::UNSPECIFIED, Ipv4Addr::UNSPECIFIED));
                RefusalLog::LastLogged
            }
            _ => RefusalLog::Quiet,
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
        assert_eq!(refused.refused(relay, relay), RefusalLog::First);
        assert_eq!(refused.refused(relay, relay), RefusalLog::Quiet);
        // The same giaddr from another source is another sender.
        assert_eq!(refused.refused(relay, Ipv4Addr::new(10, 0, 0, 77)), RefusalLog::First);
        // A flood of made-up relays: logged up to the bound, then one last line, then nothing.
        let made_up = (1..=1000u32).map(|n| Ipv4Addr::from(0x0a63_0000 + n));
        let logs: Vec<RefusalLog> = made_up.map(|a| refused.refused(a, a)).collect();
        assert_eq!(logs.iter().filter(|l| **l == RefusalLog::First).count(), MAX_LOGGED - 2);
        assert_eq!(logs.iter().filter(|l| **l == RefusalLog::LastLogged).count(), 1);
        assert_eq!(refused.seen.len(), MAX_LOGGED + 1);
        assert_eq!(refused.refused(relay, relay), RefusalLog::Quiet);
    }
}
