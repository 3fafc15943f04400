//! HTTP requests: many small requests over many keep-alive connections, the load of a rack
//! booting at once. siteboot renders each host's iPXE script (`GET /boot/<mac>.ipxe`: inventory
//! look-up, ARP table, timeline, rendering); nginx serves a static file holding the same bytes.
//! The load generator is this module's own (a minimal HTTP/1.1 client on tokio): it reports
//! every request's latency, which curl and ab do not for keep-alive loads this size.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::http::PORT;
use super::{Lab, SERVER_ADDRESS, Settings};
use crate::appliance::{Appliance, BRIDGE};

/// The host whose script is asked for: listed in siteboot's config with a kernel profile.
const MAC: &str = "52:54:00:12:34:56";
/// A request that takes longer than this fails the benchmark (a server that stopped answering).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub server: String,
    pub run: usize,
    pub connections: usize,
    pub requests: u64,
    /// From the first request sent to the last response received.
    pub seconds: f64,
    /// Latency of one request: from writing it to reading the last byte of its response.
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub server_cpu_seconds: f64,
    /// Peak RSS of the server process during the sample (siteboot only).
    pub peak_rss_kib: Option<u64>,
}

fn path() -> String {
    format!("/boot/{MAC}.ipxe")
}

/// Every run, siteboot then nginx. The nginx file is the script siteboot rendered.
pub fn run(settings: &Settings, dir: &Path) -> Result<Vec<Sample>> {
    let root = dir.join("requests-root");
    std::fs::create_dir_all(root.join("boot"))?;
    let mut samples = Vec::new();
    for run in 0..settings.runs {
        let lab = Lab::new("br")?;
        lab.address_client()?;
        let siteboot = start_siteboot(&lab, &root, settings.script_connections)?;
        let pid = siteboot.pid().context("siteboot runs")?;
        let script = lab.client.enter(|| {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(get_once(&path()))
        })?;
        if !script.starts_with(b"#!ipxe") || !script.windows(6).any(|w| w == b"kernel") {
            bail!("siteboot's script for {MAC} is not a kernel boot: {script:?}");
        }
        std::fs::write(root.join("boot").join(format!("{MAC}.ipxe")), &script)?;
        super::reset_peak_rss(pid)?;
        samples.push(measure(&lab, "siteboot", pid, settings, run, script.len())?);
        samples.last_mut().expect("pushed").peak_rss_kib = Some(super::peak_rss_kib(pid)?);
        drop(siteboot);
        drop(lab);

        let lab = Lab::new("br")?;
        lab.address_client()?;
        let nginx = super::http::start_nginx(&lab, &root, dir)?;
        super::wait_for("nginx to serve the script", Duration::from_secs(20), || {
            lab.client
                .enter(|| {
                    let runtime =
                        tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                    runtime.block_on(get_once(&path()))
                })
                .is_ok()
        })?;
        samples.push(measure(&lab, "nginx", nginx.pid(), settings, run, script.len())?);
    }
    Ok(samples)
}

fn measure(
    lab: &Lab,
    server: &str,
    pid: u32,
    settings: &Settings,
    run: usize,
    body_len: usize,
) -> Result<Sample> {
    let cpu = super::cpu_seconds(pid);
    let (requests, connections) = (settings.script_requests, settings.script_connections);
    let load = lab.client.enter(move || {
        // Built in the client namespace: its worker threads and their sockets are in it too.
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        runtime.block_on(load(&path(), requests, connections, body_len))
    })?;
    let sample = Sample {
        server: server.to_owned(),
        run,
        connections,
        requests,
        seconds: load.seconds,
        p50_ms: load.percentile(0.50),
        p99_ms: load.percentile(0.99),
        server_cpu_seconds: super::cpu_seconds(pid) - cpu,
        peak_rss_kib: None,
    };
    eprintln!(
        "http-requests {server} connections={connections} run={run}: {:.0} requests/s, p50 {:.2} ms, p99 {:.2} ms",
        requests as f64 / sample.seconds,
        sample.p50_ms,
        sample.p99_ms
    );
    Ok(sample)
}

/// siteboot with one listed host on a kernel profile (the script names its kernel, initrd and
/// command line), DHCP off. Every bench connection comes from one address, and nginx has no
/// per-address cap, so siteboot's is the number of connections plus one: the probe's connection,
/// closed by the client just before the load's connections open, holds its slot until the
/// server reads that close, and a load connection over the cap is closed on arrival.
fn start_siteboot(lab: &Lab, root: &Path, connections: usize) -> Result<Appliance> {
    let config = json!({
        "interface": BRIDGE,
        "address": SERVER_ADDRESS,
        "dhcp": { "mode": "off" },
        "http": { "port": PORT, "root": root, "max_connections_per_address": connections + 1 },
        "profiles": {
            "debian-live": {
                "kernel": "debian/vmlinuz",
                "initrds": ["debian/initrd.img"],
                "cmdline": "console=ttyS0 boot=live",
            },
        },
        "hosts": [{ "mac": MAC, "profile": "debian-live" }],
    });
    Appliance::start(&lab.server, config)
}

/// What a load run measured.
struct Load {
    seconds: f64,
    /// Every request's latency, sorted.
    latencies: Vec<Duration>,
}

impl Load {
    /// The `q` quantile of the latencies, in ms (nearest rank).
    fn percentile(&self, q: f64) -> f64 {
        let ms: Vec<f64> = self.latencies.iter().map(|l| l.as_secs_f64() * 1000.0).collect();
        super::percentile(&ms, q)
    }
}

