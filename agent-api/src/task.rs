//! What `GET v1/task` answers: the one thing the appliance wants the ramdisk to do next.
//!
//! The fields of every struct here are declared in alphabetical order on purpose: serde writes
//! them in declaration order, and the appliance has always sent its tasks with sorted keys
//! (they were `serde_json::Value`s, whose maps sort), so ramdisks get the same bytes as before.

use serde::{Deserialize, Serialize};

/// What the appliance wants done next, named by `action`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "lowercase")]
pub enum Task {
    /// Nothing to do now: ask again in `seconds` (the agent keeps it within 1 to 300).
    Wait { seconds: u64 },
    /// Boot again: an operation waits for a token the next boot brings, or the host's disk is
    /// now what it boots.
    Reboot,
    /// Report the hardware (`POST v1/inspection`), which ends the inspection.
    Inspect {
        /// The operation's id.
        operation: String,
    },
    /// Write an image and the NoCloud seed, then `POST v1/complete`. (Boxed: it is ten times
    /// the size of the others.)
    Provision(Box<Provision>),
    /// Wipe every disk, then `POST v1/complete`.
    Deprovision {
        /// The operation's id.
        operation: String,
        wipe: Wipe,
    },
}

impl Task {
    /// The answer to `GET v1/task` from a ramdisk whose token is not (or no longer) good, in
    /// both modes: `reboot` when it should boot again (`boot_again`: an operation waits for
    /// the token a new boot brings, or the host's disk is now what it boots), else `wait`.
    pub fn without_token(boot_again: bool) -> Task {
        if boot_again { Task::Reboot } else { Task::Wait { seconds: 10 } }
    }
}

/// A provision task: what to write, to which disk, with which NoCloud meta-data. The
/// bootstrap data (`user-data`) is fetched apart, once, from `GET v1/bootstrap`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Provision {
    /// Grow the image's last partition up to the seed partition at the disk's end.
    #[serde(default)]
    pub grow_last_partition: bool,
    pub image: Image,
    /// Absent: empty, which the agent fails for want of an `instance-id`.
    #[serde(default)]
    pub meta_data: MetaData,
    /// The operation's id.
    pub operation: String,
    /// Absent: no hint.
    #[serde(default)]
    pub root_device_hints: RootDeviceHints,
}

/// The image a provision writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Image {
    /// `sha256:<hex>` of the bytes as served (gzip and zstd are decompressed while writing,
    /// after this digest).
    pub checksum: String,
    /// The bytes as served, when the appliance knows (its cache does); 0: unknown. A disk
    /// must hold that much plus the seed to be chosen.
    #[serde(default)]
    pub size_bytes: u64,
    /// Where to fetch it: the appliance's cache, or the image's source.
    pub url: String,
}

/// How to choose the disk a provision writes: the disk must match every hint given; among
/// those that do, the smallest that holds the image. A disk a hint rules out is never
/// written. A hint this type does not know makes the task unreadable: ignoring it could
/// choose a disk the operator ruled out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct RootDeviceHints {
    /// At most this many bytes; 0 is no hint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_size_bytes: Option<u64>,
    /// At least this many bytes; 0 is no hint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_size_bytes: Option<u64>,
    /// Compared without case and surrounding blanks (sysfs pads models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// `/dev/sdb` or `sdb`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// `0x5000c500a1b2c3d4`, `naa.5000c500a1b2c3d4` or `eui.…`: compared without the notation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,
}

/// The NoCloud meta-data the agent writes beside the bootstrap data, as the seed's
/// `meta-data` file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaData {
    /// New with each provisioning (the operation's id), so cloud-init runs the user-data of a
    /// new instance. cloud-init needs one: the agent fails (through `POST v1/complete`, with
    /// the reason) a provision whose `instance-id` is missing or empty.
    #[serde(rename = "instance-id", default)]
    pub instance_id: String,
    /// The host name the installed OS takes.
    #[serde(rename = "local-hostname", skip_serializing_if = "Option::is_none")]
    pub local_hostname: Option<String>,
    /// `siteboot://<namespace>/<host>`, for a kubelet whose `--provider-id` comes from it.
    #[serde(rename = "provider-id", skip_serializing_if = "Option::is_none")]
    pub provider_id: Option<String>,
}

