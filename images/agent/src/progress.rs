//! Progress of long steps (writing an image, wiping a disk, `siteboot_agent_api::Progress`),
//! reported at most about once a second (docs/agent-api.md).

use std::time::{Duration, Instant};

/// Lets a progress report through at most once per `every`.
#[derive(Debug)]
pub struct Throttle {
    every: Duration,
    last: Option<Instant>,
}

impl Throttle {
    pub fn new(every: Duration) -> Self {
        Self { every, last: None }
    }

    /// Whether a report at `now` is due (the first always is); if so, it counts as sent.
    pub fn due(&mut self, now: Instant) -> bool {
        let due = self.last.is_none_or(|last| now.duration_since(last) >= self.every);
        if due {
            self.last = Some(now);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_at_most_once_per_interval() {
        let mut throttle = Throttle::new(Duration::from_secs(1));
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let due: Vec<bool> = [0, 10, 999, 1000, 1500, 2100].map(|ms| throttle.due(at(ms))).into();
        assert_eq!(due, [true, false, false, true, false, true]);
    }
}
