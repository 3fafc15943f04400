//! Leader election for a site: a `coordination.k8s.io` Lease, taken and renewed with
//! compare-and-swap on its resourceVersion. The leader runs the reconcilers and full-mode DHCP;
//! every replica serves TFTP and HTTP.
//!
//! Safety rests on two clocks that never meet, as in client-go: the leader's term ends
//! `renew_deadline` after it *started* its last successful renewal (its own monotonic clock),
//! and a standby takes the Lease only once it has *seen* the record unchanged for
//! `lease_duration` (its own monotonic clock). Since the renewal landed after it started and
//! `renew_deadline < lease_duration`, the old term is over before a new one can begin,
//! whatever the wall clocks say. Every renewal call is bounded by the term's end, so a hung
//! API call or a partition ends the term on time; the boot plane checks the deadline itself
//! when it acts, so a frozen process that wakes up late does not act on an old term.
//!
//! On shutdown the leader gives the Lease back (no holder), and standbys, which watch the
//! Lease, take it at once.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use siteboot_boot::leadership::Leadership;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The election's clock. Invariant: `renew_deadline < lease_duration`.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long a standby waits, after the Lease last changed, before taking it.
    pub lease_duration: Duration,
    /// How long a term lasts after the renewal that started it: the leader stops acting then.
    pub renew_deadline: Duration,
    /// Time between renewals, and between a standby's attempts.
    pub retry_period: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// What the Lease record said, and since when (on this replica's monotonic clock).
struct Observed {
    holder: Option<String>,
    renewed: Option<MicroTime>,
    since: Instant,
}

pub struct LeaderElection {
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: Timing,
    observed: Option<Observed>,
}

impl LeaderElection {
    pub fn new(client: Client, namespace: &str, name: &str, identity: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            timing: Timing::default(),
            observed: None,
        }
    }

    /// Runs until `release`, publishing this replica's term. On `release` it ends its term and,
    /// if it held the Lease, gives it back so a standby takes over at once.
    pub async fn run(mut self, leadership: watch::Sender<Leadership>, release: CancellationToken) {
        let changed = Arc::new(Notify::new());
        let watching =
            tokio::spawn(notify_changes(self.api.clone(), self.name.clone(), changed.clone()));
        loop {
            let started = Instant::now();
            let term = *leadership.borrow();
            // A renewal may take until the term ends; a standby's attempt, a renew deadline.
            let deadline = match term {
                Leadership::Leader { until } => until,
                _ => started + self.timing.renew_deadline,
            };
            let attempt = tokio::select! {
                attempt = tokio::time::timeout_at(deadline, self.try_lead()) => attempt,
                _ = release.cancelled() => break,
            };
            let outcome = match attempt {
                Ok(Ok(true)) => Attempt::Holds,
                Ok(Ok(false)) => Attempt::HeldByAnother,
                Ok(Err(e)) => {
                    tracing::warn!(lease = %self.name, error = %e, "cannot renew the leader Lease");
                    Attempt::Failed
                }
                Err(_) => {
                    tracing::warn!(lease = %self.name, "renewing the leader Lease timed out");
                    Attempt::Failed
                }
            };
            let next = next_term(term, outcome, started, Instant::now(), &self.timing);
            if !next.same_term(&term) {
                tracing::info!(lease = %self.name, identity = %self.identity, leading = next.is_leading(Instant::now()), "leadership changed");
            }
            leadership.send_replace(next);
            let wait = tokio::time::sleep(self.timing.retry_period);
            tokio::select! {
                _ = wait => {}
                // A standby tries again as soon as the Lease changes (a release, say).
                _ = changed.notified(), if next == Leadership::Follower => {}
                _ = release.cancelled() => break,
            }
        }
        watching.abort();
        let was_leading = leadership.send_replace(Leadership::Follower) != Leadership::Follower;
        if was_leading {
            match tokio::time::timeout(self.timing.retry_period, self.give_back()).await {
                Ok(Ok(())) => tracing::info!(lease = %self.name, "leader Lease released"),
                Ok(Err(e)) => {
                    tracing::warn!(lease = %self.name, error = %e, "cannot release the leader Lease; a standby takes over when it expires")
                }
                Err(_) => {
                    tracing::warn!(lease = %self.name, "releasing the leader Lease timed out; a standby takes over when it expires")
                }
            }
        }
    }

    /// Takes or renews the Lease. `Ok(false)`: someone else holds it.
    async fn try_lead(&mut self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let (identity, duration) = (self.identity.clone(), self.timing.lease_duration);
        let spec = |transitions: i32, acquired: Option<MicroTime>| LeaseSpec {
            holder_identity: Some(identity.clone()),
            lease_duration_seconds: Some(duration.as_secs() as i32),
            acquire_time: acquired.or(Some(MicroTime(now))),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        };
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.name.clone()), ..ObjectMeta::default() },
                spec: Some(spec(0, None)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let current = lease.spec.clone().unwrap_or_default();
        let holder = current.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(self.identity.as_str());
        if !ours && holder.is_some() && !self.expired(&current) {
            return Ok(false);
        }
        let transitions = current.lease_transitions.unwrap_or(0) + i32::from(!ours);
        lease.spec = Some(spec(transitions, if ours { current.acquire_time } else { None }));
        // replace carries the resourceVersion we read: a concurrent taker makes this fail.
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Whether the record has stayed as it is for its lease duration, as seen from here.
    fn expired(&mut self, current: &LeaseSpec) -> bool {
        let now = Instant::now();
        let observed = match self.observed.take() {
            Some(o) if o.holder == current.holder_identity && o.renewed == current.renew_time => o,
            _ => Observed {
                holder: current.holder_identity.clone(),
                renewed: current.renew_time.clone(),
                since: now,
            },
        };
        let duration = current
            .lease_duration_seconds
            .map_or(self.timing.lease_duration, |s| Duration::from_secs(s.max(0) as u64));
        let expired = now.duration_since(observed.since) > duration;
        self.observed = Some(observed);
        expired
    }

    /// Clears the holder if it is still this replica.
    async fn give_back(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        self.api.replace(&self.name, &PostParams::default(), &lease).await.map(drop)
    }
}