/// How a deprovision wipes every disk (docs/agent-api.md says what each level guarantees).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Wipe {
    /// The partition tables and the first and last MiB of the disk and of every partition.
    Quick,
    /// Every block zeroed and read back.
    Full,
    /// Nothing written.
    None,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provision() -> Task {
        Task::Provision(Box::new(Provision {
            grow_last_partition: true,
            image: Image {
                checksum: "sha256:ab".into(),
                size_bytes: 123456789,
                url: "http://10.0.0.1:8080/images/sha256/ab".into(),
            },
            meta_data: MetaData {
                instance_id: "op2".into(),
                local_hostname: Some("node-1".into()),
                provider_id: Some("siteboot://ns/node-1".into()),
            },
            operation: "op2".into(),
            root_device_hints: RootDeviceHints {
                max_size_bytes: Some(0),
                min_size_bytes: Some(0),
                model: Some("M".into()),
                name: Some("/dev/sdb".into()),
                serial: Some("S".into()),
                wwn: Some("0x5".into()),
            },
        }))
    }

    /// Each task as the appliance sends it, byte for byte (docs/agent-api.md's examples), and
    /// read back as the same task.
    #[test]
    fn the_documented_tasks_exactly() {
        let cases = [
            (Task::Wait { seconds: 10 }, r#"{"action":"wait","seconds":10}"#),
            (Task::Reboot, r#"{"action":"reboot"}"#),
            (
                Task::Inspect { operation: "op1".into() },
                r#"{"action":"inspect","operation":"op1"}"#,
            ),
            (
                provision(),
                concat!(
                    r#"{"action":"provision","growLastPartition":true,"#,
                    r#""image":{"checksum":"sha256:ab","sizeBytes":123456789,"url":"http://10.0.0.1:8080/images/sha256/ab"},"#,
                    r#""metaData":{"instance-id":"op2","local-hostname":"node-1","provider-id":"siteboot://ns/node-1"},"#,
                    r#""operation":"op2","#,
                    r#""rootDeviceHints":{"maxSizeBytes":0,"minSizeBytes":0,"model":"M","name":"/dev/sdb","serial":"S","wwn":"0x5"}}"#,
                ),
            ),
            (
                Task::Deprovision { operation: "op3".into(), wipe: Wipe::Quick },
                r#"{"action":"deprovision","operation":"op3","wipe":"quick"}"#,
            ),
            (
                Task::Deprovision { operation: "op3".into(), wipe: Wipe::Full },
                r#"{"action":"deprovision","operation":"op3","wipe":"full"}"#,
            ),
            (
                Task::Deprovision { operation: "op3".into(), wipe: Wipe::None },
                r#"{"action":"deprovision","operation":"op3","wipe":"none"}"#,
            ),
        ];
        for (task, json) in cases {
            assert_eq!(serde_json::to_string(&task).unwrap(), json);
            assert_eq!(serde_json::from_str::<Task>(json).unwrap(), task, "{json}");
        }
    }

    /// What the appliance leaves out: hints not given, a host with no provider id, and (from
    /// an older appliance) the image's size.
    #[test]
    fn absent_hints_provider_id_and_size() {
        let Task::Provision(mut p) = provision() else { unreachable!() };
        p.root_device_hints = RootDeviceHints { serial: Some("S2".into()), ..Default::default() };
        p.meta_data.provider_id = None;
        let json = serde_json::to_string(&Task::Provision(p)).unwrap();
        assert!(json.contains(r#""metaData":{"instance-id":"op2","local-hostname":"node-1"}"#));
        assert!(json.contains(r#""rootDeviceHints":{"serial":"S2"}"#), "{json}");
        let older = r#"{"action": "provision", "operation": "op2",
            "image": {"url": "http://10.0.0.1:8080/images/sha256/ab", "checksum": "sha256:ab"},
            "metaData": {"instance-id": "op2", "local-hostname": "node-1"}}"#;
        let Ok(Task::Provision(read)) = serde_json::from_str(older) else { panic!("{older}") };
        assert_eq!((read.image.size_bytes, read.grow_last_partition), (0, false));
        assert_eq!(read.root_device_hints, RootDeviceHints::default());
        // Left for the agent to refuse, with its reason, rather than unreadable.
        let bare = r#"{"action": "provision", "operation": "op2",
            "image": {"url": "u", "checksum": "c"}}"#;
        let Ok(Task::Provision(read)) = serde_json::from_str(bare) else { panic!("{bare}") };
        assert_eq!(read.meta_data, MetaData::default());
    }

    #[test]
    fn without_a_good_token_a_ramdisk_reboots_or_waits() {
        assert_eq!(Task::without_token(true), Task::Reboot);
        assert_eq!(Task::without_token(false), Task::Wait { seconds: 10 });
    }

    /// A hint this side does not know is refused rather than ignored (ignoring it could pick a
    /// disk the operator ruled out), as is an action it does not know.
    #[test]
    fn unknown_hints_and_actions_are_refused() {
        let unknown = r#"{"action": "provision", "operation": "o",
            "image": {"url": "u", "checksum": "c"},
            "metaData": {"instance-id": "o", "local-hostname": "h"},
            "rootDeviceHints": {"hctl": "0:0:0:0"}}"#;
        assert!(serde_json::from_str::<Task>(unknown).is_err());
        assert!(serde_json::from_str::<Task>(r#"{"action": "dance"}"#).is_err());
    }
}
