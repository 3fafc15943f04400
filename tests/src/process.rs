//! Supervised child processes: output goes to a log file, the process is killed on drop, and its
//! log is printed if the test is failing (the thread is panicking) when it is dropped.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// How much of a log to print when a test fails.
const LOG_TAIL_BYTES: u64 = 64 * 1024;

/// A child process whose stdout and stderr go to `<log_dir>/<name>.log`.
pub struct Supervised {
    name: String,
    child: Child,
    log_path: PathBuf,
    /// Set once the process has been waited for, so drop does not signal a reused pid.
    exited: Option<ExitStatus>,
}

impl Supervised {
    /// Starts `command` with stdin closed and its output appended to `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, command: &mut Command, log_dir: &Path) -> Result<Self> {
        crate::failure::record_panics();
        std::fs::create_dir_all(log_dir)
            .with_context(|| format!("creating log directory {}", log_dir.display()))?;
        let log_path = log_dir.join(format!("{name}.log"));
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name}: {command:?}"))?;
        Ok(Self { name: name.to_owned(), child, log_path, exited: None })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The whole log so far (lossy UTF-8).
    pub fn log(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// The last `LOG_TAIL_BYTES` of the log.
    pub fn log_tail(&self) -> String {
        tail(&self.log_path, LOG_TAIL_BYTES)
    }

    /// `Some(status)` once the process has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    /// Waits up to `timeout` for the process to exit on its own.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<ExitStatus> {
        crate::wait::for_(&format!("{} to exit", self.name), timeout, || self.try_wait())
    }

    /// Sends `signal` (for example `libc::SIGKILL`) if the process is still running.
    pub fn signal(&mut self, signal: i32) {
        if self.try_wait().is_none() {
            // SAFETY: kill(2) with a pid we own and have not reaped.
            unsafe { libc::kill(self.child.id() as i32, signal) };
        }
    }

    /// SIGKILL, then reap: what a crash looks like to the rest of the system.
    pub fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.wait_timeout(Duration::from_secs(10));
    }

    /// SIGTERM, a grace period, then SIGKILL.
    pub fn stop(&mut self) {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.try_wait().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill9();
    }

    /// Prints the log tail to stderr under a header; used when a test fails.
    pub fn print_log(&self) {
        let what = format!("{} ({})", self.name, self.log_path.display());
        crate::failure::print_log(&what, &self.log_tail());
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            self.print_log();
        }
    }
}

/// The last `max` bytes of a file, lossily decoded; empty if it cannot be read.
pub fn tail(path: &Path, max: u64) -> String {
    let Ok(mut file) = File::open(path) else { return String::new() };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    String::from_utf8_lossy(&bytes).into_owned()
}
