//! iPXE for siteboot: scripts that no configured or client-supplied string can turn into other
//! commands, and the choice of iPXE binary per firmware platform.
//!
//! Every argument that goes into a script is a [`Word`]: a token iPXE passes through verbatim.
//! Building a `Word` is the only check, so a script assembled from `Word`s is safe by
//! construction ("parse, don't validate").

#![forbid(unsafe_code)]

mod binaries;
mod script;

pub use binaries::{IpxeBinaries, Platform};
pub use script::{Script, UnsafeWord, Word};