/// `requests` GETs of `path` over `connections` keep-alive connections, opened before the clock
/// starts; each connection sends its next request when its last answer is in, until all
/// `requests` are taken. Every answer must be a 200 with a `body_len`-byte body.
async fn load(path: &str, requests: u64, connections: usize, body_len: usize) -> Result<Load> {
    let mut opened = Vec::with_capacity(connections);
    for _ in 0..connections {
        opened.push(Connection::open().await?);
    }
    let left = Arc::new(AtomicU64::new(requests));
    let started = Instant::now();
    let tasks: Vec<_> = opened
        .into_iter()
        .map(|mut connection| {
            let (left, path) = (left.clone(), path.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while left
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok()
                {
                    let sent = Instant::now();
                    let response = connection.get(&path).await?;
                    latencies.push(sent.elapsed());
                    if response.status != 200 || response.body.len() != body_len {
                        bail!(
                            "got {} with {} bytes, expected 200 with {body_len}",
                            response.status,
                            response.body.len()
                        );
                    }
                }
                Ok(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(requests as usize);
    for task in tasks {
        latencies.extend(task.await.context("a load task panicked")??);
    }
    let seconds = started.elapsed().as_secs_f64();
    latencies.sort();
    if latencies.len() as u64 != requests {
        bail!("{} of {requests} requests answered", latencies.len());
    }
    Ok(Load { seconds, latencies })
}

/// One GET of `path` on a fresh connection: the body.
async fn get_once(path: &str) -> Result<Vec<u8>> {
    let response = Connection::open().await?.get(path).await?;
    if response.status != 200 {
        bail!("GET {path}: {}", response.status);
    }
    Ok(response.body)
}

struct Response {
    status: u16,
    body: Vec<u8>,
}

/// An HTTP/1.1 keep-alive connection to the bench server, reopened when the server closes it
/// after a response (`Connection: close`, as nginx does after `keepalive_requests`).
struct Connection {
    stream: TcpStream,
    /// Bytes read past the end of the last response (none, unless the server misbehaves).
    buffered: Vec<u8>,
}

impl Connection {
    async fn open() -> Result<Self> {
        let stream = TcpStream::connect((SERVER_ADDRESS, PORT))
            .await
            .with_context(|| format!("connecting to {SERVER_ADDRESS}:{PORT}"))?;
        stream.set_nodelay(true)?;
        Ok(Self { stream, buffered: Vec::new() })
    }

    async fn get(&mut self, path: &str) -> Result<Response> {
        tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(path))
            .await
            .with_context(|| format!("GET {path}: no answer in {REQUEST_TIMEOUT:?}"))?
    }

    async fn exchange(&mut self, path: &str) -> Result<Response> {
        let request = format!("GET {path} HTTP/1.1\r\nHost: {SERVER_ADDRESS}:{PORT}\r\n\r\n");
        self.stream.write_all(request.as_bytes()).await?;
        let head_end = loop {
            if let Some(end) = self.buffered.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            self.fill().await?;
        };
        let head = std::str::from_utf8(&self.buffered[..head_end]).context("a non-UTF-8 head")?;
        let head = Head::parse(head)?;
        while self.buffered.len() < head_end + head.content_length {
            self.fill().await?;
        }
        let body = self.buffered[head_end..head_end + head.content_length].to_vec();
        self.buffered.drain(..head_end + head.content_length);
        if head.close {
            *self = Self::open().await?;
        }
        Ok(Response { status: head.status, body })
    }

    async fn fill(&mut self) -> Result<()> {
        let mut chunk = [0u8; 4096];
        let n = self.stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("the server closed the connection in the middle of a response");
        }
        self.buffered.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

/// What the client needs of a response head.
#[derive(Debug, PartialEq, Eq)]
struct Head {
    status: u16,
    content_length: usize,
    /// The server closes the connection after this response.
    close: bool,
}

impl Head {
    fn parse(head: &str) -> Result<Self> {
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or("");
        let status = status_line
            .strip_prefix("HTTP/1.1 ")
            .and_then(|rest| rest.get(..3))
            .and_then(|code| code.parse().ok())
            .with_context(|| format!("not an HTTP/1.1 status line: {status_line:?}"))?;
        let (mut content_length, mut close) = (None, false);
        for line in lines {
            let Some((name, value)) = line.split_once(':') else { continue };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                content_length = Some(value.parse().context("a bad Content-Length")?);
            } else if name.eq_ignore_ascii_case("connection") {
                close = value.eq_ignore_ascii_case("close");
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                bail!("a chunked response (Transfer-Encoding: {value}); expected Content-Length");
            }
        }
        let content_length = content_length.context("a response without Content-Length")?;
        Ok(Self { status, content_length, close })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_heads_give_status_length_and_close() {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nContent-Length: 42\r\n\r\n";
        assert_eq!(
            Head::parse(head).unwrap(),
            Head { status: 200, content_length: 42, close: false }
        );
        let head = "HTTP/1.1 404 Not Found\r\nConnection: close\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(
            Head::parse(head).unwrap(),
            Head { status: 404, content_length: 0, close: true }
        );
        assert!(Head::parse("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
        assert!(Head::parse("HTTP/1.1 200 OK\r\n\r\n").is_err());
        assert!(Head::parse("SSH-2.0\r\n\r\n").is_err());
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let load = Load { seconds: 1.0, latencies: (1..=100).map(Duration::from_millis).collect() };
        assert_eq!(load.percentile(0.50), 50.0);
        assert_eq!(load.percentile(0.99), 99.0);
        assert_eq!(load.percentile(0.0), 1.0);
    }
}
