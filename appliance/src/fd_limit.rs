//! The file-descriptor limit (RLIMIT_NOFILE) against what the configured caps may hold open.
//! Running out of descriptors under load is a denial of service, so a limit too low for the
//! configuration is refused at start-up, with the field and the way to raise it.

use std::io;

use siteboot_boot::dhcp::settings::FieldError;
use siteboot_boot::http::HttpSettings;
use siteboot_boot::tftp::TftpSettings;

/// Descriptors that are not per connection or transfer: listening and DHCP sockets, the lease
/// file, logs, the Kubernetes client's connections, the runtime's own.
const BASE: u64 = 256;

/// Descriptors the servers may hold at once: two per HTTP connection (the socket and a file
/// being served) and two per TFTP transfer (its socket and the file).
pub fn needed(http: &HttpSettings, tftp: &TftpSettings) -> u64 {
    2 * http.max_connections as u64 + 2 * tftp.max_transfers as u64 + BASE
}

/// Refuses caps that need more descriptors than `limit`.
pub fn check(http: &HttpSettings, tftp: &TftpSettings, limit: u64) -> Result<(), FieldError> {
    let needed = needed(http, tftp);
    if needed <= limit {
        return Ok(());
    }
    Err(FieldError::new(
        "http.max_connections",
        format!(
            "{} connections (with tftp.max_transfers {}) need up to {needed} file descriptors, \
             but this process may open only {limit} (RLIMIT_NOFILE hard limit): raise it \
             (systemd: LimitNOFILE= in the unit; a shell: ulimit -Hn; a pod: the container \
             runtime's limit) or lower http.max_connections",
            http.max_connections, tftp.max_transfers
        ),
    ))
}

fn get() -> io::Result<libc::rlimit> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes only the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(limit)
}

/// The hard limit: what [`raise`] brings the soft limit to.
pub fn hard() -> io::Result<u64> {
    get().map(|l| l.rlim_max)
}

/// Raises the soft limit to the hard one (as Go programs do at start): systemd and container
/// runtimes often set a soft limit of 1024 under a much higher hard one. Returns the limit.
pub fn raise() -> io::Result<u64> {
    let mut limit = get()?;
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: setrlimit reads only the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_too_low_for_the_caps_names_the_field_and_the_fix() {
        let (http, tftp) = (HttpSettings::default(), TftpSettings::default());
        assert_eq!(needed(&http, &tftp), 2 * 1024 + 2 * 256 + 256);
        assert!(check(&http, &tftp, 65_536).is_ok());
        assert!(check(&http, &tftp, 2816).is_ok());
        let e = check(&http, &tftp, 1024).unwrap_err();
        assert_eq!(e.field, "http.max_connections");
        for part in ["1024 connections", "2816 file descriptors", "only 1024", "LimitNOFILE"] {
            assert!(e.message.contains(part), "{part:?} missing from: {}", e.message);
        }
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let hard = hard().unwrap();
        assert_eq!(raise().unwrap(), hard);
        assert_eq!(get().unwrap().rlim_cur, hard);
    }
}
