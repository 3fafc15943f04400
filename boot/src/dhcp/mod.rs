//! The DHCP server: `settings` (the config section and the checked plan), `leases` (the lease
//! table), `budget` (how many addresses one client may quarantine), `relay` (which relays were
//! refused and logged), `relay_agent` (option 82 and the per-host pins checked against it),
//! `journal` (the table's crash-safe file),
//! `checkpoint` (the leases shared by a site's replicas), `server` (the protocol, no I/O) and
//! `socket` (the loop that ties them to the network).

mod budget;
pub mod checkpoint;
pub mod journal;
pub mod leases;
mod relay;
pub mod relay_agent;
pub mod server;
pub mod settings;
mod socket;

pub use socket::{DhcpService, bind_socket};
