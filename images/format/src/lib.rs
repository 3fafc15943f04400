//! The image format and its verification, shared by the appliance's image cache and the deploy
//! ramdisk: what names an image ([`ImageRef`]: where to fetch it and the SHA-256 it must have)
//! and a streaming check of that digest ([`Verifier`]). Pure: no I/O, so both sides agree on
//! exactly the same rules. Per-chunk manifests (for ramdisks fetching from each other) will
//! live here too.

#![forbid(unsafe_code)]

mod digest;
mod reference;
mod verify;

pub use digest::{Digest, DigestError};
pub use reference::{ImageRef, ImageUrl, RefError};
pub use verify::{Mismatch, Verifier};
