//! TFTP: one large file at blksize 1468, with windowsize 1, 16 and 64 (RFC 7440), siteboot
//! against tftpd-hpa and dnsmasq (which do not implement windowsize: they answer every window
//! lockstep). The client is this module's own: atftp and tftp-hpa cannot report what was
//! negotiated.

use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Lab, SERVER_ADDRESS, Settings};
use crate::appliance::{Appliance, BRIDGE};
use crate::process::Supervised;

const FILE: &str = "image.bin";
pub const BLOCK_SIZE: u16 = 1468;
/// Retransmissions of one ACK (or the request) before the transfer is given up.
const RETRIES: u32 = 5;
const RECEIVE_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub server: String,
    /// The window the client asked for.
    pub window: u16,
    /// The window the server agreed to (1 when it ignored the option).
    pub negotiated_window: u16,
    pub run: usize,
    pub bytes: u64,
    pub seconds: f64,
    pub server_cpu_seconds: f64,
}

/// The TFTP servers compared, siteboot first.
pub const SERVERS: [&str; 3] = ["siteboot", "tftpd-hpa", "dnsmasq"];

pub fn run(settings: &Settings, dir: &Path) -> Result<Vec<Sample>> {
    let root = dir.join("tftp-root");
    std::fs::create_dir_all(&root)?;
    super::write_file(&root.join(FILE), settings.tftp_bytes)?;
    let mut samples = Vec::new();
    for run in 0..settings.runs {
        for server in SERVERS {
            let lab = Lab::new("bt")?;
            lab.address_client()?;
            let running = start(server, &lab, &root, dir, 1)?;
            for &window in &settings.tftp_windows {
                let cpu = super::cpu_seconds(running.pid);
                let got = fetch_in(&lab, FILE, Ask::large_blocks(window))?;
                if got.bytes != settings.tftp_bytes {
                    bail!("{server}: got {} of {} bytes", got.bytes, settings.tftp_bytes);
                }
                eprintln!(
                    "tftp {server} window={window} (got {}, blksize {}) run={run}: {:.3} s",
                    got.window, got.block_size, got.seconds
                );
                samples.push(Sample {
                    server: server.to_owned(),
                    window,
                    negotiated_window: got.window,
                    run,
                    bytes: got.bytes,
                    seconds: got.seconds,
                    server_cpu_seconds: super::cpu_seconds(running.pid) - cpu,
                });
            }
        }
    }
    Ok(samples)
}

/// A TFTP server under test: its pid (for CPU time) and the process, stopped on drop.
pub struct Running {
    pub pid: u32,
    _process: Box<dyn std::any::Any>,
}

impl Drop for Running {
    /// tftpd-hpa's transfer processes outlive it (some retransmit for a minute after their
    /// client is gone): they go with it. The process itself is stopped after this.
    fn drop(&mut self) {
        for child in super::children(self.pid) {
            // SAFETY: kill has no memory effects; `child` was listed as this server's child.
            unsafe { libc::kill(child as libc::pid_t, libc::SIGKILL) };
        }
    }
}

/// Starts `server` serving `root` in the lab, ready for `clients` transfers at once (all from
/// the one client address), and waits until it answers.
pub fn start(server: &str, lab: &Lab, root: &Path, dir: &Path, clients: usize) -> Result<Running> {
    let running = match server {
        "siteboot" => {
            let a = start_siteboot(lab, root, clients)?;
            Running { pid: a.pid().context("siteboot runs")?, _process: Box::new(a) }
        }
        "tftpd-hpa" => {
            let p = start_tftpd(lab, root, dir)?;
            Running { pid: p.pid(), _process: Box::new(p) }
        }
        "dnsmasq" => {
            let p = start_dnsmasq(lab, root, dir, clients)?;
            Running { pid: p.pid(), _process: Box::new(p) }
        }
        other => bail!("no TFTP server {other}"),
    };
    wait_serving(lab)?;
    Ok(running)
}

