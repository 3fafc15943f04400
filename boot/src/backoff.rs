//! Backing off from errors a socket loop cannot fix itself (out of file descriptors, out of
//! buffers): wait a little, longer each time, and try again, rather than spin or give up.

use std::time::Duration;

/// Waits that double from `first` up to `max`, back to `first` after a success.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Self {
        Self { first, max, next: first }
    }

    /// The wait before the next attempt, after a failure.
    pub fn failed(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(self.max);
        wait
    }

    /// The last attempt worked: the next failure waits `first` again.
    pub fn succeeded(&mut self) {
        self.next = self.first;
    }
}

/// For the accept and receive loops: 100 ms, doubling to 1 s. Short enough that service comes
/// back soon after descriptors are freed, long enough not to flood the log.
impl Default for Backoff {
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets_on_success() {
        let mut b = Backoff::default();
        let waits: Vec<u64> = (0..6).map(|_| b.failed().as_millis() as u64).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        b.succeeded();
        assert_eq!(b.failed(), Duration::from_millis(100));
    }
}
