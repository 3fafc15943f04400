//! The deploy ramdisk's agent: what the ramdisk reads from its kernel command line
//! ([`cmdline`]) and how it talks to the appliance's agent API ([`client`]): over HTTPS,
//! trusting exactly the certificate whose fingerprint siteboot put on that command line
//! ([`siteboot_tls_pin`]). What it does for the appliance: [`inspect`] the machine, choose the
//! root disk ([`hints`]), [`write`] an image to it, grow its last partition and add a NoCloud
//! seed ([`partition`], [`seed`]), and [`wipe`] disks. The binary (`src/main.rs`) runs the task
//! loop.
//!
//! It talks only to the appliance's agent API, whose tasks and reports are the types of
//! `siteboot_agent_api`: it never depends on the controller or a Kubernetes client.

pub mod client;
pub mod cmdline;
pub mod hints;
pub mod inspect;
pub mod partition;
pub mod progress;
pub mod seed;
pub mod wipe;
pub mod write;

pub use client::{AgentClient, ClientError, Response};
pub use cmdline::{AgentUrl, Cmdline, CmdlineError, Fingerprint, Token};
