//! Rate limiting by key (a client address, say): a token bucket per key, with no clock of its
//! own (callers pass `now`), so it is tested without waiting.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// `burst` requests at once, then one per `every`.
#[derive(Debug, Clone, Copy)]
pub struct Rate {
    pub burst: u32,
    pub every: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    updated: Instant,
}

impl Bucket {
    fn refill(&mut self, rate: Rate, now: Instant) {
        let earned =
            now.saturating_duration_since(self.updated).as_secs_f64() / rate.every.as_secs_f64();
        self.tokens = (self.tokens + earned).min(f64::from(rate.burst));
        self.updated = now;
    }
}

/// Token buckets by key (by default a client address), at most `max_keys` of them.
#[derive(Debug)]
pub struct RateLimiter<K = IpAddr> {
    rate: Rate,
    max_keys: usize,
    buckets: HashMap<K, Bucket>,
}

impl<K: Hash + Eq> RateLimiter<K> {
    pub fn new(rate: Rate, max_keys: usize) -> Self {
        Self { rate, max_keys, buckets: HashMap::new() }
    }

    /// Whether `key` may go at `now` (and if so, it is counted).
    pub fn allow(&mut self, key: K, now: Instant) -> bool {
        if !self.buckets.contains_key(&key) && self.buckets.len() >= self.max_keys {
            self.forget_full(now);
        }
        let burst = f64::from(self.rate.burst);
        let bucket = self.buckets.entry(key).or_insert(Bucket { tokens: burst, updated: now });
        bucket.refill(self.rate, now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Drops the buckets that have refilled (they hold no state a new bucket would not); if
    /// every key is still limited, drops them all, which only lets them burst once more.
    fn forget_full(&mut self, now: Instant) {
        let (rate, burst) = (self.rate, f64::from(self.rate.burst));
        self.buckets.retain(|_, b| {
            b.refill(rate, now);
            b.tokens < burst
        });
        if self.buckets.len() >= self.max_keys {
            self.buckets.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RATE: Rate = Rate { burst: 3, every: Duration::from_secs(2) };

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 99, 0, last])
    }

    #[test]
    fn a_burst_then_one_per_interval() {
        let mut limiter = RateLimiter::new(RATE, 16);
        let t0 = Instant::now();
        assert!((0..3).all(|_| limiter.allow(ip(1), t0)), "the burst");
        assert!(!limiter.allow(ip(1), t0));
        assert!(limiter.allow(ip(2), t0), "addresses are limited separately");
        assert!(!limiter.allow(ip(1), t0 + Duration::from_secs(1)));
        assert!(limiter.allow(ip(1), t0 + Duration::from_secs(2)), "one token per interval");
        assert!(!limiter.allow(ip(1), t0 + Duration::from_secs(2)));
        let later = t0 + Duration::from_secs(3600);
        assert!((0..3).all(|_| limiter.allow(ip(1), later)), "refilled up to the burst only");
        assert!(!limiter.allow(ip(1), later));
    }

    #[test]
    fn refused_requests_do_not_earn_tokens() {
        let mut limiter = RateLimiter::new(RATE, 16);
        let t0 = Instant::now();
        for i in 0..100 {
            let allowed = limiter.allow(ip(1), t0 + Duration::from_millis(10 * i));
            assert_eq!(allowed, i < 3, "request {i}");
        }
    }

    #[test]
    fn memory_is_bounded_and_limited_addresses_are_kept_while_possible() {
        let mut limiter = RateLimiter::new(RATE, 4);
        let t0 = Instant::now();
        for _ in 0..3 {
            limiter.allow(ip(1), t0);
        }
        for last in 2..=200 {
            limiter.allow(ip(last), t0 + Duration::from_millis(u64::from(last)));
            assert!(limiter.buckets.len() <= 4);
        }
        let mut limiter = RateLimiter::new(RATE, 4);
        for _ in 0..3 {
            limiter.allow(ip(1), t0);
        }
        limiter.allow(ip(2), t0);
        limiter.allow(ip(3), t0);
        limiter.allow(ip(4), t0);
        // Addresses 2-4 refill after one interval; address 1 needs three.
        limiter.allow(ip(5), t0 + Duration::from_secs(2));
        assert!(!limiter.buckets.contains_key(&ip(2)), "a full bucket is forgotten");
        assert!(limiter.buckets.contains_key(&ip(1)), "a limited address is kept");
        let t2 = t0 + Duration::from_secs(2);
        assert!(limiter.allow(ip(1), t2), "with the one token it earned");
        assert!(!limiter.allow(ip(1), t2), "not with a fresh burst");
    }
}
