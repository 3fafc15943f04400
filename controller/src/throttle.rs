//! Events that any machine on the provisioning segment can cause, such as a boot script asked
//! for by an address that does not hold the MAC. Unthrottled, each such HTTP request would be a
//! write to the API server and a log line. At most one per object and reason a minute
//! ([`EACH`]), at most [`ALL`] across objects, and the next one written says how many were left
//! out.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use siteboot_boot::rate::{Rate, RateLimiter};

/// One Event per object and reason a minute.
const EACH: Rate = Rate { burst: 1, every: Duration::from_secs(60) };
/// Across objects: a rack's worth at once, then 10 a minute.
const ALL: Rate = Rate { burst: 20, every: Duration::from_secs(6) };
/// Objects and reasons tracked. Objects are Hosts (made by operators, not by the segment), so
/// this is only a backstop.
const MAX_KEYS: usize = 4096;

/// An object (`kind namespace/name`) and an Event reason.
type Key = (String, &'static str);

pub struct Throttle {
    each: RateLimiter<Key>,
    all: RateLimiter<()>,
    left_out: HashMap<Key, u64>,
}

impl Default for Throttle {
    fn default() -> Self {
        Self {
            each: RateLimiter::new(EACH, MAX_KEYS),
            all: RateLimiter::new(ALL, 1),
            left_out: HashMap::new(),
        }
    }
}

impl Throttle {
    /// Whether an Event about `object` for `reason` may be written at `now`: `Some(n)`, with
    /// the `n` left out since the last one written, or `None` (this one is left out, counted).
    pub fn admit(&mut self, object: &str, reason: &'static str, now: Instant) -> Option<u64> {
        let key = (object.to_owned(), reason);
        // The object's own limit first: one object's flood must not use up the others' share.
        if self.each.allow(key.clone(), now) && self.all.allow((), now) {
            return Some(self.left_out.remove(&key).unwrap_or(0));
        }
        if self.left_out.len() < MAX_KEYS || self.left_out.contains_key(&key) {
            *self.left_out.entry(key).or_default() += 1;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REFUSED: &str = "TokenRefused";

    #[test]
    fn one_event_per_object_and_reason_a_minute_then_the_count_left_out() {
        let mut throttle = Throttle::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(throttle.admit("Host metal/a", REFUSED, t0), Some(0));
        for i in 0..200 {
            assert_eq!(
                throttle.admit("Host metal/a", REFUSED, t0 + Duration::from_millis(i)),
                None
            );
        }
        assert_eq!(throttle.admit("Host metal/a", "Other", at(1)), Some(0), "another reason");
        assert_eq!(throttle.admit("Host metal/b", REFUSED, at(1)), Some(0), "another object");
        assert_eq!(throttle.admit("Host metal/a", REFUSED, at(59)), None);
        assert_eq!(throttle.admit("Host metal/a", REFUSED, at(60)), Some(201));
        assert_eq!(throttle.admit("Host metal/a", REFUSED, at(61)), None);
        assert_eq!(throttle.admit("Host metal/a", REFUSED, at(120)), Some(1));
        assert_eq!(throttle.admit("Host metal/a", REFUSED, at(3600)), Some(0));
    }

    #[test]
    fn all_objects_together_are_bounded_too() {
        let mut throttle = Throttle::default();
        let t0 = Instant::now();
        let host = |i: u32| format!("Host metal/host-{i}");
        let written = (0..100).filter(|i| throttle.admit(&host(*i), REFUSED, t0).is_some()).count();
        assert_eq!(written, ALL.burst as usize);
        // A minute later each object may write again, but all of them only 10 more; those
        // left out at first say so.
        let later = t0 + Duration::from_secs(60);
        let admitted: Vec<u64> =
            (20..100).filter_map(|i| throttle.admit(&host(i), REFUSED, later)).collect();
        assert_eq!(admitted, [1; 10]);
        assert!((0..20).all(|i| throttle.admit(&host(i), REFUSED, later).is_none()));
    }

    #[test]
    fn what_is_tracked_is_bounded() {
        let mut throttle = Throttle::default();
        let t0 = Instant::now();
        for i in 0..3 * MAX_KEYS {
            throttle.admit(&format!("Host metal/host-{i}"), REFUSED, t0);
            throttle.admit(&format!("Host metal/host-{i}"), REFUSED, t0);
        }
        assert!(throttle.left_out.len() <= MAX_KEYS);
    }
}
