//! TFTP: one large file at blksize 1468, with windowsize 1, 16 and 64 (RFC 7440), siteboot
//! against tftpd-hpa (which does not implement windowsize: it answers every window lockstep).
//! The client is this module's own: atftp and tftp-hpa cannot report what was negotiated.

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

pub fn run(settings: &Settings, dir: &Path) -> Result<Vec<Sample>> {
    let root = dir.join("tftp-root");
    std::fs::create_dir_all(&root)?;
    super::write_file(&root.join(FILE), settings.tftp_bytes)?;
    let mut samples = Vec::new();
    for run in 0..settings.runs {
        for server in ["siteboot", "tftpd-hpa"] {
            let lab = Lab::new("bt")?;
            lab.address_client()?;
            let (pid, _running): (u32, Box<dyn std::any::Any>) = match server {
                "siteboot" => {
                    let a = start_siteboot(&lab, &root)?;
                    (a.pid().context("siteboot runs")?, Box::new(a))
                }
                _ => {
                    let p = start_tftpd(&lab, &root, dir)?;
                    (p.pid(), Box::new(p))
                }
            };
            for &window in &settings.tftp_windows {
                let cpu = super::cpu_seconds(pid);
                let got = fetch_in(&lab, FILE, window)?;
                if got.bytes != settings.tftp_bytes {
                    bail!("{server}: got {} of {} bytes", got.bytes, settings.tftp_bytes);
                }
                eprintln!(
                    "tftp {server} window={window} (got {}) run={run}: {:.3} s",
                    got.window, got.seconds
                );
                samples.push(Sample {
                    server: server.to_owned(),
                    window,
                    negotiated_window: got.window,
                    run,
                    bytes: got.bytes,
                    seconds: got.seconds,
                    server_cpu_seconds: super::cpu_seconds(pid) - cpu,
                });
            }
        }
    }
    Ok(samples)
}

fn start_siteboot(lab: &Lab, root: &Path) -> Result<Appliance> {
    let config = json!({
        "interface": BRIDGE,
        "address": SERVER_ADDRESS,
        "dhcp": { "mode": "off" },
        "tftp": { "root": root, "max_block_size": BLOCK_SIZE, "max_window_size": 64 },
        "profiles": { "none": { "script": "#!ipxe\nexit\n" } },
    });
    let appliance = Appliance::start(&lab.server, config)?;
    wait_serving(lab)?;
    Ok(appliance)
}

/// tftpd-hpa as Debian runs it (`--secure` on a root), in the foreground.
fn start_tftpd(lab: &Lab, root: &Path, dir: &Path) -> Result<Supervised> {
    let mut command = lab.server.command("in.tftpd");
    command
        .args(["--foreground", "--listen", "--user", "root", "--secure"])
        .args(["--address", &format!("{SERVER_ADDRESS}:69")])
        .arg(root);
    let process = Supervised::spawn("tftpd-hpa", &mut command, dir)?;
    wait_serving(lab)?;
    Ok(process)
}

/// Until a request is answered (UDP has no connect to wait for).
fn wait_serving(lab: &Lab) -> Result<()> {
    super::wait_for("the TFTP server to answer", Duration::from_secs(20), || {
        let server: SocketAddr = format!("{SERVER_ADDRESS}:69").parse().expect("address");
        lab.client
            .enter(move || {
                let socket = UdpSocket::bind("0.0.0.0:0")?;
                socket.set_read_timeout(Some(Duration::from_millis(200)))?;
                socket.send_to(&request("no-such-file", 512, 1), server)?;
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
}

/// Fetches `name` from the lab's server with a socket made in the client namespace.
pub fn fetch_in(lab: &Lab, name: &str, window: u16) -> Result<Fetched> {
    let server: SocketAddr = format!("{SERVER_ADDRESS}:69").parse()?;
    let socket = lab.client.enter(|| Ok(UdpSocket::bind("0.0.0.0:0")?))?;
    fetch(&socket, server, name, BLOCK_SIZE, window)
}

/// An RRQ for `name` in octet mode with blksize and (above 1) windowsize.
fn request(name: &str, block_size: u16, window: u16) -> Vec<u8> {
    let mut packet = vec![0, 1];
    let mut field = |s: &str| {
        packet.extend_from_slice(s.as_bytes());
        packet.push(0);
    };
    field(name);
    field("octet");
    field("blksize");
    field(&block_size.to_string());
    if window > 1 {
        field("windowsize");
        field(&window.to_string());
    }
    packet
}

/// A TFTP read (RFC 1350) with blksize (RFC 2348) and windowsize (RFC 7440): the client
/// acknowledges the last block of each window, and on a gap acknowledges the last block it
/// has in order, once, so the server resends from there.
pub fn fetch(
    socket: &UdpSocket,
    server: SocketAddr,
    name: &str,
    block_size: u16,
    window: u16,
) -> Result<Fetched> {
    socket.set_read_timeout(Some(RECEIVE_TIMEOUT))?;
    let started = Instant::now();
    let rrq = request(name, block_size, window);
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
                    let value: u16 = std::str::from_utf8(value)?.parse()?;
                    match String::from_utf8_lossy(key).to_ascii_lowercase().as_str() {
                        "blksize" => size = value,
                        "windowsize" => win = value,
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
