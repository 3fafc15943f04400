//! The lifecycle record: the part of a Host's status that must survive `clusterctl move` and a
//! backup restore, kept in an annotation because both recreate objects without their status.
//! Without it a moved Provisioned host would start again at Registering, be inspected, found
//! Available and imaged again for the next Machine that asks.
//!
//! The reconciler keeps the annotation equal to what the status says ([`stale`]) and rebuilds a
//! status from it only for a Host that has none ([`restore`]). Whoever may edit a Host may edit
//! the annotation, so a restore never trusts it to skip a wipe: a restored host keeps
//! `wipeRequired`, and only a record that agrees with the Host's own claim (`spec.consumerRef`
//! and `spec.provisioning`) restores it as Provisioned. Anything else goes through Registering,
//! which wipes before the host is Available again.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

use crate::crd::{Hardware, Host, HostState, HostStatus, Installed, set_condition};

/// Annotation holding the [`Record`] as JSON.
pub const RECORD_ANNOTATION: &str = "siteboot.dev/lifecycle";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub state: HostState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub installed: Option<Installed>,
    /// Kept so a restored host is not inspected again (booting a Provisioned host into the
    /// ramdisk would stop its workload) and its Node can still be found by system UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<Hardware>,
    #[serde(default)]
    pub wipe_required: bool,
}

impl Record {
    /// What `status` says, if it has a state yet.
    pub fn of(status: &HostStatus) -> Option<Record> {
        Some(Record {
            state: status.state?,
            installed: status.installed.clone(),
            hardware: status.hardware.clone(),
            wipe_required: status.wipe_required,
        })
    }
}

/// The annotation value to write when the Host's record is missing or differs from its status.
pub fn stale(host: &Host) -> Option<String> {
    let record = Record::of(host.status.as_ref()?)?;
    let current = annotation(host).and_then(|a| serde_json::from_str::<Record>(a).ok());
    (current.as_ref() != Some(&record))
        .then(|| serde_json::to_string(&record).expect("a Record serializes"))
}

/// A status rebuilt from the record at `now`, for a Host that has a record and no state (it was
/// moved or restored), with the reason and message its Event and Ready condition carry.
pub fn restore(host: &Host, now: &Time) -> Option<(HostStatus, &'static str, String)> {
    if host.status.as_ref().and_then(|s| s.state).is_some() {
        return None;
    }
    let text = annotation(host)?;
    let mut status = host.status.clone().unwrap_or_default();
    status.last_transition_time = Some(now.clone());
    // A restored host may hold a tenant's data whatever the (editable) record says.
    status.wipe_required = true;
    let (reason, message) = match serde_json::from_str::<Record>(text) {
        Err(e) => {
            status.state = Some(HostState::Registering);
            (
                "RestoredUnreadable",
                format!("the lifecycle record is unreadable ({e}): the host is wiped before reuse"),
            )
        }
        Ok(record) => {
            status.hardware = record.hardware;
            if record.state == HostState::Provisioned
                && claim_matches(host, record.installed.as_ref())
            {
                status.state = Some(HostState::Provisioned);
                status.installed = record.installed;
                (
                    "Restored",
                    "restored as Provisioned from the lifecycle record: not imaged again"
                        .to_owned(),
                )
            } else {
                status.state = Some(HostState::Registering);
                let message = format!(
                    "restored from the lifecycle record ({:?}): the host is wiped before reuse",
                    record.state
                );
                ("Restored", message)
            }
        }
    };
    let ready = status.state == Some(HostState::Provisioned);
    set_condition(
        &mut status.conditions,
        crate::conditions::READY,
        ready,
        reason,
        &message,
        host.metadata.generation,
    );
    Some((status, reason, message))
}

/// The state `host` is in for what the appliance does with it: its own, or for a Host recreated
/// without one and not rebuilt yet (the reconciler has not run, or the Host is paused) the state
/// [`restore`] will give it. A moved Provisioned host that reboots meanwhile then boots its disk,
/// not the ramdisk, which would stop its workload.
pub fn state(host: &Host) -> Option<HostState> {
    // Only the state is read: any time will do.
    let whenever = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    host.status.as_ref().and_then(|s| s.state).or_else(|| restore(host, &whenever)?.0.state)
}

/// Whether `installed` is what the Host's own spec asks for, for the consumer it names.
fn claim_matches(host: &Host, installed: Option<&Installed>) -> bool {
    let (Some(installed), Some(consumer), Some(provisioning)) =
        (installed, &host.spec.consumer_ref, &host.spec.provisioning)
    else {
        return false;
    };
    installed.consumer == format!("{}/{}", consumer.namespace, consumer.name)
        && installed.image == provisioning.image
}

