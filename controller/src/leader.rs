//! Leader election for a site: a `coordination.k8s.io` Lease, taken and renewed with
//! compare-and-swap on its resourceVersion. The leader runs the reconcilers and full-mode DHCP;
//! every replica serves TFTP and HTTP.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;

pub struct LeaderElection {
    api: Api<Lease>,
    name: String,
    identity: String,
    lease_duration: Duration,
    renew_every: Duration,
}

impl LeaderElection {
    pub fn new(client: Client, namespace: &str, site: &str, identity: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: format!("siteboot-{site}"),
            identity: identity.to_owned(),
            lease_duration: Duration::from_secs(15),
            renew_every: Duration::from_secs(4),
        }
    }

    /// Runs forever, publishing whether this replica leads. Leadership is given up as soon as a
    /// renewal has not succeeded for a lease duration.
    pub async fn run(self, leading: watch::Sender<bool>) {
        let mut last_renewed: Option<tokio::time::Instant> = None;
        loop {
            match self.try_lead().await {
                Ok(true) => last_renewed = Some(tokio::time::Instant::now()),
                Ok(false) => last_renewed = None,
                Err(e) => {
                    tracing::warn!(lease = %self.name, error = %e, "cannot renew the leader Lease")
                }
            }
            let now_leading = last_renewed.is_some_and(|t| t.elapsed() < self.lease_duration);
            if leading.send_if_modified(|l| std::mem::replace(l, now_leading) != now_leading) {
                tracing::info!(lease = %self.name, identity = %self.identity, leading = now_leading, "leadership changed");
            }
            tokio::time::sleep(self.renew_every).await;
        }
    }

    /// Takes or renews the Lease. `Ok(false)`: someone else holds it.
    async fn try_lead(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let spec = |transitions: i32, acquired: Option<MicroTime>| LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.lease_duration.as_secs() as i32),
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
        let ours = current.holder_identity.as_deref() == Some(self.identity.as_str());
        let expired = match (&current.renew_time, current.lease_duration_seconds) {
            (Some(renewed), Some(secs)) => {
                now.as_second() - renewed.0.as_second() > i64::from(secs)
            }
            _ => true,
        };
        if !ours && !expired {
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
}