/// siteboot serving `root`, and its iPXE binaries from Debian's `ipxe` package (the files the
/// concurrent benchmark copies into `root` for the peers). Its transfer caps (`max_transfers`
/// 256 and `max_transfers_per_address` 8 by default) are raised to `clients` when that is
/// more: every bench client comes from one address.
fn start_siteboot(lab: &Lab, root: &Path, clients: usize) -> Result<Appliance> {
    let config = json!({
        "interface": BRIDGE,
        "address": SERVER_ADDRESS,
        "dhcp": { "mode": "off" },
        "tftp": {
            "root": root,
            "max_block_size": BLOCK_SIZE,
            "max_window_size": 64,
            "max_transfers": clients.max(64),
            "max_transfers_per_address": clients.max(8),
        },
        "profiles": { "none": { "script": "#!ipxe\nexit\n" } },
    });
    Appliance::start(&lab.server, config)
}

/// tftpd-hpa as Debian runs it (`--secure` on a root), in the foreground. It forks a child per
/// transfer and has no cap on them.
fn start_tftpd(lab: &Lab, root: &Path, dir: &Path) -> Result<Supervised> {
    let mut command = lab.server.command("in.tftpd");
    command
        .args(["--foreground", "--listen", "--user", "root", "--secure"])
        .args(["--address", &format!("{SERVER_ADDRESS}:69")])
        .arg(root);
    Supervised::spawn("tftpd-hpa", &mut command, dir)
}

/// dnsmasq as a TFTP server only (DNS and DHCP off), no per-transfer logging, with its cap on
/// concurrent transfers (`--tftp-max`, default 50) raised to `clients` when that is more. It
/// grants blksize up to the interface's MTU (1500: 1468 bytes of data).
fn start_dnsmasq(lab: &Lab, root: &Path, dir: &Path, clients: usize) -> Result<Supervised> {
    let args = [
        "--quiet-tftp".to_owned(),
        "--enable-tftp".to_owned(),
        format!("--tftp-root={}", root.display()),
        format!("--tftp-max={}", clients.max(50)),
    ];
    super::start_dnsmasq(lab, "dnsmasq-tftp", &args, dir)
}

/// Until a request is answered (UDP has no connect to wait for).
fn wait_serving(lab: &Lab) -> Result<()> {
    super::wait_for("the TFTP server to answer", Duration::from_secs(20), || {
        let server = server_address();
        lab.client
            .enter(move || {
                let socket = UdpSocket::bind("0.0.0.0:0")?;
                socket.set_read_timeout(Some(Duration::from_millis(200)))?;
                socket.send_to(&request("no-such-file", Ask::PLAIN), server)?;
                let mut buf = [0u8; 1024];
                Ok(socket.recv_from(&mut buf).is_ok())
            })
            .unwrap_or(false)
    })
}

/// What one transfer got.
pub struct Fetched {
    pub bytes: u64,
    pub seconds: f64,
    pub window: u16,
    pub block_size: u16,
}

/// The options a client puts in its read request.
#[derive(Clone, Copy, Debug)]
pub struct Ask {
    /// blksize (RFC 2348); 512 is not asked for, being the default.
    pub block_size: u16,
    /// windowsize (RFC 7440); 1 is not asked for.
    pub window: u16,
    /// Whether `tsize 0` is asked for (RFC 2349): the server answers with the file's size.
    pub tsize: bool,
}

impl Ask {
    /// No options: RFC 1350's 512-byte lockstep.
    pub const PLAIN: Self = Self { block_size: 512, window: 1, tsize: false };
    /// What iPXE's TFTP client asks (`tftp_send_rrq` in iPXE's src/net/udp/tftp.c): blksize
    /// of at most 1432 (`TFTP_MAX_BLKSIZE`) and tsize, never windowsize: it acknowledges
    /// every block.
    pub const IPXE: Self = Self { block_size: 1432, window: 1, tsize: true };
    /// What UEFI firmware's own PXE client (EDK2's `UefiPxeBcDxe`) asks for the boot file:
    /// blksize 1468 (its `PXEBC_DEFAULT_PACKET_SIZE` of 1480 less the UDP and TFTP headers) and
    /// windowsize 4 (`PcdPxeTftpWindowSize`'s default). It asks tsize in a request of its own
    /// first and aborts that one after the OACK; here the one request asks all three.
    pub const EDK2: Self = Self { block_size: 1468, window: 4, tsize: true };

    /// [`BLOCK_SIZE`] blocks in windows of `window`.
    pub fn large_blocks(window: u16) -> Self {
        Self { block_size: BLOCK_SIZE, window, tsize: false }
    }
}

