//! `siteboot image pull|list|rm`: the image cache in `<state_dir>/images`, from the command line.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use siteboot_image::{Digest, ImageRef};
use siteboot_image_cache::{Cache, Progress};

use crate::config::Config;

pub fn open(config: &Config) -> anyhow::Result<Cache> {
    let dir = config.state_dir.join("images");
    Cache::open(&dir, config.images.max_bytes)
        .with_context(|| format!("opening the image cache in {}", dir.display()))
}

/// A digest as `sha256:<hex>` or the bare hex.
pub fn parse_digest(text: &str) -> anyhow::Result<Digest> {
    let parsed = match text.strip_prefix("sha256:") {
        Some(_) => text.parse(),
        None => Digest::from_hex(text),
    };
    parsed.with_context(|| format!("{text:?} is not a SHA-256 digest"))
}

pub fn pull(config: &Config, url: &str, sha256: &str) -> anyhow::Result<()> {
    let image = ImageRef {
        url: url.parse().with_context(|| format!("{url:?} is not an image URL"))?,
        sha256: parse_digest(sha256)?,
    };
    let cache = open(config)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    let mut bar = ProgressBar::new(std::io::stderr().is_terminal());
    let lease = runtime.block_on(cache.get(&image, |p| bar.show(p)))?;
    bar.finish();
    println!("{} {} bytes {}", lease.digest(), lease.size(), lease.path().display());
    Ok(())
}

pub fn list(config: &Config) -> anyhow::Result<()> {
    let cache = open(config)?;
    println!("{:<71}  {:>14}  {:>12}  SOURCE", "DIGEST", "BYTES", "LAST USED");
    for image in cache.list() {
        println!(
            "{:<71}  {:>14}  {:>12}  {}",
            image.digest.to_string(),
            image.size,
            ago(image.last_used),
            image.source.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

pub fn rm(config: &Config, digest: &str) -> anyhow::Result<()> {
    let digest = parse_digest(digest)?;
    open(config)?.remove(digest)?;
    println!("removed {digest}");
    Ok(())
}

/// How long ago, to the second and in the largest unit: `3h ago`.
fn ago(when: SystemTime) -> String {
    let secs = SystemTime::now().duration_since(when).unwrap_or_default().as_secs();
    let (n, unit) = match secs {
        s if s < 60 => (s, "s"),
        s if s < 3600 => (s / 60, "m"),
        s if s < 86400 => (s / 3600, "h"),
        s => (s / 86400, "d"),
    };
    format!("{n}{unit} ago")
}

/// Progress on stderr: a bar redrawn in place on a terminal, else a plain line every few
/// seconds (logs and CI keep readable output).
struct ProgressBar {
    terminal: bool,
    last: Option<Instant>,
    shown: bool,
}

impl ProgressBar {
    fn new(terminal: bool) -> Self {
        Self { terminal, last: None, shown: false }
    }

    fn show(&mut self, p: &Progress) {
        let every = if self.terminal { Duration::from_millis(100) } else { Duration::from_secs(5) };
        if self.last.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        self.last = Some(Instant::now());
        self.shown = true;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let amount = match p.total {
            Some(total) if total > 0 => {
                let percent = p.bytes as f64 * 100.0 / total as f64;
                let bar = "#".repeat((percent / 5.0) as usize);
                format!("[{bar:<20}] {percent:5.1}% {:.1}/{:.1} MiB", mib(p.bytes), mib(total))
            }
            _ => format!("{:.1} MiB", mib(p.bytes)),
        };
        let line = format!("{amount} {:.1} MiB/s", p.rate / (1 << 20) as f64);
        let mut err = std::io::stderr();
        let _ = if self.terminal { write!(err, "\r{line}\x1b[K") } else { writeln!(err, "{line}") };
    }

    fn finish(&self) {
        if self.terminal && self.shown {
            eprintln!();
        }
    }
}
