//! Waiting with deadlines: every wait in the test suite names what it waits for and gives up.

use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// Polls `probe` every `interval` until it returns `Some`, or fails after `timeout` with an
/// error naming `what`.
pub fn until<T>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = probe() {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        sleep(interval);
    }
}

/// [`until`] with a 100 ms polling interval.
pub fn for_<T>(what: &str, timeout: Duration, probe: impl FnMut() -> Option<T>) -> Result<T> {
    until(what, timeout, Duration::from_millis(100), probe)
}

/// Async [`until`]: polls `probe` every `interval` without blocking the runtime, until it returns
/// `Some`, or fails after `timeout` with an error naming `what`. A probe that hangs counts against
/// the same deadline.
pub async fn until_async<T, F, Fut>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut probe: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(Some(value)) = tokio::time::timeout_at(deadline, probe()).await {
            return Ok(value);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(interval).await;
    }
}

/// [`until_async`] with a 100 ms polling interval.
pub async fn for_async<T, F, Fut>(what: &str, timeout: Duration, probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    until_async(what, timeout, Duration::from_millis(100), probe).await
}
