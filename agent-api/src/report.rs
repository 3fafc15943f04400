//! What the agent posts back, and the appliance's answer to a report it took.
//!
//! The appliance reads every report leniently (what an agent could not find out is left out),
//! and keeps only so much of the free text ([`Complete::message`], [`ProgressReport::step`]).

use serde::{Deserialize, Serialize};

/// What inspection found: the agent's `POST v1/inspection`, kept as the Host's
/// `status.hardware`. Whatever the agent could not read is left out rather than guessed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Hardware {
    /// Online CPUs.
    #[serde(default)]
    pub cpus: u32,
    #[serde(default, rename = "memoryMiB")]
    pub memory_mib: u64,
    /// The agent's architecture, as Rust names it (`x86_64`, `aarch64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<String>,
    /// The machine's SMBIOS identity, reported when its UUID is readable. Its UUID is what the
    /// kubelet reports as `Node.status.nodeInfo.systemUUID`: how the machine's Node is found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<System>,
    /// Sorted by name.
    #[serde(default)]
    pub disks: Vec<Disk>,
    /// Sorted by name.
    #[serde(default)]
    pub nics: Vec<Nic>,
}

/// The SMBIOS identity (`/sys/class/dmi/id`), reported when its UUID is readable. The UUID is
/// what the kubelet reports as `Node.status.nodeInfo.systemUUID`: how a machine's Node is found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct System {
    /// `/sys/class/dmi/id/product_uuid`, in lower case.
    pub uuid: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
}

/// A disk: a block device backed by a device, not an optical drive, not empty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Disk {
    /// The device node, `/dev/<name>`.
    pub name: String,
    pub size_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// World Wide Name, e.g. `0x5000c500a1b2c3d4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,
    #[serde(default)]
    pub rotational: bool,
}

/// A network interface backed by a device (not lo, bridges or other virtual ones).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Nic {
    pub name: String,
    pub mac: String,
    /// Whether the port had a carrier when inspected: a cable is in and the other end is up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<bool>,
    /// Absent when there is no link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed_mbps: Option<u32>,
}

/// `POST v1/progress`: the step a long operation is at. The agent sends at most about one a
/// second; steps are `writing image` (bytes as served) and `wiping` (bytes written and then
/// read back, per disk).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressReport {
    pub step: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<Progress>,
}

/// How far a long step is, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    pub done: u64,
    /// 0 when unknown.
    pub total: u64,
}

/// `POST v1/complete`: how a provision or deprovision ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Complete {
    pub ok: bool,
    /// What was done, or why it failed.
    #[serde(default)]
    pub message: String,
}

impl Complete {
    /// The message as the appliance keeps it: at most 512 characters.
    pub fn message(&self) -> String {
        self.message.chars().take(512).collect()
    }
}

impl ProgressReport {
    /// The step as the appliance keeps it: at most 200 characters.
    pub fn step(&self) -> String {
        self.step.chars().take(200).collect()
    }
}

/// The appliance's answer to a report it took: `{"ok":true}`. A report it does not take is
/// refused with a status and a reason instead, so this is never `false`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Ack {
    ok: bool,
}

impl Ack {
    pub const TAKEN: Ack = Ack { ok: true };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each report as the agent sends it, byte for byte (docs/agent-api.md's examples), and
    /// read back as the same report.
    #[test]
    fn the_documented_reports_exactly() {
        let hardware = Hardware {
            cpus: 2,
            memory_mib: 2048,
            arch: Some("x86_64".into()),
            system: Some(System {
                uuid: "u-1".into(),
                vendor: Some("QEMU".into()),
                model: Some("Standard PC".into()),
                serial: Some("S0".into()),
            }),
            disks: vec![Disk {
                name: "/dev/vda".into(),
                size_bytes: 1073741824,
                model: Some("M".into()),
                serial: Some("S1".into()),
                wwn: Some("0x5000".into()),
                rotational: false,
            }],
            nics: vec![Nic {
                name: "eth0".into(),
                mac: "52:54:00:12:34:56".into(),
                link: Some(true),
                speed_mbps: Some(1000),
            }],
        };
        let json = concat!(
            r#"{"cpus":2,"memoryMiB":2048,"arch":"x86_64","#,
            r#""system":{"uuid":"u-1","vendor":"QEMU","model":"Standard PC","serial":"S0"},"#,
            r#""disks":[{"name":"/dev/vda","sizeBytes":1073741824,"model":"M","serial":"S1","wwn":"0x5000","rotational":false}],"#,
            r#""nics":[{"name":"eth0","mac":"52:54:00:12:34:56","link":true,"speedMbps":1000}]}"#,
        );
        assert_eq!(serde_json::to_string(&hardware).unwrap(), json);
        assert_eq!(serde_json::from_str::<Hardware>(json).unwrap(), hardware);

        let progress = ProgressReport {
            step: "writing image".into(),
            bytes: Some(Progress { done: 123, total: 456 }),
        };
        let json = r#"{"step":"writing image","bytes":{"done":123,"total":456}}"#;
        assert_eq!(serde_json::to_string(&progress).unwrap(), json);
        assert_eq!(serde_json::from_str::<ProgressReport>(json).unwrap(), progress);
        let wiping = ProgressReport { step: "wiping".into(), bytes: None };
        assert_eq!(serde_json::to_string(&wiping).unwrap(), r#"{"step":"wiping"}"#);

        let complete = Complete { ok: false, message: "no disk fits".into() };
        let json = r#"{"ok":false,"message":"no disk fits"}"#;
        assert_eq!(serde_json::to_string(&complete).unwrap(), json);
        assert_eq!(serde_json::from_str::<Complete>(json).unwrap(), complete);

        assert_eq!(serde_json::to_string(&Ack::TAKEN).unwrap(), r#"{"ok":true}"#);
    }

    /// What an agent leaves out, the appliance reads as unknown.
    #[test]
    fn reports_are_read_leniently() {
        let hardware: Hardware = serde_json::from_str(r#"{"cpus": 2}"#).unwrap();
        assert_eq!((hardware.cpus, hardware.arch, hardware.disks.len()), (2, None, 0));
        let nic: Nic = serde_json::from_str(r#"{"name": "eth1", "mac": "m"}"#).unwrap();
        assert_eq!((nic.link, nic.speed_mbps), (None, None));
        let complete: Complete = serde_json::from_str(r#"{"ok": true}"#).unwrap();
        assert_eq!(complete.message, "");
        let long = Complete { ok: false, message: "é".repeat(600) };
        assert_eq!(long.message().chars().count(), 512);
        let long = ProgressReport { step: "s".repeat(300), bytes: None };
        assert_eq!(long.step().len(), 200);
    }
}
