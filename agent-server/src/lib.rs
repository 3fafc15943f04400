//! The deploy ramdisk's agent API as the appliance serves it (docs/agent-api.md), in both
//! modes: which endpoint a request asks for and why it is refused ([`request`]), the
//! operation's token ([`token`]), the tasks ([`task`]), when a ramdisk counts as gone
//! ([`silence`]), and the image cache the ramdisk downloads from ([`images`]). The wire types
//! are `siteboot_agent_api`'s, shared with the ramdisk's agent.
//!
//! Each mode keeps its records in its own store: Kubernetes mode in a Host's status
//! (`controller/src/agent.rs`), standalone mode in a file per host
//! (`appliance/src/standalone.rs`). Neither this crate nor standalone mode links a Kubernetes
//! client; the `schema` feature derives `JsonSchema` on the host values ([`values`]) for the
//! Host CRD.

#![forbid(unsafe_code)]

pub mod images;
pub mod request;
pub mod serve;
pub mod silence;
pub mod task;
pub mod token;
mod values;

pub use request::{
    Endpoint, Grant, Refusal, body, check_token, confirm_holder, needs_new_token, refused,
};
pub use values::{ByteCount, Image, ImageFormat, OperationKind, RootDeviceHints, WipePolicy};
