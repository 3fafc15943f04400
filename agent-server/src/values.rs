//! The host values both modes keep: what a host is imaged with, how its disks are picked and
//! wiped, and the operations the ramdisk runs. Kubernetes mode keeps them in a Host (the CRD
//! re-exports these types, with `JsonSchema` from the `schema` feature), standalone mode in its
//! config and state files.

use serde::{Deserialize, Serialize};

/// An OS image to write to a host's disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Image {
    /// Where the image is fetched from (http or https).
    #[cfg_attr(feature = "schema", schemars(regex(pattern = r"^https?://[^\s]+$")))]
    pub url: String,
    /// `sha256:<64 hex digits>` of the image as served; a mismatch fails provisioning.
    #[cfg_attr(feature = "schema", schemars(regex(pattern = r"^sha256:[0-9a-f]{64}$")))]
    pub checksum: String,
    /// `raw` (the default) or `qcow2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<ImageFormat>,
    /// Grow the image's last partition to fill the disk (up to the NoCloud seed siteboot puts
    /// at the disk's end). For images whose last partition is a root file system that grows
    /// itself on first boot (cloud-init's growpart does), this is not needed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub grow_last_partition: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    Raw,
    Qcow2,
}

/// How the deploy ramdisk picks the disk to write the image to: a disk must match every hint
/// given, and among those that do, the smallest that holds the image is chosen. A disk the
/// hints rule out is never written. Compare with what inspection found (`status.hardware`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct RootDeviceHints {
    /// The device's kernel name, e.g. `/dev/sdb` (names can change between boots: prefer
    /// serial or WWN on real servers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_size_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_size_bytes: Option<u64>,
}

/// How much of a previous tenant's data a deprovisioning removes (docs/security.md says what
/// each level guarantees).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum WipePolicy {
    /// Partition tables and signatures at the start and end of every disk: the next OS sees
    /// empty disks, but a forensic reader recovers the previous tenant's files.
    Quick,
    /// Every block of every disk zeroed (through the device's zero-out where it has one) and
    /// read back: nothing recoverable through the block device.
    Full,
    /// Nothing: for disposable test hosts only (a site whose `min_wipe` is `none`).
    None,
}

impl WipePolicy {
    /// How much it removes: none < quick < full.
    fn rank(self) -> u8 {
        match self {
            WipePolicy::None => 0,
            WipePolicy::Quick => 1,
            WipePolicy::Full => 2,
        }
    }

    /// The stronger of the two.
    pub fn stronger(self, other: WipePolicy) -> WipePolicy {
        if other.rank() > self.rank() { other } else { self }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ByteCount {
    pub done: u64,
    /// 0 when the size is not known yet.
    pub total: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum OperationKind {
    Inspect,
    Provision,
    Deprovision,
}

// The agent API (`siteboot_agent_api`) and what the records keep of it. The fields are taken
// apart, not copied by `..`, so a field added on either side is a compile error here.

impl From<siteboot_agent_api::Progress> for ByteCount {
    fn from(reported: siteboot_agent_api::Progress) -> Self {
        let siteboot_agent_api::Progress { done, total } = reported;
        Self { done, total }
    }
}

impl From<RootDeviceHints> for siteboot_agent_api::RootDeviceHints {
    fn from(hints: RootDeviceHints) -> Self {
        let RootDeviceHints { name, serial, wwn, model, min_size_bytes, max_size_bytes } = hints;
        Self { max_size_bytes, min_size_bytes, model, name, serial, wwn }
    }
}

impl From<WipePolicy> for siteboot_agent_api::Wipe {
    fn from(wipe: WipePolicy) -> Self {
        match wipe {
            WipePolicy::Quick => Self::Quick,
            WipePolicy::Full => Self::Full,
            WipePolicy::None => Self::None,
        }
    }
}
