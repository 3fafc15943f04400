//! TFTP under load: N clients at once (200 in the published run), all from one address, each
//! fetching a real iPXE binary the way its loader asks for it ([`FETCHES`]: iPXE chainloading
//! itself, [`Ask::IPXE`], blksize 1432 and tsize, one ACK per block; UEFI firmware loading
//! iPXE, [`Ask::EDK2`], blksize 1468 and windowsize 4), from siteboot, tftpd-hpa and dnsmasq.
//! Measured: the time from the moment every client sends its request to the end of the last
//! transfer, the transfers that failed (a client gives up after 5 retransmissions 1 s apart, or
//! on an error packet, or with the wrong length), and the server's CPU time. A failure is
//! counted, never fatal.

use std::net::UdpSocket;
use std::path::Path;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::tftp::{self, Ask};
use super::{Lab, Settings};

/// The binaries fetched, from Debian's `ipxe` package (installed by `scripts/setup`): the BIOS
/// one (74 KiB) and the full UEFI build (831 KiB; siteboot hands UEFI firmware the smaller
/// `snponly.efi` when it is there).
const FILES: [&str; 2] = ["undionly.kpxe", "ipxe.efi"];

/// A file and the client whose requests the clients copy.
#[derive(Clone, Copy, Debug)]
pub struct Fetch {
    pub file: &'static str,
    /// Who asks, as the table names it.
    pub asked_as: &'static str,
    pub ask: Ask,
}

/// What is measured: each binary as iPXE asks for it, and the UEFI one as UEFI firmware does.
pub const FETCHES: [Fetch; 3] = [
    Fetch { file: "undionly.kpxe", asked_as: "iPXE", ask: Ask::IPXE },
    Fetch { file: "ipxe.efi", asked_as: "iPXE", ask: Ask::IPXE },
    Fetch { file: "ipxe.efi", asked_as: "UEFI (EDK2)", ask: Ask::EDK2 },
];
const IPXE_DIR: &str = "/usr/lib/ipxe";
/// How long the server's transfer processes may take to end after the clients are done.
const SETTLE: Duration = Duration::from_secs(10);
/// Distinct failure reasons kept per sample.
const ERRORS_KEPT: usize = 5;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub server: String,
    pub file: String,
    /// [`Fetch::asked_as`].
    pub asked_as: String,
    pub file_bytes: u64,
    pub clients: usize,
    pub run: usize,
    /// From the start of every request to the end of the last transfer (done or failed).
    pub seconds: f64,
    /// Transfers that did not deliver the whole file.
    pub failed: usize,
    /// The first few distinct reasons of the failures.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
    pub server_cpu_seconds: f64,
}

pub fn run(settings: &Settings, dir: &Path) -> Result<Vec<Sample>> {
    let root = dir.join("tftp-ipxe");
    std::fs::create_dir_all(&root)?;
    for file in FILES {
        let from = Path::new(IPXE_DIR).join(file);
        std::fs::copy(&from, root.join(file))
            .with_context(|| format!("copying {} (Debian's ipxe package)", from.display()))?;
    }
    let clients = settings.tftp_clients;
    let mut samples = Vec::new();
    for run in 0..settings.runs {
        for server in tftp::SERVERS {
            let lab = Lab::new("bm")?;
            lab.address_client()?;
            let running = tftp::start(server, &lab, &root, dir, clients)?;
            for Fetch { file, asked_as, ask } in FETCHES {
                let file_bytes = std::fs::metadata(root.join(file))?.len();
                settle(server, running.pid);
                let cpu = super::cpu_seconds(running.pid);
                let outcome = fetch_all(&lab, file, ask, file_bytes, clients)?;
                settle(server, running.pid);
                let server_cpu_seconds = super::cpu_seconds(running.pid) - cpu;
                eprintln!(
                    "tftp-concurrent {server} {file} as {asked_as} x{clients} run={run}: {:.3} s, {} failed{}",
                    outcome.seconds,
                    outcome.failed,
                    outcome.errors.first().map(|e| format!(" ({e})")).unwrap_or_default()
                );
                samples.push(Sample {
                    server: server.to_owned(),
                    file: file.to_owned(),
                    asked_as: asked_as.to_owned(),
                    file_bytes,
                    clients,
                    run,
                    seconds: outcome.seconds,
                    failed: outcome.failed,
                    errors: outcome.errors,
                    server_cpu_seconds,
                });
            }
        }
    }
    Ok(samples)
}

/// Waits (up to [`SETTLE`]) until the server has no child processes: tftpd-hpa forks one per
/// transfer, and a transfer process whose last ACK was lost keeps retransmitting after its
/// client is done. One still running then is reported and left: it is not an error, and the
/// next measurement may include its CPU time.
fn settle(server: &str, pid: u32) {
    let deadline = Instant::now() + SETTLE;
    while Instant::now() < deadline {
        if super::children(pid).is_empty() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let left = super::children(pid).len();
    eprintln!(
        "tftp-concurrent {server}: {left} transfer process(es) still running after {SETTLE:?}"
    );
}

struct Outcome {
    seconds: f64,
    failed: usize,
    errors: Vec<String>,
}

/// `clients` transfers of `file` at once, each from its own socket (so its own port) in the
/// client namespace, released together.
fn fetch_all(lab: &Lab, file: &str, ask: Ask, file_bytes: u64, clients: usize) -> Result<Outcome> {
    let sockets = lab.client.enter(move || {
        (0..clients).map(|_| Ok(UdpSocket::bind("0.0.0.0:0")?)).collect::<Result<Vec<_>>>()
    })?;
    let server = tftp::server_address();
    let start = Barrier::new(clients + 1);
    let (results, elapsed) = std::thread::scope(|scope| {
        let transfers: Vec<_> = sockets
            .iter()
            .map(|socket| {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    tftp::fetch(socket, server, file, ask)
                })
            })
            .collect();
        start.wait();
        let started = Instant::now();
        let results: Vec<_> = transfers.into_iter().map(|t| t.join()).collect();
        (results, started.elapsed())
    });
    let mut errors: Vec<String> = Vec::new();
    let mut failed = 0;
    for result in results {
        let error = match result {
            Ok(Ok(got)) if got.bytes == file_bytes => continue,
            Ok(Ok(got)) => format!("got {} of {file_bytes} bytes", got.bytes),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => "the client thread panicked".to_owned(),
        };
        failed += 1;
        if errors.len() < ERRORS_KEPT && !errors.contains(&error) {
            errors.push(error);
        }
    }
    Ok(Outcome { seconds: elapsed.as_secs_f64(), failed, errors })
}
