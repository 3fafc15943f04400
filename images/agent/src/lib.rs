//! The deploy ramdisk's agent, as a library for now: what the ramdisk reads from its kernel
//! command line ([`cmdline`]) and how it talks to the appliance's agent API ([`client`]):
//! over HTTPS, trusting exactly the certificate whose fingerprint siteboot put on that command
//! line ([`pin`]). The binary that inspects, images and wipes comes with the imaging milestone.
//!
//! It talks only to the appliance's agent API: it never depends on the controller or a
//! Kubernetes client.

pub mod client;
pub mod cmdline;
pub mod pin;

pub use client::{AgentClient, ClientError, Response};
pub use cmdline::{AgentUrl, Cmdline, CmdlineError, Fingerprint, Token};
