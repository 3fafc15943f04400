//! `siteboot host list|inspect|provision|deprovision|cancel`: standalone host operations from
//! the command line, through the running appliance's control socket ([`crate::control`]).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};
use siteboot_agent_server::OperationKind;

use crate::control::{Answer, Request, call};
use crate::image::mib_per_sec;
use crate::operations::Operation;
use crate::standalone::HostView;

/// How often the operation is looked at while following it.
const POLL: Duration = Duration::from_millis(500);

pub fn list(state_dir: &Path) -> Result<()> {
    let hosts = match call(state_dir, &Request::List)? {
        Answer::Hosts(hosts) => hosts,
        Answer::Error(e) => bail!("{e}"),
        Answer::Host(_) => bail!("unexpected answer"),
    };
    println!("{:<20}  {:<17}  {:<15}  {:<12}  LAST", "NAME", "MAC", "STATE", "PROFILE");
    for host in hosts {
        let last = match &host.record.last {
            Some(l) if l.ok => format!("{:?} ok", l.kind),
            Some(l) => format!("{:?} failed: {}", l.kind, l.message),
            None => "-".to_owned(),
        };
        println!(
            "{:<20}  {:<17}  {:<15}  {:<12}  {last}",
            host.name, host.mac, host.state, host.profile
        );
    }
    Ok(())
}

/// Starts `kind` on host `name` and follows it until it ends or `timeout` passes. Progress
/// lines go to stdout; a failure is an error carrying the ramdisk's reason.
pub fn run(state_dir: &Path, name: &str, kind: OperationKind, timeout: Duration) -> Result<()> {
    let host = expect_host(call(state_dir, &Request::Start { host: name.to_owned(), kind })?)?;
    let op = host.record.operation.clone().expect("a started operation");
    let how = match (&host.ssh, &op.network_boot) {
        (Some(address), _) => format!("over SSH at {address}"),
        (None, Some(boot)) => boot.clone(),
        (None, None) => "power-cycle the host into PXE if it is on".to_owned(),
    };
    println!("{name}: {kind:?} operation {} started; {how}", op.id);
    let deadline = Instant::now() + timeout;
    let mut follow = Follow::new();
    loop {
        if Instant::now() > deadline {
            follow.end_bar();
            bail!("{name}: operation {} still running after {timeout:?}", op.id);
        }
        std::thread::sleep(POLL);
        // The appliance may be restarting: its records carry the operation over.
        let host = match call(state_dir, &Request::Show { host: name.to_owned() }) {
            Ok(answer) => expect_host(answer)?,
            Err(e) => {
                follow.line(format!("{name}: waiting for the appliance ({e:#})"));
                continue;
            }
        };
        match &host.record.operation {
            Some(current) if current.id == op.id => follow.operation(name, current),
            _ => {
                follow.end_bar();
                let Some(last) = host.record.last.as_ref().filter(|l| l.operation == op.id) else {
                    bail!("{name}: operation {} was replaced", op.id);
                };
                if last.ok {
                    println!("{name}: {kind:?} succeeded; now {}", host.state);
                    return Ok(());
                }
                bail!("{name}: {kind:?} failed: {}", last.message);
            }
        }
    }
}

/// Cancels host `name`'s operation; prints what it was and the host's state now.
pub fn cancel(state_dir: &Path, name: &str) -> Result<()> {
    let host = expect_host(call(state_dir, &Request::Cancel { host: name.to_owned() })?)?;
    let last = host.record.last.as_ref().expect("a cancelled operation is the last one");
    println!("{name}: {:?} operation {} cancelled; now {}", last.kind, last.operation, host.state);
    Ok(())
}

fn expect_host(answer: Answer) -> Result<HostView> {
    match answer {
        Answer::Host(host) => Ok(*host),
        Answer::Error(e) => bail!("{e}"),
        Answer::Hosts(_) => bail!("unexpected answer"),
    }
}

