//! The tasks `GET v1/task` answers and the bodies the agent posts back (docs/agent-api.md).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::hints::RootDeviceHints;
use crate::progress::Progress;
use crate::wipe::Policy;

/// What the appliance wants done next.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "action", rename_all = "lowercase")]
pub enum Task {
    Wait { seconds: u64 },
    Reboot,
    Inspect { operation: String },
    Provision(Provision),
    Deprovision { operation: String, wipe: Policy },
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Provision {
    pub operation: String,
    pub image: Image,
    #[serde(default)]
    pub root_device_hints: RootDeviceHints,
    #[serde(default)]
    pub grow_last_partition: bool,
    #[serde(default)]
    pub meta_data: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Image {
    pub url: String,
    /// `sha256:<hex>` of the bytes as served.
    pub checksum: String,
    /// The bytes as served, when the appliance knows (its cache does): a disk smaller than
    /// that cannot hold the image, compressed or not.
    #[serde(default)]
    pub size_bytes: u64,
}

/// `POST v1/complete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Complete {
    pub ok: bool,
    pub message: String,
}

/// `POST v1/progress`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProgressReport {
    pub step: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<Progress>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_documented_tasks() {
        let parse = |v: Value| serde_json::from_value::<Task>(v).unwrap();
        assert_eq!(parse(json!({"action": "wait", "seconds": 10})), Task::Wait { seconds: 10 });
        assert_eq!(parse(json!({"action": "reboot"})), Task::Reboot);
        assert_eq!(
            parse(json!({"action": "inspect", "operation": "op1"})),
            Task::Inspect { operation: "op1".into() }
        );
        assert_eq!(
            parse(json!({"action": "deprovision", "operation": "op3", "wipe": "full"})),
            Task::Deprovision { operation: "op3".into(), wipe: Policy::Full }
        );
        let provision = parse(json!({"action": "provision", "operation": "op2",
            "image": {"url": "http://10.0.0.1:8080/images/sha256/ab", "checksum": "sha256:ab"},
            "rootDeviceHints": {"name": "/dev/sdb", "serial": "S", "wwn": "0x5", "model": "M",
                                "minSizeBytes": 0, "maxSizeBytes": 0},
            "growLastPartition": true,
            "metaData": {"instance-id": "i", "local-hostname": "h", "provider-id": "siteboot://ns/h"}}));
        let Task::Provision(p) = provision else { panic!("{provision:?}") };
        assert_eq!(p.root_device_hints.name.as_deref(), Some("/dev/sdb"));
        assert!(p.grow_last_partition);
        assert_eq!(p.meta_data["provider-id"], "siteboot://ns/h");
        // A hint this agent does not know is refused rather than ignored: ignoring it could
        // pick a disk the operator ruled out.
        let unknown = json!({"action": "provision", "operation": "o",
            "image": {"url": "u", "checksum": "c"}, "rootDeviceHints": {"hctl": "0:0:0:0"}});
        assert!(serde_json::from_value::<Task>(unknown).is_err());
        assert!(serde_json::from_value::<Task>(json!({"action": "dance"})).is_err());
    }

    #[test]
    fn the_documented_bodies() {
        let report = ProgressReport {
            step: "writing image",
            bytes: Some(Progress { done: 123, total: 456 }),
        };
        assert_eq!(
            serde_json::to_value(report).unwrap(),
            json!({"step": "writing image", "bytes": {"done": 123, "total": 456}})
        );
        let complete = Complete { ok: false, message: "no disk fits".into() };
        assert_eq!(
            serde_json::to_value(complete).unwrap(),
            json!({"ok": false, "message": "no disk fits"})
        );
    }
}
