//! A real browser for the tests: Debian's headless Chromium, driven through chromedriver by
//! selenium (`tests/fixtures/browser/driver.py`, one JSON command per line), running inside a
//! lab namespace so it reaches the appliance there and nothing else.
//!
//! selenium comes from PyPI, pinned, into a virtualenv made with Debian's python3 and cached
//! under `${SITEBOOT_CACHE:-/var/cache/siteboot}/selenium-<version>/`; Chromium and
//! chromedriver are Debian's (`scripts/setup`), so nothing else is downloaded.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::netns::Netns;

/// The selenium release the driver is written against.
const SELENIUM: &str = "4.50.0";
const DRIVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/browser/driver.py");
/// Chromium's start, and any one command without a deadline of its own.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(90);
/// How much of the driver's log (chromedriver and selenium errors) to print on failure.
const LOG_TAIL_BYTES: u64 = 32 * 1024;

/// One console message of the page.
#[derive(Debug, Clone)]
pub struct ConsoleEntry {
    /// `SEVERE`, `WARNING`, `INFO`, ...
    pub level: String,
    pub message: String,
}

/// A headless Chromium; quit (or killed) on drop, its log printed if the test is failing.
pub struct Browser {
    child: Child,
    stdin: ChildStdin,
    answers: Receiver<String>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium inside `ns`.
    pub fn start(ns: &Netns) -> Result<Self> {
        crate::failure::record_panics();
        let python = selenium_python()?;
        let dir = tempfile::Builder::new().prefix("siteboot-browser-").tempdir()?;
        let log = dir.path().join("driver.log");
        let mut child = ns
            .command(&python)
            .arg(DRIVER)
            // selenium must not look for a driver of its own: it is given Debian's.
            .env("SE_OFFLINE", "true")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting the browser driver")?;
        let stdin = child.stdin.take().context("driver stdin")?;
        let stdout = child.stdout.take().context("driver stdout")?;
        let (lines, answers) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    return;
                }
            }
        });
        let mut browser = Self { child, stdin, answers, log, _dir: dir };
        // The driver answers once when Chromium is up: with its version.
        browser.answer("start", COMMAND_TIMEOUT)?;
        Ok(browser)
    }

    fn call(&mut self, command: Value, timeout: Duration) -> Result<Value> {
        let op = command["op"].as_str().unwrap_or("?").to_owned();
        writeln!(self.stdin, "{command}").with_context(|| format!("sending {op} to the driver"))?;
        self.stdin.flush()?;
        self.answer(&op, timeout)
    }

    fn answer(&mut self, op: &str, timeout: Duration) -> Result<Value> {
        let line = match self.answers.recv_timeout(timeout) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                bail!("the browser did not answer {op} in {timeout:?}")
            }
            Err(RecvTimeoutError::Disconnected) => {
                bail!("the browser driver exited during {op}:\n{}", self.log_tail())
            }
        };
        let answer: Value =
            serde_json::from_str(&line).with_context(|| format!("driver answered {line:?}"))?;
        if answer["ok"] == true {
            Ok(answer["value"].clone())
        } else {
            bail!("{}", answer["error"].as_str().unwrap_or("the driver failed"))
        }
    }

    /// Loads `url`.
    pub fn open(&mut self, url: &str) -> Result<()> {
        self.call(json!({ "op": "open", "url": url }), COMMAND_TIMEOUT).map(drop)
    }

    /// Runs the JavaScript function body `js` in the page; returns what it returns.
    pub fn eval(&mut self, js: &str) -> Result<Value> {
        self.call(json!({ "op": "eval", "js": js }), COMMAND_TIMEOUT)
    }

    /// Runs `js` until it returns something truthy, for at most `timeout`; returns that.
    pub fn wait(&mut self, what: &str, js: &str, timeout: Duration) -> Result<Value> {
        let command = json!({ "op": "wait", "js": js, "timeout": timeout.as_secs_f64() });
        self.call(command, timeout + COMMAND_TIMEOUT)
            .with_context(|| format!("waiting in the browser for {what}"))
    }

    pub fn click(&mut self, css: &str) -> Result<()> {
        self.call(json!({ "op": "click", "css": css }), COMMAND_TIMEOUT).map(drop)
    }

    /// Replaces the text of the input matching `css` with `text`, as typed.
    pub fn type_into(&mut self, css: &str, text: &str) -> Result<()> {
        self.call(json!({ "op": "type", "css": css, "text": text }), COMMAND_TIMEOUT).map(drop)
    }

    /// Writes a PNG of the window to `path`.
    pub fn screenshot(&mut self, path: &Path) -> Result<()> {
        match self.call(json!({ "op": "screenshot", "path": path }), COMMAND_TIMEOUT)? {
            Value::Bool(true) => Ok(()),
            other => bail!("screenshot to {}: {other}", path.display()),
        }
    }

    /// Every console message of the page so far.
    pub fn console(&mut self) -> Result<Vec<ConsoleEntry>> {
        let entries = self.call(json!({ "op": "console" }), COMMAND_TIMEOUT)?;
        let entries = entries.as_array().context("console entries")?;
        Ok(entries
            .iter()
            .map(|e| ConsoleEntry {
                level: e["level"].as_str().unwrap_or_default().to_owned(),
                message: e["message"].as_str().unwrap_or_default().to_owned(),
            })
            .collect())
    }

    fn log_tail(&self) -> String {
        crate::process::tail(&self.log, LOG_TAIL_BYTES)
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let quit = self.call(json!({ "op": "quit" }), Duration::from_secs(20));
        let exited = quit.is_ok()
            && crate::wait::for_("the browser to quit", Duration::from_secs(20), || {
                self.child.try_wait().ok().flatten()
            })
            .is_ok();
        if !exited {
            // Chromium's own processes go with the driver's session; kill what is left.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            crate::failure::print_log("browser driver log", &self.log_tail());
        }
    }
}

/// The virtualenv's python, with selenium installed; made once per machine and version.
fn selenium_python() -> Result<PathBuf> {
    crate::venv::python_with(&format!("selenium-{SELENIUM}"), &[format!("selenium=={SELENIUM}")])
}
