//! Whether this replica may act as the site's leader (answer full-mode DHCP, run the
//! reconcilers), and until when.
//!
//! Leadership is a term with an end, not a flag: the leader may act only until the deadline by
//! which it must have renewed its Lease. Whoever acts checks the deadline against the monotonic
//! clock at the moment it acts, so a leader whose renewal hangs, or whose process was frozen
//! (SIGSTOP, a VM pause), stops by itself before another replica can take the Lease over.

use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leadership {
    /// Another replica leads, or none is known to.
    Follower,
    /// This replica leads until `until` unless it renews before.
    Leader { until: Instant },
    /// No election: this replica is the only one (standalone, or `leader_election: false`).
    Always,
}

impl Leadership {
    pub fn is_leading(&self, now: Instant) -> bool {
        match self {
            Leadership::Follower => false,
            Leadership::Leader { until } => now < *until,
            Leadership::Always => true,
        }
    }

    /// Whether `self` and `other` are the same term (a renewal only moves the deadline).
    pub fn same_term(&self, other: &Leadership) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// The receiving side, as the boot plane holds it.
pub type LeadershipWatch = watch::Receiver<Leadership>;

/// Whether the replica watched by `watch` leads at this moment.
pub fn leading_now(watch: &LeadershipWatch) -> bool {
    watch.borrow().is_leading(Instant::now())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_term_ends_at_its_deadline_whatever_the_renewing_task_does() {
        let now = Instant::now();
        let term = Leadership::Leader { until: now + Duration::from_secs(10) };
        assert!(term.is_leading(now));
        assert!(term.is_leading(now + Duration::from_secs(9)));
        assert!(!term.is_leading(now + Duration::from_secs(10)));
        assert!(!Leadership::Follower.is_leading(now));
        assert!(Leadership::Always.is_leading(now + Duration::from_secs(1 << 20)));
    }

    #[test]
    fn a_renewal_is_the_same_term() {
        let now = Instant::now();
        let a = Leadership::Leader { until: now };
        let b = Leadership::Leader { until: now + Duration::from_secs(10) };
        assert!(a.same_term(&b));
        assert!(!a.same_term(&Leadership::Follower));
    }
}
