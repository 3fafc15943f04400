//! Serving files from a root directory and nothing outside it.
//!
//! Paths are checked twice: lexically (no `..`, no NUL, no empty name), then by the kernel:
//! `openat2(RESOLVE_BENEATH)` refuses any path, symlinks included, that resolves outside the
//! root, with no window between a check and the open.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};

/// A directory files are served from.
#[derive(Debug)]
pub struct FileRoot {
    dir: OwnedFd,
    path: PathBuf,
}

/// Why a requested file is not served.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("no such file")]
    NotFound,
    #[error("path leaves the served directory")]
    OutsideRoot,
    #[error("not a regular file")]
    NotAFile,
    #[error("invalid path: {0}")]
    InvalidPath(&'static str),
    #[error("{0}")]
    Io(#[from] io::Error),
}

impl FileRoot {
    pub fn open(path: &Path) -> io::Result<Self> {
        let dir = rustix::fs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Self { dir, path: path.to_owned() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens `relative` for reading. A leading `/` is taken as the root itself (firmware often
    /// asks for `/file`), so an absolute path can never name a file outside the root.
    pub fn open_file(&self, relative: &str) -> Result<(File, u64), FileError> {
        let relative = check_relative(relative)?;
        let fd = rustix::fs::openat2(
            &self.dir,
            relative,
            // NONBLOCK: opening a FIFO someone left in the root must not hang the server.
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        )
        .map_err(|e| match e {
            rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR => FileError::NotFound,
            rustix::io::Errno::XDEV | rustix::io::Errno::LOOP => FileError::OutsideRoot,
            other => FileError::Io(other.into()),
        })?;
        let file = File::from(fd);
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(FileError::NotAFile);
        }
        Ok((file, meta.len()))
    }
}

/// The lexical check: the path, without leading slashes, with no `..`, `.`-only or empty
/// components and no NUL.
pub fn check_relative(path: &str) -> Result<&str, FileError> {
    if path.contains('\0') {
        return Err(FileError::InvalidPath("contains NUL"));
    }
    let trimmed = path.trim_start_matches('/');
    if trimmed.is_empty() {
        return Err(FileError::InvalidPath("empty file name"));
    }
    for component in trimmed.split('/') {
        match component {
            ".." => return Err(FileError::OutsideRoot),
            "" | "." => return Err(FileError::InvalidPath("empty or '.' path component")),
            _ => {}
        }
    }
    Ok(trimmed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::symlink;

    #[test]
    fn serves_inside_and_refuses_outside() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"secret").unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/file"), b"hello").unwrap();
        symlink("sub/file", dir.path().join("inner-link")).unwrap();
        symlink(outside.path().join("secret"), dir.path().join("abs-link")).unwrap();
        symlink("../../../../../../../../etc/passwd", dir.path().join("rel-link")).unwrap();
        symlink(outside.path(), dir.path().join("dir-link")).unwrap();
        let root = FileRoot::open(dir.path()).unwrap();

        let (mut f, len) = root.open_file("sub/file").unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!((s.as_str(), len), ("hello", 5));
        assert!(root.open_file("/sub/file").is_ok(), "leading slash is the root");
        assert!(root.open_file("inner-link").is_ok(), "symlinks inside the root are fine");

        for bad in ["../secret", "sub/../../secret", "abs-link", "rel-link", "dir-link/secret"] {
            assert!(matches!(root.open_file(bad), Err(FileError::OutsideRoot)), "{bad}");
        }
        assert!(matches!(root.open_file("/etc/passwd"), Err(FileError::NotFound)));
        assert!(matches!(root.open_file("sub"), Err(FileError::NotAFile)));
        assert!(matches!(root.open_file("missing"), Err(FileError::NotFound)));
        assert!(matches!(root.open_file(""), Err(FileError::InvalidPath(_))));
        assert!(matches!(root.open_file("a\0b"), Err(FileError::InvalidPath(_))));
        assert!(matches!(root.open_file("sub//file"), Err(FileError::InvalidPath(_))));
    }
}
