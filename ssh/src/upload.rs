//! Sending a file as one command, without SFTP: the bytes go on the command's stdin, and the
//! command line is fixed but for the path, which goes in single quotes. sshd hands a command
//! line to the user's shell, so a path is the one place where what a Host carries could become
//! shell syntax; [`quote`] makes it one word whatever it holds, and [`RemotePath`] refuses
//! what no quoting can carry (NUL) and what is not a plain absolute path.
//!
//! The file is written next to its destination and renamed over it, so a reader (cloud-init,
//! a reboot in the middle) sees the old file or the whole new one, never half of it; it is
//! created under `umask 077` and gets its mode before the rename, so its content is never
//! readable by others before it has its mode.

use std::fmt;
use std::str::FromStr;

/// Why a remote path or mode was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UploadError {
    #[error("remote path {0:?} is not absolute")]
    NotAbsolute(String),
    #[error("remote path {0:?} names a directory, not a file")]
    NotAFile(String),
    #[error("remote path {0:?} holds a NUL or a control character")]
    ControlCharacter(String),
    #[error("file mode {0:#o} is more than permission bits (0o7777)")]
    Mode(u32),
}

/// An absolute path of a file on the server: starts with `/`, does not end with `/`, holds no
/// control character (a NUL cannot be passed at all; a newline in a path is a mistake).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePath(String);

impl FromStr for RemotePath {
    type Err = UploadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if !s.starts_with('/') {
            return Err(UploadError::NotAbsolute(s.to_owned()));
        }
        if s.ends_with('/') || s.ends_with("/.") || s.ends_with("/..") {
            return Err(UploadError::NotAFile(s.to_owned()));
        }
        if s.chars().any(char::is_control) {
            return Err(UploadError::ControlCharacter(s.to_owned()));
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for RemotePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A file's permission bits (`0o644`, `0o600`, …; setuid/setgid/sticky allowed, nothing above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMode(u32);

impl FileMode {
    pub fn new(mode: u32) -> Result<Self, UploadError> {
        if mode > 0o7777 {
            return Err(UploadError::Mode(mode));
        }
        Ok(Self(mode))
    }

    pub fn bits(self) -> u32 {
        self.0
    }
}

/// `s` as one POSIX shell word: in single quotes, where nothing is special, with each `'`
/// written as `'\''` (close, an escaped quote, reopen).
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The command that writes its stdin to `path` with `mode`, through a temporary file in the
/// same directory renamed over it.
pub(crate) fn command(path: &RemotePath, mode: FileMode) -> String {
    let target = quote(&path.0);
    let partial = quote(&format!("{}.siteboot-partial", path.0));
    format!(
        "umask 077 && cat > {partial} && chmod {mode:04o} {partial} && mv -f {partial} {target}",
        mode = mode.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paths a Host editor might write to get a command run.
    const HOSTILE: &[&str] = &[
        "/tmp/it's",
        "/tmp/'; touch /tmp/pwned; '",
        "/tmp/$(touch /tmp/pwned)",
        "/tmp/`touch /tmp/pwned`",
        "/tmp/a  b",
        "/tmp/\\'\\",
        "/tmp/*",
        "/tmp/~root",
        "/tmp/$HOME;|&><!#\"",
        "/tmp/''''",
        "/tmp/é ✓",
    ];

    #[test]
    fn quoting_gives_one_word_with_nothing_special() {
        assert_eq!(quote("/etc/hosts"), "'/etc/hosts'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("'"), r"''\'''");
    }

    /// A real shell reads every hostile path back as exactly one argument, unchanged, and runs
    /// nothing it holds.
    #[test]
    fn a_shell_reads_hostile_paths_back_unchanged() {
        for path in HOSTILE {
            let script = format!("printf '%s\\0' {}", quote(path));
            let out = std::process::Command::new("sh").args(["-c", &script]).output().unwrap();
            assert!(out.status.success(), "{script}: {out:?}");
            assert_eq!(out.stdout, format!("{path}\0").as_bytes(), "{script}");
        }
    }

    #[test]
    fn the_upload_command_quotes_the_path_and_writes_the_mode_in_octal() {
        let path: RemotePath = "/var/lib/cloud/seed/nocloud/user-data".parse().unwrap();
        assert_eq!(
            command(&path, FileMode::new(0o600).unwrap()),
            "umask 077 && cat > '/var/lib/cloud/seed/nocloud/user-data.siteboot-partial' && \
             chmod 0600 '/var/lib/cloud/seed/nocloud/user-data.siteboot-partial' && \
             mv -f '/var/lib/cloud/seed/nocloud/user-data.siteboot-partial' \
             '/var/lib/cloud/seed/nocloud/user-data'"
        );
        let hostile: RemotePath = "/tmp/x'; reboot; '".parse().unwrap();
        assert!(
            command(&hostile, FileMode::new(0o4755).unwrap())
                .contains(r"chmod 4755 '/tmp/x'\''; reboot; '\''.siteboot-partial' && mv -f")
        );
    }

    #[test]
    fn paths_and_modes_that_cannot_be_files_are_refused() {
        let err = |s: &str| s.parse::<RemotePath>().unwrap_err();
        assert_eq!(err("etc/hosts"), UploadError::NotAbsolute("etc/hosts".into()));
        assert_eq!(err(""), UploadError::NotAbsolute("".into()));
        assert_eq!(err("/etc/"), UploadError::NotAFile("/etc/".into()));
        assert_eq!(err("/etc/.."), UploadError::NotAFile("/etc/..".into()));
        assert_eq!(err("/"), UploadError::NotAFile("/".into()));
        assert_eq!(err("/tmp/a\0b"), UploadError::ControlCharacter("/tmp/a\0b".into()));
        assert_eq!(err("/tmp/a\nb"), UploadError::ControlCharacter("/tmp/a\nb".into()));
        for path in HOSTILE {
            assert!(path.parse::<RemotePath>().is_ok(), "{path:?}");
        }
        assert_eq!(FileMode::new(0o10000), Err(UploadError::Mode(0o10000)));
        assert_eq!(FileMode::new(0o7777).unwrap().bits(), 0o7777);
    }
}
