//! The siteboot boot plane: DHCP (full and proxy), TFTP and HTTP servers, and the boot decision
//! that maps "this client, this firmware, this host" to what it is sent.
//!
//! It knows nothing of Kubernetes: what each host boots comes from an [`Inventory`], which the
//! appliance implements from its config file (standalone) or from its Host cache.

pub mod admission;
pub mod arp_probe;
pub mod backoff;
pub mod client;
pub mod decision;
pub mod dhcp;
mod endpoints;
pub mod files;
pub mod http;
pub mod inventory;
pub mod leadership;
mod mac;
pub mod media;
pub mod metrics;
pub mod neighbors;
mod plane;
pub mod rate;
pub mod tftp;
pub mod timeline;
pub mod tls;

pub use endpoints::{AgentEndpoint, Endpoints};
pub use inventory::{BootAction, BootRequest, Inventory};
pub use mac::{InvalidMac, MacAddr};
pub use plane::BootPlane;
