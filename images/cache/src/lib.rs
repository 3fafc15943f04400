//! The appliance's image cache: an image named by URL and SHA-256 ([`siteboot_image::ImageRef`])
//! is fetched once (http, https or file), verified while it is written, and stored by digest
//! under the state directory, where the boot plane serves it to many hosts at once. See
//! [`store`] for the directory layout and [`Cache`] for the guarantees.

#![forbid(unsafe_code)]

mod error;
mod fetch;
pub mod store;

pub use error::{CacheError, Interruption};
pub use fetch::{FetchSink, fetch};
pub use store::{Cache, ImageInfo, Lease, Progress};
