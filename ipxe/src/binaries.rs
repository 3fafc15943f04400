//! Which iPXE binary each firmware platform is sent.

use std::fmt;
use std::path::{Path, PathBuf};

/// A firmware platform that needs its own iPXE build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Platform {
    /// Legacy BIOS PXE (UNDI): `undionly.kpxe`.
    Bios,
    /// x86-64 UEFI: `snponly.efi` uses the firmware's own network driver (SNP).
    UefiX64,
    /// arm64 UEFI.
    UefiArm64,
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Platform::Bios => "bios",
            Platform::UefiX64 => "uefi-x64",
            Platform::UefiArm64 => "uefi-arm64",
        })
    }
}

/// File names tried, in order, for each platform. Debian's `ipxe` package ships the x86 ones;
/// an arm64 build is found if the operator drops one in.
const CANDIDATES: &[(Platform, &[&str])] = &[
    (Platform::Bios, &["undionly.kpxe"]),
    (Platform::UefiX64, &["snponly.efi", "ipxe.efi"]),
    (Platform::UefiArm64, &["snponly-arm64.efi", "ipxe-arm64.efi", "arm64/snponly.efi"]),
];

/// The iPXE binaries found in a directory, by platform.
#[derive(Debug, Clone)]
pub struct IpxeBinaries {
    dir: PathBuf,
    found: Vec<(Platform, String)>,
}

impl IpxeBinaries {
    /// Looks for each platform's binary in `dir`. Platforms without one are simply not served
    /// (a client of that platform gets no boot file, and that is logged).
    pub fn discover(dir: &Path) -> Self {
        let found = CANDIDATES
            .iter()
            .filter_map(|(platform, names)| {
                names
                    .iter()
                    .find(|name| dir.join(name).is_file())
                    .map(|name| (*platform, (*name).to_owned()))
            })
            .collect();
        Self { dir: dir.to_owned(), found }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file name (relative to [`dir`](Self::dir)) of the binary for `platform`.
    pub fn file_for(&self, platform: Platform) -> Option<&str> {
        self.found.iter().find(|(p, _)| *p == platform).map(|(_, name)| name.as_str())
    }

    /// Whether `name` is one of the binaries served (so TFTP/HTTP can serve it from `dir`).
    pub fn is_binary(&self, name: &str) -> bool {
        self.found.iter().any(|(_, n)| n == name)
    }

    pub fn platforms(&self) -> impl Iterator<Item = Platform> + '_ {
        self.found.iter().map(|(p, _)| *p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovers_first_candidate_present() {
        let dir = std::env::temp_dir().join(format!("siteboot-ipxe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("undionly.kpxe"), b"x").unwrap();
        std::fs::write(dir.join("ipxe.efi"), b"x").unwrap();
        let bins = IpxeBinaries::discover(&dir);
        assert_eq!(bins.file_for(Platform::Bios), Some("undionly.kpxe"));
        assert_eq!(bins.file_for(Platform::UefiX64), Some("ipxe.efi"));
        assert_eq!(bins.file_for(Platform::UefiArm64), None);
        assert!(bins.is_binary("ipxe.efi"));
        assert!(!bins.is_binary("../etc/passwd"));
        std::fs::write(dir.join("snponly.efi"), b"x").unwrap();
        assert_eq!(IpxeBinaries::discover(&dir).file_for(Platform::UefiX64), Some("snponly.efi"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
