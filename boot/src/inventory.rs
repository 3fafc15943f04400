//! What each host boots. The boot plane asks an [`Inventory`]; the standalone appliance answers
//! from its config file, the Kubernetes mode from its Host cache.

use std::future::Future;
use std::pin::Pin;

use siteboot_ipxe::Word;

use crate::MacAddr;

/// What a host's iPXE is told to do when it fetches its script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootAction {
    /// Boot a Linux kernel and initrds fetched over HTTP.
    Linux(LinuxBoot),
    /// An operator-written iPXE script, served as it is.
    Script(String),
    /// Leave the network boot and boot the local disk.
    LocalDisk(LocalBoot),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinuxBoot {
    pub kernel: Source,
    pub initrds: Vec<Source>,
    /// Kernel command line, one argument per word. siteboot adds `initrd=`, `siteboot.url=` and
    /// `siteboot.mac=` itself.
    pub cmdline: Vec<Word>,
}

/// Where a kernel or initrd comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A path under the HTTP root, served at `/files/<path>`; already a safe URL path.
    File(Word),
    /// An absolute URL elsewhere.
    Url(Word),
}

/// How to boot the local disk from iPXE. No single method works on every machine, so it is a
/// per-profile choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalBoot {
    /// `exit`: hand control back to the firmware, which tries its next boot entry.
    Exit,
    /// `sanboot --drive 0x80`: boot the first disk through the firmware's disk interface.
    Sanboot,
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

pub trait Inventory: Send + Sync + 'static {
    /// Whether DHCP gives `mac` boot information at all. Called on the DHCP path, so it must
    /// answer from memory.
    fn boots(&self, mac: MacAddr) -> bool;

    /// What `mac` boots now; asked when its iPXE fetches `/boot/<mac>.ipxe`. `None` answers 404.
    fn boot_action(&self, mac: MacAddr) -> BoxFuture<'_, Option<BootAction>>;
}
