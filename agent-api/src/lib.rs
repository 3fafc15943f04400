//! The deploy ramdisk's agent API (docs/agent-api.md) as types: what `GET v1/task` answers
//! ([`Task`]) and what the agent posts back ([`Hardware`], [`ProgressReport`], [`Complete`]),
//! answered with [`Ack`]. The ramdisk's agent and the server (`siteboot-agent-server`, for
//! both modes) serialize and parse these, so no side writes the JSON by hand and a renamed
//! field breaks the build, not the ramdisks.
//!
//! The JSON is what ramdisks in the field speak: the tests pin it byte for byte.
//!
//! It depends on no Kubernetes client: the ramdisk and standalone mode link it without one.
//! The `schema` feature derives `JsonSchema` on the inspection report's types, for the Host
//! CRD, which keeps the report as its `status.hardware`; the ramdisk's agent leaves it off.

#![forbid(unsafe_code)]

mod report;
mod task;

pub use report::{Ack, Complete, Disk, Hardware, Nic, Progress, ProgressReport, System};
pub use task::{Image, MetaData, Provision, RootDeviceHints, Task, Wipe};

/// Where a ramdisk booted by kexec over SSH finds the secret words of its command line
/// (`siteboot.token=`, `siteboot.operation=`): a file (mode 0600) in an archive appended to its
/// initramfs, so that the token is never in a process's arguments on the server's old OS. The
/// agent reads it with `/proc/cmdline`.
pub const INITRD_CMDLINE: &str = "/siteboot/cmdline";