/// What `run` shows of the operation it follows, on stdout. Each new line is printed once. On
/// a terminal, a step that reports bytes of a known total is an indicatif bar redrawn in place;
/// where indicatif hides its bar (stdout piped or logged, TERM dumb), such a step is a line per
/// report too, as scripts and the tests read it.
struct Follow {
    /// Whether indicatif draws on stdout.
    bars: bool,
    /// The bar of the step under way; its prefix names the host and the step.
    bar: Option<ProgressBar>,
    /// The last line printed.
    shown: String,
    rate: Rate,
}

impl Follow {
    fn new() -> Self {
        let bars = !ProgressDrawTarget::stdout().is_hidden();
        Self { bars, bar: None, shown: String::new(), rate: Rate::default() }
    }

    /// Prints `line` unless it is the one printed last, below the bar, which it ends.
    fn line(&mut self, line: String) {
        if line != self.shown {
            self.end_bar();
            println!("{line}");
            self.shown = line;
        }
    }

    fn operation(&mut self, name: &str, op: &Operation) {
        let (step, bytes) = match (&op.step, op.bytes) {
            (Some(step), Some(bytes)) if self.bars && bytes.total > 0 => (step, bytes),
            _ => {
                let line = progress_line(name, op, &mut self.rate);
                return self.line(line);
            }
        };
        let prefix = format!("{name}: {step}");
        if self.bar.as_ref().is_none_or(|bar| bar.prefix() != prefix) {
            self.end_bar();
            let template =
                "{prefix} [{bar:30}] {binary_bytes}/{binary_total_bytes} ({percent}%) {msg}";
            let style = ProgressStyle::with_template(template).expect("a valid template");
            // A step that ends before its total leaves its bar where it stopped, not full.
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stdout())
                .with_style(style.progress_chars("#>-"))
                .with_prefix(prefix)
                .with_finish(ProgressFinish::Abandon);
            self.bar = Some(bar);
            // A line after the bar is printed even if it is the one printed before it.
            self.shown.clear();
        }
        let rate = self.rate.update(bytes.done);
        let bar = self.bar.as_ref().expect("a bar was just made");
        bar.set_length(bytes.total);
        bar.set_position(bytes.done);
        bar.set_message(rate.map(mib_per_sec).unwrap_or_default());
    }

    /// Leaves the bar's last state on the terminal, for what is printed next to go below it.
    fn end_bar(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        }
    }
}

/// Bytes a second, from the last two reports that moved.
#[derive(Default)]
struct Rate {
    last: Option<(Instant, u64)>,
    per_second: Option<f64>,
}

impl Rate {
    fn update(&mut self, done: u64) -> Option<f64> {
        let now = Instant::now();
        match self.last {
            Some((_, before)) if before == done => {}
            Some((at, before)) if done > before => {
                let secs = now.duration_since(at).as_secs_f64().max(0.001);
                self.per_second = Some((done - before) as f64 / secs);
                self.last = Some((now, done));
            }
            _ => self.last = Some((now, done)),
        }
        self.per_second
    }
}

fn progress_line(name: &str, op: &Operation, rate: &mut Rate) -> String {
    let Some(step) = &op.step else {
        return if op.token_issued.is_some() {
            format!("{name}: the ramdisk booted")
        } else {
            format!("{name}: waiting for the host to boot the ramdisk")
        };
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let amount = match op.bytes {
        Some(b) if b.total > 0 => format!(
            " {:.1}/{:.1} MiB ({:.0}%)",
            mib(b.done),
            mib(b.total),
            b.done as f64 * 100.0 / b.total as f64
        ),
        Some(b) => format!(" {:.1} MiB", mib(b.done)),
        None => String::new(),
    };
    let speed = op
        .bytes
        .and_then(|b| rate.update(b.done))
        .map(|r| format!(" {}", mib_per_sec(r)))
        .unwrap_or_default();
    format!("{name}: {step}{amount}{speed}")
}
