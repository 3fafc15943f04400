//! The TFTP server: read-only, for the first-stage iPXE binaries (and any files under an
//! optional root). `packet` and `transfer` hold the protocol; `server` the sockets.

pub mod packet;
mod server;
pub mod transfer;

pub use server::{TftpServer, TftpSettings};
