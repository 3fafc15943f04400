//! `siteboot host list|inspect|provision|deprovision|cancel`: standalone host operations from
//! the command line, through the running appliance's control socket ([`crate::control`]).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use siteboot_controller::crd::OperationKind;

use crate::control::{Answer, Request, call};
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
    let boot = op.network_boot.as_deref().unwrap_or("power-cycle the host into PXE if it is on");
    println!("{name}: {kind:?} operation {} started; {boot}", op.id);
    let deadline = Instant::now() + timeout;
    let mut shown = String::new();
    let mut rate = Rate::default();
    loop {
        if Instant::now() > deadline {
            bail!("{name}: operation {} still running after {timeout:?}", op.id);
        }
        std::thread::sleep(POLL);
        // The appliance may be restarting: its records carry the operation over.
        let host = match call(state_dir, &Request::Show { host: name.to_owned() }) {
            Ok(answer) => expect_host(answer)?,
            Err(e) => {
                let line = format!("{name}: waiting for the appliance ({e:#})");
                if line != shown {
                    println!("{line}");
                    shown = line;
                }
                continue;
            }
        };
        match &host.record.operation {
            Some(current) if current.id == op.id => {
                let line = progress_line(name, current, &mut rate);
                if line != shown {
                    println!("{line}");
                    shown = line;
                }
            }
            _ => {
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

fn progress_line(name: &str, op: &crate::operations::Operation, rate: &mut Rate) -> String {
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
        .map(|r| format!(" {:.1} MiB/s", r / (1 << 20) as f64))
        .unwrap_or_default();
    format!("{name}: {step}{amount}{speed}")
}
