//! A standalone host's BMC (`hosts[].bmc`): the Redfish driver Kubernetes mode uses too
//! (`siteboot_bmc`), with the credentials in a file instead of a Secret. Before an operation
//! starts, the BMC must answer with them for a system that has the host's boot MAC (so a wrong
//! address never power-cycles another machine); then it boots the host once from the network,
//! into the ramdisk.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use siteboot_bmc::{
    BmcDriver, BmcError, BootMode, BoundCredentials, Credentials, Redfish, RedfishAddress,
    RedfishClient, identity_check,
};
use siteboot_boot::MacAddr;
use siteboot_tls_pin::Fingerprint;

/// How long checking the BMC and booting the host may take together (each request has its own
/// deadline and retries; this bounds them all, and what `siteboot host` waits for).
pub const BMC_TIMEOUT: Duration = Duration::from_secs(120);

/// `hosts[].bmc`, checked.
#[derive(Debug, Clone)]
pub struct HostBmc {
    pub address: RedfishAddress,
    /// Trust exactly this certificate, instead of the platform's CAs.
    pub pin: Option<Fingerprint>,
    /// YAML with `username` and `password`; read at each use, so a changed password needs no
    /// restart.
    pub credentials_file: PathBuf,
    /// The firmware path of the network boot; unset: the system's own.
    pub boot_mode: Option<BootMode>,
}

/// Why the BMC could not boot the host.
#[derive(Debug)]
pub enum BmcFailure {
    Credentials {
        path: PathBuf,
        why: String,
    },
    Bmc(BmcError),
    /// It answered, for another machine.
    WrongSystem(String),
    TimedOut,
}

impl std::fmt::Display for BmcFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BmcFailure::Credentials { path, why } => {
                write!(f, "the BMC credentials file {}: {why}", path.display())
            }
            BmcFailure::Bmc(e) => e.fmt(f),
            BmcFailure::WrongSystem(why) => f.write_str(why),
            BmcFailure::TimedOut => {
                write!(
                    f,
                    "the BMC did not finish within {}",
                    humantime::format_duration(BMC_TIMEOUT)
                )
            }
        }
    }
}

impl From<BmcError> for BmcFailure {
    fn from(e: BmcError) -> Self {
        BmcFailure::Bmc(e)
    }
}

/// The credentials file as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialsFile {
    username: String,
    password: String,
}

/// Reads `path`: YAML `username:` and `password:`, in a file only its owner may read (a
/// password others can read is refused rather than used).
pub fn read_credentials(path: &Path) -> Result<Credentials, BmcFailure> {
    let fail = |why: String| BmcFailure::Credentials { path: path.to_owned(), why };
    let file = crate::owner_only::open(path).map_err(fail)?;
    let parsed: CredentialsFile = serde_norway::from_reader(file)
        .map_err(|e| fail(format!("is not YAML with username and password: {e}")))?;
    Credentials::new(&parsed.username, &parsed.password).map_err(|e| fail(e.to_string()))
}

/// The host's BMC, checked: it answers with the file's credentials for a system that has
/// `mac`.
pub async fn connect(bmc: &HostBmc, mac: MacAddr) -> Result<Redfish, BmcFailure> {
    let credentials = read_credentials(&bmc.credentials_file)?;
    // The operator's configuration names both the BMC and the file: nothing to bind against.
    let bound = BoundCredentials::trusted(bmc.address.clone(), bmc.pin, credentials);
    let client = RedfishClient::new(bound)?;
    let driver = Redfish::new(client).with_boot_mode(bmc.boot_mode);
    let identity = bounded(driver.identity()).await?;
    let (ok, _, why) = identity_check(&mac.to_string(), &identity);
    if !ok {
        driver.client().finish().await;
        return Err(match identity {
            Err(e) => e.into(),
            Ok(_) => BmcFailure::WrongSystem(why),
        });
    }
    Ok(driver)
}

/// Boots the host once from the network (powering it on, or restarting it); returns what was
/// done, for the record.
pub async fn boot_from_network(driver: &Redfish) -> Result<String, BmcFailure> {
    let result = bounded(driver.boot_from_network()).await;
    driver.client().finish().await;
    result??;
    Ok(format!("network boot through the BMC at {}", driver.client().address().authority()))
}

async fn bounded<T>(work: impl Future<Output = T>) -> Result<T, BmcFailure> {
    tokio::time::timeout(BMC_TIMEOUT, work).await.map_err(|_| BmcFailure::TimedOut)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn write(dir: &Path, text: &str, mode: u32) -> PathBuf {
        let path = dir.join("bmc.yaml");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn credentials_come_from_a_file_only_its_owner_can_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "username: admin\npassword: 'correct horse'\n", 0o600);
        let credentials = read_credentials(&path).unwrap();
        assert_eq!((credentials.username(), credentials.password()), ("admin", "correct horse"));

        let error =
            |text: &str, mode| read_credentials(&write(dir.path(), text, mode)).unwrap_err();
        let open = error("username: admin\npassword: x\n", 0o644).to_string();
        assert!(
            open.ends_with("is readable or writable by others (mode 644): chmod 600 it"),
            "{open}"
        );
        let missing = error("username: admin\n", 0o600).to_string();
        assert!(missing.contains("missing field `password`"), "{missing}");
        let empty = error("username: admin\npassword: ''\n", 0o400).to_string();
        assert!(empty.ends_with("its \"password\" is empty"), "{empty}");
        let gone = read_credentials(&dir.path().join("nosuch")).unwrap_err().to_string();
        assert!(gone.contains("No such file"), "{gone}");
    }
}
