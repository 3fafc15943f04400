//! The files of secrets the config names (a BMC's credentials, an SSH private key): read at each
//! use, so a changed secret needs no restart, and only if nobody but their owner may read or
//! write them (a secret others can read is refused rather than used).

use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Opens `path` if only its owner may read or write it; otherwise says why not.
pub fn open(path: &Path) -> Result<File, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let mode = file.metadata().map_err(|e| e.to_string())?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(format!(
            "is readable or writable by others (mode {:o}): chmod 600 it",
            mode & 0o777
        ));
    }
    Ok(file)
}
