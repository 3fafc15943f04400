//! `siteboot image pull|list|rm`: the image cache in `<state_dir>/images`, from the command line.

use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};
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
    let mut progress = PullProgress::new();
    let lease = runtime.block_on(cache.get(&image, |p| progress.show(p)))?;
    progress.finish();
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

/// Progress on stderr: an indicatif bar on a terminal; where indicatif hides its bar (stderr is
/// not a terminal, or TERM is dumb), a plain line every few seconds instead, so that logs and CI
/// still see the download move.
struct PullProgress {
    /// Whether indicatif draws on stderr.
    bars: bool,
    /// The bar, from the first report on (an image already cached shows none).
    bar: Option<ProgressBar>,
    /// When the last plain line was written.
    last_line: Option<Instant>,
}

/// Between two plain lines.
const LINE_EVERY: Duration = Duration::from_secs(5);

impl PullProgress {
    fn new() -> Self {
        let bars = !ProgressDrawTarget::stderr().is_hidden();
        Self { bars, bar: None, last_line: None }
    }

    fn show(&mut self, p: &Progress) {
        let rate = mib_per_sec(p.rate);
        if !self.bars {
            if self.last_line.is_none_or(|t| t.elapsed() >= LINE_EVERY) {
                self.last_line = Some(Instant::now());
                eprintln!("{} {rate}", plain_amount(p));
            }
            return;
        }
        let bar = self.bar.get_or_insert_with(|| {
            // A failed download leaves the bar where it stopped, not full.
            ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
                .with_style(pull_style(false))
                .with_finish(ProgressFinish::Abandon)
        });
        let total = p.total.filter(|&t| t > 0);
        if bar.length() != total {
            bar.set_style(pull_style(total.is_some()));
            match total {
                Some(total) => bar.set_length(total),
                None => bar.unset_length(),
            }
        }
        bar.set_position(p.bytes);
        bar.set_message(rate);
    }

    /// Leaves the bar's last state on the terminal, for what is printed next to go below it.
    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.abandon();
        }
    }
}

/// The bar while the size is known, else the bytes so far behind a spinner.
fn pull_style(sized: bool) -> ProgressStyle {
    let template = if sized {
        "[{bar:20}] {percent:>3}% {binary_bytes}/{binary_total_bytes} {msg}"
    } else {
        "{spinner} {binary_bytes} {msg}"
    };
    ProgressStyle::with_template(template).expect("a valid template").progress_chars("#>-")
}

/// What a plain line says of the bytes: `25.0% 512.0/2048.0 MiB`, or `512.0 MiB` while the size
/// is unknown.
fn plain_amount(p: &Progress) -> String {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    match p.total {
        Some(total) if total > 0 => {
            let percent = p.bytes as f64 * 100.0 / total as f64;
            format!("{percent:.1}% {:.1}/{:.1} MiB", mib(p.bytes), mib(total))
        }
        _ => format!("{:.1} MiB", mib(p.bytes)),
    }
}

/// A rate in bytes a second, as the progress of `image pull` and `host` shows it.
pub fn mib_per_sec(rate: f64) -> String {
    format!("{:.1} MiB/s", rate / (1 << 20) as f64)
}