fn annotation(host: &Host) -> Option<&str> {
    host.metadata.annotations.as_ref()?.get(RECORD_ANNOTATION).map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{ConsumerRef, HostSpec, Image, Provisioning, System, now};

    fn image(n: u8) -> Image {
        Image {
            url: format!("http://x/{n}.img"),
            checksum: format!("sha256:{}", "0".repeat(64)),
            format: None,
            grow_last_partition: false,
        }
    }

    /// A Provisioned host claimed by ns/m with image 1, as its appliance last saw it.
    fn provisioned() -> Host {
        let mut h = Host::new("h", HostSpec::new("52:54:00:00:00:01"));
        h.spec.consumer_ref = Some(ConsumerRef {
            api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
            kind: "SitebootMachine".into(),
            namespace: "ns".into(),
            name: "m".into(),
            uid: "u".into(),
        });
        h.spec.provisioning = Some(Provisioning { image: image(1) });
        h.status = Some(HostStatus {
            state: Some(HostState::Provisioned),
            installed: Some(Installed {
                image: image(1),
                consumer: "ns/m".into(),
                disk_boot_pending: false,
            }),
            hardware: Some(Hardware {
                cpus: 4,
                system: Some(System {
                    uuid: "4c4c4544-0000".into(),
                    vendor: None,
                    model: None,
                    serial: None,
                }),
                ..Default::default()
            }),
            wipe_required: true,
            ..Default::default()
        });
        h
    }

    /// What `clusterctl move` or a restore makes of `h`: the same spec and annotations, no status.
    fn moved(mut h: Host) -> Host {
        if let Some(value) = stale(&h) {
            h.metadata.annotations.get_or_insert_default().insert(RECORD_ANNOTATION.into(), value);
        }
        h.status = None;
        h
    }

    #[test]
    fn the_record_follows_the_status() {
        let mut h = provisioned();
        let value = stale(&h).expect("no record yet");
        h.metadata.annotations = Some([(RECORD_ANNOTATION.to_owned(), value)].into());
        assert_eq!(stale(&h), None, "up to date");
        h.status.as_mut().unwrap().state = Some(HostState::Deprovisioning);
        assert!(stale(&h).unwrap().contains("Deprovisioning"));
        // Conditions, addresses, operations are not part of it: no rewrite when only they change.
        let mut h = moved(provisioned());
        h.status = restore(&h, &now()).map(|(s, ..)| s);
        h.status.as_mut().unwrap().addresses.clear();
        assert_eq!(stale(&h), None);
        assert_eq!(stale(&Host::new("new", HostSpec::new("52:54:00:00:00:02"))), None);
    }

    #[test]
    fn a_moved_provisioned_host_stays_provisioned_with_its_hardware() {
        let h = moved(provisioned());
        let (status, reason, _) = restore(&h, &now()).unwrap();
        assert_eq!(reason, "Restored");
        assert_eq!(status.state, Some(HostState::Provisioned));
        assert_eq!(status.installed.unwrap().image, image(1));
        assert_eq!(status.hardware.unwrap().system.unwrap().uuid, "4c4c4544-0000");
        assert!(status.wipe_required);
        // The lifecycle then has nothing to do: no inspection, no imaging, no wipe.
        let mut restored = h.clone();
        restored.status = restore(&h, &now()).map(|(s, ..)| s);
        assert_eq!(super::super::lifecycle::next(&restored, crate::crd::WipePolicy::Quick), None);
    }

    #[test]
    fn a_record_that_does_not_match_the_claim_is_wiped_before_reuse() {
        // Released before the move (spec cleared), a different image asked for, another
        // consumer, or an Available record an editor wrote over a used host: Registering, wipe.
        let mut released = provisioned();
        released.spec.consumer_ref = None;
        released.spec.provisioning = None;
        let mut reimaged = provisioned();
        reimaged.spec.provisioning = Some(Provisioning { image: image(2) });
        let mut other = provisioned();
        other.spec.consumer_ref.as_mut().unwrap().name = "other".into();
        let mut forged = moved(provisioned());
        forged.metadata.annotations.as_mut().unwrap().insert(
            RECORD_ANNOTATION.into(),
            r#"{"state":"Available","wipeRequired":false}"#.into(),
        );
        for (what, h) in [
            ("released", moved(released)),
            ("reimaged", moved(reimaged)),
            ("other consumer", moved(other)),
            ("forged", forged),
        ] {
            let (status, ..) = restore(&h, &now()).unwrap();
            assert_eq!(status.state, Some(HostState::Registering), "{what}");
            assert!(status.wipe_required, "{what}");
            let mut restored = h.clone();
            restored.status = Some(status);
            let next =
                super::super::lifecycle::next(&restored, crate::crd::WipePolicy::Quick).unwrap();
            assert_eq!(next.to, HostState::Deprovisioning, "{what}: wiped, never Available");
        }
    }

    #[test]
    fn before_it_is_rebuilt_a_moved_host_is_taken_for_what_its_record_restores() {
        let h = moved(provisioned());
        assert_eq!(state(&h), Some(HostState::Provisioned));
        // Paused: the status is not rebuilt, but the state to boot by is the same.
        let mut paused = h.clone();
        let annotations = paused.metadata.annotations.as_mut().unwrap();
        annotations.insert(crate::crd::capi::PAUSED_ANNOTATION.into(), String::new());
        assert_eq!(state(&paused), Some(HostState::Provisioned));
        let mut released = provisioned();
        released.spec.consumer_ref = None;
        assert_eq!(state(&moved(released)), Some(HostState::Registering));
        assert_eq!(state(&Host::new("new", HostSpec::new("52:54:00:00:00:02"))), None);
        let mut live = provisioned();
        live.status.as_mut().unwrap().state = Some(HostState::Deprovisioning);
        live.metadata.annotations = h.metadata.annotations.clone();
        assert_eq!(state(&live), Some(HostState::Deprovisioning));
    }

    #[test]
    fn an_unreadable_record_is_wiped_and_a_host_with_a_state_is_left_alone() {
        let mut h = moved(provisioned());
        h.metadata.annotations.as_mut().unwrap().insert(RECORD_ANNOTATION.into(), "{".into());
        let (status, reason, message) = restore(&h, &now()).unwrap();
        assert_eq!((status.state, reason), (Some(HostState::Registering), "RestoredUnreadable"));
        assert!(status.wipe_required && message.contains("unreadable"), "{message}");
        // A Host that never had a record starts at Registering the usual way.
        assert_eq!(restore(&Host::new("new", HostSpec::new("52:54:00:00:00:02")), &now()), None);
        // A Host with a state is not restored, whatever its annotation says.
        let mut live = provisioned();
        live.metadata.annotations = h.metadata.annotations.clone();
        assert_eq!(restore(&live, &now()), None);
    }
}