/// Fetches `name` from the lab's server with a socket made in the client namespace.
pub fn fetch_in(lab: &Lab, name: &str, ask: Ask) -> Result<Fetched> {
    let socket = lab.client.enter(|| Ok(UdpSocket::bind("0.0.0.0:0")?))?;
    fetch(&socket, server_address(), name, ask)
}

/// The lab server's TFTP port.
pub fn server_address() -> SocketAddr {
    format!("{SERVER_ADDRESS}:69").parse().expect("SERVER_ADDRESS is an IPv4 address")
}

/// An RRQ for `name` in octet mode with the options of `ask`.
fn request(name: &str, ask: Ask) -> Vec<u8> {
    let mut packet = vec![0, 1];
    let mut field = |s: &str| {
        packet.extend_from_slice(s.as_bytes());
        packet.push(0);
    };
    field(name);
    field("octet");
    if ask.block_size != 512 {
        field("blksize");
        field(&ask.block_size.to_string());
    }
    if ask.tsize {
        field("tsize");
        field("0");
    }
    if ask.window > 1 {
        field("windowsize");
        field(&ask.window.to_string());
    }
    packet
}

/// A TFTP read (RFC 1350) with blksize (RFC 2348) and windowsize (RFC 7440): the client
/// acknowledges the last block of each window, and on a gap acknowledges the last block it
/// has in order, once, so the server resends from there.
pub fn fetch(socket: &UdpSocket, server: SocketAddr, name: &str, ask: Ask) -> Result<Fetched> {
    socket.set_read_timeout(Some(RECEIVE_TIMEOUT))?;
    let started = Instant::now();
    let rrq = request(name, ask);
    socket.send_to(&rrq, server)?;
    let mut buf = vec![0u8; usize::from(u16::MAX) + 4];
    // Until the first answer, a timeout resends the request; then the last ACK.
    let mut peer: Option<SocketAddr> = None;
    let mut last_ack: Vec<u8> = rrq;
    let (mut size, mut win) = (512u16, 1u16);
    let (mut block, mut in_window, mut bytes) = (0u16, 0u16, 0u64);
    let mut gap_acked = false;
    let mut retries = 0;
    loop {
        let (n, from) = match socket.recv_from(&mut buf) {
            Ok(got) => got,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                retries += 1;
                if retries > RETRIES {
                    bail!("TFTP: no answer after {RETRIES} retransmissions (at block {block})");
                }
                socket.send_to(&last_ack, peer.unwrap_or(server))?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if peer.is_some_and(|p| p != from) || n < 4 {
            continue;
        }
        retries = 0;
        let packet = &buf[..n];
        match u16::from_be_bytes([packet[0], packet[1]]) {
            // OACK: the options the server took.
            6 if peer.is_none() => {
                peer = Some(from);
                let fields: Vec<&[u8]> = packet[2..].split(|b| *b == 0).collect();
                for pair in fields.chunks(2) {
                    let [key, value] = pair else { continue };
                    // tsize may be over u16: only the options that shape the transfer are read.
                    let value = || -> Result<u16> { Ok(std::str::from_utf8(value)?.parse()?) };
                    match String::from_utf8_lossy(key).to_ascii_lowercase().as_str() {
                        "blksize" => size = value()?,
                        "windowsize" => win = value()?,
                        _ => {}
                    }
                }
                last_ack = ack(0);
                socket.send_to(&last_ack, from)?;
            }
            3 => {
                peer = Some(from);
                let number = u16::from_be_bytes([packet[2], packet[3]]);
                if number != block.wrapping_add(1) {
                    if !gap_acked {
                        gap_acked = true;
                        in_window = 0;
                        socket.send_to(&last_ack, from)?;
                    }
                    continue;
                }
                gap_acked = false;
                block = number;
                let data = n - 4;
                bytes += data as u64;
                in_window += 1;
                let last = data < usize::from(size);
                if last || in_window == win {
                    in_window = 0;
                    last_ack = ack(block);
                    socket.send_to(&last_ack, from)?;
                }
                if last {
                    return Ok(Fetched {
                        bytes,
                        seconds: started.elapsed().as_secs_f64(),
                        window: win,
                        block_size: size,
                    });
                }
            }
            5 => bail!("TFTP error from the server: {}", String::from_utf8_lossy(&packet[4..])),
            _ => {}
        }
    }
}

fn ack(block: u16) -> Vec<u8> {
    let mut packet = vec![0, 4];
    packet.extend_from_slice(&block.to_be_bytes());
    packet
}
