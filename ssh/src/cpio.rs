//! A minimal writer of the kernel's initramfs format (cpio "newc"), owner root, mtime 0: what
//! the kernel unpacks into its rootfs, one archive after another when several are concatenated.

/// A newc archive being written.
#[derive(Default)]
pub struct Newc {
    out: Vec<u8>,
    inode: u32,
}

impl Newc {
    /// A file, directory or symlink (its target as `data`) of `mode` (type and permission bits).
    pub fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.header(name, mode, data.len(), (0, 0));
        self.out.extend_from_slice(data);
        self.pad();
    }

    /// A device node.
    pub fn device(&mut self, name: &str, mode: u32, major: u32, minor: u32) {
        self.header(name, mode, 0, (major, minor));
    }

    fn header(&mut self, name: &str, mode: u32, size: usize, (major, minor): (u32, u32)) {
        self.inode += 1;
        let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let fields = [
            self.inode,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            size as u32,
            0, // dev major
            0, // dev minor
            major,
            minor,
            name.len() as u32 + 1,
            0, // checksum (unused by newc)
        ];
        self.out.extend_from_slice(b"070701");
        for field in fields {
            self.out.extend_from_slice(format!("{field:08X}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    /// The archive, with its trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, b"");
        self.out
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::process::{Command, Stdio};

    use super::*;

    #[test]
    fn newc_is_readable_by_cpio() {
        let mut cpio = Newc::default();
        cpio.entry("etc", 0o040755, b"");
        cpio.entry("etc/hello", 0o100644, b"hello\n");
        cpio.entry("bin/sh", 0o120777, b"busybox");
        let out = Command::new("sh")
            .args(["-c", "cpio -it 2>/dev/null"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                child.stdin.take().unwrap().write_all(&cpio.finish())?;
                child.wait_with_output()
            })
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "etc\netc/hello\nbin/sh\n");
    }
}