/// How one attempt to take or renew the Lease went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Holds,
    HeldByAnother,
    /// An error or a timeout: nothing is known.
    Failed,
}

/// The term after an attempt that `started` at that instant. A success starts (or extends) a
/// term to `renew_deadline` after the attempt *started*; a failure changes nothing, and a term
/// whose deadline has passed is over whatever happened.
fn next_term(
    term: Leadership,
    attempt: Attempt,
    started: Instant,
    now: Instant,
    timing: &Timing,
) -> Leadership {
    let next = match attempt {
        Attempt::Holds => Leadership::Leader { until: started + timing.renew_deadline },
        Attempt::HeldByAnother => Leadership::Follower,
        Attempt::Failed => term,
    };
    if next.is_leading(now) { next } else { Leadership::Follower }
}

/// Wakes `changed` whenever the Lease called `name` changes.
async fn notify_changes(api: Api<Lease>, name: String, changed: Arc<Notify>) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = std::pin::pin!(watcher(api, config).default_backoff());
    while let Some(event) = events.next().await {
        match event {
            Ok(_) => changed.notify_one(),
            Err(e) => tracing::debug!(lease = %name, error = %e, "watching the leader Lease"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_term_runs_from_the_start_of_the_renewal_that_won_it() {
        let timing = Timing::default();
        let t0 = Instant::now();
        // The call took 3 s: the term still ends renew_deadline after it started.
        let term = next_term(Leadership::Follower, Attempt::Holds, t0, t0 + 3 * SECOND, &timing);
        assert_eq!(term, Leadership::Leader { until: t0 + timing.renew_deadline });
        assert!(timing.renew_deadline < timing.lease_duration, "the old term ends first");
    }

    #[test]
    fn failed_renewals_keep_the_term_only_until_its_deadline() {
        let timing = Timing::default();
        let t0 = Instant::now();
        let term = Leadership::Leader { until: t0 + timing.renew_deadline };
        assert_eq!(next_term(term, Attempt::Failed, t0, t0 + 5 * SECOND, &timing), term);
        let late = t0 + timing.renew_deadline;
        assert_eq!(next_term(term, Attempt::Failed, t0, late, &timing), Leadership::Follower);
        // A renewal that succeeded but returned after the deadline (a frozen process) is over.
        assert_eq!(
            next_term(term, Attempt::Holds, t0, late + SECOND, &timing),
            Leadership::Follower
        );
        assert_eq!(
            next_term(term, Attempt::HeldByAnother, t0, t0 + SECOND, &timing),
            Leadership::Follower
        );
        assert_eq!(
            next_term(Leadership::Follower, Attempt::Failed, t0, t0, &timing),
            Leadership::Follower
        );
    }
}
