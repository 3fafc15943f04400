//! The tasks `GET v1/task` hands out, built the same way in both modes from the host's
//! values; each mode decides which one is due.

use siteboot_agent_api::{MetaData, Provision, Task};

use crate::{Image, RootDeviceHints, WipePolicy};

/// The provision task (docs/agent-api.md): the image at `url` (the appliance's copy, or its
/// source) and its size (0: unknown), how to pick the disk, and the NoCloud meta-data that
/// goes beside the bootstrap data.
pub fn provision_task(
    operation: &str,
    image: &Image,
    (url, size): (&str, u64),
    hints: &RootDeviceHints,
    meta_data: MetaData,
) -> Task {
    Task::Provision(Box::new(Provision {
        grow_last_partition: image.grow_last_partition,
        image: siteboot_agent_api::Image {
            checksum: image.checksum.clone(),
            size_bytes: size,
            url: url.to_owned(),
        },
        meta_data,
        operation: operation.to_owned(),
        root_device_hints: hints.clone().into(),
    }))
}

/// The deprovision task: wipe the disks per `wipe`.
pub fn deprovision_task(operation: &str, wipe: WipePolicy) -> Task {
    Task::Deprovision { operation: operation.to_owned(), wipe: wipe.into() }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use siteboot_agent_api as api;

    use super::*;
    use crate::ByteCount;

    fn image(grow_last_partition: bool) -> Image {
        Image {
            url: "https://images.example/os.img".into(),
            checksum: format!("sha256:{}", "ab".repeat(32)),
            format: None,
            grow_last_partition,
        }
    }

    fn meta_data() -> MetaData {
        MetaData {
            instance_id: "op-7".into(),
            local_hostname: Some("worker-a".into()),
            provider_id: Some("siteboot://metal/node-1".into()),
        }
    }

    #[test]
    fn the_provision_task_carries_the_served_url_hints_and_meta_data() {
        let image = image(true);
        let hints = RootDeviceHints { serial: Some("S2".into()), ..Default::default() };
        let served = format!("http://10.0.0.1:8080/images/sha256/{}", "ab".repeat(32));
        let task = provision_task("op-7", &image, (&served, 4096), &hints, meta_data());
        // Byte for byte what the servers sent when each wrote the task as a `json!` value.
        assert_eq!(
            serde_json::to_string(&task).unwrap(),
            json!({
                "action": "provision",
                "operation": "op-7",
                "image": { "url": served, "checksum": image.checksum, "sizeBytes": 4096 },
                "rootDeviceHints": { "serial": "S2" },
                "growLastPartition": true,
                "metaData": {
                    "instance-id": "op-7",
                    "local-hostname": "worker-a",
                    "provider-id": "siteboot://metal/node-1",
                },
            })
            .to_string()
        );
    }

    /// The two sides of docs/agent-api.md agree: what the servers send, the agent reads back
    /// from its JSON, and what the agent sends, the servers read and keep. (The JSON itself is
    /// pinned by siteboot_agent_api's tests.)
    #[test]
    fn the_agent_reads_the_tasks_and_the_servers_read_its_reports() {
        for hints in [
            RootDeviceHints::default(),
            RootDeviceHints {
                min_size_bytes: Some(1 << 30),
                wwn: Some("0x5000".into()),
                ..Default::default()
            },
        ] {
            let task =
                provision_task("op-7", &image(false), ("http://a/i", 4096), &hints, meta_data());
            let json = serde_json::to_string(&task).unwrap();
            let Ok(Task::Provision(read)) = serde_json::from_str::<Task>(&json) else {
                panic!("the agent cannot read {json}");
            };
            assert_eq!(read.image.size_bytes, 4096);
            assert_eq!(read.root_device_hints.wwn, hints.wwn);
            assert_eq!(read.root_device_hints.min_size_bytes, hints.min_size_bytes);
            assert_eq!(read.meta_data.provider_id.as_deref(), Some("siteboot://metal/node-1"));
        }
        let json = serde_json::to_string(&deprovision_task("op-8", WipePolicy::Full)).unwrap();
        assert_eq!(
            serde_json::from_str::<Task>(&json).unwrap(),
            Task::Deprovision { operation: "op-8".into(), wipe: api::Wipe::Full }
        );
        let report = api::ProgressReport {
            step: "writing image".into(),
            bytes: Some(api::Progress { done: 5, total: 9 }),
        };
        let read: api::ProgressReport =
            serde_json::from_slice(&serde_json::to_vec(&report).unwrap()).unwrap();
        assert_eq!(
            (read.step().as_str(), read.bytes.map(ByteCount::from)),
            ("writing image", Some(ByteCount { done: 5, total: 9 }))
        );
    }
}
